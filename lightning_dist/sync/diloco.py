"""DiLoCo's outer loop, as one rank runs it: the workers train alone and meet every H steps.

``RingDDPStrategy(sync=DiLoCo(every=H, ...))`` (:class:`~lightning_dist.sync.DiLoCo`) drives a :class:`DiLoCoSync`:

**Workers.** A worker is a host under ``topology="two_tier"`` (its ranks all-reduce their gradients every step, dense,
over the host's own links: the strategy's comm hook on the host's group) and a rank under ``"flat"`` (DDP's gradient
synchronisation is off: no byte leaves the rank between syncs). The *inner* step is the user's optimizer stepping on
the worker's gradient; its state stays the worker's own (never reset, never averaged).

**The sync**, after every optimizer step whose ``global_step`` is a multiple of H, on every rank:

1. the worker's pseudo-gradient ``theta_global - theta_worker``, weighted by the worker's share (``1 / W``, or under
   heterogeneous batching the samples it processed since the last sync over everyone's), flattened into buckets of
   parameters (:class:`~lightning_dist.compression.BucketLayout`, named, so a compressor's per-parameter state
   follows the parameter);
2. summed over the workers through the project's machinery: the strategy's algorithm (ring, tree, native) on a group
   of the sync's own, or the sync's compressor (``DiLoCo(compressor=...)``), whose error feedback is kept per worker
   across syncs (staged, committed only when the outer step is taken). Under two_tier each rank of a host carries
   one part across hosts (slice ``i`` of every parameter, :class:`~lightning_dist.compression.parts.PartPlan`, as
   the two-tier gradient path does) and the host all-gathers the parts;
3. step or skip: every rank holds the same reduced sum, so every rank reads the same verdict from it. A non-finite
   pseudo-gradient on any worker (a NaN travels to the same place of every rank's result: each part's first element
   is its sentinel, set when the part's local sum is not finite) skips the outer step on every worker together:
   ``theta_global``, the outer momentum and the compressor's residuals stay as they were;
4. the outer step: ``torch.optim.SGD(theta_global, lr=outer_lr, momentum=outer_momentum, nesterov=True)`` on the mean
   pseudo-gradient, one tensor per parameter (as a one-process replay writes it);
5. every rank sets its parameters to ``theta_global``; floating buffers (BatchNorm statistics) become the mean over
   the workers (integer ones, such as ``num_batches_tracked``, the floor of the mean).

The bytes of step 2 are recorded in the strategy's step statistics under the tier the sync crosses, so the sync step's
``dist/*`` metrics and the fit's totals show them; :attr:`DiLoCoSync.metrics` holds the ``sync/*`` figures.

The state a resume needs (:meth:`DiLoCoSync.state_dict`): ``theta_global``, the outer momentum and the averaged
buffers by parameter name, the samples counted since the last sync, and this rank's compressor state; each worker's
own parameters and inner optimizer state travel beside it (:mod:`lightning_dist.strategy.ring_ddp`).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from lightning_dist.comm import CommStats
from lightning_dist.comm._common import all_gather_single
from lightning_dist.comm.topology import Topology
from lightning_dist.compression import BucketLayout, Compressor, NoCompressor, Transport
from lightning_dist.compression.parts import PartPlan
from lightning_dist.sync.settings import DiLoCo

BUCKET_BYTES = 25 << 20  # the pseudo-gradient's buckets: DDP's default bucket size


@dataclass(frozen=True)
class Workers:
    """Who trains together between syncs: the ranks of every worker, and where this rank is among them."""

    ranks: tuple[tuple[int, ...], ...]  # worker index -> its ranks, ascending
    rank: int  # this rank (global)

    @classmethod
    def of(cls, topology: Optional[Topology], world_size: int, rank: int) -> Workers:
        """A worker per host under two_tier, a worker per rank otherwise (flat, or one rank)."""
        if topology is not None and topology.kind == "two_tier":
            return cls(tuple(tuple(host) for host in topology.hosts), rank)
        return cls(tuple((r,) for r in range(world_size)), rank)

    @property
    def count(self) -> int:
        return len(self.ranks)

    @property
    def index(self) -> int:
        """This rank's worker."""
        return next(i for i, ranks in enumerate(self.ranks) if self.rank in ranks)

    @property
    def mine(self) -> tuple[int, ...]:
        """The ranks of this rank's worker."""
        return self.ranks[self.index]

    @property
    def local_index(self) -> int:
        """This rank's place in its worker (the part of each bucket it carries across workers)."""
        return self.mine.index(self.rank)

    @property
    def local_size(self) -> int:
        return len(self.mine)


@dataclass
class SyncResult:
    """One sync's outcome, identical on every rank but for the bytes (each rank's own)."""

    step: int  # the global step after which it ran
    skipped: bool
    bad_workers: list[int] = field(default_factory=list)  # workers whose pseudo-gradient was not finite (on a skip)
    seconds: float = 0.0  # wall time of the whole sync on this rank
    bytes_sent: int = 0  # this rank's bytes across workers
    norm: float = 0.0  # the L2 norm of the mean pseudo-gradient (nan on a skip)


class _Bucket:
    """A run of parameters of one dtype flattened together for the exchange."""

    def __init__(self, index: list[int], names: list[str], params: list[torch.Tensor], parts: int,
                 local_index: int) -> None:
        self.index = index  # the parameters' positions in the sync's list
        self.params = params
        self.layout = BucketLayout.of([(name, p.shape) for name, p in zip(names, params)])
        self.spans = [(start, end) for _, start, end, _ in self.layout.spans()]
        self.flat = torch.empty(self.layout.numel, dtype=params[0].dtype, device=params[0].device)
        self.plan = PartPlan.of(self.layout, parts, local_index) if parts > 1 else None


class DiLoCoSync:
    """One rank's share of DiLoCo's outer loop (see the module's docstring). Built by the strategy at set-up:
    :meth:`create` makes its process groups (a collective: every rank, in the same order), :meth:`bind` attaches it
    to the wrapped module once DDP has made every rank's parameters equal."""

    def __init__(self, settings: DiLoCo, workers: Workers, algorithm: str, cross_group: Optional[dist.ProcessGroup],
                 host_group: Optional[dist.ProcessGroup] = None,
                 worker_flags_group: Optional[dist.ProcessGroup] = None) -> None:
        self.settings = settings
        self.workers = workers
        self.algorithm = algorithm
        # the pseudo-gradient's group: every rank (flat), or this rank's part across hosts (two_tier)
        self.cross_group = cross_group
        self.host_group = host_group  # two_tier: the parts' all-gather inside the host (and its buffers' broadcast)
        self.worker_flags_group = worker_flags_group  # two_tier: gloo, for the inner step's verdict inside the host
        self.compressor: Compressor = settings.compressor
        self.outer_steps = 0  # outer steps taken
        self.skipped = 0  # outer steps skipped (a non-finite pseudo-gradient)
        self.samples = [0.0] * workers.count  # per worker, since the last sync (heterogeneous batches)
        self.bytes_total = 0
        self.metrics: dict[str, float] = {}
        self._buckets: list[_Bucket] = []
        self._names: list[str] = []
        self._params: list[torch.Tensor] = []
        self._global: list[torch.Tensor] = []  # theta_global, one tensor per parameter
        self._buffers: list[tuple[str, torch.Tensor]] = []
        self._global_buffers: list[torch.Tensor] = []
        self._outer: Optional[torch.optim.SGD] = None

    @classmethod
    def create(cls, settings: DiLoCo, topology: Optional[Topology], rank: int, world_size: int, algorithm: str,
               timeout: Optional[timedelta] = None) -> DiLoCoSync:
        """The sync's groups, made by every rank in the same order: under two_tier each part's group across hosts,
        each host's group for the parts' all-gather and a gloo one for the inner step's verdict; under flat one
        group of every rank."""
        workers = Workers.of(topology, world_size, rank)
        if workers.local_size == 1:
            cross = dist.new_group(timeout=timeout) if world_size > 1 else None
            return cls(settings, workers, algorithm, cross)
        across = [list(ranks) for ranks in zip(*workers.ranks)]  # part i: the i-th rank of every host
        cross = dist.new_subgroups_by_enumeration(across, timeout=timeout)[0]
        host = dist.new_subgroups_by_enumeration([list(r) for r in workers.ranks], timeout=timeout)[0]
        flags = dist.new_subgroups_by_enumeration([list(r) for r in workers.ranks], timeout=timeout,
                                                  backend="gloo")[0]
        return cls(settings, workers, algorithm, cross, host, flags)

    @property
    def groups(self) -> list[dist.ProcessGroup]:
        """The groups this rank is in (to destroy at teardown)."""
        return [g for g in (self.cross_group, self.host_group, self.worker_flags_group) if g is not None]

    # -- set-up ---------------------------------------------------------------------------------------------------
    def bind(self, module: torch.nn.Module) -> None:
        """Attach to ``module`` (every rank holds the same parameters now): ``theta_global`` starts as them (a
        checkpoint's replace them through :meth:`load_state_dict`)."""
        named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        self._names = [name for name, _ in named]
        self._params = [p for _, p in named]
        self._buffers = [(name, b) for name, b in module.named_buffers() if b is not None]
        self._buckets = _buckets(named, self.workers.local_size, self.workers.local_index)
        with torch.no_grad():
            self._global = [p.detach().clone() for p in self._params]
            self._global_buffers = [b.detach().clone() for _, b in self._buffers]
        self._outer = torch.optim.SGD(self._global, lr=self.settings.outer_lr, momentum=self.settings.outer_momentum,
                                      nesterov=self.settings.outer_momentum > 0)

    def due(self, global_step: int) -> bool:
        """Whether the optimizer step that made ``global_step`` is followed by a sync (the same on every rank)."""
        return global_step > 0 and global_step % self.settings.every == 0

    def count_samples(self, sizes: Sequence[int]) -> None:
        """A batch of every rank's ``sizes`` (heterogeneous batching's plan) started: each worker's samples count
        towards its weight at the next sync."""
        for w, ranks in enumerate(self.workers.ranks):
            self.samples[w] += float(sum(sizes[r] for r in ranks))

    def weight(self) -> float:
        """This worker's share of the mean pseudo-gradient: its samples since the last sync over everyone's, or
        ``1 / W`` when nobody counted (even batches)."""
        total = sum(self.samples)
        if total <= 0:
            return 1.0 / self.workers.count
        return self.samples[self.workers.index] / total

    def broadcast_buffers(self) -> None:
        """Two_tier: the host's first rank's buffers to the host's other ranks, before a forward pass (DDP's own
        broadcast would cross hosts, so the strategy turns it off and calls this instead)."""
        if self.host_group is None or not self._buffers:
            return
        leader = self.workers.mine[0]
        for _, buf in self._buffers:
            dist.broadcast(buf, src=leader, group=self.host_group)

    # -- the sync -------------------------------------------------------------------------------------------------
    def sync(self, step: int, stats: Optional[CommStats] = None, tier: str = "inter_host",
             flags_group: Optional[dist.ProcessGroup] = None) -> SyncResult:
        """The outer step after optimizer step ``step`` (see the module's docstring), on every rank together.

        ``stats``: the strategy's step statistics; the pseudo-gradient's bytes are recorded under ``tier``.
        ``flags_group``: a group of every rank (gloo) to say, on a skip, which workers saw a non-finite value.
        """
        started = time.perf_counter()
        recorder = stats.tier(tier) if stats is not None else None
        sent_before = stats.bytes_sent if stats is not None else 0
        # one worker (one rank, or one host of a two_tier topology refused earlier): its sum is itself
        transport = Transport(self.algorithm, self.cross_group, recorder) if self.workers.count > 1 else None
        codec = NoCompressor() if self.compressor.warming_up else self.compressor
        weight = self.weight()
        locally_finite = True
        with torch.no_grad():
            for bucket in self._buckets:
                locally_finite &= self._reduce(bucket, codec, transport, weight)
            totals = torch.stack([bucket.flat.float().square().sum() for bucket in self._buckets]) \
                if self._buckets else torch.zeros(1)
            norm = math.sqrt(float(totals.sum()))  # the one synchronisation: the verdict, the same on every rank
            result = SyncResult(step=step, skipped=not math.isfinite(norm))
            if result.skipped:
                self.compressor.discard()
                result.bad_workers = _bad_workers(locally_finite, self.workers, flags_group)
                self.skipped += 1
            else:
                for bucket in self._buckets:
                    for i, (start, end) in zip(bucket.index, bucket.spans):
                        self._global[i].grad = bucket.flat[start:end].view(self._global[i].shape)
                self._outer.step()
                self._outer.zero_grad(set_to_none=True)
                self.compressor.commit()
                self._average_buffers(transport)
                self.outer_steps += 1
            for p, g in zip(self._params, self._global):
                p.copy_(g)
            for (_, buf), g in zip(self._buffers, self._global_buffers):
                buf.copy_(g)
        self.samples = [0.0] * self.workers.count
        sent = (stats.bytes_sent - sent_before) if stats is not None else 0
        self.bytes_total += sent
        result.seconds, result.bytes_sent, result.norm = time.perf_counter() - started, sent, norm
        self.metrics = {"sync/outer_steps": float(self.outer_steps), "sync/skipped": float(self.skipped),
                        "sync/seconds": result.seconds, "sync/waited_s": result.seconds,
                        "sync/bytes_per_sync": float(sent), "sync/bytes_per_step": self.bytes_total / max(1, step),
                        "sync/pseudo_grad_norm": norm}
        return result

    def _reduce(self, bucket: _Bucket, codec: Compressor, transport: Optional[Transport], weight: float) -> bool:
        """The bucket's weighted pseudo-gradient summed over the workers into ``bucket.flat`` (the same bits on
        every rank); whether this rank's own contribution was finite."""
        flat = bucket.flat
        for i, (start, end) in zip(bucket.index, bucket.spans):
            torch.sub(self._global[i].reshape(-1), self._params[i].detach().reshape(-1), out=flat[start:end])
        if weight != 1.0:
            flat.mul_(weight)
        plan = bucket.plan
        if plan is None:
            finite = _sentinel(flat)
            if transport is not None:
                codec.reduce(flat, bucket.layout, transport)
            return finite
        # two_tier: this rank's part across hosts, then every part back from the host's ranks
        parts = torch.zeros(plan.width * self.workers.local_size, dtype=flat.dtype, device=flat.device)
        mine = torch.zeros(plan.width, dtype=flat.dtype, device=flat.device)
        finite = True
        if plan.length:
            torch.cat([flat[a:b] for a, b in plan.spans], out=mine[: plan.length])
            finite = _sentinel(mine[: plan.length])
            codec.reduce(mine[: plan.length], plan.layout, transport)
        all_gather_single(parts, mine, group=self.host_group)
        torch.cat([parts[a:b] for a, b in plan.scatter], out=flat)
        return finite

    def _average_buffers(self, transport: Optional[Transport]) -> None:
        """Every buffer becomes the mean over the workers (a host's ranks hold the same buffers: each part's group
        averages them alike)."""
        count = self.workers.count
        for (_, buf), keep in zip(self._buffers, self._global_buffers):
            total = buf.detach().clone()
            if transport is not None and total.is_floating_point():
                transport.allreduce_(total.view(-1))
                total.div_(count)
            elif count > 1:
                dist.all_reduce(total, group=self.cross_group)
                total = torch.div(total, count, rounding_mode="floor")
            keep.copy_(total)

    def worker_verdict_group(self, guard: Any, module: torch.nn.Module
                             ) -> tuple[Optional[dist.ProcessGroup], int, int]:
        """The group, rank and size in which the inner step's step-or-skip verdict is agreed: the worker's. A worker
        of one rank reduced nothing in the comm hook, so its gradients are checked here (``guard``: the strategy's
        :class:`~lightning_dist.strategy.skip.StepGuard`, whose sentinel checks each gradient alone)."""
        if self.workers.local_size > 1:
            return self.worker_flags_group, self.workers.local_index, self.workers.local_size
        for p in module.parameters():
            if p.grad is not None and p.grad.numel():
                flat = p.grad.view(-1)
                guard.check_local(flat)
                guard.check_reduced(flat)
        return None, 0, 1

    # -- what the strategy reports and saves ------------------------------------------------------------------------
    def memory_bytes(self) -> int:
        """Bytes DiLoCo keeps beside the model: theta_global and the outer momentum (two parameter copies), the
        averaged buffers, the exchange's flat buckets and the compressor's state."""
        params = sum(p.numel() * p.element_size() for p in self._params)
        buffers = sum(b.numel() * b.element_size() for _, b in self._buffers)
        compressor = sum(self.compressor.state_bytes(b.layout if b.plan is None else b.plan.layout,
                                                     b.flat.element_size()) for b in self._buckets)
        return 3 * params + buffers + compressor

    def state_dict(self) -> dict[str, Any]:
        """What every rank holds alike (theta_global, momentum, buffers, counts: tensors by name); tensors, numbers
        and strings only (``weights_only=True`` loads it). The compressor's state is per rank: its own
        ``state_dict``."""
        momentum = {}
        for name, g in zip(self._names, self._global):
            buf = self._outer.state.get(g, {}).get("momentum_buffer") if self._outer is not None else None
            if buf is not None:
                momentum[name] = buf.detach().clone()
        return {"settings": self.settings.describe(), "workers": self.workers.count,
                "outer_steps": self.outer_steps, "skipped": self.skipped, "samples": list(self.samples),
                "bytes_total": self.bytes_total,
                "global": {name: g.detach().clone() for name, g in zip(self._names, self._global)},
                "momentum": momentum,
                "buffers": {name: b.detach().clone() for (name, _), b in zip(self._buffers, self._global_buffers)}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output (after :meth:`bind`)."""
        if self._outer is None:
            raise RuntimeError("DiLoCoSync.load_state_dict before bind: the parameters are not known yet")
        if state["settings"] != self.settings.describe():
            raise ValueError(f"the checkpoint was written with sync={state['settings']}, this run has "
                             f"sync={self.settings.describe()}: resume with the same DiLoCo settings")
        self.outer_steps, self.skipped = int(state["outer_steps"]), int(state["skipped"])
        self.bytes_total = int(state.get("bytes_total", 0))
        if int(state["workers"]) == self.workers.count:
            self.samples = [float(s) for s in state["samples"]]
        with torch.no_grad():
            for name, g in zip(self._names, self._global):
                g.copy_(state["global"][name])
                if name in state["momentum"]:
                    self._outer.state[g]["momentum_buffer"] = state["momentum"][name].to(g.device, g.dtype).clone()
            for (name, _), b in zip(self._buffers, self._global_buffers):
                if name in state["buffers"]:
                    b.copy_(state["buffers"][name])

    def restart_from_global(self) -> None:
        """Every parameter and buffer of this rank set to the global ones (a worker whose own state was lost)."""
        with torch.no_grad():
            for p, g in zip(self._params, self._global):
                p.copy_(g)
            for (_, buf), g in zip(self._buffers, self._global_buffers):
                buf.copy_(g)


def _buckets(named: list[tuple[str, torch.Tensor]], parts: int, local_index: int) -> list[_Bucket]:
    """The parameters, in the module's order, in runs of one dtype and device of at most :data:`BUCKET_BYTES`."""
    buckets: list[_Bucket] = []
    run: list[int] = []
    size = 0
    for i, (_, p) in enumerate(named):
        nbytes = p.numel() * p.element_size()
        first = named[run[0]][1] if run else None
        if first is not None and (p.dtype != first.dtype or p.device != first.device or size + nbytes > BUCKET_BYTES):
            buckets.append(_Bucket(run, [named[j][0] for j in run], [named[j][1] for j in run], parts, local_index))
            run, size = [], 0
        run.append(i)
        size += nbytes
    if run:
        buckets.append(_Bucket(run, [named[j][0] for j in run], [named[j][1] for j in run], parts, local_index))
    return buckets


def _sentinel(flat: torch.Tensor) -> bool:
    """A non-finite local sum makes the first element NaN (every compressor carries it to the same place of every
    rank's result); whether the sum was finite. ``x - 0.0`` leaves a finite first element as it was."""
    if not flat.numel():
        return True
    total = flat.sum(dtype=torch.float32)
    flat[:1].sub_((total - total).to(flat.dtype))
    return bool(torch.isfinite(total))


def _bad_workers(locally_finite: bool, workers: Workers, group: Optional[dist.ProcessGroup]) -> list[int]:
    """On a skip (every rank takes this branch together): the workers whose own pseudo-gradient was not finite."""
    flags = torch.zeros(workers.count, dtype=torch.float64)
    if not locally_finite:
        flags[workers.index] = 1.0
    if workers.count > 1 and dist.is_initialized():
        dist.all_reduce(flags, group=group)
    return [w for w in range(workers.count) if flags[w] > 0]
