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
part instead of once per rank. The price is the dense reduce-scatter and all-gather inside the host: worth it where
the host's own links are much faster than the network (NVLink or PCIe against Ethernet), not where they are not.

What holds, as on the flat path: ranks bit-identical (a host's ranks copy the same parts; the ranks reducing a
part across hosts get the same bits, the compressors' own contract); a non-finite value in any rank's bucket is
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
from datetime import timedelta
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from lightning_dist.comm import CommStats
from lightning_dist.comm._common import all_gather_single, reduce_scatter_single
from lightning_dist.comm.stats import CallRecord, TierStats
from lightning_dist.comm.topology import Topology
from lightning_dist.compression import BucketLayout, Compressor, Transport
from lightning_dist.compression.parts import PartPlan
from lightning_dist.compression.state import Scratch


class TwoTier:
    """One rank's two-tier reduction: its host's groups, its part's group across hosts, how buckets are cut.

    :meth:`reduce` does one bucket to completion. The hook splits it: :meth:`begin` (on the autograd thread, as DDP
    hands the bucket over) rearranges the bucket and issues the reduce-scatter inside the host asynchronously, so it
    runs while backward computes the next buckets; :meth:`finish` (on the communication worker, in the same order)
    waits for it, reduces the part across hosts and issues the all-gather of the parts, which completes on the
    backend's thread while the next bucket's part travels. The all-gather has a host group of its own: the two threads
    each issue their collectives in bucket order, and one group's collectives must come in the same order on every
    rank. :meth:`create` makes the three groups.
    """

    def __init__(self, topology: Topology, rank: int, intra_group: Optional[dist.ProcessGroup],
                 gather_group: Optional[dist.ProcessGroup], inter_group: Optional[dist.ProcessGroup], algorithm: str,
                 stats: CommStats) -> None:
        if topology.kind != "two_tier":
            raise ValueError(f"TwoTier needs a two_tier topology, got {topology.kind!r}")
        self.topology = topology
        self.local_size = topology.ranks_per_host
        self.local_index = topology.local_index(rank)
        self.intra_group, self.gather_group, self.inter_group = intra_group, gather_group, inter_group
        self.intra_stats = stats.tier("intra_host")
        self.transport = Transport(algorithm, inter_group, stats.tier("inter_host"))
        self.intra_seconds = 0.0  # wall time waiting for the collectives inside the host (on the worker)
        self._plans: dict[BucketLayout, PartPlan] = {}
        self._scratch = Scratch()

    @classmethod
    def create(cls, topology: Topology, rank: int, algorithm: str, stats: CommStats,
               timeout: Optional[timedelta] = None) -> TwoTier:
        """This rank's reduction on groups of its own: its host's two (the reduce-scatter's, the all-gather's) and its
        part's across hosts. A collective call: every rank makes every group, in the same order."""
        intra, gather, inter = (dist.new_subgroups_by_enumeration(ranks, timeout=timeout)[0] for ranks in
                                (topology.intra_groups(), topology.intra_groups(), topology.inter_groups()))
        return cls(topology, rank, intra, gather, inter, algorithm, stats)

    @property
    def groups(self) -> list[dist.ProcessGroup]:
        """The groups this rank is in (to destroy at teardown)."""
        return [self.intra_group, self.gather_group, self.inter_group]

    @property
    def seconds(self) -> float:
        """Wall time inside every collective of both tiers (the hook tells coding time apart with it)."""
        return self.intra_seconds + self.transport.seconds

    def plan(self, layout: BucketLayout) -> PartPlan:
        """How a bucket with ``layout`` is cut into the host's ``L`` parts (made once per layout)."""
        found = self._plans.get(layout)
        if found is None:
            found = self._plans[layout] = PartPlan.of(layout, self.local_size, self.local_index)
        return found

    def reduce(self, buffer: torch.Tensor, layout: BucketLayout, codec: Compressor) -> torch.Tensor:
        """Replace ``buffer`` (this rank's weighted gradients, flat) by the sum over every rank, in place."""
        return self.finish(self.begin(buffer, layout), codec).wait()

    def begin(self, buffer: torch.Tensor, layout: BucketLayout, slot: int = 0) -> InFlight:
        """Rearrange the bucket part by part (slice ``i`` of every parameter, padded to a common width) and issue the
        reduce-scatter inside the host. ``slot``: the bucket's own buffers (DDP's bucket index), so that buckets in
        flight together never share one."""
        plan = self.plan(layout)
        width, dtype, device = plan.width, buffer.dtype, buffer.device
        parts = self._scratch.get(("parts", slot), width * self.local_size, dtype, device)
        mine = self._scratch.get(("mine", slot), width, dtype, device)
        zeros = self._scratch.get(("zeros", slot), plan.pad, dtype, device).zero_() if plan.pad else None
        torch.cat([buffer[a:b] if a >= 0 else zeros[:b] for a, b in plan.gather], out=parts)
        work = reduce_scatter_single(mine, parts, group=self.intra_group, async_op=True)
        return InFlight(buffer, plan, parts, mine, work)

    def finish(self, flight: InFlight, codec: Compressor) -> torch.futures.Future:
        """Wait for :meth:`begin`'s reduce-scatter, reduce this rank's part across hosts, and issue the all-gather of
        every part; the returned Future completes (on the backend's thread) once the parts are back in the bucket,
        so the next bucket's part can travel between hosts meanwhile."""
        started = time.perf_counter()
        flight.work.wait()
        waited = time.perf_counter() - started  # the part backward did not hide
        self.intra_seconds += waited
        _record_intra(self.intra_stats, "reduce_scatter", flight.parts, self.local_size, waited)
        plan = flight.plan
        if plan.length:  # a bucket of parameters smaller than the host can leave the last ranks nothing to send
            codec.reduce(flight.mine[: plan.length], plan.layout, self.transport)
        gathered = all_gather_single(flight.parts, flight.mine, group=self.gather_group, async_op=True)
        # the callback runs, and is dropped, on the backend's thread: it holds tensors and the stats, never this
        # object (whose groups' destructor would join that very thread; see lightning_dist.comm.dispatch)
        parts, scatter, buffer, stats = flight.parts, plan.scatter, flight.buffer, self.intra_stats
        size, issued = self.local_size, time.perf_counter()

        def back_in_bucket_order(done: torch.futures.Future) -> torch.Tensor:
            done.value()  # raises the backend's error
            torch.cat([parts[a:b] for a, b in scatter], out=buffer)
            _record_intra(stats, "all_gather", parts, size, time.perf_counter() - issued)
            return buffer

        return gathered.get_future().then(back_in_bucket_order)


def _record_intra(stats: TierStats, name: str, parts: torch.Tensor, size: int, seconds: float) -> None:
    # the ring's count for the backend's collective (it does not say): L - 1 parts of the L
    nbytes = (size - 1) * (parts.numel() // size) * parts.element_size()
    stats.record(CallRecord(name, parts.numel(), nbytes, nbytes, seconds, estimated=True))


@dataclass
class InFlight:
    """One bucket between :meth:`TwoTier.begin` and :meth:`TwoTier.finish`."""

    buffer: torch.Tensor
    plan: PartPlan
    parts: torch.Tensor
    mine: torch.Tensor
    work: dist.Work


@dataclass
class GradientGroups:
    """Where the comm hook reduces the gradient buckets (:func:`gradient_groups`)."""

    group: Optional[dist.ProcessGroup]  # flat: the buckets' own group (None with one rank, or a worker of one rank)
    tiers: Optional[TwoTier]  # two_tier: the host's groups and the part's across hosts
    world: int  # the ranks a bucket is reduced over
    spans_hosts: bool  # whether that traffic crosses hosts (its bytes are counted as inter_host)
    owned: list[dist.ProcessGroup]  # every group made here, destroyed at teardown


def gradient_groups(topology: Optional[Topology], rank: int, world_size: int, algorithm: str, stats: CommStats,
                    timeout: Optional[timedelta], workers: Optional[Sequence[Sequence[int]]] = None) -> GradientGroups:
    """The comm hook's groups, made by every rank in the same order (a collective call): the default backend's (NCCL for
    CUDA tensors), driven by the communication worker, never interleaving with what DDP and Lightning run on the
    default group from the main thread. ``workers`` (a sync driver's, :attr:`~lightning_dist.sync.SyncDriver
    .gradient_ranks`): each rank reduces inside its own worker only; else two_tier's groups under that topology, or
    one group of every rank."""
    spans_hosts = topology is not None and len(topology.hosts) > 1
    if workers is not None:
        mine = next(ranks for ranks in workers if rank in ranks)
        group = dist.new_subgroups_by_enumeration([list(r) for r in workers], timeout=timeout)[0] \
            if len(mine) > 1 else None
        return GradientGroups(group, None, len(mine), False, [group] if group is not None else [])
    if topology is not None and topology.kind == "two_tier":
        tiers = TwoTier.create(topology, rank, algorithm, stats, timeout)
        return GradientGroups(None, tiers, world_size, spans_hosts, tiers.groups)
    group = dist.new_group(timeout=timeout) if world_size > 1 else None
    return GradientGroups(group, None, world_size, spans_hosts, [group] if group is not None else [])
