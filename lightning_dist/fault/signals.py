"""Stop signals as a flag: SIGTERM and SIGUSR1 (preemption, SLURM's warning signal) recorded, nothing more, so that the
ranks can agree at a step they share on stopping.

Why only a flag: Lightning's own SIGTERM handler runs a collective inside the signal handler (a broadcast from rank
0), which cannot complete when a peer is in another collective or gone. :class:`StopSignals` replaces it for the fit
(Lightning registers its handlers just before the fit loop, so ours go in after that) and puts back, after the fit,
the handlers from before it (Lightning's teardown, which runs before a callback's, restores its predecessors).
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from typing import Any, Optional

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
