"""One optimizer step under RingDDPStrategy: the rank's share applied in autograd, then step or skip on every rank.

**The share.** A rank's gradient counts in the sum over ranks by its share of the step's samples (``1 / N``
with even batches, ``b_i / B`` under hetero batching). :func:`shared_backward` multiplies the gradient flowing
out of the loss by it, so the buckets arrive weighted and the comm hook saves a pass over each. The loss itself
(what callbacks and loggers see) is untouched, and the hook on it is removed right after backward. Only under
automatic optimization: there Lightning zeroes the gradients at the start of each accumulation window and runs
the window's other backward passes under ``no_sync``, so a bucket never holds already-reduced gradients, which
would then be summed again unweighted. Manual optimization may backward twice without ``zero_grad``; the comm
hook weights the whole bucket then, as stock DDP does.

Applying the share in autograd is exact wherever backward is homogeneous under a power-of-two scale: multiplying
the loss gradient by 1/2 then gives bit for bit half of every parameter gradient. PyTorch's CPU kernels are not
always so (an embedding's backward, the attention's input projection): there the result equals stock DDP's within
float rounding per step rather than bit for bit (``tests/test_strategy_ranks.py`` checks both).

**Step or skip.** With the step guard armed (:mod:`lightning_dist.strategy.skip`, armed by NaNRecovery) the same
hook turns a non-finite loss into a NaN gradient; after backward every rank reads the same verdict
(:func:`decide_step`) and either steps or skips (:func:`skip_step`) together, and the compressor commits or
discards its staged state.

**fp16 loss scaling.** The buckets then carry the loss scale: :func:`follow_loss_scale` tells a lossy
compressor the step's scale (residuals in scaled units follow it, thresholds apply to unscaled values), and the
scaler's own ``unscale_`` is the agreed finiteness check, so the hook's reduced sums are not needed.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist

from lightning_dist.loss_scaler import LossScaler
from lightning_dist.strategy.hook import RingHookState
from lightning_dist.strategy.skip import StepGuard, StepVerdict


def loss_scaler_of(precision_plugin: Any) -> Optional[torch.amp.GradScaler]:
    """The precision plugin's gradient scaler under fp16 mixed precision, or None."""
    scaler = getattr(precision_plugin, "scaler", None)  # only the mixed-precision plugins have one
    return scaler if isinstance(scaler, torch.amp.GradScaler) and scaler.is_enabled() else None


@contextlib.contextmanager
def shared_backward(loss: torch.Tensor, state: RingHookState, guard: StepGuard, automatic: bool) -> Iterator[None]:
    """Around one backward pass: the loss gradient multiplied by this rank's share (and, with the guard armed,
    by NaN when the loss is not finite)."""
    share = state.step_share() if automatic else 1.0
    handle = None
    if guard.armed:
        if loss.requires_grad:
            factor = guard.loss_factor(loss, share)
            handle = loss.register_hook(lambda grad: grad * factor)
            state.weighted_in_autograd = automatic
    elif share != 1.0 and loss.requires_grad and automatic:
        handle = loss.register_hook(lambda grad: grad * share)
        state.weighted_in_autograd = True
    try:
        yield
    finally:
        if handle is not None:
            handle.remove()
        state.weighted_in_autograd = False


def follow_loss_scale(scaler: Optional[torch.amp.GradScaler], state: RingHookState) -> None:
    """Before backward: under fp16 loss scaling the compressor learns the step's scale, and the reduced buckets
    need no check of the hook's own."""
    state.check_reduced = scaler is None
    if scaler is not None and state.compressor.lossy:
        # LossScaler keeps its scale as a float; torch's GradScaler needs a device synchronisation to read it
        state.compressor.set_grad_scale(scaler.scale_value if isinstance(scaler, LossScaler) else scaler.get_scale())


def decide_step(guard: StepGuard, optimizer: Any, scaler: Optional[torch.amp.GradScaler],
                group: Optional[dist.ProcessGroup], rank: int, world_size: int, step: int) -> StepVerdict:
    """After backward, on every rank: the same verdict everywhere, from the reduced sentinels or the scaler."""
    if scaler is not None and not isinstance(scaler, LossScaler):
        raise RuntimeError(f"the step guard needs lightning_dist's LossScaler, the precision plugin holds a "
                           f"{type(scaler).__name__}; NaNRecovery swaps it in at setup")
    return guard.decide(optimizer, scaler, group, rank, world_size, step=step)


def skip_step(optimizer: Any, scaler: Optional[torch.amp.GradScaler]) -> None:
    """Every rank together: no optimizer step, and the loss scale backed off."""
    if isinstance(scaler, LossScaler):
        scaler.skip(optimizer)
        scaler.update()


def replay(result: Any, closure: Callable[[], Any]) -> Callable[[], Any]:
    """A closure whose first call returns ``result`` (backward already ran) and whose later calls (LBFGS
    evaluates several times per step) run ``closure`` again."""
    calls = 0

    def replayed() -> Any:
        nonlocal calls
        calls += 1
        return result if calls == 1 else closure()

    return replayed


@contextlib.contextmanager
def updating_with(optimizer: Any, update: Optional[Callable[[], None]]) -> Iterator[None]:
    """Lightning's optimizer step (the precision plugin's: the closure, ``on_before_optimizer_step``, clipping, fp16's
    unscale and inf check) with ``update`` in place of the optimizer's own ``step``, for a sync driver that updates
    the parameters its own way (:meth:`~lightning_dist.sync.SyncDriver.optimizer_step`); None: the optimizer's own.
    The precision plugin calls ``optimizer.step(closure=...)``: for the step's length the instance's ``step`` runs the
    closure, then ``update``; a ``step`` set on the instance before (a wrapper's) is put back after."""
    if update is None:
        yield
        return

    def closure_then_update(closure: Optional[Callable[[], Any]] = None, **_: Any) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        update()
        return loss

    instance_step = optimizer.__dict__.get("step")
    optimizer.step = closure_then_update
    try:
        yield
    finally:
        if instance_step is None:
            del optimizer.step
        else:
            optimizer.step = instance_step
