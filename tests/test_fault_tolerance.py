"""FaultTolerance with real faults in real launched jobs (the training command, 2 and 3 CPU ranks), each under a
hard deadline, each checked for leftover processes; and a bit-identical resume from a regular checkpoint.

What each launcher does with each fault on rank 1 at step 5 (docs/fault-tolerance.md's table; each row asserted here):

- raises: under fork, spawn, popen (Lightning's default) and torchrun alike, rank 1 and rank 0 (whose next
  collective fails within seconds) each write an emergency checkpoint and exit 1; torchrun's
  ``--max-restarts`` then restarts the job and ``resume=auto`` resumes it;
- SIGKILL: rank 0 writes an emergency checkpoint and exits 1 (rank 1 had no chance);
- stalls: the watchdog ends both ranks after ``timeout_s``, each with an emergency checkpoint, exit 124 (under
  popen rank 1 may first see its launcher, rank 0, gone);
- SIGTERM on every rank: every rank agrees at the next step, saves ``preempted-step=N.ckpt``, exits 0.

The fork launcher's row runs on 3 ranks (every rank saves, not just two); the faults benchmark's quick run
(``lightning_dist.benchmarks.faults``: a raise, a SIGKILL of rank 0 and a stall on 2 fork ranks, each resumed) is
tested here too, because its jobs and this module's run two at a time (:func:`side_by_side`): most of a job's time
is one process's start-up or a wait, which leaves the second core idle.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
import warnings
from dataclasses import dataclass
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lightning_dist import FaultTolerance, RingDDPStrategy
from lightning_dist.benchmarks import faults
from lightning_dist.fault.checkpoint import find_checkpoints, verify
from lightning_dist.hetero import HeteroBatching
from lightning_dist.testing import (
    JOB_VAR,
    ToyClassifier,
    free_port,
    job_processes,
    kill_job,
    launched_externally,
    quiet_trainer,
    run_ranks,
    side_by_side,
)

# the fixture runs every faulty job, two at a time, each under its own deadline, in the setup of the first test
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
CLI = [sys.executable, "-m", "lightning_dist.train"]
FT = ["callbacks=[checkpoint,fault_tolerance]", "callbacks.fault_tolerance.timeout_s=8",
      "callbacks.fault_tolerance.poll_s=1", "trainer.enable_progress_bar=false"]
TIMEOUT_S = 8


def _inject(kind, rank=1, step=5, name="inject", **extra):
    node = f"+callbacks.{name}"
    return [f"{node}._target_=lightning_dist.testing.InjectFault", f"{node}.kind={kind}", f"{node}.rank={rank}",
            f"{node}.step={step}"] + [f"{node}.{k}={v}" for k, v in extra.items()]


@dataclass
class Run:
    rc: int
    log: str
    seconds: float
    out: Path
    leftover: list[str]

    def checkpoints(self, kind=""):
        return sorted(p.name for p in self.out.rglob(f"{kind}*.ckpt"))


def _leftover(job: str) -> list[str]:
    """Processes of the job still alive a few seconds after it ended (none should be)."""
    deadline = time.monotonic() + 5.0
    while True:
        alive = [str(proc) for proc in job_processes(job).values()]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


def _launch(out: Path, *overrides: str, start_method="fork", deadline=150, cmd=None) -> Run:
    args = cmd or CLI + [f"strategy.start_method={start_method}", "trainer.max_epochs=1", *FT, *overrides,
                         f"hydra.run.dir={out}"]
    job = uuid.uuid4().hex
    started = time.monotonic()
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env={**os.environ, JOB_VAR: job, "MASTER_PORT": str(free_port())})
    try:
        log, _ = proc.communicate(timeout=deadline)
    except subprocess.TimeoutExpired:
        kill_job(job)
        log, _ = proc.communicate()
        raise AssertionError(f"the job did not end within {deadline} s:\n{log[-3000:]}") from None
    except BaseException:  # pytest-timeout, Ctrl-C: nothing of the job outlives the test
        kill_job(job)
        raise
    seconds = time.monotonic() - started
    leftover = _leftover(job)
    if leftover:
        kill_job(job)
    return Run(proc.returncode, log, seconds, out, leftover)


def _summary(run: Run) -> dict:
    return json.loads((run.out / "summary.json").read_text())


def _corrupt_copy_resumed(tmp: Path, source: str) -> Run:
    """resume=auto after ``source``'s fault, with the newest emergency checkpoint corrupted on disk."""
    shutil.copytree(tmp / source, tmp / "resumed")
    victim = tmp / "resumed" / "checkpoints" / "emergency" / "emergency-rank0-step=5.ckpt"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    return _launch(tmp / "resumed", "resume=auto")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every faulty job once, two at a time (90 s to 3 min on 2 shared cores); the tests below read them."""
    tmp = tmp_path_factory.mktemp("faults")
    # torchrun: one failure at the first step of epoch 2 (just after the epoch-end checkpoint), one restart,
    # resume=auto; against the same job uninterrupted
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                "--max-restarts", "1", "-m", "lightning_dist.train", "strategy.start_method=popen", "resume=auto",
                "trainer.max_epochs=2", *FT]
    once = tmp / "once"

    def popen_then_resumed():
        raised = _launch(tmp / "raise_popen", *_inject("raise"), start_method="popen")
        return {"raise_popen": raised, "resumed": _corrupt_copy_resumed(tmp, "raise_popen")}

    jobs = {  # the longest first, so that the two lanes end together
        # the benchmark's own deadline per job (120 s) is well inside pytest-timeout's
        "bench": lambda: faults.main(["--quick", "--timeout", "6", "--out", str(tmp / "bench")]),
        "torchrun": lambda: _launch(tmp / "torchrun", cmd=torchrun + _inject("raise", step=23, once_file=str(once))
                                    + [f"hydra.run.dir={tmp / 'torchrun'}"], deadline=240),
        "torchrun_ref": lambda: _launch(tmp / "torchrun_ref", cmd=torchrun + [f"hydra.run.dir={tmp / 'torchrun_ref'}"],
                                        deadline=240),
        "sigterm": lambda: _launch(tmp / "sigterm", *_inject("signal", rank=0, name="sig0"),
                                   *_inject("signal", rank=1, name="sig1"), start_method="popen"),
        "popen": popen_then_resumed,
        "raise_spawn": lambda: _launch(tmp / "raise_spawn", *_inject("raise"), start_method="spawn"),
        "stall": lambda: _launch(tmp / "stall", *_inject("stall")),
        "kill": lambda: _launch(tmp / "kill", *_inject("kill")),
        "raise3": lambda: _launch(tmp / "raise3", "trainer.devices=3", *_inject("raise")),
    }
    got = dict(zip(jobs, side_by_side(*jobs.values())))
    got.update(got.pop("popen"))
    got["bench"] = (got["bench"], tmp / "bench")
    return got


def test_no_process_is_left_behind(runs):
    for name, run in runs.items():
        if name != "bench":  # the benchmark watches its jobs until none of their processes is left
            assert run.leftover == [], (name, run.leftover)


@pytest.mark.parametrize("name, ranks", [("raise3", 3), ("raise_popen", 2), ("raise_spawn", 2)])
def test_an_exception_saves_every_ranks_own_state_and_exits_non_zero(runs, name, ranks):
    run = runs[name]  # raise3: the fork launcher's row, on 3 ranks (every rank saves, not just two)
    assert run.rc != 0 and "injected fault on rank 1 at global step 5" in run.log
    assert run.checkpoints("emergency") == [f"emergency-rank{r}-step=5.ckpt" for r in range(ranks)]
    for path in run.out.rglob("emergency-*.ckpt"):
        meta = verify(path)
        assert meta["verified"] and meta["kind"] == "emergency" and meta["global_step"] == 5
    assert run.seconds < 60


def test_a_killed_rank(runs):
    run = runs["kill"]
    assert run.rc != 0 and run.seconds < 60
    assert run.checkpoints("emergency") == ["emergency-rank0-step=5.ckpt"]  # rank 1 had no chance


def test_a_stalled_rank_is_named_and_every_rank_is_gone_within_the_bound(runs):
    run = runs["stall"]
    assert run.rc != 0
    assert "rank 1 (step 5) stopped making progress first" in run.log
    assert "no rank has made progress for" in run.log  # the watchdog (exit code 124), not a collective timeout
    assert run.seconds < TIMEOUT_S + 40  # start-up, 5 steps, the timeout, a few polls
    assert run.checkpoints("emergency") == ["emergency-rank0-step=5.ckpt", "emergency-rank1-step=5.ckpt"]


def test_sigterm_on_every_rank_stops_cleanly_after_an_agreed_checkpoint(runs):
    run = runs["sigterm"]
    assert run.rc == 0, run.log[-3000:]
    # the signal arrives at the start of step 5, after the step's flags were filled: step 6's exchange carries
    # it, and every rank stops once step 6 is done (global step 7)
    # both ranks on one host: the whole job ends, as before a host could leave (no "leave" in the message)
    assert "SIGTERM on ranks 0, 1 (host 0): every rank stops at global step 7 after saving" in run.log
    assert "leave, the others restart" not in run.log
    assert "preempted-step=7.ckpt" in run.checkpoints()
    assert verify(run.out / "checkpoints" / "preempted-step=7.ckpt")["verified"]
    assert _summary(run)["global_step"] == 7


def test_resume_skips_a_corrupt_checkpoint_and_finishes(runs):
    run = runs["resumed"]
    assert run.rc == 0, run.log[-3000:]
    assert "skipping checkpoint" in run.log and "emergency-rank0-step=5.ckpt" in run.log
    assert "resuming from" in run.log and "emergency-rank1-step=5.ckpt: emergency (rank 1), global step 5" in run.log
    assert _summary(run)["global_step"] == 23  # the rest of the epoch


def test_torchrun_restarts_resumes_and_matches_the_uninterrupted_run(runs):
    run, ref = runs["torchrun"], runs["torchrun_ref"]
    assert run.rc == 0 and ref.rc == 0, run.log[-3000:]
    assert "injected fault on rank 1 at global step 23" in run.log
    assert "resuming from" in run.log and "regular, global step 23" in run.log
    got, want = _summary(run), _summary(ref)
    assert got["global_step"] == want["global_step"] == 46
    assert got["metrics"] == want["metrics"]  # bit-identical: the same loss and accuracy to the last digit


# -- python -m lightning_dist.benchmarks.faults --quick (its pure judging and summaries: test_benchmark_faults.py) --
def test_the_faults_benchmarks_quick_run_writes_json_table_and_plot(runs):
    payload, out = runs["bench"]
    saved = json.loads((out / "faults.json").read_text())
    records = saved["records"]
    assert [(r["kind"], r["victim"], r["step"]) for r in records] == list(faults.QUICK_TRIALS)
    for r in records:
        assert r["ok"], (r["kind"], r["problems"], r.get("log_tail", "")[-2000:])
        assert r["rc"] not in (0, None) and not r["timed_out"] and len(r["rank_pids"]) == 2
        assert all(0 <= g <= r["bound_s"] for g in r["rank_gone_s"]) and r["all_gone_s"] <= r["bound_s"]
        assert r["resume"]["global_step"] == faults.EPOCH_STEPS and r["resume"]["resumed_step"] == r["step"]
        assert r["found_ranks"] == r["expected_ranks"]
    stall = records[2]
    assert stall["watchdog_fired"] and stall["rank_gone_s"][0] >= 6  # the watchdog's timeout, not a crash
    assert payload["target"]["met"] and payload["target"]["k"] == 3
    text = (out / "faults.txt").read_text()
    assert "Target: 3 of 3 trials" in text and "MET (3 of 3)" in text and "stall" in text
    assert (out / "faults.png").read_bytes().startswith(b"\x89PNG")


# -- a regular checkpoint resumes bit-identically: generators per rank, compressor, heterogeneous sampler ---------
class Dropout(ToyClassifier):
    """ToyClassifier's data (16 features, 4 classes) through a network with dropout: a resume is bit-identical only
    when every rank's generators come back with the checkpoint."""

    def __init__(self):
        super().__init__(features=16, classes=4, momentum=0.9)
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 4))


def _fit(tmp, epochs, ckpt_path=None):
    pl.seed_everything(0, verbose=False)
    strategy = RingDDPStrategy(compressor="int8", hetero=HeteroBatching(batch_sizes=[12, 4]))
    checkpoint = pl.callbacks.ModelCheckpoint(dirpath=tmp, save_top_k=-1, every_n_epochs=1)
    trainer = quiet_trainer(devices=2, strategy=strategy, max_epochs=epochs, enable_checkpointing=True,
                            callbacks=[FaultTolerance(timeout_s=30, poll_s=1), checkpoint])
    model = Dropout()
    trainer.fit(model, ckpt_path=ckpt_path, weights_only=True)
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _resume_ranks(rank, world_size, tmp):
    with launched_externally(rank, world_size), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        straight = _fit(os.path.join(tmp, "straight"), epochs=3)
        _fit(os.path.join(tmp, "first"), epochs=1)
        (info,) = find_checkpoints([os.path.join(tmp, "first")])
        resumed = _fit(os.path.join(tmp, "second"), epochs=3, ckpt_path=info.path)
    return straight, resumed, info.meta


def test_a_regular_checkpoint_resumes_bit_identically(tmp_path):
    results = run_ranks(_resume_ranks, 2, str(tmp_path), deadline_s=120)
    for straight, resumed, meta in results:
        assert meta["verified"] and meta["kind"] == "regular"  # written by AtomicCheckpointIO
        assert torch.equal(straight, resumed)
    assert torch.equal(results[0][0], results[1][0])  # and the replicas agree
