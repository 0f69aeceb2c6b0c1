"""Emergency checkpoints: one rank's own state, written with no collective while the job is failing, and the
mechanisms around the write: a timer that ends a process its teardown would hang, and a guard on the fit loop.

An emergency checkpoint (``<checkpoint dir>/emergency/emergency-rank{r}-step={N}.ckpt``, written atomically with a
sidecar by :func:`lightning_dist.fault.checkpoint.save_checkpoint`) holds what Lightning's own checkpoint holds
(model, optimizer, loops, callbacks' state) plus what the caller adds (under RingDDPStrategy, FaultTolerance adds the
strategy's local entry, this rank's compressor state:
:meth:`~lightning_dist.strategy.RingFeatures.local_checkpoint_state`), dumped by this rank alone: its peers may be
gone, so nothing in it may wait for them. It is written at most once per process, by whichever thread meets the
fault first (the training thread on an exception, the watchdog's on a stall); the other waits for that write.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from typing import Any, Callable, Optional

import lightning.pytorch as pl

from lightning_dist.fault.checkpoint import checkpoint_dir, save_checkpoint
from lightning_dist.upstream import dump_checkpoint

EXIT_EXCEPTION, EXIT_STALL, EXIT_STOP_TIMEOUT = 1, 124, 143  # an exception; no progress; a stop not agreed in time


class EmergencyCheckpoint:
    """This rank's emergency checkpoint: :meth:`write` once, from any thread; :attr:`writing` from then on."""

    def __init__(self) -> None:
        self.paths: list[str] = []  # written by this rank in this process
        self.writing = False  # a write has begun: no collective anywhere in this process from now on
        self._lock: Optional[threading.Lock] = None  # made by arm(): the callback holding this is pickled for spawn
        self._done: Optional[threading.Event] = None  # set when the write has ended, either way

    def arm(self) -> None:
        """In the rank's process, before the fit."""
        self._lock, self._done = threading.Lock(), threading.Event()

    def write(self, trainer: pl.Trainer, dirpath: Optional[str], reason: str,
              extra: Optional[Callable[[], dict[str, Any]]] = None) -> Optional[str]:
        """This rank's own state, no collective: model, optimizer, loops, callbacks, generators, and the entries
        ``extra()`` returns (the strategy's, which only the caller, above the strategy, can ask for; it must not
        wait for a peer either). Returns the path, or None when another thread is writing it (or has) or the write
        failed (said on stderr)."""
        with self._lock or contextlib.nullcontext():
            if self.writing:
                return None
            self.writing = True
        rank = trainer.global_rank
        path = os.path.join(checkpoint_dir(trainer, dirpath), "emergency",
                            f"emergency-rank{rank}-step={trainer.global_step}.ckpt")
        try:
            checkpoint = dump_checkpoint(trainer)
            rewind_unfinished_batch(checkpoint)
            if extra is not None:
                checkpoint.update(extra())
            os.makedirs(os.path.dirname(path), exist_ok=True)
            save_checkpoint(checkpoint, path, meta={"kind": "emergency", "rank": rank, "reason": reason,
                                                    "world_size": trainer.world_size})
            self.paths.append(path)
            print(f"[lightning_dist] rank {rank}: emergency checkpoint {path} ({reason})", file=sys.stderr, flush=True)
            return path
        except Exception as err:  # noqa: BLE001 - the process is failing already: say why the save failed too
            print(f"[lightning_dist] rank {rank}: the emergency checkpoint could not be written: "
                  f"{type(err).__name__}: {err}", file=sys.stderr, flush=True)
            return None
        finally:
            if self._done is not None:
                self._done.set()

    def wait(self, timeout_s: float) -> None:
        """Let a write another thread has begun finish (up to ``timeout_s``), rather than cut it off."""
        if self.writing and self._done is not None:
            self._done.wait(timeout_s)


def rewind_unfinished_batch(checkpoint: dict[str, Any]) -> bool:
    """The batch a fault interrupted (started, not processed: its step did not finish) did not happen: the checkpoint's
    loop counters are put back to the last processed batch, as the data loader's state already is.

    Lightning resets only its per-epoch counters on a restart and tells where a checkpoint was written from its
    running totals; left as they were, a run that resumes from this checkpoint and later from one written at a batch's
    end (an agreed stop, an elastic join) would resume one batch before its loader. Returns whether it rewound."""
    loops = checkpoint.get("loops") or {}
    progress = (loops.get("fit_loop") or {}).get("epoch_loop.batch_progress")
    if not progress:
        return False
    rewound = False
    for part in ("total", "current"):
        counts = progress[part]
        if counts["processed"] < counts["started"]:
            counts["ready"] = counts["started"] = counts["processed"]
            rewound = True
    if rewound:
        progress["is_last_batch"] = False
    return rewound


PEER_GONE_GRACE_S = 3.0  # after an exception that says a peer is gone: the time left for a teardown
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


def peer_gone(exception: BaseException) -> bool:
    """Whether ``exception`` (or one it came from) says a peer's connection closed: gloo's words for a peer that
    ended."""
    seen: set[int] = set()
    current: Optional[BaseException] = exception
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if any(words in str(current) for words in _PEER_GONE):
            return True
        current = current.__cause__ or current.__context__
    return False


def exit_later(seconds: float, code: int) -> None:
    """End the process with ``code`` in ``seconds`` unless it has ended by then (a daemon thread)."""
    def end() -> None:
        time.sleep(seconds)
        print(f"[lightning_dist] the process did not end within {seconds:.0f} s of the fault; ending it "
              f"(exit code {code})", file=sys.stderr, flush=True)
        os._exit(code)

    threading.Thread(target=end, name="lightning_dist-exit", daemon=True).start()


def guard_fit_loop(trainer: pl.Trainer, on_exception: Callable[[BaseException], None]) -> None:
    """Call ``on_exception`` with whatever escapes the fit loop, then let it go on.

    Lightning's fork and spawn launchers run the fit in their children without Lightning's exception handling (the
    parent calls ``on_exception``, in a process that is not a rank), so a callback's ``on_exception`` never runs in
    the rank that failed. :func:`unguard_fit_loop` undoes it."""
    run = trainer.fit_loop.run

    def guarded_run(*args: Any, **kwargs: Any) -> Any:
        try:
            return run(*args, **kwargs)
        except BaseException as exception:
            on_exception(exception)
            raise

    trainer.fit_loop.run = guarded_run


def unguard_fit_loop(trainer: pl.Trainer) -> None:
    trainer.fit_loop.__dict__.pop("run", None)  # the class's own run again
