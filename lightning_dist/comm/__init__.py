"""Collectives built on ``torch.distributed`` point-to-point operations. No Lightning in here.

- :func:`ring_allreduce_`: bandwidth-optimal pipelined ring, for large messages.
- :func:`tree_allreduce_`: latency-optimal recursive doubling, for small messages.
- :func:`native_allreduce_`: the backend's own ``all_reduce`` with the same contract.
- :func:`allreduce_`: any of them by name, ``"auto"`` choosing by message size (the tree below
  :data:`AUTO_TREE_MAX_BYTES` at 3 or more ranks, native otherwise); :func:`allreduce_async` returns a
  Future instead.
- :class:`CommStats`: bytes sent/received and time per call.
"""

from lightning_dist.comm._common import (
    completed_future,
    destroy_at_exit,
    destroy_groups,
    future_devices,
    release_scratch,
)
from lightning_dist.comm.dispatch import (
    ALGORITHMS,
    AUTO_TREE_MAX_BYTES,
    allreduce_,
    allreduce_async,
    check_algorithm,
    choose_algorithm,
    native_allreduce_,
    resolve_algorithm,
)
from lightning_dist.comm.ring import DEFAULT_SEGMENT_BYTES, ring_allreduce_, ring_bytes_sent
from lightning_dist.comm.stats import CallRecord, CommStats
from lightning_dist.comm.tree import tree_allreduce_

__all__ = [
    "ALGORITHMS",
    "AUTO_TREE_MAX_BYTES",
    "DEFAULT_SEGMENT_BYTES",
    "CallRecord",
    "CommStats",
    "allreduce_",
    "allreduce_async",
    "check_algorithm",
    "completed_future",
    "future_devices",
    "destroy_at_exit",
    "destroy_groups",
    "choose_algorithm",
    "native_allreduce_",
    "release_scratch",
    "resolve_algorithm",
    "ring_allreduce_",
    "ring_bytes_sent",
    "tree_allreduce_",
]
