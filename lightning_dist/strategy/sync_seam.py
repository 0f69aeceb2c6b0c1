"""The strategy's side of the sync driver protocol (:mod:`lightning_dist.sync.driver`): what follows from a driver's
answers, derived here once rather than asked of every driver.

- **Refusals**: the settings' :meth:`~lightning_dist.sync.SyncSettings.refuses` read against the fit's settings at
  set-up, raised on every rank before DDP wraps the model.
- **From** :attr:`~lightning_dist.sync.SyncDriver.gradient_ranks` (the workers): a rank's share of the gradient taken
  among its worker's ranks (the strategy's hetero share), DDP's buffer broadcast off, DDP's synchronisation off for a
  worker of one rank, NaNRecovery's step-or-skip agreed among the worker's ranks (a gloo group of theirs), and
  Lightning's SIGTERM broadcast run only before the steps where the workers meet.
- **From** :meth:`~lightning_dist.sync.SyncDriver.before_forward`'s ``False`` (DDP reduces nothing in the step: the
  driver does): DDP's synchronisation off for the step, each rank's gradients checked for NaNRecovery and the flag
  agreed among the worker's ranks, fp16 loss scaling's verdict agreed among them.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from lightning_dist.comm import destroy_groups
from lightning_dist.comm.topology import Topology
from lightning_dist.hetero import HeteroBatching
from lightning_dist.loss_scaler import LossScaler
from lightning_dist.strategy.skip import StepGuard, StepVerdict
from lightning_dist.sync import EveryStep, FitSettings, SyncContext, SyncDriver, SyncSettings
from lightning_dist.sync.context import agree_flags
from lightning_dist.upstream import wrap_sigterm_broadcast


class SyncSeam:
    """The sync settings of a strategy and the driver bound to its fit, with what the strategy derives from them."""

    def __init__(self, settings: Optional[SyncSettings], guard: StepGuard) -> None:
        self.settings = settings  # None: every step
        self.guard = guard  # the strategy's step-or-skip (NaNRecovery arms it)
        self.driver: SyncDriver = SyncDriver()  # the driver of this fit, bound at set-up (every step's until then)
        self.worker: Optional[list[int]] = None  # the ranks of this rank's worker, where the driver has workers
        self.worker_group: Optional[dist.ProcessGroup] = None  # gloo, the worker's ranks (a worker of several)
        self.bypassed = False  # the driver said DDP reduces nothing in the step under way (before_forward)
        self._broadcast_buffers = True  # DDP's own setting, restored when a driver's workers give way to every rank

    @property
    def reduces(self) -> bool:
        """Whether DDP reduces this step's gradients through the comm hook (False: a worker of one rank, or a step
        whose gradients the driver reduces itself)."""
        return not self.bypassed and (self.worker is None or len(self.worker) > 1)

    def refuse(self, trainer: Any, hetero: Optional[HeteroBatching], topology: Optional[Topology],
               world_size: int) -> None:
        """Raise what the settings declare they cannot do under the fit's settings (every rank alike)."""
        if self.settings is None:
            return
        fit = FitSettings(hetero=hetero, accumulation=int(trainer.accumulate_grad_batches),
                          precision=str(trainer.precision), gradient_clip_val=trainer.gradient_clip_val,
                          manual_optimization=not trainer.lightning_module.automatic_optimization,
                          topology=topology.kind if topology is not None else None, world_size=world_size)
        problem = self.settings.refuses(fit)
        if problem:
            raise ValueError(problem)

    def bind(self, context: SyncContext, ddp: torch.nn.parallel.DistributedDataParallel, trainer: Any,
             timeout: Any) -> Optional[Sequence[Sequence[int]]]:
        """Bind the settings to this fit (every rank, in the same order) and derive what the workers imply; returns
        them (None: every rank)."""
        self.driver = (self.settings or EveryStep()).bind(context)
        self._broadcast_buffers = ddp.broadcast_buffers
        self.worker_group = None
        workers = self.derive(context.rank, ddp, timeout)
        if self.settings is not None:  # a collective of every rank before every batch: only where the workers meet
            driver = self.driver

            def only_when_workers_meet(broadcast: Any) -> Any:
                def broadcast_if_meeting() -> None:
                    if driver.meets(trainer.global_step + 1):
                        broadcast()

                return broadcast_if_meeting

            wrap_sigterm_broadcast(trainer, only_when_workers_meet)
        return workers

    def derive(self, rank: int, ddp: torch.nn.parallel.DistributedDataParallel, timeout: Any
               ) -> Optional[Sequence[Sequence[int]]]:
        """What the driver's workers imply (at bind, and again when the driver's workers change between steps:
        ``SyncContext.regroup``): this rank's worker, DDP's flags, the verdict's group; returns the workers."""
        self.bypassed = False
        workers = self.driver.gradient_ranks
        self.worker = None if workers is None else next(list(w) for w in workers if rank in w)
        if self.worker_group is not None:
            destroy_groups([self.worker_group])
            self.worker_group = None
        ddp.broadcast_buffers = self._broadcast_buffers if workers is None else False
        ddp.require_backward_grad_sync = workers is None or len(self.worker) > 1
        if workers is not None:  # each worker keeps its own buffers (DDP would broadcast rank zero's every forward)
            # a worker of one rank reduces nothing: DDP's synchronisation is off (above) for as long as it holds
            if any(len(w) > 1 for w in workers):  # NaNRecovery's verdict agreed inside a worker (every rank makes it)
                self.worker_group = dist.new_subgroups_by_enumeration([list(w) for w in workers], timeout=timeout,
                                                                      backend="gloo")[0]
        return workers

    def before_forward(self, ddp: torch.nn.parallel.DistributedDataParallel) -> None:
        # (when DDP reduces, its flag stays Lightning's: under accumulate_grad_batches its no_sync window turns it off
        # for the window's earlier micro-batches)
        self.bypassed = self.driver.before_forward() is False
        if self.bypassed:
            ddp.require_backward_grad_sync = False

    def group(self, exchange_group: Optional[dist.ProcessGroup], rank: int,
              world_size: int) -> tuple[Optional[dist.ProcessGroup], int, int]:
        """The group, rank and size of this rank's worker (every rank when the driver has no workers)."""
        if self.worker is None:
            return exchange_group, rank, world_size
        if len(self.worker) == 1:
            return None, 0, 1
        return self.worker_group, self.worker.index(rank), len(self.worker)

    def agree_scaler(self, optimizer: Any, scaler: Any, exchange_group: Optional[dist.ProcessGroup], rank: int,
                     world_size: int) -> None:
        """After backward of a step whose gradients DDP did not reduce: fp16 loss scaling's verdict made every rank's
        of the worker (a rank that skips the step while its peers enter the driver's collectives would hang them)."""
        group, _, size = self.group(exchange_group, rank, world_size)
        if self.bypassed and size > 1 and isinstance(scaler, LossScaler):
            scaler.agree(optimizer, group)

    def record_skip(self, step: int, reason: str) -> None:
        """A sync the driver skipped: NaNRecovery hears of it as of a skipped step."""
        if self.guard.armed:
            self.guard.record(StepVerdict(step=step, skipped=True, reason=reason))

    def verdict_group(self, module: torch.nn.Module, scaler: Any,
                      exchange_group: Optional[dist.ProcessGroup], rank: int,
                      world_size: int) -> tuple[Optional[dist.ProcessGroup], int, int]:
        """Where NaNRecovery's step-or-skip is agreed: the worker's ranks. Gradients DDP did not reduce carried no
        sentinel through the comm hook: each is checked here, and the flag agreed among the worker's ranks (one
        all-reduce), unless fp16 loss scaling's agreed verdict decides."""
        group, index, size, guard = *self.group(exchange_group, rank, world_size), self.guard
        if self.reduces or (self.bypassed and size > 1 and isinstance(scaler, LossScaler)):
            return group, index, size
        sentinels = []
        for p in module.parameters():
            if p.grad is not None and p.grad.numel():
                flat = p.grad.view(-1)
                guard.check_local(flat)  # NaN in the first element when not finite; who saw it, for the message
                sentinels.append(flat[:1].float())
        # one read of every parameter's sentinel (on a GPU: one synchronisation)
        bad = bool((~torch.isfinite(torch.cat(sentinels))).any()) if sentinels else False
        if size > 1 and world_size > 1:
            bad = agree_flags(bad, group)
        guard.check_reduced(torch.full((1,), math.nan if bad else 0.0))
        return group, index, size


def agreeing_scaler(plugin: Any) -> Optional[LossScaler]:
    """The precision plugin's fp16 loss scaler, made one that can agree across ranks: torch's GradScaler swapped for a
    LossScaler that behaves as it does (:meth:`LossScaler.plain`); None without fp16 loss scaling."""
    scaler = getattr(plugin, "scaler", None)
    if isinstance(scaler, torch.amp.GradScaler) and scaler.is_enabled() and not isinstance(scaler, LossScaler):
        plugin.scaler = scaler = LossScaler.plain(scaler)
    return scaler if isinstance(scaler, LossScaler) else None
