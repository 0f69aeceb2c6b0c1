"""Lightning's ``popen`` launcher ends every rank the moment one fails; under fault tolerance it waits for their saves.

Lightning's subprocess launcher (``start_method="popen"``) starts ranks 1.. from rank 0's process, and a thread there
(``_ChildProcessObserver``) polls them every 5 s: once one has exited with a non-zero code, it SIGKILLs every other
rank and rank 0 itself, so that nothing is left behind. That races FaultTolerance, whose survivors save an emergency
checkpoint and exit on their own within a bound: in ``tests/test_fault_tolerance.py``'s ``kill_popen`` job (rank 1
SIGKILLed) on a loaded machine, rank 0 wrote its checkpoint and was then SIGKILLed (-9) instead of exiting 1, and a
poll that falls inside a save ends the rank before its checkpoint is written.

:func:`defer_kill` holds the observer's kill for ``grace_s`` seconds, the bound within which every rank ends itself;
then it kills what is left, as Lightning would. The observer is a thread of rank 0's process, so rank 0 ending on its
own ends the wait. Nothing is left behind later than that bound, and no save is cut short. It reaches one private
Lightning object (the observer thread); where the installed Lightning has none of that shape, nothing is changed and
Lightning's own behaviour stays.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Optional

try:  # a private class of Lightning's: absent or changed in another version, the launcher's behaviour stays its own
    from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver
except ImportError:  # pragma: no cover (the pinned range has it)
    _ChildProcessObserver = None


def process_observer() -> Optional[Any]:
    """The popen launcher's observer thread in this process (rank 0 of a popen launch), or None."""
    if _ChildProcessObserver is None:
        return None
    return next((t for t in threading.enumerate() if isinstance(t, _ChildProcessObserver) and t.is_alive()), None)


def defer_kill(observer: Any, grace_s: float) -> Optional[Callable[[], None]]:
    """Hold ``observer``'s kill of every rank for ``grace_s`` seconds after it decided on it; returns what undoes it
    (None: the observer has no kill of the expected shape)."""
    terminate = getattr(observer, "_terminate_all", None)
    if terminate is None:
        return None

    def terminate_after_grace() -> None:
        # the observer is a thread of rank 0's process: rank 0 ending (its save done) ends this wait too
        time.sleep(grace_s)
        terminate()  # what is left, rank 0 among them, as Lightning would have at once

    observer._terminate_all = terminate_after_grace

    def undo() -> None:
        observer._terminate_all = terminate

    return undo


__all__ = ["defer_kill", "process_observer"]
