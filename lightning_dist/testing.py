"""Run a function on N local gloo ranks with a hard deadline: the harness behind the tests and benchmarks.

This is not a training launcher (training is launched by Lightning, ``torchrun`` or SLURM). It is the
small tool that ``torch/testing/_internal/common_distributed.py`` is for PyTorch: one process per rank,
rendezvous through a file (no port to clash), and every child killed when one fails or the deadline passes,
so a broken collective fails a test in seconds instead of hanging it; the error then holds each unfinished rank's
output and the Python stacks of its threads at that moment. And :func:`watch_job`, for tests and
benchmarks that launch a real job (the training command): every process the job starts, found by a variable
they all inherit, watched until none is left, all killed at a deadline. And what the tests and benchmarks fit:
:func:`quiet_trainer` and :class:`ToyClassifier`, plus callbacks that slow a rank, inject a fault or record logs.
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import gc
import multiprocessing as mp
import os
import pickle
import queue
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import uuid
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Iterator, Optional, Sequence

import lightning.pytorch as pl
import psutil
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import Logger
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_dist.strategy.features import features_of

_KEPT_GROUPS: list = []  # see _child: process groups a rank holds until it exits
_GRACE_S = 3.0  # after a rank fails, how long the others get to report before they are killed
JOB_VAR = "LIGHTNING_DIST_TEST_JOB"  # set for each launched job: its processes are found by it
SIDE_BY_SIDE_VAR = "LIGHTNING_DIST_SIDE_BY_SIDE"  # every process started under side_by_side inherits it


class RanksFailed(RuntimeError):
    """A rank raised, died, or the group ran past its deadline."""


def _own_output(output_path: str) -> None:
    """In a rank: stdout and stderr (the file descriptors, and Python's streams on them) go to the rank's own file,
    and ``faulthandler`` writes every thread's Python stack there on a crash and on ``SIGUSR1`` (the parent's signal
    at a deadline): what a stuck rank was doing is then in the parent's report, not lost with the rank."""
    fd = os.open(output_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    # under pytest's capture sys.stdout is not fd 1: rebind both streams, line-buffered, so a stuck rank's last
    # lines are in the file
    sys.stdout = open(1, "w", buffering=1, encoding="utf-8", errors="replace", closefd=False)
    sys.stderr = open(2, "w", buffering=1, encoding="utf-8", errors="replace", closefd=False)
    faulthandler.enable(file=sys.stderr, all_threads=True)
    faulthandler.register(_DUMP_SIGNAL, file=sys.stderr, all_threads=True)


def _die_with_parent(parent: int) -> None:
    """In a rank: the kernel kills it when the process that started it dies (Linux's ``PR_SET_PDEATHSIG``), so a rank
    never outlives a harness killed from outside (a test run stopped with SIGKILL), which would have killed it."""
    with contextlib.suppress(Exception):  # not Linux: no such guard
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # 1: PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the parent died before the guard was set
        os._exit(1)


def _child(fn: Callable[..., Any], rank: int, world_size: int, store_path: str, deadline_s: float,
           args: tuple, results: Any, output_path: str, parent: int) -> None:
    os.setsid()  # its own process group: the parent kills it together with anything it started
    _die_with_parent(parent)
    _own_output(output_path)
    torch.set_num_threads(1)  # N ranks share the machine's cores; one intra-op thread each
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{store_path}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=deadline_s),
        )
        try:
            out = fn(rank, world_size, *args)
        finally:
            # fn's reference cycles may still hold the group: free them now, while it exists, not later on one
            # of gloo's threads, where the group's destructor would join that very thread and abort the rank
            gc.collect()
            # A callback gloo ran on its own thread (a comm hook's ``then``) may still be dropping its closure when
            # fn returns; if that drop is the group's last reference, the group's destructor joins that very thread
            # and aborts the rank ("Resource deadlock avoided"). The groups are kept alive here until the child
            # exits (os._exit: no destructors run), so their last reference is never dropped on gloo's thread.
            _KEPT_GROUPS.extend(dist.distributed_c10d._world.pg_map)
            dist.destroy_process_group()
        # plain pickle to bytes: the queue's own pickler would pass tensors as shared-memory handles,
        # which break once this process exits before the parent has read them
        results.put((rank, "ok", pickle.dumps(out)))
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises
        results.put((rank, "error", traceback.format_exc()))


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    deadline_s: float = 120.0,
    start_method: str = "fork",
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return the results in rank order.

    ``fn`` runs after ``init_process_group`` and must return something picklable. Raises
    :class:`RanksFailed` with every failing rank's traceback if any rank raises, exits without a result,
    or the whole group has not finished within ``deadline_s`` seconds; all children are killed first.
    ``fork`` starts in milliseconds; use ``spawn`` when the parent holds threads that must not be forked. A forked rank
    inherits this process's MKL allocator: after MKL ran on several threads here, a rank's first matrix product can
    spin forever inside it; set ``MKL_DISABLE_FAST_MM=1`` before torch is imported (``tests/conftest.py`` does).

    Each rank's stdout and stderr go to a file of its own, copied to this process's stderr as it grows.
    Before a rank that is still running is killed (at the deadline, or after a peer failed), it is asked to write
    every thread's Python stack (``faulthandler`` on ``SIGUSR1``); the error then holds, for every rank that did not
    finish, the end of its output with those stacks: where each stuck rank was waiting.
    """
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1.")
    ctx = mp.get_context(start_method)
    workdir = tempfile.mkdtemp(prefix="lightning_dist_ranks_")
    store_path = os.path.join(workdir, "store")
    logs = [os.path.join(workdir, f"rank{rank}.out") for rank in range(world_size)]
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_child, args=(fn, rank, world_size, store_path, deadline_s, args, results, logs[rank],
                                         os.getpid()), daemon=True)
        for rank in range(world_size)
    ]
    outputs: dict[int, Any] = {}
    errors: dict[int, str] = {}
    copier = _OutputCopier(logs)
    why_killed = ""  # why ranks that had not finished were killed
    try:
        for p in procs:
            p.start()
        copier.start()  # after the forks: no thread of ours is copied into a rank
        end = time.monotonic() + deadline_s
        deadline_end = end
        while len(outputs) + len(errors) < world_size:
            remaining = end - time.monotonic()
            if remaining <= 0:
                why_killed = (f"deadline of {deadline_s:.0f}s passed" if end >= deadline_end else
                              f"killed {_GRACE_S:.0f}s after a peer failed or exited")
                break
            try:
                rank, status, payload = results.get(timeout=min(remaining, 0.2))
            except queue.Empty:
                # A rank that died without reporting (segfault, SIGKILL) would otherwise cost the whole deadline.
                dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0)
                        and i not in outputs and i not in errors]
                for i in dead:
                    errors[i] = f"rank {i} exited with code {procs[i].exitcode} without a result"
                    end = min(end, time.monotonic() + _GRACE_S)
                if any(p.exitcode == 0 for i, p in enumerate(procs) if i not in outputs and i not in errors):
                    end = min(end, time.monotonic() + _GRACE_S)  # exited cleanly: its result is due any moment
                continue
            if status != "ok":
                # Its peers now fail too (connection reset) or block: give them a moment to report, so the
                # first cause is in the message, then kill whoever is left.
                errors[rank] = payload
                end = min(end, time.monotonic() + _GRACE_S)
                continue
            outputs[rank] = pickle.loads(payload)
        running = [i for i in range(world_size) if i not in outputs and i not in errors]
        if running:
            _dump_stacks([procs[i] for i in running], [logs[i] for i in running])
            for i in running:
                errors[i] = (f"rank {i} was still running: {why_killed}; ranks that had not finished were killed "
                             f"(finished: {sorted(outputs) or 'none'})")
    finally:
        for p in procs:
            if p.pid is not None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)  # the rank and whatever it started (a Lightning launcher)
                except (ProcessLookupError, PermissionError):
                    pass
        for p in procs:
            if p.pid is not None:  # one that never started (its start raised) cannot be joined
                p.join(timeout=5)
        copier.stop()
        results.close()
        tails = {rank: _tail(logs[rank]) for rank in errors}
        shutil.rmtree(workdir, ignore_errors=True)
    if errors:
        text = "\n".join(f"--- rank {r} ---\n{msg}\n--- rank {r}: the end of its output ---\n{tails[r]}"
                         for r, msg in sorted(errors.items()))
        raise RanksFailed(f"{len(errors)} rank(s) failed in a group of {world_size}:\n{text}")
    return [outputs[r] for r in range(world_size)]


_DUMP_SIGNAL = signal.SIGUSR1  # a rank writes every thread's Python stack to its stderr on this signal
_DUMP_WAIT_S = 3.0  # how long the stacks may take to arrive before the ranks are killed anyway
_TAIL_LINES = 120  # lines of a failed rank's output in the error


def _dump_stacks(procs: Sequence[Any], logs: Sequence[str]) -> None:
    """Signal each of ``procs`` to write its threads' Python stacks to its log; wait until every dump is written (a
    rank's file has a new stack and has stopped growing), for :data:`_DUMP_WAIT_S` at most."""
    sizes = {}
    for p, log in zip(procs, logs):
        if p.pid is None or p.exitcode is not None:
            continue
        sizes[log] = os.path.getsize(log) if os.path.exists(log) else 0
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(p.pid, _DUMP_SIGNAL)
    end = time.monotonic() + _DUMP_WAIT_S
    last: dict[str, int] = {}
    while sizes and time.monotonic() < end:
        time.sleep(0.1)
        for log, size in list(sizes.items()):
            with open(log, "rb") as fh:
                fh.seek(size)
                new = fh.read()
            if b"(most recent call first)" in new and last.get(log) == len(new):
                del sizes[log]  # a dump has begun and nothing came in the last 0.1 s: it is complete
            last[log] = len(new)


def _tail(path: str, lines: int = _TAIL_LINES) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            text = fh.read().splitlines()
    except OSError:
        return "(no output)"
    if not text:
        return "(no output)"
    cut = f"[{len(text) - lines} earlier lines left out]\n" if len(text) > lines else ""
    return cut + "\n".join(text[-lines:])


class _OutputCopier:
    """Copies the ranks' output files to this process's stderr as they grow (a thread, polling)."""

    def __init__(self, paths: Sequence[str], poll_s: float = 0.1) -> None:
        self.paths, self.poll_s = list(paths), poll_s
        self.offsets = dict.fromkeys(self.paths, 0)
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="run_ranks-output", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.copy()  # whatever came last

    def _loop(self) -> None:
        while not self._stop.wait(self.poll_s):
            self.copy()

    def copy(self) -> None:
        for path in self.paths:
            try:
                with open(path, "rb") as fh:
                    fh.seek(self.offsets[path])
                    chunk = fh.read()
            except OSError:
                continue
            if chunk:
                self.offsets[path] += len(chunk)
                with contextlib.suppress(OSError):
                    os.write(2, chunk)


@contextlib.contextmanager
def launched_externally(rank: int, world_size: int, hosts: int = 1) -> Iterator[None]:
    """Inside a :func:`run_ranks` rank: let Lightning train in this very process, as under ``torchrun``.

    Sets the variables a launcher sets (``LOCAL_RANK``, ``RANK``, ``WORLD_SIZE``, ``NODE_RANK``), so
    Lightning sees processes created externally, launches none, and reuses the process group
    :func:`run_ranks` already initialised: ``Trainer(devices=world_size).fit(...)`` then runs on every rank
    in-process, fits in a fraction of a second, and its exceptions reach the caller. Restores the
    environment afterwards.

    With ``hosts`` > 1 the ranks pose as ``hosts`` nodes of ``world_size // hosts`` ranks each, numbered node by
    node, through the variables torchrun sets (``GROUP_RANK``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
    ``TORCHELASTIC_RUN_ID``; no ``MASTER_ADDR``, so no store is looked for): train with
    ``Trainer(devices=world_size // hosts, num_nodes=hosts)``.
    """
    if hosts < 1 or world_size % hosts:
        raise ValueError(f"hosts={hosts} must divide world_size={world_size}")
    per_host = world_size // hosts
    values = {"LOCAL_RANK": str(rank % per_host), "RANK": str(rank), "WORLD_SIZE": str(world_size),
              "NODE_RANK": str(rank // per_host)}
    if hosts > 1:
        values.update(GROUP_RANK=str(rank // per_host), LOCAL_WORLD_SIZE=str(per_host), GROUP_WORLD_SIZE=str(hosts),
                      TORCHELASTIC_RUN_ID="launched_externally")
    names = (*values, "GROUP_RANK", "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE", "TORCHELASTIC_RUN_ID")
    saved = {name: os.environ.get(name) for name in names}
    for name in names:
        os.environ.pop(name, None)
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


# -- a port for a launched job ------------------------------------------------------------------------------------
_PORTS_GIVEN: set[int] = set()
_PORTS_LOCK = threading.Lock()


def free_port() -> int:
    """A TCP port free on this machine now, below the kernel's ephemeral range and never given out before by this
    process: a launched single-machine job's ``MASTER_PORT`` when several jobs start at once. Each job finding its
    own (Lightning binds port 0, closes it, and binds it again later) lets two jobs started together pick the same
    port, and the second fails with EADDRINUSE or, worse, joins the first one's store; a port outside the ephemeral
    range is one no port-0 bind anywhere can take in the meantime."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as fh:
        ephemeral_low = int(fh.read().split()[0])
    low = max(1024, ephemeral_low - 12000)
    with _PORTS_LOCK:
        for _ in range(1000):
            port = random.randrange(low, ephemeral_low)
            if port in _PORTS_GIVEN:
                continue
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
                try:
                    probe.bind(("", port))
                except OSError:
                    continue
            _PORTS_GIVEN.add(port)
            return port
    raise RuntimeError(f"no free port in [{low}, {ephemeral_low}) after 1000 tries")


# -- a launched job and every process it starts ------------------------------------------------------------------
def job_processes(job: str, var: str = JOB_VAR) -> dict[int, psutil.Process]:
    """The live (not zombie) processes of the job started with ``var=job`` (``JOB_VAR`` unless said): every
    process the job starts inherits the variable (torchrun starts its workers in sessions of their own, so neither
    the job's process group nor its session finds them all)."""
    found = {}
    for proc in psutil.process_iter():
        try:
            if proc.environ().get(var) == job and proc.status() != psutil.STATUS_ZOMBIE:
                found[proc.pid] = proc
        except psutil.Error:
            continue
    return found


def kill_job(job: str, var: str = JOB_VAR) -> None:
    """SIGKILL every live process of the job (found by ``var``, as :func:`job_processes`)."""
    for pid in job_processes(job, var):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def side_by_side(*calls: Callable[[], Any], lanes: int = 2, settle_s: float = 120.0) -> list[Any]:
    """Run ``calls`` (each launches jobs and waits for them) on ``lanes`` threads, taken in the order given; their
    results in that order. For tests: a launched job spends much of its time in one process's imports or in waiting
    (a watchdog's timeout, a rendezvous, a shaped link), so a second job beside it uses the core the first leaves
    idle; put the longest calls first.

    Every process that any call starts inherits :data:`SIDE_BY_SIDE_VAR` (it is set in this process's environment
    until every call has returned; a call that passes its children an environment must start from
    ``os.environ``, as :class:`~lightning_dist.simcluster.SimCluster` and :func:`watch_job` do). When a call raises, or
    the caller is interrupted (pytest-timeout, Ctrl-C), the calls not started are dropped and every such process is
    killed, again and again until every running call has returned (what a call starts after the first kill dies
    too; each call's own clean-up, such as leaving a :class:`SimCluster`, runs as it returns, within
    ``settle_s``); then the first exception is raised."""
    token = uuid.uuid4().hex
    before = os.environ.get(SIDE_BY_SIDE_VAR)
    os.environ[SIDE_BY_SIDE_VAR] = token
    pool = ThreadPoolExecutor(max_workers=lanes, thread_name_prefix="side_by_side")
    try:
        futures = [pool.submit(call) for call in calls]
        try:
            done, _ = wait(futures, return_when=FIRST_EXCEPTION)
            for future in done:
                future.result()  # the first failure, as soon as there is one
            return [future.result() for future in futures]
        except BaseException:
            for future in futures:
                future.cancel()
            deadline = time.monotonic() + settle_s
            while time.monotonic() < deadline:
                kill_job(token, SIDE_BY_SIDE_VAR)
                if all(future.done() for future in futures):
                    break
                time.sleep(0.2)
            raise
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        if before is None:
            os.environ.pop(SIDE_BY_SIDE_VAR, None)
        else:
            os.environ[SIDE_BY_SIDE_VAR] = before


@dataclass
class ProcSeen:
    """One process of a watched job: when it was first seen, last seen alive, and seen gone."""

    pid: int
    ppid: int
    cmdline: tuple[str, ...]
    create_time: float
    first_seen: float
    last_seen: float
    gone_at: Optional[float] = None


@dataclass
class JobRun:
    """What one watched job did, times on the watcher's monotonic clock."""

    rc: Optional[int]
    started: float
    ended: float  # when none of its processes was left (or when they were killed)
    timed_out: bool
    lines: list[tuple[float, str]]  # its output, each line with the time it arrived
    procs: dict[int, ProcSeen]
    launcher: int  # the command's own pid

    @property
    def log(self) -> str:
        return "".join(line for _, line in self.lines)

    def line_time(self, pattern: re.Pattern) -> tuple[Optional[float], Optional[re.Match]]:
        """When the first line matching ``pattern`` arrived, and its match."""
        for stamp, line in self.lines:
            match = pattern.search(line)
            if match:
                return stamp, match
        return None, None


def _read_lines(stream: Any, lines: list[tuple[float, str]]) -> None:
    for line in iter(stream.readline, ""):
        lines.append((time.monotonic(), line))
    stream.close()


def watch_job(args: Sequence[str], deadline_s: float, scan_s: float = 0.05,
              env: Optional[dict[str, str]] = None) -> JobRun:
    """Run ``args`` as a job of its own (a new session, a fresh ``JOB_VAR``, ``env`` added to this process's
    environment), stdout and stderr merged and stamped line by line, and look at every process of the job every
    ``scan_s`` seconds until none is left (a process is gone when it no longer exists or is a zombie); SIGKILL them
    all after ``deadline_s`` seconds."""
    job = uuid.uuid4().hex
    started = time.monotonic()
    proc = subprocess.Popen(list(args), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            encoding="utf-8", errors="replace", start_new_session=True, bufsize=1,
                            env={**os.environ, **(env or {}), JOB_VAR: job})
    lines: list[tuple[float, str]] = []
    reader = threading.Thread(target=_read_lines, args=(proc.stdout, lines), daemon=True)
    reader.start()
    seen: dict[int, ProcSeen] = {}
    timed_out = False
    while True:
        proc.poll()  # reaps the launcher once it exits: a zombie launcher counts as gone anyway
        now = time.monotonic()
        alive = job_processes(job)
        for pid, member in alive.items():
            if pid in seen:
                seen[pid].last_seen = now
                continue
            with contextlib.suppress(psutil.Error):
                seen[pid] = ProcSeen(pid, member.ppid(), tuple(member.cmdline()), member.create_time(), now, now)
        for pid, record in seen.items():
            if pid not in alive and record.gone_at is None:
                record.gone_at = now
        if not alive and proc.returncode is not None:
            break
        if now - started > deadline_s:
            timed_out = True
            kill_job(job)
            proc.wait()
            now = time.monotonic()
            for record in seen.values():
                record.gone_at = now if record.gone_at is None else record.gone_at
            break
        time.sleep(scan_s)
    reader.join(timeout=10)
    return JobRun(proc.returncode, started, now, timed_out, lines, seen, proc.pid)


class Slowdown(Callback):
    """A Lightning callback that makes chosen ranks slower by a known factor, for tests and benchmarks only.

    ``Slowdown({1: 2.0})`` makes rank 1 take twice its own forward and backward time, before its gradients
    leave (as a slower accelerator would: the other ranks wait for its buckets): when backward starts it sleeps
    ``factor - 1`` times this step's forward time plus its backward time estimated from the previous step's
    backward-to-forward ratio. The sleep counts as the rank's compute, so the strategy's speed measurement
    sees a rank ``factor`` times slower per sample; it needs no CPU, so on a small machine the other ranks do
    not lose cores to it. Not part of any product code path.
    """

    def __init__(self, factors: dict[int, float]) -> None:
        bad = {r: f for r, f in factors.items() if not (isinstance(f, (int, float)) and f >= 1)}
        if bad:
            raise ValueError(f"Slowdown factors {bad}: each must be >= 1 (2.0: twice as slow)")
        self.factors = dict(factors)
        self._started = self._backward_started = 0.0
        self._backward_per_forward = 2.0  # until measured: backward costs about twice the forward pass

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._started = time.perf_counter()

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
        factor = self.factors.get(trainer.global_rank, 1.0)
        forward = time.perf_counter() - self._started
        self._forward = forward
        if factor > 1.0:
            time.sleep((factor - 1.0) * forward * (1.0 + self._backward_per_forward))
        self._backward_started = time.perf_counter()

    def on_after_backward(self, trainer: Any, pl_module: Any) -> None:
        features = features_of(trainer.strategy)
        window = features.backward_window() if features is not None else None
        # the end of backward waits for the other ranks' buckets: not this rank's work
        waited = window[1] - window[0] if window is not None else 0.0
        backward = time.perf_counter() - self._backward_started - waited
        if self._forward > 0 and backward > 0:
            self._backward_per_forward = backward / self._forward
        self._started = time.perf_counter()  # a step run as micro-batches: the next one's forward starts now


class RecordingLogger(Logger):
    """A Lightning logger that keeps what was logged, as ``(step, metrics)`` pairs in :attr:`logged` (tests)."""

    name, version = "recording", 0

    def __init__(self) -> None:
        super().__init__()
        self.logged: list[tuple[Any, dict[str, float]]] = []

    def log_metrics(self, metrics: dict[str, float], step: Any = None) -> None:
        self.logged.append((step, dict(metrics)))

    def log_hyperparams(self, *args: Any, **kwargs: Any) -> None:
        pass


class InjectFault(Callback):
    """A fault on one rank at one global step, for tests and the ``faults`` benchmark only.

    ``kind``: ``"raise"`` (a RuntimeError in the training step), ``"kill"`` (SIGKILL to itself: no Python
    cleanup at all), ``"stall"`` (sleeps ``stall_s`` at the start of the step: alive, sockets open, no
    progress, as a stuck data loader), ``"signal"`` (sends itself ``signum``, SIGTERM by default, as a
    scheduler's preemption would). ``once_file``: when given, the fault happens only if that file does not
    exist yet, and creates it (a restarted attempt then runs clean).
    """

    KINDS = ("raise", "kill", "stall", "signal")

    def __init__(self, kind: str, rank: int, step: int, stall_s: float = 3600.0, signum: int = int(signal.SIGTERM),
                 once_file: str | None = None) -> None:
        if kind not in self.KINDS:
            raise ValueError(f"InjectFault kind={kind!r}: use one of {self.KINDS}")
        self.kind, self.rank, self.step, self.stall_s, self.signum = kind, rank, step, stall_s, signum
        self.once_file = once_file

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_rank != self.rank or trainer.global_step != self.step:
            return
        if self.once_file is not None:
            if os.path.exists(self.once_file):
                return
            with open(self.once_file, "w") as f:
                f.write(f"{self.kind} at step {self.step} on rank {self.rank}\n")
        # the wall clock's time of the fault, for a test that bounds how long after it every rank is gone
        print(f"[InjectFault] rank {self.rank}: {self.kind} at global step {self.step} (time {time.time():.3f})",
              flush=True)
        if self.kind == "raise":
            raise RuntimeError(f"injected fault on rank {self.rank} at global step {self.step}")
        if self.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.kind == "stall":
            time.sleep(self.stall_s)
        if self.kind == "signal":
            os.kill(os.getpid(), self.signum)


# -- what the tests and benchmarks fit ------------------------------------------------------------------------------
def quiet_trainer(**kwargs: Any) -> pl.Trainer:
    """A CPU Trainer without logger, checkpointing, progress bar, model summary or sanity validation: a test or a
    benchmark checks or measures training, and its output is its own; ``kwargs`` add to or override these."""
    settings = {"accelerator": "cpu", "logger": False, "enable_checkpointing": False, "enable_progress_bar": False,
                "enable_model_summary": False, "num_sanity_val_steps": 0}
    return pl.Trainer(**{**settings, **kwargs})


class ToyClassifier(pl.LightningModule):
    """A small MLP classifier with its own fixed data, the model most tests train.

    The data: ``samples`` rows of ``features`` standard normal values drawn from a generator seeded with 0, the
    label of a row the index of its largest value among the first ``classes`` features. The network:
    ``Linear`` layers of the widths in ``hidden`` (each followed by ``Tanh`` unless ``activation=False``: a
    network of Linear and Tanh layers has a backward that is exactly homogeneous under a power-of-two scale),
    then a ``Linear`` to ``classes``; built after ``torch.manual_seed(seed)`` when ``seed`` is given (the
    same initial weights in every fit), else from the caller's random state. ``optimizer``: ``"sgd"`` (with
    ``momentum``), ``"adam"`` or ``"adamw"`` (torch's default weight decay, 0.01). ``distributed_sampler``: the
    loader brings its own unshuffled ``DistributedSampler`` (Lightning's own always shuffles; pass
    ``use_distributed_sampler=False``), so that global batch ``k`` holds rows ``k * world_size * batch_size`` on.
    ``keep_batches``: every training batch this rank saw is kept in ``seen`` (a one-process replay reads them).
    Subclasses change the data through :meth:`dataset` and the step through ``training_step``.
    """

    def __init__(self, features: int = 12, hidden: Sequence[int] = (32,), classes: int = 2, samples: int = 128,
                 batch_size: int = 8, optimizer: str = "sgd", lr: float = 0.1, momentum: float = 0.0,
                 activation: bool = True, shuffle: bool = False, distributed_sampler: bool = False,
                 seed: Optional[int] = None, keep_batches: bool = False) -> None:
        super().__init__()
        if optimizer not in ("sgd", "adam", "adamw"):
            raise ValueError(f"ToyClassifier optimizer={optimizer!r}: use 'sgd', 'adam' or 'adamw'")
        if seed is not None:
            torch.manual_seed(seed)
        layers: list[nn.Module] = []
        width = features
        for size in hidden:
            layers += [nn.Linear(width, size), nn.Tanh()] if activation else [nn.Linear(width, size)]
            width = size
        self.net = nn.Sequential(*layers, nn.Linear(width, classes))
        self.features, self.classes, self.samples, self.batch_size = features, classes, samples, batch_size
        self.optimizer, self.lr, self.momentum = optimizer, lr, momentum
        self.shuffle, self.distributed_sampler = shuffle, distributed_sampler
        self.keep_batches, self.seen = keep_batches, []

    def data(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The inputs and labels, the same on every call and every rank."""
        x = torch.randn(self.samples, self.features, generator=torch.Generator().manual_seed(0))
        return x, x[:, : self.classes].argmax(1)

    def dataset(self) -> TensorDataset:
        """The training set: :meth:`data` as a ``TensorDataset``."""
        return TensorDataset(*self.data())

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.keep_batches:
            self.seen.append((batch[0].clone(), batch[1].clone()))
        return nn.functional.cross_entropy(self.net(batch[0]), batch[1])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer == "adam":
            return torch.optim.Adam(self.parameters(), lr=self.lr)
        if self.optimizer == "adamw":
            return torch.optim.AdamW(self.parameters(), lr=self.lr)
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)

    def train_dataloader(self) -> DataLoader:
        data = self.dataset()
        if self.distributed_sampler:
            return DataLoader(data, batch_size=self.batch_size, sampler=DistributedSampler(data, shuffle=False))
        return DataLoader(data, batch_size=self.batch_size, shuffle=self.shuffle)
