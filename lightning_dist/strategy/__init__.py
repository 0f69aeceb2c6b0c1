"""RingDDPStrategy, its DDP comm hook, and the per-step control exchange."""

from lightning_dist.strategy.control import StepControl
from lightning_dist.strategy.hook import RingHookState, ring_comm_hook
from lightning_dist.strategy.ring_ddp import RingDDPStrategy

__all__ = ["RingDDPStrategy", "RingHookState", "StepControl", "ring_comm_hook"]
