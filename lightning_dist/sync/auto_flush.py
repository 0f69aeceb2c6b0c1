"""The error-feedback residuals a per-step compressor still owes when ``sync="auto"`` switches away from it, flushed:
sent dense and added to the next step's gradient, so that what the compressor held back reaches the model.

Error feedback (:mod:`lightning_dist.compression.error_feedback`) keeps, per rank and parameter, what the compressed
gradient left out; its next step sends ``C(g + e)``. A switch to another way of syncing ends that chain, so
:class:`OwedResiduals` ends it as the compressor would have without compressing: at the next step every rank sums
every rank's residuals (one dense all-reduce of one model's worth, at the step's start, every rank together) and adds
the sum to the gradient that step reduced, after its backward and before the optimizer (and any clipping) sees it.
A checkpoint written in the switch step gathers them at its save and carries the sum, so a fit resumed from it
flushes them into its first step alike (an emergency checkpoint, written without collectives, does not).
After the flush the sum of the gradients the optimizer was handed equals the sum of the true mean gradients, as it
would after a compressor that owes nothing (the EF invariant; ``tests/test_auto.py`` checks the flushed step).

Residuals are in the units of the reduced gradient (each rank's share already weighted in), and under fp16 loss
scaling in the compressor's loss scale: the flush rescales them to the step's. Two_tier's residuals, each a rank's
part of a bucket across hosts, are not flushed (every rank agrees): they are dropped with a message, as OneBitAdam's
compressed momentum is.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_dist.compression import Compressor
from lightning_dist.sync.context import SyncContext


class OwedResiduals:
    """The residuals of the compressor replaced at a switch: :meth:`hold` it (in the switch step), :meth:`gather`
    (the next step's start, every rank: a collective), :meth:`add_to_grads` (once that step's gradient is reduced)."""

    def __init__(self, context: SyncContext) -> None:
        self.context = context
        self.compressor: Optional[Compressor] = None  # replaced, its step not yet finished when held
        self.name = ""  # its label, for the messages
        self.flat: Optional[torch.Tensor] = None  # every rank's residuals summed, by parameter (trainable, in order)
        self.scale = 1.0  # the loss scale they are in units of

    @property
    def pending(self) -> bool:
        """A compressor is held, or its residuals gathered and not yet added: the step's closure is to be wrapped
        (:meth:`after`; the closure runs the forward whose start gathers them)."""
        return self.compressor is not None or self.flat is not None

    def hold(self, compressor: Compressor, name: str) -> None:
        """``compressor`` (``name``: its label) was replaced in this step; the strategy finishes the step on it too
        (``SyncContext.set_compressor``), so its residuals are read at the next step's start."""
        self.compressor, self.name = compressor, name

    def _params(self) -> list[tuple[str, torch.nn.Parameter]]:
        return [(n, p) for n, p in self.context.module.named_parameters() if p.requires_grad]

    def gather(self) -> None:
        """Every rank: the held compressor's residuals summed over every rank (a collective, one model's worth)."""
        compressor, self.compressor = self.compressor, None
        if compressor is None:
            return
        residuals = compressor.residuals
        parts, whole, matched = [], True, 0
        for name, p in self._params():
            r = residuals.get(name)
            matched += r is not None
            whole = whole and (r is None or r.numel() == p.numel())
            parts.append(r.detach().reshape(-1).to("cpu", torch.float32) if r is not None and whole
                         else torch.zeros(p.numel()))
        whole = whole and matched == len(residuals)  # (two_tier's are keyed by parts: "name#i/parts")
        if self.context.agree(not whole):  # every rank drops, or every rank flushes
            warnings.warn(f"sync='auto': switching away from {self.name} drops its error feedback's residuals (each "
                          "rank's part of a bucket across hosts, under two_tier)", stacklevel=2)
            return
        flat = torch.cat(parts) if parts else torch.zeros(0)
        if self.context.world_size > 1:
            dist.all_reduce(flat, group=self.context.exchange_group)
        self.flat, self.scale = flat, compressor.grad_scale
        rank_zero_info(f"sync='auto': {self.name}'s error-feedback residuals (norm {float(flat.norm()):.3g}, every "
                       "rank's summed) are added to this step's gradient")

    # -- checkpoints: a checkpoint written in the switch step carries the flush to the resumed fit --------------------
    def state_dict(self) -> Optional[dict[str, Any]]:
        """Every rank (a checkpoint's save, a collective): the held residuals gathered now, instead of at the next
        step's start (the same sum), and kept as the checkpoint's; None when nothing is owed."""
        self.gather()
        return None if self.flat is None else {"flat": self.flat, "scale": self.scale, "name": self.name}

    def load_state_dict(self, state: Optional[dict[str, Any]]) -> None:
        """The summed residuals a checkpoint carried: added to the resumed fit's first step's gradient."""
        if state is not None:
            self.flat, self.scale, self.name = state["flat"], float(state["scale"]), state["name"]

    def after(self, closure: Callable[[], Any]) -> Callable[[], Any]:
        """``closure`` (forward, whose start gathers the residuals, and backward, the gradient reduced), then
        :meth:`add_to_grads`."""

        def flushed() -> Any:
            output = closure()
            self.add_to_grads()
            return output

        return flushed

    def add_to_grads(self) -> None:
        """The summed residuals added to the reduced gradient (this rank's ``.grad``), in the step's loss scale."""
        flat, self.flat = self.flat, None
        if flat is None:
            return
        factor = self.context.compressor().grad_scale / self.scale
        offset = 0
        with torch.no_grad():
            for _, p in self._params():
                n = p.numel()
                if p.grad is not None:
                    p.grad.add_(flat[offset:offset + n].view_as(p).to(p.grad), alpha=factor)
                offset += n
