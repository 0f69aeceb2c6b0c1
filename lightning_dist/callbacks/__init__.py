"""Lightning callbacks that work with RingDDPStrategy (MemoryMonitor also with any other strategy)."""

from lightning_dist.callbacks.dist_metrics import DistMetricsCallback
from lightning_dist.callbacks.fault_tolerance import FaultTolerance
from lightning_dist.callbacks.memory_monitor import InsufficientMemoryError, MemoryMonitor
from lightning_dist.callbacks.nan_recovery import NaNRecovery, NaNRecoveryError

__all__ = ["DistMetricsCallback", "FaultTolerance", "InsufficientMemoryError", "MemoryMonitor", "NaNRecovery",
           "NaNRecoveryError"]
