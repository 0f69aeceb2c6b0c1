"""The launch environment under each launcher's variables, the store client's timeouts and its one key scheme, with
a local TCPStore standing in for torchrun's agent store (no ranks, no launcher)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from lightning_dist import launch
from lightning_dist.launch import LaunchEnv, LaunchStoreError, attempt_store, connect_store

TORCHRUN = {"TORCHELASTIC_RUN_ID": "abc123", "TORCHELASTIC_RESTART_COUNT": "2", "TORCHELASTIC_USE_AGENT_STORE": "True",
            "LOCAL_WORLD_SIZE": "4", "RANK": "5", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
SLURM = {"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "1", "SLURM_PROCID": "3", "SLURM_NTASKS_PER_NODE": "2",
         "MASTER_PORT": "12910"}
LAUNCH_VARS = ("TORCHELASTIC_", "SLURM_", "MASTER_", "LOCAL_WORLD_SIZE", "RANK")
# The timeout of every connection to a live store here. torch's TCPStore client looks up the name of the address it
# connects to (a reverse DNS query, even for 127.0.0.1) inside its connect timeout; a resolver that drops the query
# stalls it for its own 5 s timeout (seen on these machines: about one query in fifty), so a connection given 5 s or
# less fails now and then with "The client socket has timed out" (throwTimeoutError). Nothing waits this long when
# the store answers.
LIVE_S = 60.0


@pytest.fixture
def no_launcher(monkeypatch):
    """This process's environment without any launcher's variables (restored after the test)."""
    for name in list(os.environ):
        if name.startswith(LAUNCH_VARS):
            monkeypatch.delenv(name)
    return monkeypatch


@pytest.fixture
def live_store():
    """A TCPStore on a free port, as torchrun's agent hosts one."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=LIVE_S))
    yield store
    del store


def _under_agent(monkeypatch, store, rank=0, restart=0, run_id="none"):
    for name, value in {"TORCHELASTIC_RUN_ID": run_id, "TORCHELASTIC_RESTART_COUNT": str(restart), "RANK": str(rank),
                        "TORCHELASTIC_USE_AGENT_STORE": "True", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": str(store.port)}.items():
        monkeypatch.setenv(name, value)


def test_torchrun():
    env = LaunchEnv.current(TORCHRUN)
    assert env == LaunchEnv(launcher="torchrun", restart_count=2, local_world_size=4, run_id="torchrun-abc123", rank=5,
                            store_address=("10.0.0.1", 29500), agent_store=True)
    assert env.key("watchdog") == "lightning_dist/watchdog/attempt_2"
    assert env.key("process_group") == "lightning_dist/process_group/attempt_2"
    assert env.key("resume") == "lightning_dist/resume/attempt_2"
    assert env.key("run_dir") == "lightning_dist/run_dir"  # every attempt's
    static = LaunchEnv.current({**TORCHRUN, "TORCHELASTIC_RUN_ID": "none"})  # no --rdzv-id
    assert static.launcher == "torchrun" and static.run_id is None
    # torchrun inside an srun task: torchrun created the processes; without an id of its own the job's names the run
    nested = LaunchEnv.current({**SLURM, **TORCHRUN, "TORCHELASTIC_RUN_ID": "none"})
    assert nested.launcher == "torchrun" and nested.run_id == "slurm-77.1" and nested.rank == 5


def test_slurm():
    env = LaunchEnv.current(SLURM)
    assert env == LaunchEnv(launcher="slurm", restart_count=0, local_world_size=2, run_id="slurm-77.1", rank=3,
                            store_address=None, agent_store=False)
    assert LaunchEnv.current({k: v for k, v in SLURM.items() if k != "SLURM_STEP_ID"}).run_id == "slurm-77.0"
    assert LaunchEnv.current({"SLURM_JOB_ID": "77"}).launcher is None  # an salloc shell: no task of srun's


def test_no_launcher():
    assert LaunchEnv.current({}) == LaunchEnv()
    assert LaunchEnv().key("watchdog") == "lightning_dist/watchdog/attempt_0"
    # Lightning's launchers set the store's address, and a launcher's counts are read whoever set them
    env = LaunchEnv.current({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1234", "LOCAL_WORLD_SIZE": "3"})
    assert env.launcher is None and env.store_address == ("127.0.0.1", 1234) and env.local_world_size == 3
    junk = LaunchEnv.current({"MASTER_ADDR": "h", "MASTER_PORT": "x", "LOCAL_WORLD_SIZE": "0",
                              "TORCHELASTIC_RESTART_COUNT": "", "RANK": "-1"})
    assert junk == LaunchEnv()  # what cannot be read is not there
    with pytest.raises(ValueError, match=r"purpose 'ft': use one of \['process_group', 'resume', 'run_dir', "):
        env.key("ft")


def test_the_environment_is_read_when_asked(no_launcher):
    assert LaunchEnv.current().local_world_size is None
    no_launcher.setenv("SLURM_NTASKS_PER_NODE", "3")
    assert LaunchEnv.current().local_world_size == 3
    no_launcher.setenv("LOCAL_WORLD_SIZE", "2")  # torchrun's count wins (torchrun inside srun)
    assert LaunchEnv.current().local_world_size == 2


def test_a_store_that_is_not_there_fails_within_the_timeout(no_launcher):
    with pytest.raises(LaunchStoreError, match="MASTER_ADDR and MASTER_PORT"):
        connect_store(5.0)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # nothing listens there once the socket is closed
    started = time.monotonic()
    with pytest.raises(LaunchStoreError, match=rf"store at 127\.0\.0\.1:{port} .* did not answer within 0\.5 s"):
        connect_store(0.5, LaunchEnv(store_address=("127.0.0.1", port)))
    assert time.monotonic() - started < 1.5  # torch alone overruns a short timeout by a back-off of a second or two


EXIT_RIGHT_AFTER_A_TIMEOUT = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("launch_alone", sys.argv[1])  # the module alone: no package import
launch = sys.modules["launch_alone"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(launch)
try:
    launch.connect_store(0.5, launch.LaunchEnv(store_address=("127.0.0.1", int(sys.argv[2]))))
except launch.LaunchStoreError:
    print("timed out", flush=True)
"""  # and the interpreter exits at once, while torch still retries the connection on connect_store's thread


@pytest.mark.subprocess_ok  # its subject is how a process ends
def test_a_process_that_exits_right_after_a_store_timeout_ends_cleanly():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # nothing listens there once the socket is closed
    done = subprocess.run([sys.executable, "-c", EXIT_RIGHT_AFTER_A_TIMEOUT, launch.__file__, str(port)],
                          capture_output=True, text=True, timeout=120)
    # with connect_store's thread a daemon this aborted every time: exit code 134, "terminate called without an
    # active exception" (the thread, still in torch's C++ constructor, is torn down as the interpreter finalizes)
    assert done.returncode == 0 and done.stdout == "timed out\n", (done.returncode, done.stderr[-3000:])


def test_the_attempt_store_keeps_each_attempts_keys_apart(no_launcher, live_store):
    assert attempt_store(timedelta(seconds=LIVE_S)) is None  # no agent store: the default group makes its own
    _under_agent(no_launcher, live_store, restart=0)
    first = attempt_store(timedelta(seconds=LIVE_S))
    first.set("rank0_address", "dead peer")
    assert live_store.get("lightning_dist/process_group/attempt_0/rank0_address") == b"dead peer"
    no_launcher.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    second = attempt_store(timedelta(seconds=LIVE_S))
    assert not second.check(["rank0_address"])  # a restarted rank cannot read the dead attempt's address
    client = connect_store(LIVE_S)
    client.set("k", "v")
    assert live_store.get("k") == b"v"
    # the client's timeout is connect_store's: torch's TCPStore bounds every get and wait by it (a missing key's too)
    assert client.timeout == timedelta(seconds=LIVE_S) and connect_store(LIVE_S / 2).timeout.total_seconds() == 30


def test_the_run_directory_and_the_resume_choice_go_through_the_store(no_launcher, live_store, tmp_path):
    from lightning_dist.config import run_dir_name
    from lightning_dist.fault import resume
    from lightning_dist.fault.checkpoint import save_checkpoint

    for name in (resume.ENV, resume.ENV_DIR):
        no_launcher.delenv(name, raising=False)
    # a static rendezvous has no run id: the first attempt's rank 0 names the run, its restarts find the name
    _under_agent(no_launcher, live_store, rank=0)
    named = run_dir_name()
    _under_agent(no_launcher, live_store, rank=1, restart=1)
    assert run_dir_name() == named and named.startswith("torchrun-")
    # resume=auto: rank 0 of each attempt chooses, the other ranks read its choice
    save_checkpoint({"global_step": 3}, tmp_path / "step=3.ckpt")
    _under_agent(no_launcher, live_store, rank=0, restart=1)
    assert resume.choose(str(tmp_path)) == str(tmp_path / "step=3.ckpt")
    save_checkpoint({"global_step": 4}, tmp_path / "step=4.ckpt")  # written after rank 0 chose
    _under_agent(no_launcher, live_store, rank=1, restart=1)
    assert resume.choose(str(tmp_path)) == str(tmp_path / "step=3.ckpt")
    assert live_store.get("lightning_dist/resume/attempt_1") == str(tmp_path / "step=3.ckpt").encode()


def test_the_watchdog_falls_back_to_the_groups_store(no_launcher, live_store):
    from lightning_dist.fault import watchdog

    fallback = object()
    no_launcher.setattr(watchdog.dist.distributed_c10d, "_get_default_store", lambda: fallback)
    assert watchdog.open_store(LIVE_S) is fallback  # no address
    no_launcher.setenv("MASTER_ADDR", "127.0.0.1")
    no_launcher.setenv("MASTER_PORT", str(live_store.port))
    assert isinstance(watchdog.open_store(LIVE_S), dist.TCPStore)
