"""DiLoCo's outer loop, as one rank runs it: the workers train alone and meet every H steps.

:class:`DiLoCoSync` is composed of its parts: who trains together and the fragments' schedule
(:mod:`~lightning_dist.sync.diloco_fragments`), the exchanges (:mod:`~lightning_dist.sync.diloco_exchange`), the outer
step (:mod:`~lightning_dist.sync.diloco_outer`) and the checkpoint state (:mod:`~lightning_dist.sync.diloco_state`).
docs/sync.md ("How it works") has the algorithm; the sync driver around it is
:mod:`~lightning_dist.sync.diloco_driver`.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from lightning_dist.comm import CommStats
from lightning_dist.comm.topology import Topology
from lightning_dist.sync.buckets import HOST, host_copy
from lightning_dist.sync.diloco_exchange import Exchange, Exchanges
from lightning_dist.sync.diloco_fragments import Fragment, Schedule, SyncedModel, Workers
from lightning_dist.sync.diloco_outer import GlobalSwap, OuterStep
from lightning_dist.sync.diloco_settings import DiLoCoSettings
from lightning_dist.sync.diloco_state import SyncState

Agree = Callable[[list[bool]], list[bool]]  # flags agreed across every rank (SyncContext.agree)


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


class DiLoCoSync:
    """One rank's share of DiLoCo's outer loop. Built by the strategy at set-up: :meth:`create` makes its process
    groups (a collective: every rank, in the same order), :meth:`attach` attaches it to the wrapped module once DDP
    has made every rank's parameters equal. It holds its parts and delegates to them: :attr:`schedule` (the fragments
    and when each syncs), :attr:`exchanges` (their reduction, here or on the sync's thread, and those in flight),
    :attr:`outer` (``theta_global`` and the outer step), :attr:`swap` (validation on ``theta_global``) and
    :attr:`state` (what a checkpoint keeps)."""

    def __init__(self, settings: DiLoCoSettings, workers: Workers, algorithm: str,
                 cross_group: Optional[dist.ProcessGroup], host_group: Optional[dist.ProcessGroup] = None,
                 buffers_group: Optional[dist.ProcessGroup] = None) -> None:
        self.settings = settings
        self.workers = workers
        # two_tier: the buffers' broadcast inside the host, from the main thread (with a delay host_group is the
        # sync thread's)
        self.buffers_group = buffers_group if buffers_group is not None else host_group
        self.schedule = Schedule(settings, workers)
        self.exchanges = Exchanges(settings, workers, algorithm, cross_group, host_group)
        self.outer = OuterStep(settings)
        self.swap = GlobalSwap()
        self.state = SyncState(settings, self.schedule, self.exchanges, self.outer)
        self.model: Optional[SyncedModel] = None  # set at attach
        self.metrics: dict[str, float] = {}
        self.lost_workers: list[int] = []  # an elastic restart: old ranks whose workers' state is gone (restore_sync)

    @classmethod
    def create(cls, settings: DiLoCoSettings, topology: Optional[Topology], rank: int, world_size: int, algorithm: str,
               timeout: Optional[timedelta] = None) -> DiLoCoSync:
        """The sync's groups, made by every rank in the same order: under two_tier each part's group across hosts and
        each host's group for the parts' all-gather; under flat one group of every rank."""
        workers = Workers.of(topology, world_size, rank)
        # the pseudo-gradient and the averaged buffers are host tensors: gloo groups (docs/sync.md, "Where the state
        # lives")
        if workers.local_size == 1:
            cross = dist.new_group(timeout=timeout, backend="gloo") if world_size > 1 else None
            return cls(settings, workers, algorithm, cross)
        across_hosts = [list(ranks) for ranks in zip(*workers.ranks)]  # part i: the i-th rank of every host
        hosts = [list(r) for r in workers.ranks]
        cross = dist.new_subgroups_by_enumeration(across_hosts, timeout=timeout, backend="gloo")[0]
        host = dist.new_subgroups_by_enumeration(hosts, timeout=timeout, backend="gloo")[0]
        # the model's own buffers, broadcast inside the host before each forward from the main thread: where they
        # live (the default backend's group: NCCL for a GPU model)
        buffers = dist.new_subgroups_by_enumeration(hosts, timeout=timeout)[0]
        return cls(settings, workers, algorithm, cross, host, buffers)

    @property
    def groups(self) -> list[dist.ProcessGroup]:
        """The groups this rank is in (to destroy at teardown)."""
        found = (self.exchanges.cross_group, self.exchanges.host_group, self.buffers_group)
        return list({id(g): g for g in found if g is not None}.values())

    # -- the parts' figures -----------------------------------------------------------------------------------------
    @property
    def fragments(self) -> list[Fragment]:
        return self.schedule.fragments

    @property
    def inflight(self) -> list[Exchange]:
        """Exchanges started, not landed (a delay only), in the order they started."""
        return self.exchanges.inflight

    @property
    def outer_steps(self) -> int:
        return self.outer.steps

    @property
    def skipped(self) -> int:
        return self.outer.skipped

    @property
    def bytes_total(self) -> int:
        return self.exchanges.bytes_total

    @property
    def samples(self) -> list[float]:
        """Per worker, the samples counted since the first fragment's last sync (the whole model's without
        fragments)."""
        return self.schedule.fragments[0].samples

    @property
    def unsynced_from(self) -> int:
        return self.exchanges.unsynced_from

    # -- set-up ---------------------------------------------------------------------------------------------------
    def attach(self, module: torch.nn.Module) -> None:
        """Attach to ``module`` (every rank holds the same parameters now): ``theta_global`` starts as them (a
        checkpoint's replace them through :meth:`load_state_dict`)."""
        self.model = self.state.model = SyncedModel.of(module)
        self.schedule.cut(self.model)
        self.exchanges.attach(len(self.schedule.fragments), self.model.device)
        self.outer.attach(self.model)

    # -- the schedule ---------------------------------------------------------------------------------------------
    def due(self, global_step: int) -> bool:
        """Whether the optimizer step that made ``global_step`` is followed by a fragment's sync starting or landing
        (the same on every rank)."""
        return (self.schedule.warming(global_step) or self.schedule.starting(global_step) is not None
                or bool(self.exchanges.landing(global_step)))

    def meets(self, global_step: int) -> bool:
        """Whether the workers meet on the training loop's thread in the step that makes ``global_step``: a sync runs
        in it (no delay), or, with a delay (the exchanges run beside the loop), the first fragment's sync starts after
        it: once per H steps. Where a collective of every rank costs no extra wait (the strategy's SIGTERM
        broadcast)."""
        if self.schedule.warming(global_step):
            return True
        fragment = self.schedule.starting(global_step)
        return fragment is not None and (not self.settings.delay or fragment.index == 0)

    def count_samples(self, sizes: Sequence[int]) -> None:
        self.schedule.count_samples(sizes)

    def count_rate(self, rate: float) -> None:
        """The inner learning rate of the optimizer step just taken (before :meth:`sync_after` for it)."""
        self.schedule.count_rate(rate)

    def weight(self, fragment: int = 0) -> float:
        return self.schedule.weight(fragment)

    # -- every step -----------------------------------------------------------------------------------------------
    def broadcast_buffers(self) -> None:
        """Two_tier: the host's first rank's buffers to the host's other ranks, before a forward pass (DDP's own
        broadcast would cross hosts, so the strategy turns it off and calls this instead)."""
        if self.buffers_group is None or not self.model.buffers:
            return
        for buf in self.model.buffers:
            dist.broadcast(buf, src=self.workers.leader, group=self.buffers_group)

    # -- the sync -------------------------------------------------------------------------------------------------
    def sync_after(self, step: int, stats: Optional[CommStats] = None, tier: str = "inter_host",
                   agree: Optional[Agree] = None) -> list[SyncResult]:
        """After optimizer step ``step``, on every rank together: the exchanges due to land land (in the order they
        started), then the fragment due to sync starts (and, without a delay, lands at once). Returns the syncs that
        landed.

        ``stats``: the strategy's step statistics; the pseudo-gradient's bytes are recorded under ``tier`` (a delayed
        exchange's in the step it lands). ``agree``: flags agreed across every rank (the context's
        :meth:`~lightning_dist.sync.context.SyncContext.agree`), to say, on a skip, which workers saw a non-finite
        value.
        """
        results = [self._land(ex, stats, tier, agree) for ex in self.exchanges.landing(step)]
        if self.schedule.warming(step):  # (nothing is in flight: the first delayed exchange starts after the warm-up)
            return results + [self._average_now(f, step, stats, tier, agree) for f in self.fragments]
        fragment = self.schedule.starting(step)
        if fragment is not None:
            exchange = self._start(fragment, step, stats, tier, self.settings.delay)
            if not self.settings.delay:
                results.append(self._land(exchange, stats, tier, agree))
        return results

    def _start(self, fragment: Fragment, step: int, stats: Optional[CommStats], tier: str, delay: int,
               averages: bool = False) -> Exchange:
        samples, weight, rate = self.schedule.take_samples(fragment, step)
        return self.exchanges.start(fragment, step, samples, weight, self.outer.theta, self.model, stats, tier, delay,
                                    averages, rate)

    def _average_now(self, fragment: Fragment, step: int, stats: Optional[CommStats], tier: str,
                     agree: Optional[Agree]) -> SyncResult:
        """A warm-up step's or the final sync's: the fragment's exchange in the step, landed as the workers' weighted
        mean (``theta_global`` minus the mean pseudo-gradient; no outer step, the momentum untouched)."""
        exchange = self._start(fragment, step, stats, tier, delay=0, averages=True)
        return self._land(exchange, stats, tier, agree)

    def _land(self, exchange: Exchange, stats: Optional[CommStats], tier: str,
              agree: Optional[Agree]) -> SyncResult:
        """The outer step on the fragment (or the skip), and the worker's parameters set from ``theta_global``."""
        started = time.perf_counter()
        sent_before = stats.bytes_sent if stats is not None else 0
        self.exchanges.take(exchange, stats, tier)
        fragment, norm, outer = exchange.fragment, exchange.norm, self.outer
        result = SyncResult(step=exchange.lands, skipped=not math.isfinite(norm), fragment=fragment.index)
        with torch.no_grad():
            if result.skipped:
                result.bad_workers = self.exchanges.bad_workers(exchange, agree)
                outer.skipped += 1
            else:
                outer.step(exchange)
                if fragment.buffers and exchange.buffers is not None:
                    averaged = exchange.buffers
                elif fragment.buffers:
                    averaged = [host_copy(b) for b in self.model.buffers]
                    self.exchanges.average(averaged, self.exchanges.transport(
                        stats.tier(tier) if stats is not None else None))
                if fragment.buffers:
                    for kept, mean in zip(outer.buffers, averaged):
                        kept.copy_(mean)
            outer.land(exchange, self.model, result.skipped)
        sent = exchange.bytes_sent + ((stats.bytes_sent - sent_before) if stats is not None else 0)
        self.exchanges.bytes_total += sent
        landing = time.perf_counter() - started
        result.seconds, result.waited = exchange.seconds + landing, exchange.waited + landing
        result.bytes_sent, result.norm = sent, norm
        self.metrics = {"sync/outer_steps": float(outer.steps), "sync/skipped": float(outer.skipped),
                        "sync/seconds": result.seconds, "sync/waited_s": result.waited,
                        "sync/bytes_per_sync": float(sent),
                        "sync/bytes_per_step": self.bytes_total / max(1, exchange.lands),
                        "sync/pseudo_grad_norm": norm}
        if self.settings.fragments > 1:
            self.metrics["sync/fragment"] = float(fragment.index)
        return result

    def settle(self) -> None:
        """Every exchange in flight settled: its reduction waited for and its verdict read (before a checkpoint: what
        it saves is then the same on every run); nothing lands early."""
        self.exchanges.settle_all()

    def land_inflight(self, stats: Optional[CommStats] = None, tier: str = "inter_host",
                      agree: Optional[Agree] = None) -> list[SyncResult]:
        """The end of a fit, on every rank together: every exchange still in flight lands now (the model the fit
        leaves holds every sync it started)."""
        return [self._land(ex, stats, tier, agree) for ex in list(self.inflight)]

    def final_sync(self, step: int, stats: Optional[CommStats] = None, tier: str = "inter_host",
                   agree: Optional[Agree] = None) -> list[SyncResult]:
        """The end of a fit after optimizer step ``step`` (``DiLoCo(final_sync=True)``), on every rank together: the
        exchanges in flight land (:meth:`land_inflight`), then every fragment whose sync did not start after ``step``
        averages the workers, in the step (its pseudo-gradient since its last sync, workers weighted by their
        samples, as every sync's; ``theta_global`` minus it, as a warm-up step: no outer momentum), and every rank's
        parameters and buffers become ``theta_global`` and the averaged buffers. Called instead of
        :meth:`sync_after` in a last step known as such, it takes the place of the sync due there."""
        results = self.land_inflight(stats, tier, agree)
        if step > 0:
            for fragment in self.fragments:
                if fragment.started != step:  # steps since its last sync
                    results.append(self._average_now(fragment, step, stats, tier, agree))
        self.outer.copy_to(self.model)
        return results

    # -- validation -------------------------------------------------------------------------------------------------
    def swap_in_validated(self) -> None:
        """Validation of the agreed model: this rank's own parameters and buffers kept in host memory, and the model
        the settings' ``validate`` names (:meth:`~lightning_dist.sync.diloco_outer.OuterStep.validated`: the workers'
        mean at the last sync, or ``theta_global``) with the averaged buffers set in their place."""
        self.swap.swap_in(self.model, self.outer)

    def swap_back(self) -> None:
        """This rank's own parameters and buffers back, bit for bit (after :meth:`swap_in_validated`)."""
        self.swap.swap_back(self.model)

    def worker_tensors(self) -> dict[str, torch.Tensor]:
        """While the global model is swapped in: this rank's own parameters and buffers by name (a checkpoint written
        during validation saves them as the worker's); else {}."""
        return self.swap.worker_tensors(self.model)

    def close(self) -> None:
        """Stop the sync's thread (teardown; after a fault an exchange may still wait for a peer: not waited for)."""
        self.exchanges.close()

    # -- what the strategy reports and saves ------------------------------------------------------------------------
    def memory_bytes(self) -> int:
        """Bytes DiLoCo keeps beside the model: theta_global and the outer momentum (two parameter copies), with
        ``validate="mean"`` the workers' mean at the last sync (a third), the
        averaged buffers, the exchange's flat buckets, the compressors' state and, with a delay, the worker's
        parameters at the start of each exchange in flight (at most ``ceil(delay F / H)`` fragments at once)."""
        params = sum(p.numel() * p.element_size() for p in self.model.params)
        buffers = sum(b.numel() * b.element_size() for b in self.model.buffers)
        compressor = sum(f.compressor.state_bytes(b.layout if b.plan is None else b.plan.layout, b.flat.element_size())
                         for f in self.fragments for b in f.buckets)
        snapshots = 0
        if self.settings.delay and self.fragments:
            spacing = self.settings.every // self.settings.fragments
            largest = max(sum(self.model.params[i].numel() * self.model.params[i].element_size() for i in f.params)
                          for f in self.fragments)
            snapshots = min(len(self.fragments), -(-self.settings.delay // spacing)) * (largest + buffers)
        return (3 + bool(self.outer.mean)) * params + buffers + compressor + snapshots

    def memory_by_device(self) -> dict[str, int]:
        """:meth:`memory_bytes` by device type: all of it in host memory (``"cpu"``), none beside a GPU model
        (``"cuda"``: 0), as docs/sync.md says; the tensors themselves are checked in :meth:`state_tensors`."""
        found = {self.model.device.type: 0, HOST.type: 0}
        found[HOST.type] += self.memory_bytes()
        return found

    def state_tensors(self) -> list[torch.Tensor]:
        """Every tensor DiLoCo keeps between syncs: theta_global, the outer momentum, the averaged buffers, the
        buckets, the snapshots and buffers of exchanges in flight (where they live is what a test checks)."""
        found = [*self.outer.tensors(), *self.outer.mean, *(b.flat for f in self.fragments for b in f.buckets),
                 *self.outer.momenta()]
        for ex in self.inflight:
            found += [*(ex.snapshot or []), *(ex.buffers or [])]
        return found

    def state_dict(self, settle: bool = True) -> dict[str, Any]:
        """What every rank holds alike (theta_global, momentum, buffers, counts, the exchanges in flight with their
        reduced sums: tensors by name); tensors, numbers and strings only (``weights_only=True`` loads it).

        ``settle``: settle the exchanges in flight first (:meth:`settle`); False (an emergency checkpoint: a peer
        may be gone) keeps only those already settled, and the others' samples count towards their next sync."""
        if settle:
            self.settle()
        return self.state.state_dict()

    def rank_state(self) -> dict[str, Any]:
        """This rank's own part (after :meth:`state_dict`): each fragment's compressor state, and whether its own
        contribution to each exchange in flight was finite."""
        return self.state.rank_state()

    def inflight_snapshots(self) -> list[dict[str, torch.Tensor]]:
        """This worker's part (after :meth:`state_dict`): its parameters at the start of each exchange in flight, by
        name."""
        return self.state.inflight_snapshots()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output (after :meth:`attach`); then :meth:`load_rank_state` and
        :meth:`load_inflight_snapshots`."""
        self.state.load_state_dict(state)

    def load_rank_state(self, state: Optional[dict[str, Any]], shared_only: bool = False) -> None:
        """This rank's part from :meth:`rank_state` (None: nothing of this rank's was saved; ``shared_only``:
        another rank's, whose shared compressor state applies)."""
        self.state.load_rank_state(state, shared_only)

    def load_inflight_snapshots(self, snapshots: Optional[list[dict[str, torch.Tensor]]]) -> None:
        """This worker's parameters at the start of each exchange in flight, from :meth:`inflight_snapshots` (None: not
        saved; each lands then on the worker's parameters as restored, as if it had started now)."""
        self.state.load_inflight_snapshots(snapshots)

    def restart_from_global(self) -> None:
        """Every parameter and buffer of this rank set to the global ones (a worker whose own state was lost)."""
        self.outer.copy_to(self.model)
        self.load_inflight_snapshots(None)
