"""CUDA memory snapshots on an out-of-memory error, for https://pytorch.org/memory_viz.

The allocator's history is recorded from the start of a fit (``torch.cuda.memory._record_memory_history``) and
dumped (``torch.cuda.memory._dump_snapshot``) to ``<directory>/oom-rank{r}-step{N}.pickle``: by torch's
out-of-memory observer at the failed allocation, before anything is freed (where the build has one), else when the
out-of-memory error reaches Lightning (:meth:`OomSnapshots.on_exception`). An OOM torch recovers from, such as a
convolution retrying with less workspace, fires the observer too: it writes at most :data:`MAX_OBSERVED` per fit.

torch's observer cannot be detached, so there is one per process, attached on first use; it calls whichever
:class:`OomSnapshots` is recording now, held weakly, so that neither it nor its trainer outlives the fit.
"""

from __future__ import annotations

import os
import weakref
from typing import Any, Optional

import torch
import torch.distributed as dist

MAX_OBSERVED = 8  # snapshots the observer writes per fit (recoverable OOMs fire it too)
_recording: Optional[weakref.ref] = None  # the OomSnapshots recording now
_ATTACHED = False  # the process's observer is attached


def _observer(device: int, alloc: int, device_alloc: int, device_free: int) -> None:
    snapshots = _recording() if _recording is not None else None
    if snapshots is not None:
        snapshots.dump("oom", observed=True)


class OomSnapshots:
    """Records a fit's CUDA allocations and writes the snapshots; :attr:`paths` lists this fit's."""

    def __init__(self, entries: int) -> None:
        self.entries = entries  # allocation events the history keeps
        self.paths: list[str] = []
        self.recording = False
        self._directory = ""
        self._trainer: Optional[weakref.ref] = None  # weak: the observer outlives the fit

    def start(self, trainer: Any, directory: str) -> None:
        """Record from now on (a CUDA device is in use); the snapshots go to ``directory``."""
        global _ATTACHED, _recording
        self.paths, self._directory, self._trainer = [], directory, weakref.ref(trainer)
        torch.cuda.memory._record_memory_history(max_entries=self.entries)
        self.recording = True
        _recording = weakref.ref(self)
        attach = getattr(torch._C, "_cuda_attach_out_of_memory_observer", None)
        if attach is not None and not _ATTACHED:
            attach(_observer)
            _ATTACHED = True

    def dump(self, why: str, observed: bool = False) -> Optional[str]:
        """Write the allocator's history; from the observer (the moment of a failed allocation, which torch may still
        recover from) at most :data:`MAX_OBSERVED` times."""
        if not self.recording or (observed and len(self.paths) >= MAX_OBSERVED):
            return None
        os.makedirs(self._directory, exist_ok=True)
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        path = os.path.join(self._directory, f"{why}-rank{rank}-step{self._step()}.pickle")
        torch.cuda.memory._dump_snapshot(path)  # a later OOM at the same step overwrites it: the latest wins
        if path not in self.paths:
            self.paths.append(path)
        return path

    def on_exception(self, exception: BaseException) -> None:
        """An exception reached Lightning: an OOM's snapshot, unless the observer wrote this step's already (or
        this torch build has no observer)."""
        if isinstance(exception, torch.cuda.OutOfMemoryError) and self.recording:
            step = self._step()
            if not any(path.endswith(f"-step{step}.pickle") for path in self.paths):
                self.dump("oom")

    def stop(self) -> None:
        global _recording
        if self.recording:
            self.recording = False
            torch.cuda.memory._record_memory_history(enabled=None)
        if _recording is not None and _recording() is self:
            _recording = None
        self._trainer = None

    def _step(self) -> int:
        trainer = self._trainer() if self._trainer is not None else None
        return trainer.global_step if trainer is not None else -1
