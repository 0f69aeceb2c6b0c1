"""The DDP communication hook that sends every gradient bucket through lightning_dist's collectives.

DDP calls ``ring_comm_hook(state, bucket)`` once per gradient bucket as soon as backward has filled it.
The hook runs four visible stages (each a ``torch.profiler.record_function`` range, so they show in a
Chrome trace):

1. **weight**: scale the local gradient by this rank's share of the step. With equal batches that is
   ``1 / N``, applied as a division, exactly as stock DDP divides, so the two agree bit for bit.
2. **compress**: the compressor turns the bucket into a payload (identity for now).
3. **transport**: ``ring``, ``tree``, ``native`` or ``auto`` all-reduce of the payload, by sum.
4. **decompress**: the reduced payload goes back into the bucket's buffer.

The all-reduce is blocking, so the hook returns an already completed ``Future``; DDP accepts that on gloo
and NCCL. Bytes and seconds go into ``state.stats``, which the strategy reads once per step.
"""

# no `from __future__ import annotations`: DDP inspects the hook's real annotations (dist.GradBucket)

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch.profiler import record_function

from lightning_dist.comm import CommStats, allreduce_
from lightning_dist.compression import Compressor, NoCompressor


@dataclass
class RingHookState:
    """Everything the hook needs; one per DDP model, owned by the strategy."""

    # -- settings
    algorithm: str = "auto"  # "ring", "tree", "native" or "auto"
    process_group: Optional[dist.ProcessGroup] = None  # None: the world
    compressor: Compressor = field(default_factory=NoCompressor)
    # -- per-step inputs, set by the strategy
    world_size: int = 1
    weight: Optional[float] = None  # this rank's share of the step's samples; None means 1 / world_size
    # called when DDP hands over the step's last bucket, before it travels: the strategy starts the
    # per-step control exchange here so that it overlaps this bucket's all-reduce
    on_last_bucket: Optional[Callable[[], None]] = None
    # -- outputs, read and reset by the strategy once per step
    stats: CommStats = field(default_factory=lambda: CommStats(keep_records=False))
    # id(parameter) -> its name in the module; compressor state is keyed by names, because DDP rebuilds
    # (and renumbers) its buckets after the first step and in every new process
    param_names: dict[int, str] = field(default_factory=dict)
    _bucket_keys: dict[tuple[int, int, int], str] = field(default_factory=dict)


def ring_comm_hook(state: RingHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Reduce one gradient bucket: weight -> compress -> transport -> decompress."""
    if state.on_last_bucket is not None and bucket.is_last():
        state.on_last_bucket()
    buffer = bucket.buffer()
    with record_function("lightning_dist.weight"):
        if state.weight is None:
            buffer.div_(state.world_size)
        else:
            buffer.mul_(state.weight)
    key = _bucket_key(state, bucket)
    with record_function("lightning_dist.compress"):
        payload, ctx = state.compressor.compress(buffer, key)
    with record_function(f"lightning_dist.transport.{state.algorithm}"):
        allreduce_(payload, state.algorithm, group=state.process_group, op="sum", stats=state.stats)
    with record_function("lightning_dist.decompress"):
        result = state.compressor.decompress(payload, ctx, buffer)
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(result)
    return fut


def _bucket_key(state: RingHookState, bucket: dist.GradBucket) -> str:
    """The names of the bucket's parameters, joined: stable when DDP rebuilds and renumbers its buckets."""
    params = bucket.parameters()
    if not params:
        return f"bucket{bucket.index()}"
    cache_key = (bucket.index(), id(params[0]), len(params))
    key = state._bucket_keys.get(cache_key)
    if key is None:
        key = ",".join(state.param_names.get(id(p), f"param{i}") for i, p in enumerate(params))
        state._bucket_keys[cache_key] = key
    return key
