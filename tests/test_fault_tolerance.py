"""FaultTolerance with real faults in real launched jobs (the training command, 2 and 3 CPU ranks), each under a
hard deadline, each checked for leftover processes; and a bit-identical resume from a regular checkpoint.

docs/fault-tolerance.md's table, a fault on rank 1, each row asserted here under every launcher it names: fork (and
spawn for a raise), popen (Lightning's default) and torchrun. For each: every rank's exit code, as its launcher saw
it; the command's own; which emergency checkpoints were written, each complete (its SHA-256 and size, computed here,
are its sidecar's), by its rank, for the fault's reason, holding the fault's step, and every rank's the same weights.

- raises: every rank writes an emergency checkpoint and exits 1; torchrun's ``--max-restarts`` then restarts the
  job and ``resume=auto`` resumes it;
- SIGKILL: rank 1 dies (-9), rank 0 writes an emergency checkpoint and exits 1 (under torchrun, a rank that has saved
  may instead be ended by the SIGTERM torchrun sends the other workers: -15, ``TORCHRUN_SURVIVOR``);
- stalls: after ``timeout_s`` every rank writes an emergency checkpoint; the stalled rank's watchdog ends it (124),
  another rank exits 124 when its own watchdog called the stall first, or 1 when its collective with the stalled rank
  broke first (which of the two is a race; its checkpoint's reason says which, and the exit code must match);
- SIGTERM on every rank: every rank agrees at the next step, saves ``preempted-step=N.ckpt``, exits 0.

Jobs are shared: a row is often the resume of another row's job (``resume=auto`` from its emergency checkpoints:
fork's SIGTERM after its SIGKILL, popen's stall after its SIGKILL, popen's SIGTERM after its raise), and torchrun's
column is one job that meets every fault in turn, restarted after each (raise, SIGKILL, stall, then SIGTERM).
Each rank's exit code comes from the launcher that reaped it: every process of a job loads a recorder
(``_RECORDER``, a ``sitecustomize`` on the job's ``PYTHONPATH``) that logs each rank it starts and each exit status
it reaps, and the job runs under a reaper (``_REAPER``, a child subreaper) that reaps what outlived its launcher.

The fork launcher's raise runs on 3 ranks (every rank saves, not just two). The jobs run two at a time
(:func:`side_by_side`): much of a job's time is one process's start-up or a wait. The faults benchmark's quick run is
in the benchmark tier (tests/test_benchmark_faults.py, ``pytest -m benchmark``).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import uuid
import warnings
from dataclasses import dataclass, field
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
TIMEOUT_S, POLL_S = 8, 1
FT = ["callbacks=[checkpoint,fault_tolerance]", f"callbacks.fault_tolerance.timeout_s={TIMEOUT_S}",
      f"callbacks.fault_tolerance.poll_s={POLL_S}", "trainer.enable_progress_bar=false"]
EXITS_VAR = "LIGHTNING_DIST_TEST_EXITS"  # where a job's processes log the ranks they start and the exits they reap
KILLED = -9  # a rank's exit code when SIGKILL ended it (Python's convention: minus the signal)
# torchrun sends SIGTERM to the other workers as soon as one fails: a rank that has saved and is tearing down exits 1,
# or, once Lightning's teardown has put back the default SIGTERM handler, is ended by it (-15); it saved either way
TORCHRUN_SURVIVOR = (1, -15)

# Loaded by every Python process of a job (a sitecustomize on its PYTHONPATH): a launcher that starts a rank logs
# "start <launcher pid> <pid> <attempt> <rank> <time>" and, when it reaps it, "exit <launcher pid> <pid> <code> <time>",
# for subprocess.Popen (popen's ranks, torchrun's workers: the rank from their environment) and for
# multiprocessing (fork and spawn: torch's process index).
_RECORDER = """
import multiprocessing.popen_fork as _popen_fork
import os
import subprocess
import time

_LOG = os.environ.get("LIGHTNING_DIST_TEST_EXITS")


def _write(*fields):
    fd = os.open(_LOG, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (" ".join(map(str, [*fields, round(time.time(), 3)])) + "\\n").encode())
    finally:
        os.close(fd)


if _LOG:
    _init, _handle = subprocess.Popen.__init__, subprocess.Popen._handle_exitstatus

    def _popen_init(self, *args, **kwargs):
        env = kwargs.get("env") or {}
        self._exit_rank = env.get("RANK", env.get("LOCAL_RANK"))
        _init(self, *args, **kwargs)
        if self._exit_rank is not None:
            _write("start", os.getpid(), self.pid, env.get("TORCHELASTIC_RESTART_COUNT", 0), self._exit_rank)

    def _popen_handle(self, *args, **kwargs):
        _handle(self, *args, **kwargs)
        if getattr(self, "_exit_rank", None) is not None:
            _write("exit", os.getpid(), self.pid, self.returncode)

    subprocess.Popen.__init__, subprocess.Popen._handle_exitstatus = _popen_init, _popen_handle
    _process_init_0, _process_poll_0 = _popen_fork.Popen.__init__, _popen_fork.Popen.poll

    def _process_init(self, process_obj):
        target = getattr(process_obj, "_target", None)
        self._exit_rank = process_obj._args[1] if getattr(target, "__name__", "") == "_wrap" else None
        _process_init_0(self, process_obj)
        if self._exit_rank is not None:
            _write("start", os.getpid(), self.pid, 0, self._exit_rank)

    def _process_poll(self, *args, **kwargs):
        known = self.returncode is not None
        code = _process_poll_0(self, *args, **kwargs)
        if code is not None and not known and getattr(self, "_exit_rank", None) is not None:
            _write("exit", os.getpid(), self.pid, code)
        return code

    _popen_fork.Popen.__init__, _popen_fork.Popen.poll = _process_init, _process_poll
"""

# Runs the job's command as its child, as a child subreaper: a rank whose launcher ended first (popen's rank 1 after
# rank 0) is reaped here ("exit <reaper pid> <pid> <code>"); logs the command's own "top <reaper pid> <pid> <code>"
# and returns once every process it reaped is gone.
_REAPER = """
import ctypes, os, subprocess, sys, time
ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
top = subprocess.Popen(sys.argv[1:])
code = 1
while True:
    try:
        pid, status = os.wait()
    except ChildProcessError:
        break
    got = os.waitstatus_to_exitcode(status)
    with open(os.environ["LIGHTNING_DIST_TEST_EXITS"], "a") as log:
        log.write(f"{'top' if pid == top.pid else 'exit'} {os.getpid()} {pid} {got} {time.time():.3f}\\n")
    code = got if pid == top.pid else code
sys.exit(code if code >= 0 else 128 - code)
"""


def _inject(kind, rank=1, step=5, name="inject", **extra):
    node = f"+callbacks.{name}"
    return [f"{node}._target_=lightning_dist.testing.InjectFault", f"{node}.kind={kind}", f"{node}.rank={rank}",
            f"{node}.step={step}"] + [f"{node}.{k}={v}" for k, v in extra.items()]


@dataclass
class Run:
    rc: int  # the command's exit code (negative: the signal that ended it)
    log: str
    out: Path
    leftover: list[str]
    exits: dict[tuple[int, int], int] = field(default_factory=dict)  # (attempt, rank) -> that rank's exit code
    last_exit: float = 0.0  # the wall clock's time of the job's last reaped exit

    def gone_s(self) -> float:
        """Seconds from the first fault injected (its line in the log) to the last of the job's processes reaped:
        what FaultTolerance bounds (``faults.bound_s``), whatever the start-up took on a loaded machine."""
        line = next(line for line in self.log.splitlines() if line.startswith("[InjectFault]"))
        return self.last_exit - float(line.rsplit("(time ", 1)[1].rstrip(")"))

    def checkpoints(self, kind=""):
        return sorted(p.name for p in self.out.rglob(f"{kind}*.ckpt"))

    def ranks(self, attempt=0):
        """Every rank's exit code in ``attempt`` (torchrun's restarts count from 0), in rank order."""
        return [code for (a, _), code in sorted(self.exits.items()) if a == attempt]


def _leftover(job: str) -> list[str]:
    """Processes of the job still alive a few seconds after it ended (none should be)."""
    deadline = time.monotonic() + 5.0
    while True:
        alive = [str(proc) for proc in job_processes(job).values()]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


def _exits(path: Path, top_is_rank0: bool) -> tuple[int, dict[tuple[int, int], int], float]:
    """The command's exit code, every rank's and the time of the last exit, from the recorder's and the reaper's log
    (``_RECORDER``, ``_REAPER``)."""
    top = code = None
    started, reaped, last = {}, {}, 0.0
    for line in path.read_text().splitlines():
        kind, by, pid, *rest = line.split()
        if kind != "start":
            last = max(last, float(rest[-1]))
        if kind == "top":
            top, code = int(pid), int(rest[0])
        elif kind == "start":
            started[int(pid)] = (int(by), int(rest[0]), int(rest[1]))
        else:
            reaped[int(pid)] = int(rest[0])
    assert top is not None, f"no exit status of the command in {path}"
    # a rank is what the command's own process started (what a rank starts in turn is not one)
    exits = {(attempt, rank): reaped.get(pid) for pid, (by, attempt, rank) in started.items() if by == top}
    if top_is_rank0:
        exits[(0, 0)] = code
    return code, exits, last


def _launch(out: Path, *overrides: str, start_method="fork", deadline=150, cmd=None) -> Run:
    args = cmd or CLI + [f"strategy.start_method={start_method}", "trainer.max_epochs=1", *FT, *overrides,
                         f"hydra.run.dir={out}"]
    tools = out.parent / "tools"  # the fixture writes the recorder and the reaper there
    job = uuid.uuid4().hex
    exits = out.parent / f"{out.name}.exits"
    exits.unlink(missing_ok=True)
    env = {**os.environ, JOB_VAR: job, "MASTER_PORT": str(free_port()), EXITS_VAR: str(exits),
           "PYTHONPATH": os.pathsep.join([str(tools), *filter(None, [os.environ.get("PYTHONPATH")])])}
    proc = subprocess.Popen([sys.executable, str(tools / "reaper.py"), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True, env=env)
    try:
        log, _ = proc.communicate(timeout=deadline)
    except subprocess.TimeoutExpired:
        kill_job(job)
        log, _ = proc.communicate()
        raise AssertionError(f"the job did not end within {deadline} s:\n{log[-3000:]}") from None
    except BaseException:  # pytest-timeout, Ctrl-C: nothing of the job outlives the test
        kill_job(job)
        raise
    leftover = _leftover(job)
    if leftover:
        kill_job(job)
    rc, ranks, last = _exits(exits, top_is_rank0=cmd is None and start_method == "popen")
    return Run(rc, log, out, leftover, ranks, last)


def _summary(run: Run) -> dict:
    return json.loads((run.out / "summary.json").read_text())


def _resumed(tmp: Path, source: str, name: str, *overrides: str, corrupt: str = "", **kwargs) -> Run:
    """resume=auto after ``source``'s fault (a copy of its run directory), with ``corrupt``, one of its emergency
    checkpoints, damaged on disk."""
    shutil.copytree(tmp / source, tmp / name)
    if corrupt:
        victim = tmp / name / "checkpoints" / "emergency" / corrupt
        data = bytearray(victim.read_bytes())
        data[len(data) // 2] ^= 0xFF
        victim.write_bytes(bytes(data))
    return _launch(tmp / name, "resume=auto", *overrides, **kwargs)


def _sigterm(step):
    """SIGTERM on both ranks at the start of ``step``."""
    return [*_inject("signal", rank=0, step=step, name="sig0"), *_inject("signal", rank=1, step=step, name="sig1")]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every faulty job once, two at a time (2 to 4 min on 2 shared cores); the tests below read them."""
    tmp = tmp_path_factory.mktemp("faults")
    (tmp / "tools").mkdir()
    (tmp / "tools" / "sitecustomize.py").write_text(_RECORDER)
    (tmp / "tools" / "reaper.py").write_text(_REAPER)
    # torchrun: every fault in turn, each in an attempt of its own (a file per fault: a restarted attempt does not
    # meet it again); the raise at the first step of epoch 2, just after the epoch-end checkpoint; against the same
    # job without the raise, up to the SIGKILL (rank 0's emergency checkpoint then holds the state of step 26)
    def torchrun(name, restarts, *overrides):
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                "--max-restarts", str(restarts), "-m", "lightning_dist.train", "strategy.start_method=popen",
                "resume=auto", "trainer.max_epochs=2", *FT, *overrides, f"hydra.run.dir={tmp / name}"]

    chain = [*_inject("raise", step=23, once_file=str(tmp / "raised")),
             *_inject("kill", step=26, name="kill", once_file=str(tmp / "killed")),
             *_inject("stall", step=29, name="stall", once_file=str(tmp / "stalled")), *_sigterm(32)]
    ref = [*_inject("kill", step=26, name="kill")]

    def popen_then_resumed():  # the resume skips a corrupt checkpoint, then stops on SIGTERM
        raised = _launch(tmp / "raise_popen", *_inject("raise"), start_method="popen")
        return {"raise_popen": raised, "sigterm_popen": _resumed(tmp, "raise_popen", "sigterm_popen", *_sigterm(8),
                                                                 corrupt="emergency-rank0-step=5.ckpt",
                                                                 start_method="popen")}

    def killed_then_stalled_popen():
        killed = _launch(tmp / "kill_popen", *_inject("kill"), start_method="popen")
        return {"kill_popen": killed,
                "stall_popen": _resumed(tmp, "kill_popen", "stall_popen", *_inject("stall", step=8, name="stall"),
                                        start_method="popen")}

    def killed_then_sigterm_fork():
        killed = _launch(tmp / "kill", *_inject("kill"))
        return {"kill": killed, "sigterm_fork": _resumed(tmp, "kill", "sigterm_fork", *_sigterm(8))}

    jobs = {  # the longest first, so that the two lanes end together
        "torchrun": lambda: _launch(tmp / "torchrun", cmd=torchrun("torchrun", 3, *chain), deadline=300),
        "popen_kill": killed_then_stalled_popen,
        "torchrun_ref": lambda: _launch(tmp / "torchrun_ref", cmd=torchrun("torchrun_ref", 0, *ref), deadline=240),
        "popen": popen_then_resumed,
        "fork_kill": killed_then_sigterm_fork,
        "raise_spawn": lambda: _launch(tmp / "raise_spawn", *_inject("raise"), start_method="spawn"),
        "stall": lambda: _launch(tmp / "stall", *_inject("stall")),
        "raise3": lambda: _launch(tmp / "raise3", "trainer.devices=3", *_inject("raise")),
    }
    results = side_by_side(*jobs.values())
    assert len(results) == len(jobs)
    got = dict(zip(jobs, results, strict=True))
    for name in ("popen", "popen_kill", "fork_kill"):
        got.update(got.pop(name))
    return got


WATCHDOG = "watchdog: no rank has made progress for"  # how a stall's emergency checkpoint says why it was written
PEER_GONE = ("Connection closed by peer", "Connection reset by peer")  # gloo's words for a collective whose peer died
# popen: the stalled rank's watchdog may see its launcher (rank 0, ended by its own watchdog) gone before it calls the
# stall itself; both end the rank with 124 (lightning_dist.fault.watchdog)
LAUNCHER_GONE = "the process that launched it"


def _emergency(run: Run, step: int, ranks, reason: str, victim=1, world_size=2,
               launcher_gone: bool = False) -> dict[int, str]:
    """Every rank in ``ranks`` wrote its emergency checkpoint of ``step``: complete (the file's SHA-256 and size,
    computed here, are its sidecar's; the project's ``verify`` agrees), by that rank, holding ``step`` in its loops'
    counters (the interrupted batch rewound) and the same weights on every rank. ``reason``: why the victim's sidecar
    says it was written (a stall: the watchdog's verdict); a peer's says its collective with the victim broke, or, in a
    stall, its own watchdog's verdict; ``launcher_gone``: the victim may instead have seen its launcher gone first
    (popen). Returns every rank's reason."""
    weights, reasons = {}, {}
    for r in ranks:
        path = run.out / "checkpoints" / "emergency" / f"emergency-rank{r}-step={step}.ckpt"
        meta = json.loads(Path(f"{path}.meta.json").read_text())
        data = path.read_bytes()
        assert (meta["sha256"], meta["bytes"]) == (hashlib.sha256(data).hexdigest(), len(data)), path
        assert verify(path)["verified"]
        assert (meta["kind"], meta["rank"], meta["global_step"], meta["world_size"]) == ("emergency", r, step,
                                                                                          world_size)
        reasons[r] = meta["reason"]
        if r == victim:
            saw_launcher_gone = launcher_gone and LAUNCHER_GONE in meta["reason"]
            assert meta["reason"].startswith(reason) or saw_launcher_gone, meta["reason"]
        elif not (reason == WATCHDOG and meta["reason"].startswith(WATCHDOG)):
            assert any(words in meta["reason"] for words in PEER_GONE), meta["reason"]
        checkpoint = torch.load(path, weights_only=True)
        assert checkpoint["global_step"] == step
        progress = checkpoint["loops"]["fit_loop"]["epoch_loop.batch_progress"]["total"]
        assert progress["started"] == progress["processed"] == step, progress
        weights[r] = checkpoint["state_dict"]
    first = weights[min(weights)]
    for r, state in weights.items():
        assert state.keys() == first.keys() and all(torch.equal(state[k], first[k]) for k in first), r
    return reasons


def _stall_exits(codes: list[int], reasons: dict[int, str], victim=1, survivor=(1,)) -> None:
    """A stall's exit codes: the stalled rank's own watchdog ends it (124); a peer, blocked in a collective with it,
    exits 124 when its own watchdog called the stall first, or 1 when that collective broke first (the stalled rank's
    watchdog ended it): each as its checkpoint says. ``survivor``: the codes of that second path (torchrun's)."""
    assert codes[victim] == 124, codes
    for rank, code in enumerate(codes):
        if rank != victim:
            assert code == 124 if reasons[rank].startswith(WATCHDOG) else code in survivor, (codes, reasons)


def test_no_process_is_left_behind(runs):
    for name, run in runs.items():
        assert run.leftover == [], (name, run.leftover)


RAISED = "RuntimeError: injected fault on rank 1 at global step 5"


@pytest.mark.parametrize("name, ranks", [("raise3", 3), ("raise_popen", 2), ("raise_spawn", 2)])
def test_an_exception_saves_every_ranks_own_state_and_every_rank_exits_1(runs, name, ranks):
    run = runs[name]  # raise3: the fork launcher's row, on 3 ranks (every rank saves, not just two)
    assert "injected fault on rank 1 at global step 5" in run.log
    assert run.ranks() == [1] * ranks, run.exits
    assert run.rc == 1  # popen: rank 0's own; fork and spawn: Lightning's parent, which raises the rank's error
    assert run.checkpoints("emergency") == [f"emergency-rank{r}-step=5.ckpt" for r in range(ranks)]
    _emergency(run, 5, range(ranks), RAISED, world_size=ranks)
    assert run.gone_s() <= faults.bound_s("raise", TIMEOUT_S, POLL_S)


@pytest.mark.parametrize("name", ["kill", "kill_popen"])
def test_a_killed_rank(runs, name):
    run = runs[name]
    assert run.ranks() == [1, KILLED], run.exits  # rank 0 after its collective failed
    assert run.rc == 1 and run.gone_s() <= faults.bound_s("kill", TIMEOUT_S, POLL_S)
    assert run.checkpoints("emergency") == ["emergency-rank0-step=5.ckpt"]  # rank 1 had no chance
    _emergency(run, 5, [0], "", victim=1)


@pytest.mark.parametrize("name, step", [("stall", 5), ("stall_popen", 8)])
def test_a_stalled_rank_is_named_and_every_rank_is_gone_within_the_bound(runs, name, step):
    run = runs[name]
    assert f"rank 1 (step {step}) stopped making progress first" in run.log
    assert "no rank has made progress for" in run.log  # the watchdog, not a collective timeout
    assert run.gone_s() <= faults.bound_s("stall", TIMEOUT_S, POLL_S)  # the timeout, a few polls, the saves
    assert [c for c in run.checkpoints("emergency") if f"step={step}." in c] == [
        f"emergency-rank0-step={step}.ckpt", f"emergency-rank1-step={step}.ckpt"]
    _stall_exits(run.ranks(), _emergency(run, step, [0, 1], WATCHDOG, launcher_gone=name == "stall_popen"))
    # popen: rank 0's own; fork: Lightning's parent, which raises the first failed rank's code
    assert run.rc == (run.ranks()[0] if name == "stall_popen" else 1)


def _agreed_stop(run: Run, step: int, attempt: int = 0, since: int = 0):
    """SIGTERM on both ranks at the start of ``step - 2``: the signal arrives after that step's flags were filled, the
    next step's exchange carries it, and every rank stops once that step is done (global step ``step``), saving one
    regular checkpoint and exiting 0."""
    # both ranks on one host: the whole job ends, as before a host could leave (no "leave" in the message)
    assert f"SIGTERM on ranks 0, 1 (host 0): every rank stops at global step {step} after saving" in run.log
    assert "leave, the others restart" not in run.log
    assert run.ranks(attempt) == [0, 0], run.exits
    assert run.rc == 0, run.log[-3000:]
    path = run.out / "checkpoints" / f"preempted-step={step}.ckpt"
    meta, data = json.loads(Path(f"{path}.meta.json").read_text()), path.read_bytes()
    assert (meta["sha256"], meta["bytes"]) == (hashlib.sha256(data).hexdigest(), len(data))
    assert verify(path)["verified"] and meta["kind"] == "regular" and meta["global_step"] == step
    assert torch.load(path, weights_only=True)["global_step"] == step
    # no fault: no emergency checkpoint after the one the run resumed from
    assert [c for c in run.checkpoints("emergency") if int(c.split("=")[1][:-5]) > since] == []


@pytest.mark.parametrize("name", ["sigterm_fork", "sigterm_popen"])
def test_sigterm_on_every_rank_stops_cleanly_after_an_agreed_checkpoint(runs, name):
    run = runs[name]
    _agreed_stop(run, 10, since=5)
    assert _summary(run)["global_step"] == 10


def test_resume_from_emergency_checkpoints(runs):
    # the SIGKILL's: rank 0's, the only one (popen's stall and fork's SIGTERM are its resumes)
    for name in ("stall_popen", "sigterm_fork"):
        assert "resuming from" in runs[name].log
        assert "emergency-rank0-step=5.ckpt: emergency (rank 0), global step 5" in runs[name].log
    # the raise's, with rank 0's corrupt: skipped, and rank 1's taken
    run = runs["sigterm_popen"]
    assert "skipping checkpoint" in run.log and "emergency-rank0-step=5.ckpt" in run.log
    assert "resuming from" in run.log and "emergency-rank1-step=5.ckpt: emergency (rank 1), global step 5" in run.log


def test_torchrun_meets_every_fault_restarts_and_resumes(runs):
    run = runs["torchrun"]
    assert run.rc == 0, run.log[-3000:]
    # attempt 0: rank 1 raises at step 23 (the first of epoch 2), and rank 0's collective fails: both save, exit 1;
    # the first to exit exits 1, and torchrun's SIGTERM may end the other once it has saved (either rank: the raising
    # one, still tearing down when rank 0 has saved and exited, too)
    first = run.ranks(0)
    assert all(code in TORCHRUN_SURVIVOR for code in first) and 1 in first, run.exits
    _emergency(run, 23, [0, 1], "RuntimeError: injected fault on rank 1 at global step 23")
    assert "resuming from" in run.log and "regular, global step 23" in run.log  # at the same step a regular one wins
    # attempt 1: rank 1 is killed at step 26; rank 0 saves and exits 1 (or torchrun's SIGTERM ends it once saved)
    assert run.ranks(1)[1] == KILLED and run.ranks(1)[0] in TORCHRUN_SURVIVOR, run.exits
    assert "emergency-rank1-step=26.ckpt" not in run.checkpoints("emergency")
    _emergency(run, 26, [0], "")
    assert "emergency-rank0-step=26.ckpt: emergency (rank 0), global step 26" in run.log
    # attempt 2: rank 1 stalls at step 29; the watchdog ends it with 124, and rank 0 with 124 or, its collective
    # broken first, 1
    assert "rank 1 (step 29) stopped making progress first" in run.log
    _stall_exits(run.ranks(2), _emergency(run, 29, [0, 1], WATCHDOG), survivor=TORCHRUN_SURVIVOR)
    # attempt 3: SIGTERM on both at step 32, an agreed stop at 34
    _agreed_stop(run, 34, attempt=3, since=29)
    assert sorted(a for a, _ in run.exits) == [0, 0, 1, 1, 2, 2, 3, 3]  # no other attempt


def test_torchrun_resumes_a_regular_checkpoint_bit_identically(runs):
    """After the restart from step 23's regular checkpoint, rank 0's state at step 26 (its emergency checkpoint at
    the SIGKILL) is bit for bit that of the same job run without the raise: every weight and optimizer moment."""
    run, ref = runs["torchrun"], runs["torchrun_ref"]
    assert ref.ranks()[1] == KILLED and ref.ranks()[0] in TORCHRUN_SURVIVOR and ref.rc == 1, ref.exits  # no restart
    assert "injected fault on rank 1 at global step 23" in run.log
    ours, theirs = (torch.load(r.out / "checkpoints" / "emergency" / "emergency-rank0-step=26.ckpt",
                               weights_only=True) for r in (run, ref))
    assert ours["state_dict"].keys() == theirs["state_dict"].keys()
    for key, value in theirs["state_dict"].items():
        assert torch.equal(ours["state_dict"][key], value), key
    (mine,), (reference,) = ours["optimizer_states"], theirs["optimizer_states"]
    assert mine["state"].keys() == reference["state"].keys() and len(reference["state"]) > 0
    for index, state in reference["state"].items():
        assert state.keys() == mine["state"][index].keys()
        assert all(torch.equal(mine["state"][index][k], v) for k, v in state.items()), index


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
