"""DiLoCo as a sync driver (:mod:`lightning_dist.sync.driver`): what it does around Lightning's step, its checkpoints.

:class:`DiLoCo` is what users pass (``RingDDPStrategy(sync=DiLoCo(every=50))``): its settings
(:class:`~lightning_dist.sync.diloco_settings.DiLoCoSettings`, checked before any process starts) as
:class:`~lightning_dist.sync.SyncSettings`: :meth:`DiLoCo.check`, :meth:`DiLoCo.refuses` and :meth:`DiLoCo.bind`. At
set-up ``bind`` makes the running :class:`DiLoCoDriver`, which holds the outer loop
(:class:`~lightning_dist.sync.diloco.DiLoCoSync`, its :attr:`~DiLoCoDriver.loop`) and answers the hooks the strategy
calls from then on:

- *set-up*: the outer loop's groups; its workers (:attr:`DiLoCoDriver.gradient_ranks`), from which the strategy
  derives the rest: DDP's gradient synchronisation kept inside a worker (off for a worker of one rank, whose gradients
  then never leave it; on the host's group for a host, dense, over its own links), DDP's buffer broadcast off (the sync
  averages buffers, and a host's first rank broadcasts them inside the host before each forward), NaNRecovery's verdict
  agreed inside the worker, and Lightning's SIGTERM broadcast (a collective across every worker before every batch)
  run only before the steps where the workers meet anyway (:meth:`DiLoCoSync.meets`);
- *every batch*: each worker's samples weigh its pseudo-gradient; ``balance="steps"`` runs a faster worker's share as
  more inner steps (:func:`~lightning_dist.sync.diloco_fragments.inner_steps`, agreed from every rank's share);
- *after every optimizer step*: the fragment syncs that land and start there (each a long collective of every rank, a
  model's worth of bytes over the slowest links: FaultTolerance's watchdog waits while every rank is in one, through
  the context's ``long_collective``); a skipped outer step is warned of and reported to NaNRecovery as a skipped
  step; after the fit's last step (the context's ``ends_fit``, or a stop a callback agreed on, met at the last
  validation or at the end) the final sync;
- *validation*: ``theta_global`` swapped in (``validate="global"``) and each rank's own parameters back afterwards;
  ``sync/validated_global`` (in its report) names the model validated;
- *checkpoints*: :func:`sync_entry` (every rank's part gathered to rank zero) and :func:`restore_sync`, the pair
  behind :meth:`DiLoCoDriver.state_dict` and :meth:`DiLoCoDriver.load_state_dict`.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_dist.comm import destroy_groups
from lightning_dist.compression import NoCompressor
from lightning_dist.hetero import micro_batch_sizes
from lightning_dist.identities import map_ranks
from lightning_dist.sync.buckets import gather_to_rank_zero
from lightning_dist.sync.context import SyncContext
from lightning_dist.sync.diloco import DiLoCoSync, SyncResult
from lightning_dist.sync.diloco_fragments import inner_steps
from lightning_dist.sync.diloco_settings import DiLoCoSettings
from lightning_dist.sync.driver import FitSettings, SyncDriver, SyncReport, SyncSettings


class DiLoCo(DiLoCoSettings, SyncSettings):
    __doc__ = DiLoCoSettings.__doc__
    name = "diloco"

    def check(self, *, compressor: Any, hetero: Any, topology: str) -> None:
        if not isinstance(compressor, NoCompressor):
            raise ValueError(f"compressor={compressor.describe()} compresses the per-step gradient, which "
                             "sync=DiLoCo does not send between workers; compress the pseudo-gradient instead: "
                             f"sync=DiLoCo(every={self.every}, compressor={compressor.name!r}) (on the command "
                             f"line sync.compressor={compressor.name}), and drop compressor=")
        if self.balance == "steps":
            problem = steps_balance_problem(hetero, topology)
            if problem is not None:
                raise ValueError(problem)

    def refuses(self, fit: FitSettings) -> Optional[str]:
        # accumulation and mixed precision: each worker's inner steps are Lightning's own (docs/compatibility.md)
        if self.balance == "steps":  # topology="auto" may have resolved to two_tier
            return steps_balance_problem(fit.hetero, fit.topology or "flat")
        return None

    def bind(self, context: SyncContext) -> DiLoCoDriver:
        return DiLoCoDriver(self, context)


class DiLoCoDriver(SyncDriver):
    """One rank's running DiLoCo: the outer loop (:attr:`loop`, a :class:`~lightning_dist.sync.diloco.DiLoCoSync`) and
    the hooks the strategy calls (the module's docstring)."""

    def __init__(self, settings: DiLoCoSettings, context: SyncContext) -> None:
        """Made by every rank at set-up, in the same order (the outer loop's groups are collectives)."""
        self.settings, self.context = settings, context
        self.loop = DiLoCoSync.create(settings, context.topology, context.rank, context.world_size, context.algorithm,
                                      context.timeout)
        self.inner_counts: Optional[list[int]] = None  # balance="steps": each rank's inner steps per training step
        self.final_step: Optional[int] = None  # the step after which the final sync ran (None: not yet)
        self.ended = False  # end_of_fit ran (close() after a fault says the final sync was skipped)
        self._memory: Optional[dict[str, int]] = None  # the bytes it keeps, by device (fixed once attached)
        self.loop.attach(context.module)
        workers = self.loop.workers
        rank_zero_info(f"RingDDPStrategy: {settings.describe()} over {workers.count} workers "
                       f"({'hosts' if workers.local_size > 1 else 'ranks'}: {[list(r) for r in workers.ranks]})")

    @property
    def gradient_ranks(self) -> Sequence[Sequence[int]]:
        # a worker of one rank reduces nothing (the strategy turns DDP's synchronisation off, and the buffers'
        # broadcast: a host's ranks share theirs in before_forward)
        return self.loop.workers.ranks

    # -- every step ---------------------------------------------------------------------------------------------
    def meets(self, global_step: int) -> bool:
        return self.loop.meets(global_step)

    def before_batch(self, sizes: Sequence[int], micro: Optional[list[int]]) -> tuple[Optional[list[int]], bool]:
        self.loop.count_samples(sizes)  # each worker's samples weigh its pseudo-gradient
        if self.settings.balance != "steps":
            return micro, True
        counts = inner_steps(sizes)  # the share as inner steps of about the smallest share, alike on every rank
        if counts != self.inner_counts:
            self.inner_counts = counts
            rank_zero_info(f"RingDDPStrategy: DiLoCo(balance='steps'): inner steps per training step {counts} "
                           f"(shares {list(sizes)})")
        rank = self.context.rank
        return micro_batch_sizes(sizes[rank], count=counts[rank]), False

    def before_forward(self) -> None:
        self.loop.broadcast_buffers()

    def after_step(self, global_step: int) -> None:
        context = self.context
        if self.settings.inner_rate != "none":  # the rate this step ran at (Lightning steps a scheduler after it)
            self.loop.count_rate(inner_rate(context.optimizers))
        if self.settings.final_sync and context.ends_fit(global_step):
            self._final_sync_once(global_step, "the fit's last step")  # in place of the sync due after it, if any
        elif self.loop.due(global_step):
            with context.long_collective(f"DiLoCo's sync after global step {global_step}"):
                results = self.loop.sync_after(global_step, context.stats, self._tier(), agree=context.agree)
            self._warn_skips(results)

    def _final_sync_once(self, step: int, why: str) -> None:
        """Every worker meets once more (the settings' ``final_sync``): every rank then holds ``theta_global``."""
        if self.final_step is not None:
            return
        self.final_step = step
        syncs, context = self.report().syncs, self.context
        with context.long_collective(f"DiLoCo's final sync after global step {step}"):
            results = self.loop.final_sync(step, context.stats, self._tier(), context.agree)
        self._warn_skips(results)
        rank_zero_info(f"RingDDPStrategy: DiLoCo's final sync after global step {step} ({why}): "
                       f"{self.report().syncs - syncs} fragment(s) averaged; every rank holds theta_global")

    # -- validation -----------------------------------------------------------------------------------------------
    def validation(self, starting: bool) -> None:
        if not starting:
            self.loop.swap_back()
            return
        context = self.context
        if not context.fitting:
            return
        if self.settings.final_sync and context.stopping and not context.sanity_checking:  # the fit's last validation
            self._final_sync_once(context.global_step, "a stop every rank agreed on")
        if self.settings.validate != "worker":
            self.loop.swap_in_validated()

    # -- the end ----------------------------------------------------------------------------------------------------
    def end_of_fit(self) -> None:
        self.ended = True
        context = self.context
        if self.settings.final_sync:
            self._final_sync_once(context.global_step, "the fit ended")
        else:  # exchanges still in flight land: the fit's model holds every sync it started
            with context.long_collective("DiLoCo's exchanges in flight at the end of the fit"):
                results = self.loop.land_inflight(context.stats, self._tier(), context.agree)
            self._warn_skips(results)

    def _tier(self) -> str:
        topology = self.context.topology
        return "inter_host" if topology is not None and len(topology.hosts) > 1 else "intra_host"

    def _warn_skips(self, results: list[SyncResult]) -> None:
        """A skipped outer step is warned of, and NaNRecovery hears of it as of a skipped step."""
        for result in results:
            if not result.skipped:
                continue
            fragment = f" (fragment {result.fragment})" if self.settings.fragments > 1 else ""
            workers = result.bad_workers or "none of them alone (the sum overflowed)"
            rank_zero_warn(f"RingDDPStrategy: DiLoCo skipped the outer step{fragment} after global step {result.step}: "
                           f"a non-finite pseudo-gradient (workers {workers}); every worker restarts from theta_global")
            self.context.record_skip(result.step, f"non-finite pseudo-gradient on worker(s) {result.bad_workers} at "
                                                  f"the DiLoCo sync{fragment}: the outer step skipped on every worker")

    def close(self) -> None:
        context = self.context
        if self.settings.final_sync and self.final_step is None and not self.ended and context.fitting \
                and context.global_step > 0:
            warnings.warn(f"rank {context.rank}: the fit stopped on a fault (a peer gone, an error): DiLoCo's "
                          "final sync is skipped, and this rank keeps its own worker's parameters", stacklevel=2)
        self.loop.swap_back()  # a fault during validation: this rank's own parameters, as its checkpoint holds them
        self.loop.exchanges.close()  # the exchanges' thread
        destroy_groups(self.loop.groups)

    # -- checkpoints and reports ----------------------------------------------------------------------------------
    def state_dict(self, local: bool = False) -> dict[str, Any]:
        context, loop = self.context, self.loop
        if local and self.settings.final_sync and self.final_step is None:
            warnings.warn(f"rank {context.rank}: an emergency checkpoint (peers may be gone): DiLoCo's final sync is "
                          "skipped; it holds theta_global beside this worker's own parameters", stacklevel=2)
        leader = local or context.rank == loop.workers.leader  # a worker's ranks hold the same state
        worker = worker_state(context, loop.worker_tensors()) if leader else None
        # every worker's state to rank zero (exchanges in flight settled first), unless an emergency checkpoint's
        with contextlib.nullcontext() if local else context.long_collective("DiLoCo's state gathered for a checkpoint"):
            return sync_entry(loop, worker, context.rank, context.world_size,
                              None if local else context.exchange_group, local=local, identities=context.identities)

    def load_state_dict(self, state: Optional[dict[str, Any]]) -> Optional[list[Any]]:
        if state is None:
            rank_zero_warn("The checkpoint holds no DiLoCo state (written without sync=DiLoCo): theta_global starts "
                           "as the restored parameters, with no outer momentum.")
            return None
        context, loop = self.context, self.loop
        optimizers = restore_sync(loop, context.module, state, context.rank, context.world_size, context.identities)
        hetero = context.hetero
        if loop.lost_workers and hetero is not None:  # their samples since the last sync train again
            hetero.lost_workers = (loop.unsynced_from, list(loop.lost_workers))
            rank_zero_info(f"RingDDPStrategy: DiLoCo workers of old ranks {loop.lost_workers} were lost with their "
                           f"progress since global batch {loop.unsynced_from}: their samples since then train again "
                           "on the survivors")
        return optimizers  # this worker's own inner optimizer states

    def report(self) -> SyncReport:
        if self._memory is None:
            self._memory = self.loop.memory_by_device()
        return SyncReport(syncs=self.loop.outer_steps + self.loop.skipped, metrics=self.loop.metrics,
                          memory=self._memory,
                          validation={"sync/validated_global": float(self.settings.validate == "global"),
                                      "sync/validated_mean": float(self.settings.validate == "mean")})


def inner_rate(optimizers: Sequence[Any]) -> float:
    """The learning rate the inner optimizers stepped at: their parameter groups' ``lr`` weighted by the elements of
    each group (0 without one)."""
    total = weighted = 0.0
    for optimizer in optimizers:
        for group in getattr(optimizer, "param_groups", ()):
            lr, count = group.get("lr"), sum(p.numel() for p in group["params"])
            if isinstance(lr, torch.Tensor):
                lr = float(lr)
            if isinstance(lr, (int, float)) and count:
                total, weighted = total + count, weighted + float(lr) * count
    return weighted / total if total else 0.0


def steps_balance_problem(hetero: Any, topology: str) -> Optional[str]:
    """What ``DiLoCo(balance="steps")`` cannot do, or None: it needs heterogeneous batching (it measures each worker's
    speed and gives the shares the inner steps are cut from) and a worker of one rank (``flat``: the ranks of a host
    would have to run the same inner steps); caps per pass are the accumulation's, which this replaces."""
    if hetero is None:
        return ("sync=DiLoCo(balance='steps') runs more inner steps on a faster worker, from the speeds "
                "heterogeneous batching measures: pass hetero=HeteroBatching() (on the command line "
                "hetero=balanced), or use balance='batches'")
    if topology == "two_tier":
        return ("sync=DiLoCo(balance='steps') with topology='two_tier': a worker is then a host, whose ranks "
                "would have to run the same inner steps; use topology='flat' (a worker per rank) or "
                "balance='batches'")
    if hetero.memory_caps is not None or hetero.max_batch_size is not None or hetero.accumulate not in ("auto", "off"):
        return ("sync=DiLoCo(balance='steps') cuts each share into inner steps of about the smallest share; "
                "HeteroBatching's memory_caps, max_batch_size and accumulate counts do not apply: drop them, "
                "or use balance='batches'")
    return None


# -- checkpoints ------------------------------------------------------------------------------------------------------
def worker_state(context: SyncContext, worker_tensors: Optional[dict[str, torch.Tensor]] = None) -> dict[str, Any]:
    """A rank's (so its DiLoCo worker's) parameters, buffers and inner optimizer states, as Lightning saves rank
    zero's; ``worker_tensors``: its own parameters and buffers by name while the global model is swapped in for
    validation (:meth:`DiLoCoSync.worker_tensors`)."""
    module = context.module.state_dict()
    return {"module": {k: worker_tensors.get(k, v) for k, v in module.items()} if worker_tensors else module,
            "optimizers": context.optimizer_states()}


def sync_entry(diloco: DiLoCoSync, worker_state: Optional[dict[str, Any]], rank: int, world_size: int,
               group: Optional[dist.ProcessGroup], local: bool = False,
               identities: Optional[list[str]] = None) -> dict[str, Any]:
    """DiLoCo's part of the checkpoint (under ``"lightning_dist"``, key ``"sync"``): what every rank holds alike
    (``theta_global``, the outer momentum, the averaged buffers, the reduced sums of exchanges in flight), and per rank
    its compressors' state and, from a worker's first rank, the worker's own parameters, inner optimizer state and
    parameters at the start of each exchange in flight (``worker_state``): mid-cycle, the workers differ, and
    Lightning saves rank zero's alone. A collective on ``group`` (every rank's part goes to rank zero), unless
    ``local`` (an emergency checkpoint: this rank's part only, and exchanges in flight are not waited for). In an
    elastic run ``identities`` (every rank's node identity) let a restart at another size find each survivor's own
    worker (:func:`restore_sync`)."""
    state = diloco.state_dict(settle=not local)  # first: what is in flight is settled (or dropped) here
    if worker_state is not None:
        worker_state = {**worker_state, "inflight": diloco.inflight_snapshots()}
    ranks = gather_to_rank_zero({"rank": diloco.rank_state(), "worker": worker_state}, rank, world_size, group, local)
    return {"state": state, "world_size": world_size, "ranks": ranks, "identities": identities}


def restore_sync(diloco: DiLoCoSync, module: Any, entry: dict[str, Any], rank: int, world_size: int,
                 identities: Optional[list[str]] = None) -> Optional[list[Any]]:
    """This rank's DiLoCo state from :func:`sync_entry`'s output, once the sync is bound: ``theta_global`` and the
    outer momentum, this rank's compressor state and its worker's own parameters; returns the worker's inner
    optimizer states for Lightning to load (None: they are not in the checkpoint, and the worker restarts from
    ``theta_global``, losing its progress since the last sync, with a warning).

    In an elastic run (``identities`` given, and saved in the entry) a worker of one rank takes the state of the old
    rank with its node identity at any world size: a survivor goes on from the inner state it reached, and a newcomer
    starts from ``theta_global`` (silently: it had no progress to lose)."""
    diloco.load_state_dict(entry["state"])
    ranks = entry["ranks"]
    same = entry["world_size"] == world_size and entry["state"]["workers"] == diloco.workers.count
    source: Optional[int] = rank if same else None  # the old rank whose entry is this rank's
    mapped = identities is not None and entry.get("identities") and diloco.workers.local_size == 1
    if mapped:
        source = map_ranks(entry["identities"], identities)[rank]
    if source is not None and ranks[source] is not None:
        diloco.load_rank_state(_rank_part(ranks[source]))
    else:
        first = next((r for r in ranks if r is not None), None)
        diloco.load_rank_state(_rank_part(first), shared_only=True)
    # this rank's own entry (an emergency checkpoint's, or its old rank's), else its worker's first rank's
    candidates = (source,) if mapped else ((rank, diloco.workers.leader) if same else ())
    found = [ranks[r]["worker"] for r in candidates if r is not None and ranks[r] is not None]
    worker = next((w for w in found if w is not None), None)
    if mapped:  # the old ranks whose workers are gone with their progress since the last sync
        new = set(identities or ())
        diloco.lost_workers = [r for r, identity in enumerate(entry["identities"])
                               if identity not in new or ranks[r] is None or ranks[r].get("worker") is None]
    if worker is None and mapped and source is None:  # a newcomer: theta_global is where it starts
        diloco.restart_from_global()
        return None
    if worker is None:
        warnings.warn(f"rank {rank}: the checkpoint holds no parameters of this rank's DiLoCo worker (written by "
                      f"{entry['world_size']} ranks, or an emergency checkpoint of another rank): it restarts from "
                      "theta_global, and its inner progress since the last sync is lost", stacklevel=3)
        diloco.restart_from_global()
        return None
    module.load_state_dict(worker["module"])
    diloco.load_inflight_snapshots(worker.get("inflight"))
    return worker["optimizers"]


def _rank_part(saved: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """A rank's entry's own part (:meth:`DiLoCoSync.rank_state`); a checkpoint written before fragments held the one
    compressor's state under ``"compressor"``."""
    if saved is None:
        return None
    return saved["rank"] if "rank" in saved else {"compressors": [saved["compressor"]], "finite": []}
