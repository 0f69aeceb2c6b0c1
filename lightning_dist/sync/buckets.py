"""What every sync driver needs around the parameters: their buckets, host copies, and a gather to rank zero.

A driver that moves the parameters (DiLoCo's pseudo-gradient) or the optimizer's state (OneBitAdam's momentum)
flattens them into buckets as DDP does for gradients: runs of one dtype and device, in the module's order, of at
most :data:`BUCKET_BYTES`. A checkpoint gathers every rank's part of a driver's state to rank zero, each tensor copied
to the host first (:func:`to_host`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from lightning_dist.compression import BucketLayout
from lightning_dist.compression.parts import PartPlan

BUCKET_BYTES = 25 << 20  # DDP's default bucket size
HOST = torch.device("cpu")  # where a driver keeps state off the model's device (DiLoCo's, whatever that device)


@dataclass
class Bucket:
    """A run of parameters of one dtype and device, flattened together."""

    index: list[int]  # the parameters' positions in the list the buckets were cut from
    params: list[torch.Tensor]
    layout: BucketLayout
    flat: torch.Tensor  # ``layout.numel`` elements of the parameters' dtype, where the driver keeps them
    plan: Optional[PartPlan] = None  # a host's ranks reduce parts of it (DiLoCo under two_tier): this rank's part

    @property
    def spans(self) -> list[tuple[int, int]]:
        """Each parameter's ``[start, end)`` in :attr:`flat`."""
        return [(start, end) for _, start, end, _ in self.layout.spans()]


def cut_buckets(named: Sequence[tuple[str, torch.Tensor]],
                flat: Callable[[int, torch.Tensor], torch.Tensor],
                index: Optional[Sequence[int]] = None) -> list[Bucket]:
    """``named`` parameters, in their order, in runs of one dtype and device of at most :data:`BUCKET_BYTES`; each
    bucket's :attr:`Bucket.flat` is ``flat(numel, first_parameter)`` (on the device, or in host memory); ``index``:
    the parameters' positions in the caller's list (default: 0, 1, ...)."""
    index = list(range(len(named))) if index is None else list(index)
    runs: list[list[int]] = []
    size = 0
    for i, (_, p) in enumerate(named):
        nbytes = p.numel() * p.element_size()
        first = named[runs[-1][0]][1] if runs else None
        if first is None or p.dtype != first.dtype or p.device != first.device or size + nbytes > BUCKET_BYTES:
            runs.append([])
            size = 0
        runs[-1].append(i)
        size += nbytes
    buckets = []
    for run in runs:
        layout = BucketLayout.of([(named[j][0], named[j][1].shape) for j in run])
        buckets.append(Bucket([index[j] for j in run], [named[j][1] for j in run], layout,
                              flat(layout.numel, named[run[0]][1])))
    return buckets


def host_empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """An empty tensor in host memory, pinned where CUDA is available (its copies to and from the GPU then run at
    full PCIe speed and may be asynchronous)."""
    return torch.empty(numel, dtype=dtype, device=HOST, pin_memory=torch.cuda.is_available())


def host_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` (any device) in host memory, pinned where CUDA is available."""
    out = host_empty(t.numel(), t.dtype).view(t.shape)
    out.copy_(t.detach())
    return out


def to_host(value: Any) -> Any:
    """``value`` (dicts, lists and tuples of tensors, numbers and strings) with every tensor copied to the CPU: what a
    rank sends to rank zero (``gather_object`` would otherwise unpickle each rank's CUDA tensors onto rank zero's GPU,
    at ``cuda:<the sender's index>``, a device rank zero may not see)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu")
    if isinstance(value, dict):
        return {k: to_host(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(to_host(v) for v in value)
    return value


def gather_to_rank_zero(mine: Any, rank: int, world_size: int, group: Optional[dist.ProcessGroup],
                        local: bool = False) -> list[Any]:
    """Every rank's ``mine`` (copied to the host) at rank zero, by rank; the other ranks get a list holding their own
    only, as does every rank when ``local`` (an emergency checkpoint, written while peers may be gone: no
    collective). A collective on ``group`` otherwise: every rank calls it alike."""
    mine = to_host(mine)
    ranks: list[Any] = [None] * world_size
    if local or world_size == 1 or not dist.is_initialized():
        ranks[rank] = mine
    else:
        dist.gather_object(mine, ranks if rank == 0 else None, dst=0, group=group)
    return ranks
