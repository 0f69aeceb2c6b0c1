"""Lightning callbacks that work with RingDDPStrategy."""

from lightning_dist.callbacks.dist_metrics import DistMetricsCallback

__all__ = ["DistMetricsCallback"]
