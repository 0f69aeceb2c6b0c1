"""DiLoCo's outer loop, as one rank runs it: the workers train alone and meet every H steps.

``RingDDPStrategy(sync=DiLoCo(every=H, ...))`` (:class:`~lightning_dist.sync.DiLoCo`) runs a :class:`DiLoCoSync` (as the
sync driver :class:`~lightning_dist.sync.diloco_driver.DiLoCoDriver`, which adds what it does around Lightning's step):

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

**The warm-up** (``DiLoCo(warmup=W)``): after each of the fit's first ``W`` optimizer steps every fragment syncs, in
the step, with step 4 replaced by plain averaging (``theta_global`` minus the mean pseudo-gradient: the workers'
weighted mean; the outer momentum is not touched). The syncs every H steps follow from step ``W + 1`` on, on their
usual steps (a cycle after the warm-up may be partial: its pseudo-gradient covers the steps since the last sync).

The bytes of step 2 are recorded in the strategy's step statistics under the tier the sync crosses, so the sync step's
``dist/*`` metrics and the fit's totals show them; :attr:`DiLoCoSync.metrics` holds the ``sync/*`` figures.

**Streaming** (``DiLoCo(fragments=F, delay=tau, mix=alpha)``, Douillard et al. 2025). The parameters are cut into
``F`` :class:`Fragment` s (whole parameters in the module's order, about ``1 / F`` of the elements each: every rank
derives the same cut from the names and shapes); fragment ``f`` runs the steps above after the optimizer steps where
``global_step % H == f H / F``, on its own buckets, with its own copy of the compressor (residuals per fragment) and its
own samples count; the outer momentum is per parameter, so per fragment. With ``tau = 0`` each fragment's sync runs in
its step, steps 1-5 as above: ``F = 1`` is the synchronous sync, bit for bit. With ``tau >= 1`` a fragment's sync is an
:class:`Exchange` in two halves:

- *start*, after step ``s``: the weighted pseudo-gradient is computed on the main thread (and, for the fragment that
  carries the buffers, a copy of them), the worker's parameters at ``s`` are kept, and step 2 (the reduction, and the
  buffers' average) goes to a communication thread of the sync's own (one thread, first in first out: every rank
  issues the same collectives in the same order, on the sync's own groups, which nothing else uses) while the next
  ``tau`` inner steps compute;
- *land*, after step ``s + tau``: wait for the reduction (what the loop waited is ``sync/waited_s``), steps 3-4, and the
  fragment's parameters become ``p_now + alpha (theta_global_new - p_at_s)``: ``alpha`` of the way to the new global
  value plus the worker's progress since ``s``. On a skip the fragment restarts from ``theta_global`` (unchanged) on
  every worker, as without a delay: the worker whose value was not finite would otherwise keep it.

**The end of a fit** (``DiLoCo(final_sync=True)``, the default: :meth:`DiLoCoSync.final_sync`): what is in flight
lands, then every fragment with steps since its last sync averages them, in the step, as a warm-up step does (step 4
replaced by plain averaging: no outer step's extrapolation in the model the fit leaves), and every rank leaves the fit
holding ``theta_global``, the workers' weighted mean. Where the fit's end is known in its last step (``max_steps``,
``max_epochs``), the sync due after that step is this averaging; a stop found after it (a stop a callback sets) keeps
that sync's outer step. **Validation** (``validate="global"``, the default) runs on ``theta_global`` and the averaged
buffers, swapped in (:meth:`DiLoCoSync.swap_in_global`) and each rank's own parameters put back afterwards, bit for
bit.

A checkpoint written while an exchange is in flight waits for its reduction first (:meth:`DiLoCoSync.settle`: nothing
lands early) and saves the reduced sum beside ``theta_global`` and each worker's parameters at ``s`` beside the
worker's own state, so a resumed run lands it at ``s + tau`` exactly as the uninterrupted run does. An emergency
checkpoint (a peer may be gone) keeps only the exchanges already reduced; the others are dropped, and their fragments'
samples count towards the next sync, which then carries the worker's progress over both cycles.

**Where the state lives.** ``theta_global``, the outer momentum, the averaged buffers, the pseudo-gradient's buckets,
the snapshots of exchanges in flight and the compressor's state are kept in host memory (pinned where CUDA is
available), never beside a GPU model: for a 7 B fp32 model they are three or more extra copies of it (~84 GB), which is
also where torchft keeps its backup. The outer step runs on the CPU; each parameter's pseudo-gradient is read off the
device into its bucket, and the new ``theta_global`` is copied back onto the device parameter by parameter. So the
sync's collectives carry host tensors, on gloo groups of its own (on a CPU run the default backend is gloo anyway):
DiLoCo's thread then issues no NCCL work beside the training loop's, which NCCL could deadlock on (operations on
different communicators launched in a different order on different ranks); every thread that touches the device sets
it first. GPU-resident extra state: 0 bytes (:meth:`DiLoCoSync.memory_by_device`).

The state a resume needs (:meth:`DiLoCoSync.state_dict`): ``theta_global``, the outer momentum and the averaged
buffers by parameter name, the samples counted since each fragment's last sync, and the exchanges in flight; per rank
(:meth:`DiLoCoSync.rank_state`) the compressors' states; per worker (:meth:`DiLoCoSync.worker_state`) the parameters
at the start of each exchange in flight. Each worker's own parameters and inner optimizer state travel beside it
(:mod:`lightning_dist.strategy.checkpoint`).
"""

from __future__ import annotations

import copy
import math
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from lightning_dist.comm import CommStats
from lightning_dist.comm._common import all_gather_single
from lightning_dist.comm.stats import CallRecord
from lightning_dist.comm.topology import Topology
from lightning_dist.compression import BucketLayout, Compressor, NoCompressor, Transport
from lightning_dist.compression.parts import PartPlan
from lightning_dist.sync.settings import DiLoCoSettings

BUCKET_BYTES = 25 << 20  # the pseudo-gradient's buckets: DDP's default bucket size
HOST = torch.device("cpu")  # where DiLoCo's state lives, whatever the model's device
THREAD_NAME = "lightning_dist-comm-sync"  # the streaming exchanges' thread (tests look for it)


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
    """One sync's outcome, identical on every rank but for the bytes and times (each rank's own)."""

    step: int  # the global step after which it landed (its exchange started ``delay`` steps earlier)
    skipped: bool
    fragment: int = 0
    bad_workers: list[int] = field(default_factory=list)  # workers whose pseudo-gradient was not finite (on a skip)
    seconds: float = 0.0  # wall time of the exchange on this rank (start to reduced sum, plus the outer step)
    waited: float = 0.0  # how long the training loop spent in it (= seconds without a delay)
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
        self.flat = host_empty(self.layout.numel, params[0].dtype)  # in host memory: see "Where the state lives"
        self.plan = PartPlan.of(self.layout, parts, local_index) if parts > 1 else None


@dataclass
class Fragment:
    """A part of the parameters that syncs on its own schedule: its buckets, compressor and samples count."""

    index: int
    offset: int  # it syncs after the steps where global_step % H == offset
    params: list[int]  # its parameters' positions in the sync's list
    buckets: list[_Bucket]
    compressor: Compressor  # its own copy: error feedback per fragment
    samples: list[float]  # per worker, since this fragment's last sync (heterogeneous batches)
    buffers: bool  # whether the model's buffers are averaged with it (the first fragment)
    started: int = -1  # the step after which its last sync started (-1: none in this fit yet)


@dataclass
class Exchange:
    """One fragment's sync between its start (after step ``step``) and its landing (after step ``lands``)."""

    fragment: Fragment
    step: int
    lands: int
    samples: list[float]  # the fragment's counts it used (given back if the exchange is dropped)
    snapshot: Optional[list[torch.Tensor]] = None  # the worker's parameters at ``step`` (a delay only)
    buffers: Optional[list[torch.Tensor]] = None  # the averaged buffers, reduced beside it (a delay only)
    stats: Optional[CommStats] = None  # its collectives' records, merged into the step's at landing (a delay only)
    future: Optional[Future] = None  # the reduction on the sync's thread (a delay only)
    locally_finite: bool = True  # this rank's contribution
    seconds: float = 0.0  # the exchange's own wall time (the main thread's part and the reduction)
    waited: float = 0.0  # the main thread's part
    bytes_sent: int = 0  # this rank's bytes across workers, recorded in the step's stats so far
    norm: Optional[float] = None  # the mean pseudo-gradient's norm, once reduced (NaN: skip)
    averages: bool = False  # a warm-up step's or the final sync's: theta_global takes the mean (lr 1, no momentum)


class DiLoCoSync:
    """One rank's share of DiLoCo's outer loop (see the module's docstring). Built by the strategy at set-up:
    :meth:`create` makes its process groups (a collective: every rank, in the same order), :meth:`attach` attaches it
    to the wrapped module once DDP has made every rank's parameters equal."""

    def __init__(self, settings: DiLoCoSettings, workers: Workers, algorithm: str,
                 cross_group: Optional[dist.ProcessGroup], host_group: Optional[dist.ProcessGroup] = None,
                 worker_flags_group: Optional[dist.ProcessGroup] = None,
                 buffers_group: Optional[dist.ProcessGroup] = None) -> None:
        self.settings = settings
        self.workers = workers
        self.algorithm = algorithm
        # the pseudo-gradient's group: every rank (flat), or this rank's part across hosts (two_tier)
        self.cross_group = cross_group
        self.host_group = host_group  # two_tier: the parts' all-gather inside the host (and its buffers' broadcast)
        self.worker_flags_group = worker_flags_group  # two_tier: gloo, for the inner step's verdict inside the host
        # two_tier with a delay: the buffers' broadcast inside the host, from the main thread (host_group is the
        # sync thread's then)
        self.buffers_group = buffers_group if buffers_group is not None else host_group
        self.outer_steps = 0  # outer steps taken (one per fragment sync)
        self.skipped = 0  # outer steps skipped (a non-finite pseudo-gradient)
        self.bytes_total = 0
        self.metrics: dict[str, float] = {}
        self.fragments: list[Fragment] = []
        self.inflight: list[Exchange] = []  # started, not landed (a delay only), in the order they started
        # per fragment, the step after which its newest reduced exchange started: every worker's progress up to it
        # is in theta_global (or in a reduced sum that lands)
        self.reduced_at: list[int] = []
        self.lost_workers: list[int] = []  # an elastic restart: old ranks whose workers' state is gone (restore_sync)
        self._thread: Optional[ThreadPoolExecutor] = None
        self._names: list[str] = []
        self._params: list[torch.Tensor] = []
        self._global: list[torch.Tensor] = []  # theta_global, one tensor per parameter
        self._buffers: list[tuple[str, torch.Tensor]] = []
        self._global_buffers: list[torch.Tensor] = []
        self._outer: Optional[torch.optim.SGD] = None
        self.device: torch.device = HOST  # the model's device (attach); the state stays on HOST
        self._own: Optional[list[torch.Tensor]] = None  # this rank's own parameters and buffers while validating global

    @classmethod
    def create(cls, settings: DiLoCoSettings, topology: Optional[Topology], rank: int, world_size: int, algorithm: str,
               timeout: Optional[timedelta] = None) -> DiLoCoSync:
        """The sync's groups, made by every rank in the same order: under two_tier each part's group across hosts,
        each host's group for the parts' all-gather and a gloo one for the inner step's verdict; under flat one
        group of every rank."""
        workers = Workers.of(topology, world_size, rank)
        # the pseudo-gradient and the averaged buffers are host tensors: gloo groups (see "Where the state lives")
        if workers.local_size == 1:
            cross = dist.new_group(timeout=timeout, backend="gloo") if world_size > 1 else None
            return cls(settings, workers, algorithm, cross)
        across = [list(ranks) for ranks in zip(*workers.ranks)]  # part i: the i-th rank of every host
        hosts = [list(r) for r in workers.ranks]
        cross = dist.new_subgroups_by_enumeration(across, timeout=timeout, backend="gloo")[0]
        host = dist.new_subgroups_by_enumeration(hosts, timeout=timeout, backend="gloo")[0]
        flags = dist.new_subgroups_by_enumeration(hosts, timeout=timeout, backend="gloo")[0]
        # the model's own buffers, broadcast inside the host before each forward from the main thread: where they
        # live (the default backend's group: NCCL for a GPU model)
        buffers = dist.new_subgroups_by_enumeration(hosts, timeout=timeout)[0]
        return cls(settings, workers, algorithm, cross, host, flags, buffers)

    @property
    def groups(self) -> list[dist.ProcessGroup]:
        """The groups this rank is in (to destroy at teardown)."""
        found = (self.cross_group, self.host_group, self.worker_flags_group, self.buffers_group)
        return list({id(g): g for g in found if g is not None}.values())

    @property
    def samples(self) -> list[float]:
        """Per worker, the samples counted since the first fragment's last sync (the whole model's without
        fragments)."""
        return self.fragments[0].samples

    # -- set-up ---------------------------------------------------------------------------------------------------
    def attach(self, module: torch.nn.Module) -> None:
        """Attach to ``module`` (every rank holds the same parameters now): ``theta_global`` starts as them (a
        checkpoint's replace them through :meth:`load_state_dict`)."""
        named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        self._names = [name for name, _ in named]
        self._params = [p for _, p in named]
        self._buffers = [(name, b) for name, b in module.named_buffers() if b is not None]
        self.fragments = []
        for f, index in enumerate(fragment_cut([(name, p.numel()) for name, p in named], self.settings.fragments)):
            compressor = copy.deepcopy(self.settings.compressor)  # the settings' stays unused: a second fit starts anew
            self.fragments.append(Fragment(
                f, self.settings.offset(f), index,
                _buckets([named[i] for i in index], self.workers.local_size, self.workers.local_index, index),
                compressor, [0.0] * self.workers.count, buffers=f == 0))
        self.reduced_at = [0] * len(self.fragments)
        self.device = self._params[0].device if self._params else HOST
        with torch.no_grad():
            self._global = [host_copy(p) for p in self._params]
            self._global_buffers = [host_copy(b) for _, b in self._buffers]
        self._outer = torch.optim.SGD(self._global, lr=self.settings.outer_lr, momentum=self.settings.outer_momentum,
                                      nesterov=self.settings.outer_momentum > 0)

    def warming(self, global_step: int) -> bool:
        """Whether the optimizer step that made ``global_step`` is one of the warm-up's (``DiLoCo(warmup=...)``):
        every fragment averages after it."""
        return 0 < global_step <= self.settings.warmup

    def due(self, global_step: int) -> bool:
        """Whether the optimizer step that made ``global_step`` is followed by a fragment's sync starting or landing
        (the same on every rank)."""
        return (self.warming(global_step) or self._starting(global_step) is not None
                or any(ex.lands == global_step for ex in self.inflight))

    def meets(self, global_step: int) -> bool:
        """Whether the workers meet on the training loop's thread in the step that makes ``global_step``: a sync runs
        in it (no delay), or, with a delay (the exchanges run beside the loop), the first fragment's sync starts after
        it: once per H steps. Where a collective of every rank costs no extra wait (the strategy's SIGTERM
        broadcast)."""
        if self.warming(global_step):
            return True
        fragment = self._starting(global_step)
        return fragment is not None and (not self.settings.delay or fragment.index == 0)

    def _starting(self, global_step: int) -> Optional[Fragment]:
        """The fragment whose sync starts after the optimizer step that made ``global_step`` (at most one: the
        offsets differ; none in the warm-up, whose steps sync every fragment)."""
        if global_step <= self.settings.warmup:
            return None
        phase = global_step % self.settings.every
        return next((f for f in self.fragments if f.offset == phase), None)

    def count_samples(self, sizes: Sequence[int]) -> None:
        """A batch of every rank's ``sizes`` (heterogeneous batching's plan) started: each worker's samples count
        towards its weight at every fragment's next sync."""
        for fragment in self.fragments:
            for w, ranks in enumerate(self.workers.ranks):
                fragment.samples[w] += float(sum(sizes[r] for r in ranks))

    def weight(self, fragment: int = 0) -> float:
        """This worker's share of the mean pseudo-gradient of ``fragment``: its samples since the fragment's last sync
        over everyone's, or ``1 / W`` when nobody counted (even batches)."""
        samples = self.fragments[fragment].samples
        total = sum(samples)
        if total <= 0:
            return 1.0 / self.workers.count
        return samples[self.workers.index] / total

    def broadcast_buffers(self) -> None:
        """Two_tier: the host's first rank's buffers to the host's other ranks, before a forward pass (DDP's own
        broadcast would cross hosts, so the strategy turns it off and calls this instead)."""
        if self.buffers_group is None or not self._buffers:
            return
        leader = self.workers.mine[0]
        for _, buf in self._buffers:
            dist.broadcast(buf, src=leader, group=self.buffers_group)

    # -- the sync -------------------------------------------------------------------------------------------------
    def sync_after(self, step: int, stats: Optional[CommStats] = None, tier: str = "inter_host",
                   flags_group: Optional[dist.ProcessGroup] = None) -> list[SyncResult]:
        """After optimizer step ``step``, on every rank together: the exchanges due to land land (in the order they
        started), then the fragment due to sync starts (and, without a delay, lands at once). Returns the syncs that
        landed.

        ``stats``: the strategy's step statistics; the pseudo-gradient's bytes are recorded under ``tier`` (a delayed
        exchange's in the step it lands). ``flags_group``: a group of every rank (gloo) to say, on a skip, which
        workers saw a non-finite value.
        """
        results = [self._land(ex, stats, tier, flags_group) for ex in list(self.inflight) if ex.lands == step]
        if self.warming(step):  # (nothing is in flight: the first delayed exchange starts after the warm-up)
            return results + [self._average_now(f, step, stats, tier, flags_group) for f in self.fragments]
        fragment = self._starting(step)
        if fragment is not None:
            exchange = self._start(fragment, step, stats, tier)
            if self.settings.delay:
                self.inflight.append(exchange)
            else:
                results.append(self._land(exchange, stats, tier, flags_group))
        return results

    def _average_now(self, fragment: Fragment, step: int, stats: Optional[CommStats], tier: str,
                     flags_group: Optional[dist.ProcessGroup]) -> SyncResult:
        """A warm-up step's or the final sync's: the fragment's exchange in the step, landed as the workers' weighted
        mean (``theta_global`` minus the mean pseudo-gradient; no outer step, the momentum untouched)."""
        return self._land(self._start(fragment, step, stats, tier, delay=0, averages=True), stats, tier, flags_group)

    def _start(self, fragment: Fragment, step: int, stats: Optional[CommStats], tier: str,
               delay: Optional[int] = None, averages: bool = False) -> Exchange:
        """The fragment's weighted pseudo-gradient into its buckets, and its reduction: here (no delay) or on the
        sync's thread (``delay``: the settings' unless given). ``averages``: it lands as the workers' mean
        (:meth:`_average_now`)."""
        started = time.perf_counter()
        delay = self.settings.delay if delay is None else delay
        exchange = Exchange(fragment, step, step + delay, list(fragment.samples), averages=averages)
        fragment.started = step
        weight = self.weight(fragment.index)
        fragment.samples = [0.0] * self.workers.count
        with torch.no_grad():
            for bucket in fragment.buckets:
                flat = bucket.flat
                for i, (start, end) in zip(bucket.index, bucket.spans):  # the parameter read off the device
                    torch.sub(self._global[i].reshape(-1), self._params[i].detach().reshape(-1).to(HOST),
                              out=flat[start:end])
                if weight != 1.0:
                    flat.mul_(weight)
            if delay:
                exchange.snapshot = [host_copy(self._params[i]) for i in fragment.params]
                if fragment.buffers and self._buffers:
                    exchange.buffers = [host_copy(b) for _, b in self._buffers]
        if not delay:
            recorder = stats.tier(tier) if stats is not None else None
            sent_before = stats.bytes_sent if stats is not None else 0
            exchange.locally_finite = self._reduce_all(fragment, recorder)
            exchange.bytes_sent = (stats.bytes_sent - sent_before) if stats is not None else 0
        else:
            exchange.stats = CommStats(keep_records=True)
            if self._thread is None:
                self._thread = self._executor()
            exchange.future = self._thread.submit(self._reduce_in_background, exchange)
        exchange.waited = time.perf_counter() - started
        exchange.seconds = exchange.waited
        return exchange

    def _reduce_in_background(self, exchange: Exchange) -> None:
        """The sync's thread: the fragment's reduction and, for the fragment that carries them, the buffers'
        average; on groups only this thread uses."""
        started = time.perf_counter()
        recorder = exchange.stats.tier("inter_host")
        with torch.no_grad():
            exchange.locally_finite = self._reduce_all(exchange.fragment, recorder)
            if exchange.buffers is not None:
                self._average(exchange.buffers, self._transport(recorder))
        exchange.seconds += time.perf_counter() - started

    def _transport(self, recorder: Any) -> Optional[Transport]:
        # one worker (one rank, or one host of a two_tier topology refused earlier): its sum is itself
        return Transport(self.algorithm, self.cross_group, recorder) if self.workers.count > 1 else None

    def _reduce_all(self, fragment: Fragment, recorder: Any) -> bool:
        """Every bucket of ``fragment`` summed over the workers (the same bits on every rank); whether this rank's own
        contribution was finite."""
        transport = self._transport(recorder)
        codec = NoCompressor() if fragment.compressor.warming_up else fragment.compressor
        finite = True
        with torch.no_grad():
            for bucket in fragment.buckets:
                finite &= self._reduce(bucket, codec, transport)
        return finite

    @property
    def unsynced_from(self) -> int:
        """The first global batch (position) whose training is in no reduced exchange yet, for some fragment: what a
        worker lost now would take with it (exact without fragments; with them, some fragments hold a part of it)."""
        return min(self.reduced_at, default=0)

    def settle(self) -> None:
        """Wait for every exchange in flight to be reduced and read its verdict (before a checkpoint: what it saves
        is then the same on every run); nothing lands early."""
        for exchange in self.inflight:
            self._finish(exchange)

    def _finish(self, exchange: Exchange) -> None:
        """Wait for the reduction; the verdict from the reduced sum (the same on every rank), and the fragment's
        compressor keeps its staged state or drops it. Once per exchange."""
        if exchange.norm is not None:
            return
        if exchange.future is not None:
            waiting = time.perf_counter()
            exchange.future.result()  # a failed collective raises here, on the training loop's thread
            exchange.waited += time.perf_counter() - waiting
            exchange.future = None
        buckets = exchange.fragment.buckets
        totals = torch.stack([b.flat.float().square().sum() for b in buckets]) if buckets else torch.zeros(1)
        exchange.norm = math.sqrt(float(totals.sum()))
        compressor = exchange.fragment.compressor
        self.reduced_at[exchange.fragment.index] = max(self.reduced_at[exchange.fragment.index], exchange.step)
        if math.isfinite(exchange.norm):
            compressor.commit()
        else:
            compressor.discard()

    def _land(self, exchange: Exchange, stats: Optional[CommStats], tier: str,
              flags_group: Optional[dist.ProcessGroup]) -> SyncResult:
        """The outer step on the fragment (or the skip), and the worker's parameters set from ``theta_global``."""
        started = time.perf_counter()
        sent_before = stats.bytes_sent if stats is not None else 0
        self._finish(exchange)
        if exchange.stats is not None and stats is not None:  # a delayed exchange's bytes count in this step
            recorder = stats.tier(tier)
            for record in exchange.stats.records:
                recorder.record(record)
        if exchange in self.inflight:
            self.inflight.remove(exchange)
        fragment, norm = exchange.fragment, exchange.norm
        result = SyncResult(step=exchange.lands, skipped=not math.isfinite(norm), fragment=fragment.index)
        with torch.no_grad():
            if result.skipped:
                result.bad_workers = _bad_workers(exchange.locally_finite, self.workers, flags_group)
                self.skipped += 1
            else:
                for bucket in fragment.buckets:
                    for i, (start, end) in zip(bucket.index, bucket.spans):
                        reduced = bucket.flat[start:end].view(self._global[i].shape)
                        if exchange.averages:  # theta_global - mean(theta_global - theta_w): the workers' mean
                            self._global[i].sub_(reduced)
                        else:
                            self._global[i].grad = reduced
                if not exchange.averages:
                    self._outer.step()
                    self._outer.zero_grad(set_to_none=True)
                if fragment.buffers and exchange.buffers is not None:
                    for keep, mean in zip(self._global_buffers, exchange.buffers):
                        keep.copy_(mean)
                elif fragment.buffers:
                    averaged = [host_copy(b) for _, b in self._buffers]
                    self._average(averaged, self._transport(stats.tier(tier) if stats is not None else None))
                    for keep, mean in zip(self._global_buffers, averaged):
                        keep.copy_(mean)
                self.outer_steps += 1
            if exchange.snapshot is None or result.skipped:  # the worker restarts from theta_global
                for i in fragment.params:
                    self._params[i].copy_(self._global[i])
            else:  # p_now + mix (theta_global - p_at_s), the difference taken on the host and streamed over
                for i, at_start in zip(fragment.params, exchange.snapshot):
                    self._params[i].add_((self._global[i] - at_start).to(self._params[i].device),
                                         alpha=self.settings.mix)
            if fragment.buffers:
                for (_, buf), g in zip(self._buffers, self._global_buffers):
                    buf.copy_(g)
        sent = exchange.bytes_sent + ((stats.bytes_sent - sent_before) if stats is not None else 0)
        self.bytes_total += sent
        landing = time.perf_counter() - started
        result.seconds, result.waited = exchange.seconds + landing, exchange.waited + landing
        result.bytes_sent, result.norm = sent, norm
        self.metrics = {"sync/outer_steps": float(self.outer_steps), "sync/skipped": float(self.skipped),
                        "sync/seconds": result.seconds, "sync/waited_s": result.waited,
                        "sync/bytes_per_sync": float(sent),
                        "sync/bytes_per_step": self.bytes_total / max(1, exchange.lands),
                        "sync/pseudo_grad_norm": norm}
        if self.settings.fragments > 1:
            self.metrics["sync/fragment"] = float(fragment.index)
        return result

    def finish(self, stats: Optional[CommStats] = None, tier: str = "inter_host",
               flags_group: Optional[dist.ProcessGroup] = None) -> list[SyncResult]:
        """The end of a fit, on every rank together: every exchange still in flight lands now (the model the fit
        leaves holds every sync it started)."""
        return [self._land(ex, stats, tier, flags_group) for ex in list(self.inflight)]

    def final_sync(self, step: int, stats: Optional[CommStats] = None, tier: str = "inter_host",
                   flags_group: Optional[dist.ProcessGroup] = None) -> list[SyncResult]:
        """The end of a fit after optimizer step ``step`` (``DiLoCo(final_sync=True)``), on every rank together: the
        exchanges in flight land (:meth:`finish`), then every fragment whose sync did not start after ``step`` averages
        the workers, in the step (its pseudo-gradient since its last sync, workers weighted by their samples, as every
        sync's; ``theta_global`` minus it, as a warm-up step: no outer momentum), and every rank's parameters and
        buffers become ``theta_global`` and the averaged buffers. Called instead of :meth:`sync_after` in a last step
        known as such, it takes the place of the sync due there."""
        results = self.finish(stats, tier, flags_group)
        if step > 0:
            for fragment in self.fragments:
                if fragment.started != step:  # steps since its last sync
                    results.append(self._average_now(fragment, step, stats, tier, flags_group))
        with torch.no_grad():
            for t, g in zip(self._tensors(), (*self._global, *self._global_buffers)):
                t.copy_(g)
        return results

    def _tensors(self) -> list[torch.Tensor]:
        """This rank's parameters and buffers, in the order of ``theta_global`` and the averaged buffers."""
        return [*self._params, *(b for _, b in self._buffers)]

    def swap_in_global(self) -> None:
        """Validation of the global model: this rank's own parameters and buffers kept in host memory, and
        ``theta_global`` and the averaged buffers (the model after the last sync that landed) set in their place."""
        if self._own is not None:
            return
        with torch.no_grad():
            self._own = [host_copy(t) for t in self._tensors()]
            for t, g in zip(self._tensors(), (*self._global, *self._global_buffers)):
                t.copy_(g)

    def swap_back(self) -> None:
        """This rank's own parameters and buffers back, bit for bit (after :meth:`swap_in_global`)."""
        if self._own is None:
            return
        with torch.no_grad():
            for t, own in zip(self._tensors(), self._own):
                t.copy_(own)
        self._own = None

    def own_state(self) -> dict[str, torch.Tensor]:
        """While the global model is swapped in: this rank's own parameters and buffers by name (a checkpoint written
        during validation saves them as the worker's); else {}."""
        names = [*self._names, *(name for name, _ in self._buffers)]
        return dict(zip(names, self._own)) if self._own is not None else {}

    def _executor(self) -> ThreadPoolExecutor:
        """The exchanges' thread (one, first in first out). It selects the model's CUDA device first: a thread's
        current device is its own (cuda:0 until set), and torch's point-to-point calls can hang without it."""
        device = self.device
        setup = (lambda: torch.cuda.set_device(device)) if device.type == "cuda" else None
        return ThreadPoolExecutor(1, thread_name_prefix=THREAD_NAME, initializer=setup)

    def close(self) -> None:
        """Stop the sync's thread (teardown; after a fault an exchange may still wait for a peer: not waited for)."""
        if self._thread is not None:
            self._thread.shutdown(wait=False, cancel_futures=True)
            self._thread = None

    def _reduce(self, bucket: _Bucket, codec: Compressor, transport: Optional[Transport]) -> bool:
        """The bucket's weighted pseudo-gradient (in ``bucket.flat``) summed over the workers in place (the same bits
        on every rank); whether this rank's own contribution was finite."""
        flat = bucket.flat
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

    def _average(self, buffers: list[torch.Tensor], transport: Optional[Transport]) -> None:
        """``buffers`` (copies of the model's, in order) become the mean over the workers in place (a host's ranks
        hold the same buffers: each part's group averages them alike); integer ones the floor of the mean."""
        count = self.workers.count
        for total in buffers:
            if transport is not None and total.is_floating_point():
                transport.allreduce_(total.view(-1))
                total.div_(count)
            elif count > 1:
                dist.all_reduce(total, group=self.cross_group)
                total.copy_(torch.div(total, count, rounding_mode="floor"))

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
        averaged buffers, the exchange's flat buckets, the compressors' state and, with a delay, the worker's
        parameters at the start of each exchange in flight (at most ``ceil(delay F / H)`` fragments at once)."""
        params = sum(p.numel() * p.element_size() for p in self._params)
        buffers = sum(b.numel() * b.element_size() for _, b in self._buffers)
        compressor = sum(f.compressor.state_bytes(b.layout if b.plan is None else b.plan.layout, b.flat.element_size())
                         for f in self.fragments for b in f.buckets)
        snapshots = 0
        if self.settings.delay and self.fragments:
            spacing = self.settings.every // self.settings.fragments
            largest = max(sum(self._params[i].numel() * self._params[i].element_size() for i in f.params)
                          for f in self.fragments)
            snapshots = min(len(self.fragments), -(-self.settings.delay // spacing)) * (largest + buffers)
        return 3 * params + buffers + compressor + snapshots

    def memory_by_device(self) -> dict[str, int]:
        """:meth:`memory_bytes` by device type: all of it in host memory (``"cpu"``), none beside a GPU model
        (``"cuda"``: 0), as the module's docstring says; the tensors themselves are checked in
        :meth:`state_tensors`."""
        found = {self.device.type: 0, HOST.type: 0}
        found[HOST.type] += self.memory_bytes()
        return found

    def state_tensors(self) -> list[torch.Tensor]:
        """Every tensor DiLoCo keeps between syncs: theta_global, the outer momentum, the averaged buffers, the
        buckets, the snapshots and buffers of exchanges in flight (where they live is what a test checks)."""
        found = [*self._global, *self._global_buffers, *(b.flat for f in self.fragments for b in f.buckets)]
        if self._outer is not None:
            found += [s["momentum_buffer"] for s in self._outer.state.values() if "momentum_buffer" in s]
        for ex in self.inflight:
            found += [*(ex.snapshot or []), *(ex.buffers or [])]
        return found

    def state_dict(self, settle: bool = True) -> dict[str, Any]:
        """What every rank holds alike (theta_global, momentum, buffers, counts, the exchanges in flight with their
        reduced sums: tensors by name); tensors, numbers and strings only (``weights_only=True`` loads it).

        ``settle``: wait for the exchanges in flight first (:meth:`settle`); False (an emergency checkpoint: a peer
        may be gone) keeps only those already reduced, and the others' samples count towards their next sync."""
        if settle:
            self.settle()
        momentum = {}
        for name, g in zip(self._names, self._global):
            buf = self._outer.state.get(g, {}).get("momentum_buffer") if self._outer is not None else None
            if buf is not None:
                momentum[name] = buf.detach().clone()
        samples = [list(f.samples) for f in self.fragments]
        inflight = []
        for ex in self.inflight:
            if ex.norm is None:  # not reduced: dropped, its samples back to its fragment's count
                samples[ex.fragment.index] = [a + b for a, b in zip(samples[ex.fragment.index], ex.samples)]
                continue
            inflight.append({"fragment": ex.fragment.index, "step": ex.step, "lands": ex.lands, "norm": ex.norm,
                             "samples": list(ex.samples), "seconds": ex.seconds, "waited": ex.waited,
                             "sums": [b.flat.detach().clone() for b in ex.fragment.buckets],
                             "buffers": None if ex.buffers is None else [b.clone() for b in ex.buffers],
                             "records": [asdict(r) for r in (ex.stats.records if ex.stats is not None else [])]})
        return {"settings": self.settings.describe(), "workers": self.workers.count,
                "outer_steps": self.outer_steps, "skipped": self.skipped,
                "samples": samples[0] if len(samples) == 1 else samples, "inflight": inflight,
                "reduced_at": list(self.reduced_at),
                "bytes_total": self.bytes_total,
                "global": {name: g.detach().clone() for name, g in zip(self._names, self._global)},
                "momentum": momentum,
                "buffers": {name: b.detach().clone() for (name, _), b in zip(self._buffers, self._global_buffers)}}

    def rank_state(self) -> dict[str, Any]:
        """This rank's own part (after :meth:`state_dict`): each fragment's compressor state, and whether its own
        contribution to each exchange in flight was finite."""
        return {"compressors": [f.compressor.state_dict() for f in self.fragments],
                "finite": [ex.locally_finite for ex in self.inflight if ex.norm is not None]}

    def worker_state(self) -> list[dict[str, torch.Tensor]]:
        """This worker's part (after :meth:`state_dict`): its parameters at the start of each exchange in flight, by
        name."""
        return [{self._names[i]: t.clone() for i, t in zip(ex.fragment.params, ex.snapshot)}
                for ex in self.inflight if ex.norm is not None and ex.snapshot is not None]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output (after :meth:`attach`); then :meth:`load_rank_state` and
        :meth:`load_worker_state`."""
        if self._outer is None:
            raise RuntimeError("DiLoCoSync.load_state_dict before attach: the parameters are not known yet")
        if state["settings"] != self.settings.describe():
            raise ValueError(f"the checkpoint was written with sync={state['settings']}, this run has "
                             f"sync={self.settings.describe()}: resume with the same DiLoCo settings")
        self.outer_steps, self.skipped = int(state["outer_steps"]), int(state["skipped"])
        self.bytes_total = int(state.get("bytes_total", 0))
        self.reduced_at = [int(r) for r in state.get("reduced_at", [0] * len(self.fragments))]
        same = int(state["workers"]) == self.workers.count
        samples = state["samples"] if self.settings.fragments > 1 else [state["samples"]]
        if same:
            for fragment, counts in zip(self.fragments, samples):
                fragment.samples = [float(s) for s in counts]
        self.inflight = []
        with torch.no_grad():
            for name, g in zip(self._names, self._global):
                g.copy_(state["global"][name])
                if name in state["momentum"]:
                    self._outer.state[g]["momentum_buffer"] = host_copy(state["momentum"][name].to(g.dtype))
            for (name, _), b in zip(self._buffers, self._global_buffers):
                if name in state["buffers"]:
                    b.copy_(state["buffers"][name])
            for saved in state.get("inflight", []):
                fragment = self.fragments[saved["fragment"]]
                for bucket, total in zip(fragment.buckets, saved["sums"]):
                    bucket.flat.copy_(total)
                stats = CommStats()
                for record in saved["records"]:
                    stats.record(CallRecord(**record))
                self.inflight.append(Exchange(
                    fragment, int(saved["step"]), int(saved["lands"]),
                    [float(s) for s in saved["samples"]] if same else [0.0] * self.workers.count,
                    buffers=None if saved["buffers"] is None else [host_copy(b) for b in saved["buffers"]],
                    stats=stats, seconds=float(saved["seconds"]),
                    waited=float(saved["waited"]), norm=float(saved["norm"])))

    def load_rank_state(self, state: Optional[dict[str, Any]], shared_only: bool = False) -> None:
        """This rank's part from :meth:`rank_state` (None: nothing of this rank's was saved; ``shared_only``:
        another rank's, whose shared compressor state applies)."""
        if state is None:
            return
        for fragment, saved in zip(self.fragments, state["compressors"]):
            fragment.compressor.load_state_dict(saved, shared_only=shared_only)
        if not shared_only:
            for exchange, finite in zip(self.inflight, state["finite"]):
                exchange.locally_finite = bool(finite)

    def load_worker_state(self, snapshots: Optional[list[dict[str, torch.Tensor]]]) -> None:
        """This worker's parameters at the start of each exchange in flight, from :meth:`worker_state` (None: not
        saved; each lands then on the worker's parameters as restored, as if it had started now)."""
        for k, exchange in enumerate(self.inflight):
            params = exchange.fragment.params
            if snapshots is not None and k < len(snapshots):  # on the host, wherever the checkpoint was mapped
                exchange.snapshot = [host_copy(snapshots[k][self._names[i]]) for i in params]
            elif self.settings.delay:
                exchange.snapshot = [host_copy(self._params[i]) for i in params]

    def restart_from_global(self) -> None:
        """Every parameter and buffer of this rank set to the global ones (a worker whose own state was lost)."""
        with torch.no_grad():
            for p, g in zip(self._params, self._global):
                p.copy_(g)
            for (_, buf), g in zip(self._buffers, self._global_buffers):
                buf.copy_(g)
        self.load_worker_state(None)


def inner_steps(shares: Sequence[int]) -> list[int]:
    """``DiLoCo(balance="steps")``: how many inner steps each worker (a rank) runs per training step, from the shares
    of the global batch heterogeneous batching gave them (which follow each one's measured speed, and every rank
    holds alike): the share over the smallest share, rounded, at least 1. Each worker runs its share as that many
    inner steps of near-equal size, so every inner step holds about the smallest share whatever the worker's speed.
    ``[8, 8, 8, 4]`` (one worker at half speed) gives ``[2, 2, 2, 1]``."""
    smallest = min(shares)
    if smallest <= 0:
        raise ValueError(f"shares {list(shares)}: every worker needs at least one sample per step")
    return [max(1, int(math.floor(share / smallest + 0.5))) for share in shares]


def fragment_cut(sizes: Sequence[tuple[str, int]], fragments: int) -> list[list[int]]:
    """The parameters (``(name, numel)`` in the module's order) cut into ``fragments`` runs of whole parameters of
    about equal numel: a run ends once its cumulative numel reaches the next ``k / F`` of the total, keeping at least
    one parameter for every later run. Every rank derives the same cut from the same model. Fewer parameters than
    fragments is refused (name the fix)."""
    if len(sizes) < fragments:
        raise ValueError(f"DiLoCo(fragments={fragments}) but the model has {len(sizes)} trainable parameter tensors: "
                         f"a fragment holds whole parameters; use fragments <= {len(sizes)}")
    total = sum(n for _, n in sizes)
    cut: list[list[int]] = [[] for _ in range(fragments)]
    done, f = 0, 0
    for i, (_, numel) in enumerate(sizes):
        left = len(sizes) - i  # parameters not yet placed, this one included
        # move on when this run is full, or when every later fragment needs one of the parameters left
        if cut[f] and f < fragments - 1 and (done >= total * (f + 1) / fragments or left <= fragments - 1 - f):
            f += 1
        elif cut[f] and f < fragments - 1 and done + numel / 2 > total * (f + 1) / fragments:
            f += 1  # this parameter lies mostly past the boundary: it starts the next run
        cut[f].append(i)
        done += numel
    return cut


def _buckets(named: list[tuple[str, torch.Tensor]], parts: int, local_index: int,
             index: Optional[list[int]] = None) -> list[_Bucket]:
    """The parameters, in the module's order, in runs of one dtype and device of at most :data:`BUCKET_BYTES`;
    ``index``: their positions in the sync's list (default: 0, 1, ...)."""
    index = list(range(len(named))) if index is None else index
    buckets: list[_Bucket] = []
    run: list[int] = []
    size = 0
    for i, (_, p) in enumerate(named):
        nbytes = p.numel() * p.element_size()
        first = named[run[0]][1] if run else None
        if first is not None and (p.dtype != first.dtype or p.device != first.device or size + nbytes > BUCKET_BYTES):
            buckets.append(_Bucket([index[j] for j in run], [named[j][0] for j in run], [named[j][1] for j in run],
                                   parts, local_index))
            run, size = [], 0
        run.append(i)
        size += nbytes
    if run:
        buckets.append(_Bucket([index[j] for j in run], [named[j][0] for j in run], [named[j][1] for j in run], parts,
                               local_index))
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


def host_empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """An empty tensor in host memory, pinned where CUDA is available (its copies to and from the GPU then run at
    full PCIe speed and may be asynchronous)."""
    return torch.empty(numel, dtype=dtype, device=HOST, pin_memory=torch.cuda.is_available())


def host_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` (any device) in host memory, pinned where CUDA is available: DiLoCo's state is kept there."""
    out = host_empty(t.numel(), t.dtype).view(t.shape)
    out.copy_(t.detach())
    return out
