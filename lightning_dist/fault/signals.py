"""Stop signals as a flag: SIGTERM and SIGUSR1 (preemption, SLURM's warning signal) recorded, nothing more, so that the
ranks can agree at a step they share on stopping.

Why only a flag: Lightning's own SIGTERM handler runs a collective inside the signal handler (a broadcast from rank
0), which cannot complete when a peer is in another collective or gone. :class:`StopSignals` replaces it for the fit
(Lightning registers its handlers just before the fit loop, so ours go in after that) and puts back, after the fit,
the handlers from before it (Lightning's teardown, which runs before a callback's, restores its predecessors).

What Lightning's SIGUSR1 handler did beyond stopping, SLURM's requeue (``SLURMEnvironment(auto_requeue=True)``: save a
checkpoint, then ``scontrol requeue <job id>`` from rank zero), is done once the ranks agreed and saved: the caller
asks :func:`requeue_signal` which signal Lightning would requeue on and runs :func:`requeue_slurm_job`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from typing import Any, Optional

from lightning.fabric.plugins.environments import SLURMEnvironment

NAMES = ("SIGTERM", "SIGUSR1")


def signums() -> list[int]:
    """The numbers of :data:`NAMES` this platform has."""
    return [signum for name in NAMES if (signum := getattr(signal, name, None)) is not None]


class StopSignals:
    """The first stop signal this process received (:attr:`signum`, None for none) and when."""

    def __init__(self) -> None:
        self.signum: Optional[int] = None  # set by the handler: the only thing it does
        self.received_at = 0.0  # time.monotonic() then
        self._before: dict[int, Any] = {}  # the handlers from before the fit
        self._replaced: dict[int, Any] = {}  # what restore() puts back

    def remember(self) -> None:
        """In ``setup``, before Lightning registers its own: the handlers to restore after the fit."""
        self._before = {signum: signal.getsignal(signum) for signum in signums()}

    def install(self) -> None:
        """In ``on_train_start``, after Lightning registered its own; only the main thread may set handlers."""
        if threading.current_thread() is not threading.main_thread():
            return
        for signum in signums():
            in_force = signal.signal(signum, self.record)
            self._replaced[signum] = self._before.get(signum, in_force)

    def restore(self) -> None:
        for signum, handler in self._replaced.items():
            with contextlib.suppress(ValueError, TypeError):
                signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        self._replaced = {}

    def record(self, signum: int, frame: Any) -> None:
        """The handler: keeps the first signal."""
        if self.signum is None:
            self.signum, self.received_at = signum, time.monotonic()

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else ""

    def waited_s(self) -> float:
        """Seconds since the signal arrived."""
        return time.monotonic() - self.received_at


def requeue_signal(strategy: Any) -> Optional[int]:
    """The signal on which Lightning would requeue this SLURM job: its cluster environment's ``requeue_signal``
    (SIGUSR1 by default) where that is a :class:`SLURMEnvironment` with ``auto_requeue``; else None. Read from a
    strategy of several processes (``strategy.cluster_environment``)."""
    environment = getattr(strategy, "cluster_environment", None)  # a ParallelStrategy's; a single device has none
    if not isinstance(environment, SLURMEnvironment) or not environment.auto_requeue:
        return None
    return int(environment.requeue_signal) if environment.requeue_signal is not None else None


def requeue_slurm_job(timeout_s: float = 60.0) -> tuple[bool, str]:
    """``scontrol requeue <job id>``, as Lightning's auto-requeue runs it (an array job's task as
    ``<array job id>_<task id>``); returns whether it succeeded and a line for the log. Called on rank zero only."""
    array_job = os.environ.get("SLURM_ARRAY_JOB_ID")
    job = f"{array_job}_{os.environ.get('SLURM_ARRAY_TASK_ID', '')}" if array_job else os.environ.get("SLURM_JOB_ID")
    if not job:
        return False, "SLURM's auto-requeue is on but SLURM_JOB_ID is not set: the job is not requeued"
    try:
        code = subprocess.run(["scontrol", "requeue", job], check=False, timeout=timeout_s).returncode
    except (OSError, subprocess.TimeoutExpired) as err:
        return False, f"requeuing SLURM job {job} failed ({type(err).__name__}: {err})"
    if code != 0:
        return False, f"requeuing SLURM job {job} failed: scontrol exited with {code}"
    return True, f"requeued SLURM job {job} (scontrol requeue {job})"
