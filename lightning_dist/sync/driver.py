"""The sync driver protocol: what a way of syncing the workers does around Lightning's optimizer step.

Two objects, as Lightning's ``Callback`` keeps the user's arguments apart from a fit's state:

- :class:`SyncSettings`, what the user passes (``RingDDPStrategy(sync=...)``): its :attr:`~SyncSettings.name`,
  :meth:`~SyncSettings.describe`, :meth:`~SyncSettings.check` (before any process starts), :meth:`~SyncSettings.refuses`
  (at the strategy's set-up, from the fit's settings: heterogeneous batching, accumulation, precision, clipping,
  manual optimization) and :meth:`~SyncSettings.bind`, which makes
- :class:`SyncDriver`, one rank's running driver, bound to one fit through a :class:`~lightning_dist.sync.context.
  SyncContext` (a narrow view of the fit: ranks, the module, groups, the trainer's step; never the strategy). The
  strategy calls its twelve hooks at fixed points and knows no way of syncing by name.

The bound driver's hooks, in the order the strategy calls them (every hook on every rank, in the same order: a hook may
run a collective):

1. :attr:`~SyncDriver.gradient_ranks` once bound: None, the comm hook reduces over every rank; else every worker's
   ranks. The strategy derives the rest: a rank's share of the step's gradient is taken among its worker's ranks, DDP's
   buffer broadcast is off, a worker of one rank turns DDP's synchronisation off, NaNRecovery's step-or-skip is agreed
   among the worker's ranks.
2. Every training step: :meth:`~SyncDriver.meets`, :meth:`~SyncDriver.before_batch` (heterogeneous batching),
   :meth:`~SyncDriver.before_forward` (whose ``False`` says that DDP reduces nothing in this step: the driver does, in
   its optimizer step), :meth:`~SyncDriver.optimizer_step`, :meth:`~SyncDriver.after_step`.
3. :meth:`~SyncDriver.validation` before (``starting=True``) and after each validation loop.
4. :meth:`~SyncDriver.end_of_fit`, :meth:`~SyncDriver.close`.
5. :meth:`~SyncDriver.state_dict` (checkpoints; a collective unless ``local``) and :meth:`~SyncDriver.load_state_dict`
   (a resume, once bound: it restores the driver in one call and hands back this rank's optimizer states where the
   workers hold their own).
6. :meth:`~SyncDriver.report`: syncs, the last sync's ``sync/*`` metrics (DistMetrics logs them), bytes kept by
   device (MemoryMonitor's estimate).

docs/contributing/feature-seam.md is the contract, with a worked example (averaging parameters every H steps).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, Sequence

if TYPE_CHECKING:
    from lightning_dist.sync.context import SyncContext


@dataclass(frozen=True)
class FitSettings:
    """What :meth:`SyncSettings.refuses` sees of a fit, at the strategy's set-up (every rank alike, before DDP wraps the
    model and before the driver binds)."""

    hetero: Any  # the strategy's HeteroBatching, or None
    accumulation: int  # Trainer(accumulate_grad_batches=...): micro-batches per optimizer step
    precision: str  # Trainer(precision=...): "32-true", "16-mixed", "bf16-mixed", ...
    gradient_clip_val: Optional[float]  # Trainer(gradient_clip_val=...), None or 0: no clipping
    manual_optimization: bool  # the LightningModule's automatic_optimization is False
    topology: Optional[str]  # what topology resolved to: "flat", "two_tier" (None with one rank)
    world_size: int


@dataclass(frozen=True)
class SyncReport:
    """What a bound driver reports (:meth:`SyncDriver.report`), read by DistMetrics and MemoryMonitor."""

    syncs: int = 0  # syncs so far this fit, taken or skipped: DistMetrics logs ``metrics`` whenever this changes
    metrics: Mapping[str, float] = field(default_factory=dict)  # the last sync's ``sync/*`` figures
    # bytes the driver keeps beside the model and its optimizer, by device type ("cpu", "cuda"): MemoryMonitor counts
    # those on the device it watches
    memory: Mapping[str, int] = field(default_factory=dict)
    validation: Mapping[str, float] = field(default_factory=dict)  # logged after every validation of a fit

    @property
    def memory_bytes(self) -> int:
        return sum(self.memory.values())


class SyncSettings:
    """A way of syncing the workers, as the user writes it: checked before any process starts, bound at set-up."""

    name = "sync"  # a short name for logs
    # whether the bound driver sets the comm hook's per-step compressor itself (SyncContext.set_compressor, as
    # sync="auto" does): a resume then restores the compressor's state once the driver restored its own
    chooses_compressor = False

    def describe(self) -> str:
        """The settings in one line (logs, the run's summary, matching a checkpoint's state)."""
        return type(self).__name__

    def check(self, *, compressor: Any, hetero: Any, topology: str) -> None:
        """Raise ``ValueError`` naming the fix when the strategy's ``compressor`` (a Compressor), ``hetero`` (a
        HeteroBatching or None) or requested ``topology`` (``"auto"``, ``"flat"``, ``"two_tier"``) cannot work with
        this way of syncing (``RingDDPStrategy.__init__``, in the launching process)."""

    def refuses(self, fit: FitSettings) -> Optional[str]:
        """What this way of syncing cannot do under the fit's settings (heterogeneous batching, accumulation, mixed
        precision, clipping, manual optimization), as a message naming the driver, the setting and the fix; None: it
        can. The strategy raises it on every rank at set-up, before DDP wraps the model."""
        return None

    def bind(self, context: SyncContext) -> SyncDriver:
        """Attach to a fit (every rank, in the same order: groups made here are made alike, once Lightning's set-up is
        done: DDP has wrapped the model, the optimizers exist); returns the driver that receives the later hooks."""
        return SyncDriver()


class SyncDriver:
    """One rank's driver, bound to one fit: twelve hooks (the module's docstring gives their order). Every default does
    what syncing every step needs: nothing."""

    @property
    def gradient_ranks(self) -> Optional[Sequence[Sequence[int]]]:
        """How the comm hook reduces each gradient bucket: None over every rank; else the ranks of every worker (each
        rank's hook reduces over its own worker's ranks only; a rank's share of the step's gradient is its samples
        over its worker's). Read once, after :meth:`SyncSettings.bind`."""
        return None

    def meets(self, global_step: int) -> bool:
        """Whether the workers meet on the training loop's thread in the optimizer step that makes ``global_step`` (a
        sync runs in it), the same answer on every rank: where a collective of every rank costs no wait of its own.
        Features that need every rank's values exchange on these steps at their defaults, and Lightning's SIGTERM
        broadcast runs only before them. Default: every step."""
        return True

    def before_batch(self, sizes: Sequence[int], micro: Optional[list[int]]) -> tuple[Optional[list[int]], bool]:
        """Heterogeneous batching's plan of a batch: every rank's ``sizes`` and this rank's ``micro``-batches (None:
        one pass). Returns the passes this rank runs and whether they accumulate into one optimizer step (``False``:
        each pass is an optimizer step of its own, an *inner step*)."""
        return micro, True

    def before_forward(self) -> Optional[bool]:
        """Before each training step's forward pass. ``False``: DDP reduces none of this step's gradients (the driver
        reduces them itself in :meth:`optimizer_step`); the strategy then turns DDP's synchronisation off for the step,
        checks each rank's gradients for NaNRecovery and agrees fp16 loss scaling's verdict itself. None or True: the
        comm hook reduces them (inside the worker's ranks)."""
        return None

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any],
                       step: Callable[..., Any]) -> Any:
        """The optimizer's step: ``step(closure)`` is Lightning's (the precision plugin's ``optimizer.step(closure)``;
        the closure runs the training step and backward first, unless they ran already: then it returns their
        result). A driver that updates the parameters its own way passes that update: ``step(closure, update)`` runs
        Lightning's path (the closure, ``on_before_optimizer_step``, clipping, fp16's unscale and inf check) and then
        ``update()`` in place of the optimizer's own step; the driver never touches the optimizer's ``step`` itself.
        Not called for a step every rank skips."""
        return step(closure)

    def after_step(self, global_step: int) -> None:
        """After every optimizer step, taken or skipped; ``global_step`` counts it."""

    def validation(self, starting: bool) -> None:
        """Before (``starting``) and after a validation loop (the sanity check's too; every rank: a collective may run;
        after: once the callbacks' ``on_validation_end`` ran, a checkpoint may have been saved). In a fit a callback
        stopped (``context.stopping``) the one before is the fit's last validation, before :meth:`end_of_fit`."""

    def end_of_fit(self) -> None:
        """The fit ended normally, after its last validation (every rank calls this: a collective may run)."""

    def close(self) -> None:
        """Teardown, also after a fault: release threads and state; never wait for a peer."""

    def state_dict(self, local: bool = False) -> Optional[dict[str, Any]]:
        """What a checkpoint keeps of this driver (under ``checkpoint["lightning_dist"]["sync"]``; rank zero writes the
        value; None: nothing). Every rank calls it alike, so it may gather from every rank, unless ``local``: an
        emergency checkpoint, written by one rank while its peers may be gone (no collective)."""
        return None

    def load_state_dict(self, state: Optional[dict[str, Any]]) -> Optional[list[Any]]:
        """A resume, once bound, before Lightning loads the optimizers' states: restore :meth:`state_dict`'s output
        (None: the checkpoint holds none). Returns this rank's optimizer states where the workers hold their own (the
        states Lightning then loads), None for the checkpoint's."""
        return None

    def report(self) -> SyncReport:
        """Syncs so far, the last sync's metrics, the bytes kept by device (cheap: read every step)."""
        return SyncReport()


class EveryStep(SyncSettings):
    """Syncing every step: DDP's gradient all-reduce through the strategy's comm hook (``sync=None`` or
    ``"every_step"``, the default); its driver's every hook is the default's."""

    name = "every_step"

    def describe(self) -> str:
        return "every_step"
