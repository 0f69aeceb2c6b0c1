"""Per-rank gradient accumulation: a rank's share of a step run as several micro-batches inside one training step.

Heterogeneous batching gives each rank a share of the global batch that follows its speed
(:class:`~lightning_dist.hetero.HeteroBatching`); when a share exceeds what the rank's memory holds, the plan cuts it
into micro-batches (:meth:`~lightning_dist.hetero.HeteroBatching.micro_sizes`) and :class:`MicroBatches` runs them
inside the one Lightning training step, so the ranks still meet once per step:

- the batch is cut along the first dimension of every tensor whose first dimension is the share (:func:`cut`; other
  values reach every micro-batch whole), as ``DataParallel`` scatters its inputs;
- Lightning's closure runs ``training_step``, then zeroes the gradients, then runs backward. The strategy hands it
  the first micro-batch's output and, from the backward Lightning asks for, runs the rest: each further
  micro-batch's ``training_step`` and every micro-batch's backward (Lightning's, through the strategy: precision
  plugin, loss scaling, ``on_before_backward`` / ``on_after_backward``), all but the last with DDP's gradient
  synchronisation off. Gradients add up locally and the last backward starts the exchange: the comm hook (and any
  compressor) sees the accumulated gradient once per step, on every rank. What Lightning keeps of the step (the
  progress bar's loss, ``on_train_batch_end``'s outputs) is the first micro-batch's output;
- micro-batch ``j`` of ``b_ij`` samples carries ``b_ij / B`` of the step (the rank's share ``b_i / B`` split by
  samples, applied to the loss gradient like the share itself, :mod:`.stepping`), so the sum over ranks is one
  step over the union of every rank's samples, as with one pass per rank;
- ``self.log`` sees each micro-batch as its batch (its size weighs ``on_epoch`` means); ``sync_dist`` reductions
  of every micro-batch but the last are skipped (the last one's value is the step's, as under Lightning's own
  accumulation, and ranks with fewer micro-batches would otherwise wait in a reduction the others never join),
  and any other collective from inside those micro-batches raises instead of hanging.

With ``accumulate=False`` (syncing every H steps with ``DiLoCo(balance="steps")``: a faster worker runs more inner
steps) each micro-batch is an inner step of its own instead: the first one's backward and the optimizer step are
Lightning's, and :meth:`MicroBatches.more_steps` (from the strategy's ``optimizer_step``) runs each further one's
``zero_grad``, ``training_step``, backward and optimizer step, each its own mean-loss gradient (the share whole).
There the first inner step's ``self.log(sync_dist=True)`` reduces (where a rank of one inner step reduces: before the
step's exchange), and the further ones' stay local.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from typing import Any, Callable, Iterator, Optional

import torch
from lightning_utilities.core.apply_func import apply_to_collection

from lightning_dist.strategy.hook import RingHookState
from lightning_dist.upstream import logged_results, running_hook


def cut(batch: Any, sizes: Sequence[int]) -> list[Any]:
    """``batch`` cut into ``len(sizes)`` micro-batches: every tensor whose first dimension is ``sum(sizes)`` is cut
    along it (views, no copy), anything else goes whole to every micro-batch. Raises ``ValueError`` when no tensor has
    that first dimension (nothing to cut)."""
    total, found = sum(sizes), False

    def piece(start: int, size: int) -> Any:
        def narrow(tensor: torch.Tensor) -> torch.Tensor:
            nonlocal found
            if tensor.dim() > 0 and tensor.shape[0] == total:
                found = True
                return tensor.narrow(0, start, size)
            return tensor

        return apply_to_collection(batch, torch.Tensor, narrow)

    starts = [sum(sizes[:j]) for j in range(len(sizes))]
    pieces = [piece(start, size) for start, size in zip(starts, sizes)]
    if not found:
        raise ValueError(f"per-rank gradient accumulation cuts this rank's batch of {total} samples into "
                         f"micro-batches of {list(sizes)} along the first dimension of its tensors, but this batch "
                         f"({type(batch).__name__}) has no tensor whose first dimension is {total}: return tensors "
                         "with the samples first from the training DataLoader, or set hetero.accumulate='off'")
    return pieces


def loss_of(output: Any) -> torch.Tensor:
    """The loss of a ``training_step`` output, as Lightning's automatic optimization reads it."""
    loss = output.get("loss") if isinstance(output, Mapping) else output
    if not isinstance(loss, torch.Tensor):
        raise RuntimeError("under per-rank gradient accumulation every micro-batch's training_step must return its "
                           f"loss (a Tensor, or a dict with 'loss'); it returned {type(output).__name__}. Skipping a "
                           "step by returning None is not supported in distributed training.")
    return loss


class MicroBatches:
    """Runs one rank's share of a step as micro-batches (the module docstring); the strategy holds one.

    Lightning's closure runs ``training_step``, then zeroes the gradients (on a window's first batch), then runs
    backward: gradients accumulated inside ``training_step`` would be lost. So :meth:`start` (from the strategy's
    ``training_step``) hands Lightning the first micro-batch, and :meth:`backward` (from the strategy's ``backward``)
    runs its backward, then the user's ``training_step`` and the backward of every other micro-batch in turn.
    """

    def __init__(self) -> None:
        self.inner = False  # True while a training_step other than the step's last runs: no collective may start
        self._pending: Optional[tuple[list[Any], Sequence[int], float, tuple]] = None
        self._steps: Optional[tuple[list[Any], float, tuple]] = None  # accumulate=False: the inner steps left

    def start(self, strategy: Any, batch: Any, rest: tuple, sizes: Sequence[int], state: RingHookState,
              step: Callable[..., Any], accumulate: bool = True) -> Any:
        """The first micro-batch's ``step(piece, *rest)`` (the strategy's own ``training_step``, with DDP's
        synchronisation off: DDP decides in forward whether the backward that follows reduces); the others wait for
        :meth:`backward`. ``state`` carries the rank's share of the step, split by samples, to each backward.
        ``accumulate=False``: each micro-batch an inner step of its own (:meth:`more_steps`), with the share whole."""
        pieces = cut(batch, sizes)
        if not accumulate:  # the first inner step's collectives run here, where a rank of one inner step runs its own
            self._steps = (pieces[1:], state.step_share(), rest)
            with _logged_as(strategy.lightning_module.trainer, pieces[0]):
                return step(pieces[0], *rest)
        self._pending = (pieces, sizes, state.step_share(), rest)
        state.share = self._pending[2] * sizes[0] / sum(sizes)
        with _logged_as(strategy.lightning_module.trainer, pieces[0]), self._inside(), \
                strategy.block_backward_sync():
            return step(pieces[0], *rest)

    @property
    def pending(self) -> bool:
        """Whether the current step has micro-batches :meth:`backward` must run."""
        return self._pending is not None

    def backward(self, strategy: Any, first_loss: torch.Tensor, backward: Callable[[torch.Tensor], Any],
                 state: RingHookState, step: Callable[..., Any]) -> Any:
        """The first micro-batch's backward (``backward(loss)``: the strategy's one pass, with the share and the
        precision plugin), then each further micro-batch's ``training_step`` and backward; every one but the last with
        DDP's synchronisation off. Returns the last backward's result."""
        assert self._pending is not None
        pieces, sizes, share, rest = self._pending
        self._pending = None
        trainer = strategy.lightning_module.trainer
        normalize = trainer.accumulate_grad_batches  # as Lightning's closure divides each loss it backpropagates
        loss, total, last = first_loss, sum(sizes), len(sizes) - 1
        for j, (size, piece) in enumerate(zip(sizes, pieces)):
            # every micro-batch but the last: forward and backward with DDP's synchronisation off
            with strategy.block_backward_sync() if j < last else contextlib.nullcontext():
                if j > 0:
                    with _logged_as(trainer, piece), running_hook(trainer.lightning_module, "training_step"), \
                            (self._inside() if j < last else contextlib.nullcontext()):
                        loss = loss_of(step(piece, *rest)) / normalize
                state.share = share * size / total
                result = backward(loss)
        return result

    @property
    def steps_pending(self) -> bool:
        """Whether the current training step has inner steps :meth:`more_steps` must run."""
        return self._steps is not None

    def more_steps(self, strategy: Any, optimizer: Any, backward: Callable[[torch.Tensor], Any],
                   take_step: Callable[[Any], None], state: RingHookState, step: Callable[..., Any]) -> None:
        """After Lightning's optimizer step of the first micro-batch: each further micro-batch as an inner step of
        its own (``zero_grad``, ``training_step``, ``backward(loss)`` with the share whole, ``take_step(output)``: the
        strategy's step or skip). None of them may start a collective: a rank of one inner step ran its
        ``self.log(sync_dist=True)`` reductions in its one ``training_step``, before the step's exchange, and so did
        the first inner step here; a reduction now would meet the others' exchange instead (a deadlock)."""
        assert self._steps is not None
        pieces, share, rest = self._steps
        self._steps = None
        trainer = strategy.lightning_module.trainer
        normalize = trainer.accumulate_grad_batches
        for piece in pieces:
            optimizer.zero_grad()
            with _logged_as(trainer, piece), running_hook(trainer.lightning_module, "training_step"), self._inside():
                output = step(piece, *rest)
            state.share = share
            backward(loss_of(output) / normalize)
            take_step(output)

    @contextlib.contextmanager
    def _inside(self) -> Iterator[None]:
        self.inner = True
        try:
            yield
        finally:
            self.inner = False

    def check_collective(self, name: str) -> None:
        """Called by the strategy's collectives: raise rather than wait for ranks that will never join."""
        if self.inner:
            raise RuntimeError(
                f"{name} called from inside training_step under per-rank gradient accumulation: ranks run their "
                "shares as different numbers of micro-batches, so a collective there would wait for ranks that never "
                "join it. Log with self.log(..., sync_dist=True) (handled), move the collective to a hook that runs "
                "once per step (on_train_batch_end), or set hetero.accumulate='off'.")


@contextlib.contextmanager
def _logged_as(trainer: Any, piece: Any) -> Iterator[None]:
    """``self.log`` infers a value's batch size from the batch Lightning's results hold: the micro-batch's own while its
    ``training_step`` runs, the whole share (as Lightning set it) again afterwards."""
    results = logged_results(trainer)
    if results is None:
        yield
        return
    batch, results.batch, results.batch_size = results.batch, piece, None
    try:
        yield
    finally:
        results.batch, results.batch_size = batch, None
