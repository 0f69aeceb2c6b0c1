"""Heterogeneous batching: per-rank batch sizes that follow each rank's speed, gradients weighted by samples.

``RingDDPStrategy(hetero=HeteroBatching(...))``; see :mod:`.batching` for the policy, :mod:`.plan` for the
sizes, :mod:`.sampler` for which samples each rank computes, :mod:`.loader` for the training loader.
"""

from lightning_dist.hetero.batching import HeteroBatching
from lightning_dist.hetero.loader import HeteroDataLoader, hetero_dataloader
from lightning_dist.hetero.plan import BatchPlan, micro_batch_sizes, split_batch
from lightning_dist.hetero.sampler import HeteroBatchSampler

__all__ = ["BatchPlan", "HeteroBatchSampler", "HeteroBatching", "HeteroDataLoader", "hetero_dataloader",
           "micro_batch_sizes", "split_batch"]
