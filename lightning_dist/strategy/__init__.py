"""RingDDPStrategy, its DDP comm hook, the per-step exchange, and the seam features use it through."""

from lightning_dist.strategy.exchange import StepExchange
from lightning_dist.strategy.features import RingFeatures, features_of
from lightning_dist.strategy.hook import BucketObserver, RingHookState, ring_comm_hook
from lightning_dist.strategy.ring_ddp import RingDDPStrategy

__all__ = ["BucketObserver", "RingDDPStrategy", "RingFeatures", "RingHookState", "StepExchange", "features_of",
           "ring_comm_hook"]
