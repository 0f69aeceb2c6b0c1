"""What a sync driver sees of the fit it is bound to: :class:`SyncContext`, built by the strategy at set-up.

A narrow view, not the strategy: ranks, the module, the strategy's groups and statistics, a few callables into the
strategy's mechanisms (the share, NaNRecovery's record of a skipped sync, the stall watch around a long collective),
a helper to agree on flags across ranks, and what a driver reads of the trainer (its step, whether the fit stops),
each through a property. ``tests/test_sync_seam.py`` fails when a module of ``lightning_dist.sync`` reaches past it
(``.strategy``, a private attribute).
"""

from __future__ import annotations

import contextlib
from datetime import timedelta
from typing import Any, Callable, ContextManager, Optional, Sequence, Union

import torch
import torch.distributed as dist

from lightning_dist.comm import CommStats
from lightning_dist.comm.topology import Topology
from lightning_dist.upstream import can_stop_early, trainer_of


class SyncContext:
    """What the strategy hands a driver at :meth:`~lightning_dist.sync.SyncSettings.bind`.

    Args:
        rank: this rank.
        world_size: every rank of the fit.
        module: the user's LightningModule (the one DDP wraps: its parameters are the fit's).
        topology: flat or two_tier and the ranks of each host; None with one rank.
        algorithm: the strategy's all-reduce algorithm (ring, tree, native, auto).
        timeout: the strategy's collective timeout, for the driver's own groups.
        stats: the strategy's step statistics: record a sync's bytes here and the step's ``dist/*`` show them.
        hetero: the strategy's HeteroBatching, or None.
        find_unused: DDP's ``find_unused_parameters`` (parameters may go unused in a step).
        share: this rank's share of the step's samples (its gradient is weighted by it), live.
        reduction: new groups (a collective: every rank, in the same order) that reduce a flat bucket over every rank
            as the comm hook does (a ``strategy.tiers.GradientGroups``).
        record_skip: tell NaNRecovery a sync was skipped: ``(global step, reason)``.
        long_collective: wraps a collective of every rank that may take long (a stall watch waits while every rank is
            inside one).
        exchange_group: the strategy's gloo group of every rank, while it exists (None after teardown).
        identities: every rank's node identity in elastic runs, else None.
        optimizer_states: this rank's optimizers' states, as Lightning saves them.
        agreeing_scaler: the fp16 loss scaler made one that agrees across ranks (None without fp16 loss scaling).
        observe: ``(observer, True)`` tells a bucket observer (the comm hook's ``BucketObserver`` protocol) about every
            gradient bucket from now on, ``(observer, False)`` stops.
        compressor: the comm hook's per-step compressor, now.
        set_compressor: the comm hook's per-step compressor from the next bucket on (None: dense); the one it
            replaces keeps or drops what it staged in this step with the step's verdict, as the comm hook's does.
        regroup: the driver's :attr:`~lightning_dist.sync.SyncDriver.gradient_ranks` changed (a driver that hands the
            fit to another, as ``sync="auto"`` does): the strategy derives again what follows from them (the hook's
            groups, DDP's flags, the verdict's group). A collective: every rank, at the same point between steps.
    """

    def __init__(self, *, rank: int, world_size: int, module: torch.nn.Module, topology: Optional[Topology],
                 algorithm: str, timeout: Optional[timedelta], stats: CommStats, hetero: Any = None,
                 find_unused: bool = False, share: Callable[[], float] = lambda: 1.0,
                 reduction: Optional[Callable[[], Any]] = None,
                 record_skip: Callable[[int, str], None] = lambda step, reason: None,
                 long_collective: Optional[Callable[[str], ContextManager[Any]]] = None,
                 exchange_group: Callable[[], Optional[dist.ProcessGroup]] = lambda: None,
                 identities: Callable[[], Optional[list[str]]] = lambda: None,
                 optimizer_states: Callable[[], list[Any]] = list,
                 agreeing_scaler: Callable[[], Any] = lambda: None,
                 observe: Callable[[Any, bool], None] = lambda observer, on: None,
                 compressor: Callable[[], Any] = lambda: None,
                 set_compressor: Callable[[Any], None] = lambda compressor: None,
                 regroup: Callable[[], None] = lambda: None) -> None:
        self.rank, self.world_size, self.module = rank, world_size, module
        self.topology, self.algorithm, self.timeout, self.stats = topology, algorithm, timeout, stats
        self.hetero, self.find_unused, self.share, self.record_skip = hetero, find_unused, share, record_skip
        self.reduction = reduction
        self.optimizer_states, self.agreeing_scaler = optimizer_states, agreeing_scaler
        self.observe, self.compressor, self.set_compressor, self.regroup = observe, compressor, set_compressor, regroup
        self._long = long_collective
        self._exchange_group, self._identities = exchange_group, identities

    # -- the strategy's groups and elastic identities -------------------------------------------------------------
    @property
    def exchange_group(self) -> Optional[dist.ProcessGroup]:
        """The strategy's gloo group of every rank (CPU tensors), while it exists (None after teardown: the default
        group then, as a checkpoint saved after ``fit`` needs)."""
        return self._exchange_group()

    @property
    def identities(self) -> Optional[list[str]]:
        """Every rank's node identity, in rank order (elastic runs; None otherwise)."""
        return self._identities()

    def long_collective(self, what: str) -> ContextManager[Any]:
        """Wrap a collective of every rank that may take long (a sync: the model's bytes over the slowest links)."""
        return self._long(what) if self._long is not None else contextlib.nullcontext()

    def agree(self, flags: Union[bool, Sequence[bool]], group: Optional[dist.ProcessGroup] = None
              ) -> Union[bool, list[bool]]:
        """Whether any rank of ``group`` (default: :attr:`exchange_group`, every rank) raised the flag, for one flag or
        a list of them: one all-reduce (MAX) of the flags, the same answer on every rank. Every rank of the group must
        call it. Without peers it returns the flags as they are."""
        if self.world_size == 1:
            return flags if isinstance(flags, bool) else list(flags)
        return agree_flags(flags, group if group is not None else self.exchange_group)

    # -- the trainer, as a driver reads it ------------------------------------------------------------------------
    @property
    def _trainer(self) -> Any:
        return trainer_of(self.module)

    @property
    def fitting(self) -> bool:
        """Whether a fit is running (validation, a test or a checkpoint after the fit are not)."""
        trainer = self._trainer
        return trainer is not None and trainer.state.fn == "fit"

    @property
    def global_step(self) -> int:
        """The trainer's optimizer steps so far (0 without a trainer)."""
        trainer = self._trainer
        return trainer.global_step if trainer is not None else 0

    @property
    def sanity_checking(self) -> bool:
        trainer = self._trainer
        return trainer is not None and trainer.sanity_checking

    @property
    def stopping(self) -> bool:
        """Whether a callback stopped the fit (``trainer.should_stop``: FaultTolerance's agreed stop, EarlyStopping)
        and the fit loop stops there (past ``min_steps``/``min_epochs``); the same on every rank."""
        trainer = self._trainer
        return trainer is not None and trainer.should_stop and can_stop_early(trainer)

    @property
    def estimated_steps(self) -> float:
        """The fit's optimizer steps as the trainer estimates them (``inf`` when it cannot know)."""
        return self._trainer.estimated_stepping_batches

    @property
    def optimizers(self) -> list[Any]:
        """This rank's optimizers (after Lightning's set-up)."""
        trainer = self._trainer
        return list(trainer.optimizers) if trainer is not None else []

    def ends_fit(self, global_step: int) -> bool:
        """Whether the optimizer step that made ``global_step`` is the fit's last by its limits, the same on every
        rank: ``max_steps`` reached, or the last batch of ``max_epochs``' last epoch (called from
        :meth:`~lightning_dist.sync.SyncDriver.after_step`, before the fit's last validation and the checkpoints of its
        end). A stop a callback sets is known later (:attr:`stopping`, at the last validation or the end of the fit);
        so is ``max_time``."""
        trainer = self._trainer
        if 0 < trainer.max_steps <= global_step:
            return True
        epochs, loop = trainer.max_epochs, trainer.fit_loop.epoch_loop
        if epochs is None or epochs < 0 or trainer.current_epoch + 1 < epochs:
            return False
        return loop.batch_progress.current.ready >= trainer.num_training_batches or loop.batch_progress.is_last_batch


def agree_flags(flags: Union[bool, Sequence[bool]], group: Optional[dist.ProcessGroup]) -> Union[bool, list[bool]]:
    """Whether any rank of ``group`` raised each flag: one all-reduce (MAX) of them, the same answer on every rank of
    the group, each of which must call it (without a process group: the flags as they are). The one way the sync seam
    agrees on a flag (:meth:`SyncContext.agree`, NaNRecovery's verdict among a worker's ranks)."""
    one = isinstance(flags, bool)
    values = torch.tensor([flags] if one else list(flags), dtype=torch.uint8)
    if dist.is_initialized():
        dist.all_reduce(values, op=dist.ReduceOp.MAX, group=group)
    agreed = [bool(v) for v in values.tolist()]
    return agreed[0] if one else agreed
