"""The sync driver: what a way of syncing the workers does around Lightning's optimizer step.

``RingDDPStrategy(sync=...)`` takes any :class:`SyncDriver`. The strategy calls the hooks below at fixed points and
knows no way of syncing by name; :class:`EveryStep` (every hook a no-op: DDP's gradient all-reduce of every step,
through the strategy's comm hook) is what it drives without one, and :class:`~lightning_dist.sync.DiLoCo` is the
first driver with hooks of its own. A driver's life, in the order the strategy calls it:

1. **Before any process starts** (``RingDDPStrategy.__init__``, in the launching process): :meth:`SyncDriver.check`
   refuses combinations that cannot work, naming the fix; :meth:`SyncDriver.describe` is its one-line summary.
2. **Set-up** (every rank, once DDP has wrapped the model, so every rank holds the same parameters):
   :meth:`SyncDriver.bind` with a :class:`SyncContext` makes the driver's groups, takes the module, applies a
   resumed checkpoint's entry, and returns the driver that receives every later hook (``self``, or an object holding
   the fit's running state). Its :attr:`SyncDriver.gradient_ranks` tells the strategy how the comm hook reduces:
   None, over every rank (the strategy's own groups, flat or two_tier); else the ranks of this rank's worker (the
   driver has turned DDP's synchronisation off where a worker is one rank); a rank's share of the step's gradient
   is then taken among its worker's ranks. Then :meth:`SyncDriver.setup` with the trainer.
3. **Every training step**: :meth:`SyncDriver.meets` (whether the workers meet in the step: features that need
   every rank's values exchange on those steps), :meth:`SyncDriver.before_batch` (heterogeneous batching's plan of the
   batch: its sizes and micro-batches), :meth:`SyncDriver.before_forward`, :meth:`SyncDriver.verdict_group` (where
   NaNRecovery's step-or-skip is agreed), :meth:`SyncDriver.optimizer_step` (around the optimizer's own step) and
   :meth:`SyncDriver.after_step` after every optimizer step, taken or skipped (Lightning counts both);
   :func:`ends_fit` says whether that step is the fit's last by its limits (``max_steps``, ``max_epochs``), the same
   on every rank.
4. **Validation**: :meth:`SyncDriver.before_validation` and :meth:`SyncDriver.after_validation` (Lightning's
   ``on_validation_start`` and ``on_validation_end``, on every rank: e.g. DiLoCo validates ``theta_global``).
5. **The end**: :meth:`SyncDriver.end_of_fit` (``on_train_end``, after the fit's last validation: what is in flight
   lands, on every rank together), :meth:`SyncDriver.close` (teardown, also after a fault: never waits for a peer).
6. **Checkpoints**: :meth:`SyncDriver.checkpoint_entry` (saved under ``checkpoint["lightning_dist"]["sync"]``),
   restored through :attr:`SyncContext.checkpoint` at the next bind, and :meth:`SyncDriver.restore_optimizers` (a
   driver whose workers hold optimizer states of their own hands Lightning this rank's).
7. **Reports**: :attr:`SyncDriver.metrics` (logged by DistMetrics whenever :attr:`SyncDriver.syncs` changes),
   :meth:`SyncDriver.memory_bytes` (MemoryMonitor's estimate).

Every hook runs on every rank, in the same order: a driver that runs a collective in a hook runs it on every rank.
docs/contributing/feature-seam.md has a worked example (averaging parameters every H steps).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from types import MappingProxyType
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from lightning_dist.comm import CommStats
from lightning_dist.comm.topology import Topology


@dataclass
class SyncContext:
    """What the strategy hands a driver at set-up (:meth:`SyncDriver.bind`)."""

    strategy: Any  # the RingDDPStrategy (a Lightning DDPStrategy: ranks, optimizers, lightning_module, features)
    ddp: torch.nn.parallel.DistributedDataParallel  # the wrapped model; ``ddp.module`` is the user's module
    topology: Optional[Topology]  # flat or two_tier and the ranks of each host; None with one rank
    algorithm: str  # the strategy's all-reduce algorithm (ring, tree, native, auto)
    timeout: Optional[timedelta]  # the strategy's collective timeout, for the driver's own groups
    stats: CommStats  # the strategy's step statistics: record a sync's bytes here and the step's dist/* show them
    guard: Any  # the strategy's StepGuard (NaNRecovery's step-or-skip mechanism; ``armed`` when in use)
    hetero: Any  # the strategy's HeteroBatching, or None
    checkpoint: Optional[dict[str, Any]]  # a resumed checkpoint's ``"lightning_dist"`` entry ({}: none), else None
    record_skip: Callable[[int, str], None]  # tell NaNRecovery a sync was skipped: (global step, reason)
    share: Callable[[], float]  # this rank's share of the step's samples (its gradient is weighted by it), live
    # new groups (a collective: every rank, in the same order) that reduce a flat bucket over every rank as the comm
    # hook does: a strategy.tiers.GradientGroups (``tiers``: two_tier's dense-inside-the-host reduction, else ``group``)
    reduction: Callable[[], Any]

    @property
    def rank(self) -> int:
        return self.strategy.global_rank

    @property
    def world_size(self) -> int:
        return self.strategy.world_size

    @property
    def module(self) -> torch.nn.Module:
        return self.ddp.module

    @property
    def exchange_group(self) -> Optional[dist.ProcessGroup]:
        """The strategy's gloo group of every rank (CPU tensors), while it exists (None after teardown: the default
        group then, as a checkpoint saved after ``fit`` needs)."""
        return self.strategy.features.exchange_group


class SyncDriver:
    """A way of syncing the workers (the module's docstring gives the order of the hooks). Every hook's default does
    what syncing every step needs: nothing."""

    name = "sync"  # a short name for logs and checkpoints

    # -- before any process starts ----------------------------------------------------------------------------
    def describe(self) -> str:
        """The settings in one line (logs, the run's summary, matching a checkpoint's state)."""
        return type(self).__name__

    def check(self, *, compressor: Any, hetero: Any, topology: str) -> None:
        """Raise ``ValueError`` naming the fix when the strategy's ``compressor`` (a Compressor), ``hetero`` (a
        HeteroBatching or None) or requested ``topology`` (``"auto"``, ``"flat"``, ``"two_tier"``) cannot work with
        this way of syncing."""

    # -- set-up -------------------------------------------------------------------------------------------------
    def bind(self, context: SyncContext) -> SyncDriver:
        """Attach to a fit (every rank, in the same order: groups made here are made alike); returns the driver that
        receives the later hooks."""
        return self

    @property
    def gradient_ranks(self) -> Optional[Sequence[Sequence[int]]]:
        """How the comm hook reduces each gradient bucket: None over every rank; else the ranks of every worker (each
        rank's hook then reduces over its own worker's ranks only, and a rank's share of the step's gradient, under
        heterogeneous batching, is its samples over its worker's)."""
        return None

    def setup(self, trainer: Any) -> None:
        """After Lightning's set-up of the fit (the trainer's loops exist)."""

    # -- every step ---------------------------------------------------------------------------------------------
    def meets(self, global_step: int) -> bool:
        """Whether the workers meet on the training loop's thread in the optimizer step that makes ``global_step`` (a
        sync runs in it), the same answer on every rank: where a collective of every rank costs no wait of its own.
        Features that need every rank's values exchange on these steps at their defaults (FaultTolerance's stop
        requests, MemoryMonitor's readings: ``RingFeatures.workers_meet``). Default: every step."""
        return True

    def before_batch(self, sizes: Sequence[int], micro: Optional[list[int]]) -> tuple[Optional[list[int]], bool]:
        """Heterogeneous batching's plan of a batch: every rank's ``sizes`` and this rank's ``micro``-batches (None:
        one pass). Returns the passes this rank runs and whether they accumulate into one optimizer step (``False``:
        each pass is an optimizer step of its own, an *inner step*)."""
        return micro, True

    def before_forward(self) -> None:
        """Before each training step's forward pass."""

    def verdict_group(self) -> Optional[tuple[Optional[dist.ProcessGroup], int, int]]:
        """``(group, rank, size)`` in which NaNRecovery's step-or-skip verdict is agreed (None: every rank, on the
        strategy's exchange group); called once backward is done."""
        return None

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any],
                       step: Callable[[Callable[[], Any]], Any]) -> Any:
        """The optimizer's step: ``step(closure)`` is Lightning's (the precision plugin's ``optimizer.step(closure)``;
        the closure runs the training step and backward first, unless they ran already: then it returns their
        result). A driver that updates the parameters another way (compressed momentum) runs ``closure()`` itself
        instead, and returns its result. Not called for a step every rank skips."""
        return step(closure)

    def after_step(self, global_step: int) -> None:
        """After every optimizer step, taken or skipped; ``global_step`` counts it."""

    # -- validation -------------------------------------------------------------------------------------------------
    def before_validation(self) -> None:
        """Before a validation loop (the sanity check's too; every rank: a collective may run). In a fit that a callback
        stopped (``trainer.should_stop``) this is the fit's last one, before ``end_of_fit``."""

    def after_validation(self) -> None:
        """After a validation loop, once the callbacks' ``on_validation_end`` ran (a checkpoint may have been saved)."""

    # -- the end ------------------------------------------------------------------------------------------------
    def end_of_fit(self) -> None:
        """The fit ended normally, after its last validation (every rank calls this: a collective may run)."""

    def close(self) -> None:
        """Teardown, also after a fault: release threads and state; never wait for a peer."""

    # -- checkpoints --------------------------------------------------------------------------------------------
    def checkpoint_entry(self, local: bool = False) -> Optional[dict[str, Any]]:
        """What a checkpoint keeps of this driver (rank zero writes the value; None: nothing). Every rank calls it
        alike, so it may gather from every rank, unless ``local``: an emergency checkpoint, written by one rank
        while its peers may be gone (no collective)."""
        return None

    def restore_optimizers(self, checkpoint: dict[str, Any]) -> dict[str, Any]:
        """The checkpoint whose ``optimizer_states`` Lightning loads into this rank's optimizers."""
        return checkpoint

    # -- reports ------------------------------------------------------------------------------------------------
    # The last sync's ``sync/*`` metrics (DistMetrics logs them when :attr:`syncs` changes); a driver assigns its own.
    metrics: Mapping[str, float] = MappingProxyType({})

    @property
    def syncs(self) -> int:
        """Syncs so far this fit (taken or skipped)."""
        return 0

    def memory_bytes(self) -> int:
        """Bytes the driver keeps beside the model and its optimizer (MemoryMonitor's estimate)."""
        return 0

    def memory_by_device(self) -> Optional[dict[str, int]]:
        """:meth:`memory_bytes` by device type (``"cpu"``, ``"cuda"``), where a driver keeps its state off the model's
        device (DiLoCo keeps it in host memory); None: all of it beside the model, on its device."""
        return None


def ends_fit(trainer: Any, global_step: int) -> bool:
    """Whether the optimizer step that made ``global_step`` is the fit's last by its limits, the same on every rank:
    ``max_steps`` reached, or the last batch of ``max_epochs``' last epoch (called from :meth:`SyncDriver.after_step`,
    before the fit's last validation and the checkpoints of its end). A stop a callback sets (``trainer.should_stop``:
    FaultTolerance's agreed stop, EarlyStopping) is known later: at :meth:`SyncDriver.before_validation`, or at
    :meth:`SyncDriver.end_of_fit` when no validation follows; so is ``max_time``."""
    if 0 < trainer.max_steps <= global_step:
        return True
    epochs, loop = trainer.max_epochs, trainer.fit_loop.epoch_loop
    if epochs is None or epochs < 0 or trainer.current_epoch + 1 < epochs:
        return False
    return loop.batch_progress.current.ready >= trainer.num_training_batches or loop.batch_progress.is_last_batch


class EveryStep(SyncDriver):
    """Syncing every step: DDP's gradient all-reduce through the strategy's comm hook (``sync=None`` or
    ``"every_step"``, the default); every hook is the default's."""

    name = "every_step"

    def describe(self) -> str:
        return "every_step"
