"""The two-tier reduction of a gradient bucket: dense inside the host, the compressor only between hosts.

With ``RingDDPStrategy(topology="two_tier")`` (or ``"auto"`` on at least 2 hosts of at least 2 ranks each,
:func:`lightning_dist.comm.topology.resolve_topology`), every bucket of ``M`` elements on a host of ``L`` ranks
goes through three collectives:

1. **reduce-scatter inside the host** (the backend's own, dense, uncompressed): local rank ``i`` ends with the
   host's sum of part ``i``: slice ``i`` of every parameter in the bucket
   (:meth:`~lightning_dist.compression.BucketLayout.split`: between rows, so a matrix stays a matrix). The bucket is
   rearranged part by part first (one copy), each part padded to the longest;
2. **part ``i`` across hosts**, between the ``i``-th ranks of every host, by the strategy's algorithm and
   compressor (:meth:`~lightning_dist.compression.Compressor.reduce` on a
   :class:`~lightning_dist.compression.Transport` over that group) with the part's own layout: a compressor's
   per-parameter state is per slice (``name#i/L``), error feedback included. Slices are cut by parameter, not by
   position in the bucket, so they stay the same when DDP rebuilds its buckets in another order after the first
   step, and a checkpoint's state applies in a new process;
3. **all-gather inside the host**: every rank gets every part, copied back into the bucket's order.

So each host sends ``2 (H - 1) / H`` of a bucket across the slow network in all (dense), shared by its ``L`` ranks,
where the flat ring sends about ``2`` buckets per crossing edge; and a sparse codec's payload crosses once per host
shard instead of once per rank.

What holds, as on the flat path: ranks bit-identical (a host's ranks copy the same shards; the ranks reducing a
shard across hosts get the same bits, the compressors' own contract); a non-finite value in any rank's bucket is
non-finite at the same place on every rank (a sum keeps it, the codecs carry it), so the step guard's sentinel in
element 0 (slice 0 of the first parameter, in part 0) still speaks for the whole bucket; the hetero weights are
applied before, in autograd.

Bytes are counted per tier (:meth:`lightning_dist.comm.CommStats.tier`): the two collectives inside the host as
``intra_host`` (the ring's count for the backend's calls: ``(L - 1)`` parts each), the part's reduction as
``inter_host`` (what its transport counts).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from lightning_dist.comm import CommStats
from lightning_dist.comm.stats import CallRecord
from lightning_dist.comm.topology import Topology
from lightning_dist.compression import BucketLayout, Compressor, Transport
from lightning_dist.compression.state import Scratch

# torch 2.13 renamed all_gather_into_tensor and reduce_scatter_tensor (which still work, with a warning)
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class TwoTier:
    """One rank's two-tier reduction: its host's group, its part's group across hosts, how buckets are cut."""

    def __init__(self, topology: Topology, rank: int, intra_group: Optional[dist.ProcessGroup],
                 inter_group: Optional[dist.ProcessGroup], algorithm: str, stats: CommStats) -> None:
        if topology.kind != "two_tier":
            raise ValueError(f"TwoTier needs a two_tier topology, got {topology.kind!r}")
        self.topology = topology
        self.local_size = topology.ranks_per_host
        self.local_index = topology.local_index(rank)
        self.intra_group, self.inter_group = intra_group, inter_group
        self.intra_stats = stats.tier("intra_host")
        self.transport = Transport(algorithm, inter_group, stats.tier("inter_host"))
        self.intra_seconds = 0.0  # wall time inside the collectives within the host
        self._plans: dict[BucketLayout, _Plan] = {}
        self._scratch = Scratch()

    @property
    def seconds(self) -> float:
        """Wall time inside every collective of both tiers (the hook tells coding time apart with it)."""
        return self.intra_seconds + self.transport.seconds

    def plan(self, layout: BucketLayout) -> _Plan:
        """How a bucket with ``layout`` is cut into the host's ``L`` parts (made once per layout)."""
        found = self._plans.get(layout)
        if found is None:
            found = self._plans[layout] = _Plan.of(layout, self.local_size, self.local_index)
        return found

    def reduce(self, buffer: torch.Tensor, layout: BucketLayout, codec: Compressor) -> torch.Tensor:
        """Replace ``buffer`` (this rank's weighted gradients, flat) by the sum over every rank, in place."""
        plan = self.plan(layout)
        width, dtype, device = plan.width, buffer.dtype, buffer.device
        parts = self._scratch.get(("parts", width), width * self.local_size, dtype, device)
        zeros = self._scratch.get(("zeros", plan.pad), plan.pad, dtype, device).zero_() if plan.pad else None
        # the bucket rearranged part by part (slice i of every parameter, then padding to a common width)
        torch.cat([buffer[a:b] if a >= 0 else zeros[:b] for a, b in plan.gather], out=parts)
        mine = self._scratch.get(("mine", width), width, dtype, device)
        self._intra("reduce_scatter", _reduce_scatter_single, mine, parts)
        if plan.length:  # a parameter smaller than the host leaves the last ranks nothing to send
            codec.reduce(mine[: plan.length], plan.layout, self.transport)
        self._intra("all_gather", _all_gather_single, parts, mine)
        torch.cat([parts[a:b] for a, b in plan.scatter], out=buffer)  # back in the bucket's order
        return buffer

    def _intra(self, name: str, collective: object, output: torch.Tensor, inp: torch.Tensor) -> None:
        started = time.perf_counter()
        collective(output, inp, group=self.intra_group)  # type: ignore[operator]
        seconds = time.perf_counter() - started
        self.intra_seconds += seconds
        part = min(output.numel(), inp.numel())
        nbytes = (self.local_size - 1) * part * inp.element_size()  # the ring's count; the backend does not say
        self.intra_stats.record(CallRecord(name, max(output.numel(), inp.numel()), nbytes, nbytes, seconds,
                                           estimated=True))


@dataclass(frozen=True)
class _Plan:
    """One bucket layout cut into a host's parts (:meth:`~lightning_dist.compression.BucketLayout.split`).

    ``gather``: the bucket's ranges that, concatenated, make the parts end to end, each padded to ``width``
    (``(-1, n)``: ``n`` zeros); ``scatter``: the ranges of those parts that, concatenated, give the bucket back.
    """

    layout: BucketLayout  # this rank's part
    length: int  # its elements (the rest of its ``width`` is padding)
    width: int  # the longest part: every part is padded to it for the reduce-scatter
    pad: int  # the most padding any part needs
    gather: tuple[tuple[int, int], ...]
    scatter: tuple[tuple[int, int], ...]

    @classmethod
    def of(cls, layout: BucketLayout, parts: int, index: int) -> _Plan:
        split = layout.split(parts)
        lengths = [part.numel for part, _ in split]
        width = max(lengths)
        gather: list[tuple[int, int]] = []
        where: dict[tuple[int, int], tuple[int, int]] = {}  # a piece's range in the bucket -> its range in the parts
        for i, (_, spans) in enumerate(split):
            offset = i * width
            for a, b in spans:
                gather.append((a, b))
                where[(a, b)] = (offset, offset + b - a)
                offset += b - a
            if lengths[i] < width:
                gather.append((-1, width - lengths[i]))
        scatter = tuple(where[span] for span in sorted(where))  # bucket order
        return cls(split[index][0], lengths[index], width, width - min(lengths), tuple(gather), scatter)
