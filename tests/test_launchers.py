"""Beyond one machine: torchrun and SLURM create the processes, RingDDPStrategy launches none of its own.

Each launch is a real group of processes on this machine (loopback), started in its own session with a hard
deadline; on a timeout or a failure the whole session is killed, so nothing is left running. The six launches run
two at a time in one fixture; each test reads its own, and a launch that failed fails its test only.
"""

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_dist.config import local_world_size, resolve_devices, run_dir_name
from lightning_dist.testing import free_port, side_by_side

HERE = Path(__file__).resolve().parent
SCRIPT = str(HERE / "launch_script.py")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
DEADLINE_S = 150


def _clean_env(**extra):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "TORCHELASTIC_", "MASTER_", "LOCAL_", "GROUP_", "ROLE_"))
           and k not in ("RANK", "WORLD_SIZE", "NODE_RANK")}
    env.update({"OMP_NUM_THREADS": "1", **extra})
    return env


def _run_all(commands, cwd, envs=None):
    """Start every command (one per "node" or task) in its own session; wait for all; kill all on timeout. Returns
    their outputs, or the AssertionError saying which failed (read by its test: one launch failing fails its own
    test only)."""
    envs = envs or [_clean_env(MASTER_PORT=str(free_port()))] * len(commands)
    procs = [subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True) for cmd, env in zip(commands, envs, strict=True)]
    outputs = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=DEADLINE_S)
            outputs.append(out)
    except subprocess.TimeoutExpired:
        return AssertionError(f"a launch ran past {DEADLINE_S}s; killed")
    finally:
        for proc in procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for proc, out in zip(procs, outputs, strict=True):
        if proc.returncode != 0:
            return AssertionError(f"exit code {proc.returncode}:\n{out[-4000:]}")
    return outputs


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    """Every launch of this module, two at a time (:func:`~lightning_dist.testing.side_by_side`: a launch spends much
    of its time in one process's imports or in a rendezvous): name -> (its outputs, its directory)."""
    dirs = {name: tmp_path_factory.mktemp(name) for name in
            ("reference", "standalone", "two_nodes", "slurm", "command", "command_two_nodes")}

    def torchrun_nodes(tmp, args):  # two "nodes" of one process each, a static rendezvous on this machine
        port = str(free_port())
        return [TORCHRUN + ["--nnodes", "2", "--node-rank", str(rank), "--nproc-per-node", "1",
                            "--master-addr", "127.0.0.1", "--master-port", port, *args(rank)] for rank in (0, 1)]

    def slurm(tmp):  # what `srun --ntasks-per-node 2` sets for a 2-task job; the test starts the two tasks itself
        port = str(free_port())
        envs = [_clean_env(SLURM_NTASKS="2", SLURM_NTASKS_PER_NODE="2", SLURM_NNODES="1", SLURM_NODEID="0",
                           SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank), SLURM_JOB_ID="4242", SLURM_STEP_ID="0",
                           SLURM_JOB_NAME="lightning_dist_test", SLURM_NODELIST="127.0.0.1", MASTER_PORT=port)
                for rank in (0, 1)]
        return _run_all([[sys.executable, SCRIPT, str(tmp / "w.pt"), "2", "1", "ring_ddp_spawn"]] * 2, tmp, envs)

    jobs = {  # the longest first
        "command_two_nodes": lambda tmp: _run_all(torchrun_nodes(tmp, lambda rank: [
            "-m", "lightning_dist.train", "trainer.devices=auto", "trainer.num_nodes=2", "trainer.max_epochs=1",
            "trainer.limit_train_batches=3", "trainer.limit_val_batches=1", "trainer.enable_progress_bar=false"]), tmp),
        "command": lambda tmp: _run_all([TORCHRUN + [
            "--standalone", "--nproc-per-node", "2", "-m", "lightning_dist.train", "trainer.devices=auto",
            "trainer.max_epochs=1", "trainer.limit_train_batches=5", "trainer.limit_val_batches=2",
            "trainer.enable_progress_bar=false"]], tmp),
        "two_nodes": lambda tmp: _run_all(torchrun_nodes(tmp, lambda rank: [
            SCRIPT, str(tmp / f"w{rank}.pt"), "1", "2", "ring_ddp"]), tmp),
        # the fork variant, which under torchrun used to fork two more ranks inside each worker
        "standalone": lambda tmp: _run_all([TORCHRUN + ["--standalone", "--nproc-per-node", "2", SCRIPT,
                                                        str(tmp / "w.pt"), "2", "1", "ring_ddp_fork"]], tmp),
        "slurm": slurm,
        # the script on one machine, 2 processes forked by Lightning itself: the weights every launch must match
        "reference": lambda tmp: _run_all([[sys.executable, SCRIPT, str(tmp / "w.pt"), "2", "1", "ring_ddp_fork"]],
                                          tmp),
    }
    done = side_by_side(*(lambda name=name: jobs[name](dirs[name]) for name in jobs))
    return {name: (outputs, dirs[name]) for name, outputs in zip(jobs, done, strict=True)}


def _launched(launches, name):
    """A launch's outputs and directory, its failure raised here."""
    outputs, tmp = launches[name]
    if isinstance(outputs, AssertionError):
        raise outputs
    return outputs, tmp


@pytest.fixture(scope="module")
def reference(launches):
    _, tmp = _launched(launches, "reference")
    return torch.load(tmp / "w.pt")


def _same_weights(a, b):
    return all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)


@pytest.mark.slow
def test_torchrun_standalone_user_script_launches_no_ranks_of_its_own(launches, reference):
    (out,), tmp = _launched(launches, "standalone")
    result = torch.load(tmp / "w.pt")
    assert result["world_size"] == 2 and result["environment"] == "TorchElasticEnvironment"
    assert result["launcher"] == "_SubprocessScriptLauncher"
    assert out.count("Initializing distributed") == 2  # one per torchrun worker, not two more inside each
    assert out.count("launches none of its own") == 1  # said once, by rank zero
    assert _same_weights(result["state"], reference["state"])


@pytest.mark.slow
def test_two_nodes_on_one_machine_train_the_single_node_weights(launches, reference):
    _, tmp = _launched(launches, "two_nodes")
    result = torch.load(tmp / "w0.pt")  # global rank 0 lives on node 0
    assert not (tmp / "w1.pt").exists()
    assert result["world_size"] == 2 and result["steps"] == 12  # 2 epochs of 96 samples / 2 ranks / batch 8
    assert _same_weights(result["state"], reference["state"])


@pytest.mark.slow
def test_a_slurm_job_is_picked_up_and_trains_the_same_weights(launches, reference):
    _, tmp = _launched(launches, "slurm")
    result = torch.load(tmp / "w.pt")
    assert result["environment"] == "SLURMEnvironment" and result["world_size"] == 2
    assert _same_weights(result["state"], reference["state"])


@pytest.mark.slow
def test_the_training_command_under_torchrun_writes_one_run_directory(launches):
    (out,), tmp = _launched(launches, "command")
    runs = sorted(p.name for p in (tmp / "outputs").iterdir())
    assert len(runs) == 1 and runs[0].startswith("torchrun-"), runs  # both ranks agreed on one directory
    run = tmp / "outputs" / runs[0]
    assert (run / "summary.json").exists() and (run / "checkpoints" / "last.ckpt").exists()
    assert out.count("summary: ") == 1  # summary written and announced once, by rank zero
    assert out.count("Initializing distributed") == 2
    threads = re.findall(r"intra_op_threads=(\d+)", out)
    assert threads and all(int(t) == max(1, (os.cpu_count() or 1) // 2) for t in threads), threads


def test_devices_and_the_run_directory_follow_the_launcher(monkeypatch):
    for name in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    assert resolve_devices("auto") == "auto" and resolve_devices(3) == 3 and resolve_devices("4") == 4
    assert local_world_size("auto", "cpu") == 1 and local_world_size(3, "cpu") == 3
    assert re.fullmatch(r"\d{4}-\d\d-\d\d/\d\d-\d\d-\d\d", run_dir_name())  # Hydra's own timestamp layout
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # torchrun --nproc-per-node 2
    assert resolve_devices("auto") == 2 and resolve_devices(-1) == 2 and local_world_size("auto", "cpu") == 2
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "abc123")
    assert run_dir_name() == "torchrun-abc123"
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "4")
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_PROCID", "3")
    assert resolve_devices("auto") == 4 and run_dir_name() == "slurm-77.0"


def test_devices_auto_and_two_nodes_compose_and_validate_under_a_launcher(monkeypatch):
    from hydra import compose, initialize_config_module

    import lightning_dist.train  # noqa: F401 - registers the schema and the run-directory resolver
    from lightning_dist.config import validate

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")  # torchrun --nnodes 2 --nproc-per-node 1
    with initialize_config_module("lightning_dist.conf", version_base="1.3"):
        cfg = compose("config", overrides=["trainer.devices=auto", "trainer.num_nodes=2"])
    validate(cfg)
    assert cfg.trainer.devices == "auto" and cfg.trainer.num_nodes == 2
    assert resolve_devices(cfg.trainer.devices) == 1


@pytest.mark.slow
def test_the_command_on_two_nodes_with_a_static_rendezvous_shares_one_run_directory(launches):
    # no --rdzv-id: the run id is "none", so rank 0's timestamp travels through torchrun's store
    outputs, tmp = _launched(launches, "command_two_nodes")
    runs = sorted(p.name for p in (tmp / "outputs").iterdir())
    assert len(runs) == 1 and runs[0].startswith("torchrun-"), runs
    assert (tmp / "outputs" / runs[0] / "summary.json").exists()
    assert sum(out.count("summary: ") for out in outputs) == 1
