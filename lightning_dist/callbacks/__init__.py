"""Lightning callbacks that work with RingDDPStrategy (MemoryMonitor also with any other strategy).

They hold policy; the mechanisms they drive live below them (``strategy/``, ``fault/``, ``memory/``).
DistMetricsCallback, the strategy's own reporting, lives in :mod:`lightning_dist.strategy.dist_metrics`.
"""

from lightning_dist.callbacks.elastic import ElasticTraining
from lightning_dist.callbacks.fault_tolerance import FaultTolerance
from lightning_dist.callbacks.memory_monitor import InsufficientMemoryError, MemoryMonitor
from lightning_dist.callbacks.nan_recovery import NaNRecovery, NaNRecoveryError
from lightning_dist.strategy.dist_metrics import DistMetricsCallback

__all__ = ["DistMetricsCallback", "ElasticTraining", "FaultTolerance", "InsufficientMemoryError", "MemoryMonitor",
           "NaNRecovery", "NaNRecoveryError"]
