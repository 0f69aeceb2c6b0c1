"""Memory: the pre-flight estimate (:mod:`~lightning_dist.memory.estimate`), in-job readers
(:mod:`~lightning_dist.memory.readers`), what a rank reports and rank zero logs (:mod:`~lightning_dist.memory.report`)
and CUDA snapshots on an out-of-memory error (:mod:`~lightning_dist.memory.oom`): the mechanisms
:class:`~lightning_dist.callbacks.MemoryMonitor` drives."""

from lightning_dist.memory.estimate import ActivationProbe, CommSetup, MemoryEstimate, estimate_memory

__all__ = ["ActivationProbe", "CommSetup", "MemoryEstimate", "estimate_memory"]
