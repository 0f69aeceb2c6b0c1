"""Lightning callbacks that work with RingDDPStrategy."""

from lightning_dist.callbacks.dist_metrics import DistMetricsCallback
from lightning_dist.callbacks.nan_recovery import NaNRecovery, NaNRecoveryError

__all__ = ["DistMetricsCallback", "NaNRecovery", "NaNRecoveryError"]
