"""Memory: the pre-flight estimate (:mod:`~lightning_dist.memory.estimate`) and in-job readers
(:mod:`~lightning_dist.memory.readers`) that :class:`~lightning_dist.callbacks.MemoryMonitor` builds on."""

from lightning_dist.memory.estimate import ActivationProbe, CommSetup, MemoryEstimate, estimate_memory

__all__ = ["ActivationProbe", "CommSetup", "MemoryEstimate", "estimate_memory"]
