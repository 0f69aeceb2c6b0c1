"""The one seam between :class:`~lightning_dist.strategy.RingDDPStrategy` and the features built on it.

Callbacks, experiments, benchmarks and tests read and ask the strategy only through :class:`RingFeatures`, found
with :func:`features_of`; under any other strategy :func:`features_of` returns ``None``, and that is the one
place a feature finds out (as Lightning's callbacks reach the accelerator through typed attributes, never
``getattr`` on private names).

What a feature may use:

- **the step counter** :attr:`RingFeatures.step`: optimizer steps (taken or skipped) since this fit started,
  the same on every rank; :attr:`RingFeatures.exchange_step` is the value it had during the step whose
  exchange completed last;
- **the per-step exchange** (:class:`~lightning_dist.strategy.exchange.StepExchange`): register named slots,
  fill them, read every rank's values; ask for an interval with :meth:`RingFeatures.request_exchange` (or for the
  steps where the workers meet: :meth:`RingFeatures.workers_meet`), test :meth:`RingFeatures.exchange_due_for`;
  :attr:`RingFeatures.exchange_group` is the strategy's gloo group, for a feature's own rare collective (CPU tensors
  on every backend);
- **measurements**: :attr:`RingFeatures.last_step` (this rank's own last step), :attr:`RingFeatures.step_metrics`
  (every rank's, from the last exchange, identical on every rank), :attr:`RingFeatures.totals` (this rank's
  over the fit), :meth:`RingFeatures.backward_window` (when backward handed over its last bucket and when the
  last reduction finished);
- **the buckets** (:meth:`RingFeatures.add_bucket_observer`): a :class:`~lightning_dist.strategy.hook.BucketObserver`
  is told when DDP hands the comm hook each gradient bucket (with its gradient) and when its reduction is done
  (``lightning-dist-advise`` times the buckets and replays them this way); none registered, the hook pays nothing;
- **long collectives**: the strategy and its sync driver wrap one (DiLoCo's sync) in
  :meth:`RingFeatures.long_collective`; a feature that watches for stalls sets :attr:`RingFeatures.collective_guard`
  (FaultTolerance: its watchdog waits while every rank is inside one);
- **mechanisms a policy drives**: :attr:`RingFeatures.step_guard` (step-or-skip, armed by NaNRecovery),
  :attr:`RingFeatures.loss_scaler` (fp16 loss scaling), :attr:`RingFeatures.compressor` (its state, for
  snapshots) and :meth:`RingFeatures.local_checkpoint_state` (an emergency checkpoint's entry, no collective);
- **elastic runs**: :attr:`RingFeatures.identities`, every rank's node identity, which
  :class:`~lightning_dist.callbacks.ElasticTraining` sets at set-up; checkpoints then record it, and a restart at
  another world size maps each rank's state by it.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Optional

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy

from lightning_dist.comm.topology import Topology, state_layout
from lightning_dist.compression import Compressor
from lightning_dist.hetero import HeteroBatching
from lightning_dist.strategy.checkpoint import CHECKPOINT_KEY, local_entry
from lightning_dist.strategy.exchange import StepExchange
from lightning_dist.strategy.hook import BucketObserver, RingHookState
from lightning_dist.strategy.schedule import ExchangeSchedule
from lightning_dist.strategy.skip import StepGuard
from lightning_dist.strategy.step_meter import StepMeter
from lightning_dist.strategy.stepping import loss_scaler_of
from lightning_dist.sync.driver import SyncDriver


class RingFeatures:
    """What features may read and ask of a :class:`~lightning_dist.strategy.RingDDPStrategy` (its
    :attr:`~lightning_dist.strategy.RingDDPStrategy.features`)."""

    # The strategy is typed as Lightning's DDPStrategy, never as RingDDPStrategy: the seam sits below the strategy
    # that builds it (ring_ddp imports this module, so this one must not import ring_ddp).
    def __init__(self, strategy: DDPStrategy, meter: StepMeter, schedule: ExchangeSchedule, guard: StepGuard,
                 hook_state: RingHookState, hetero: Optional[HeteroBatching] = None) -> None:
        self._strategy = strategy  # for what only the running strategy knows: ranks, the precision plugin, topology
        self._meter, self._schedule, self._guard, self._hook_state = meter, schedule, guard, hook_state
        self._hetero = hetero
        self.identities: Optional[list[str]] = None  # every rank's node identity, in rank order (elastic runs)
        # sync=: the sync driver bound to the fit at set-up (its report and state), None when syncing every step
        self.sync: Optional[SyncDriver] = None
        # wraps a long collective (:meth:`long_collective`); set by a feature that watches for stalls (FaultTolerance)
        self.collective_guard: Optional[Callable[[str], ContextManager[Any]]] = None
        schedule.meets = self.workers_meet

    # -- the step counter -------------------------------------------------------------------------------------
    @property
    def step(self) -> int:
        """Optimizer steps (taken or skipped) since this fit started: the same count on every rank."""
        return self._meter.step

    @property
    def exchange_step(self) -> int:
        """:attr:`step` during the step whose exchange completed last (-1: none yet): a feature that filled its
        per-rank slots on step ``s`` reads them while this equals ``s``."""
        return self._meter.exchange_step

    # -- the per-step exchange --------------------------------------------------------------------------------
    @property
    def exchange(self) -> StepExchange:
        """The per-step exchange; register slots on it in a callback's ``setup`` or later (inside ``fit``)."""
        return self._schedule.exchange

    @property
    def exchange_group(self) -> Optional[dist.ProcessGroup]:
        """The strategy's own gloo group (CPU tensors on every backend; None with one rank)."""
        return self._schedule.group

    def request_exchange(self, every_n_steps: int, name: str, when_workers_meet: bool = False) -> None:
        """Carry every rank's per-rank slots to all ranks on every ``every_n_steps``-th optimizer step, for the
        feature ``name`` (0 withdraws the request). The same steps on every rank. ``when_workers_meet``: each interval's
        exchange waits for the interval's first step where the workers meet (:meth:`workers_meet`), so that a sync
        driver's workers are not held together between its syncs."""
        self._schedule.request(every_n_steps, name, when_workers_meet)

    def exchange_due(self, every_n_steps: int) -> bool:
        """Whether the coming (or current) optimizer step is one of ``every_n_steps``'s (the same on every rank)."""
        return self._schedule.due_every(every_n_steps, self.step)

    def exchange_due_for(self, name: str) -> bool:
        """Whether the coming (or current) optimizer step exchanges for feature ``name``'s request (the same on every
        rank; False without one)."""
        return self._schedule.due_for(name, self.step)

    def workers_meet(self) -> bool:
        """Whether the workers meet in the coming (or current) optimizer step: every step when syncing every step;
        under a sync driver, the steps it says (:meth:`~lightning_dist.sync.SyncDriver.meets`: DiLoCo's sync steps),
        where a collective of every rank costs no wait of its own. The same answer on every rank."""
        if self.sync is None:
            return True
        return self.sync.meets(self._strategy.lightning_module.trainer.global_step + 1)  # the step in progress: + 1

    # -- measurements -----------------------------------------------------------------------------------------
    @property
    def last_step(self) -> dict[str, float]:
        """This rank's own measurements of its last optimizer step (no collective involved)."""
        return self._meter.last_step

    @property
    def step_metrics(self) -> dict[str, float]:
        """Every rank's measurements (the ``dist/*`` metrics) of the step before :attr:`exchange_step`, identical
        on every rank; empty until an exchange carried a complete step."""
        return self._meter.step_metrics

    @property
    def totals(self) -> dict[str, float]:
        """This rank's running totals over the fit: steps, bytes sent, comm and exposed seconds, samples."""
        return self._meter.totals

    def backward_window(self) -> Optional[tuple[float, float]]:
        """During ``on_after_backward``: ``(handed, done)``, the ``perf_counter`` at which this backward pass
        handed over its last gradient bucket and at which the last bucket reduction finished; None when no bucket
        was handed over to the communication thread (``overlap=False``, or an accumulation pass)."""
        return self._hook_state.backward_window()

    # -- the buckets ------------------------------------------------------------------------------------------
    def add_bucket_observer(self, observer: BucketObserver) -> None:
        """Tell ``observer`` about every gradient bucket from now on: when the comm hook is handed it, with its
        gradient, and when its reduction is done (:class:`~lightning_dist.strategy.hook.BucketObserver`)."""
        if observer not in self._hook_state.observers:
            self._hook_state.observers.append(observer)

    def remove_bucket_observer(self, observer: BucketObserver) -> None:
        """Stop telling ``observer`` about buckets (nothing happens when it was not registered)."""
        if observer in self._hook_state.observers:
            self._hook_state.observers.remove(observer)

    # -- long collectives ------------------------------------------------------------------------------------
    def long_collective(self, what: str) -> ContextManager[Any]:
        """Wrap a collective every rank takes part in that may take long (a sync of the whole model over slow links),
        so that a stall watch (:attr:`collective_guard`) waits while every rank is inside it."""
        guard = self.collective_guard
        return guard(what) if guard is not None else contextlib.nullcontext()

    # -- mechanisms a policy drives ---------------------------------------------------------------------------
    @property
    def step_guard(self) -> StepGuard:
        """The step-or-skip mechanism; inactive until armed (NaNRecovery arms it)."""
        return self._guard

    @property
    def loss_scaler(self) -> Optional[torch.amp.GradScaler]:
        """The precision plugin's gradient scaler (fp16 mixed precision), or None."""
        return loss_scaler_of(self._strategy.precision_plugin)

    @property
    def compressor(self) -> Compressor:
        """The gradient compressor (state staged per step: committed after the optimizer stepped)."""
        return self._hook_state.compressor

    @property
    def hetero(self) -> Optional[HeteroBatching]:
        """The strategy's heterogeneous batching (its plan, sampler and hand-overs), None without one."""
        return self._hetero

    def local_checkpoint_state(self) -> dict[str, Any]:
        """The checkpoint entry :meth:`~lightning_dist.strategy.RingDDPStrategy.save_checkpoint` adds, with this
        rank's compressor state only and no collective (an emergency checkpoint, written while peers may be
        gone)."""
        strategy = self._strategy
        entry = local_entry(self._hook_state.compressor, strategy.global_rank, strategy.world_size, self.identities,
                            state_layout(self.topology))
        sync = self.sync.state_dict(local=True) if self.sync is not None else None
        if sync is not None:
            entry[CHECKPOINT_KEY]["sync"] = sync
        return entry

    @property
    def topology(self) -> Optional[Topology]:
        """How the gradients are reduced, resolved at set-up, the same on every rank: ``kind`` (``"flat"`` or
        ``"two_tier"``) and the ranks on each host; None with one rank."""
        return self._strategy.topology


def features_of(strategy: Any) -> Optional[RingFeatures]:
    """The strategy's feature seam, or None when it is not a :class:`~lightning_dist.strategy.RingDDPStrategy`:
    the one place a feature finds out which strategy it runs under."""
    # What identifies our strategy is the seam it exposes (a RingFeatures), so this module needs no import of the
    # strategy that builds it (ring_ddp imports this one).
    features = getattr(strategy, "features", None)
    return features if isinstance(features, RingFeatures) else None
