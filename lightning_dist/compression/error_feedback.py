"""Error feedback: what a lossy compressor did not send this step is added to the next step's gradient.

Seide et al. (1-bit SGD, 2014), Stich et al. ("Sparsified SGD with memory", 2018), Karimireddy et al.
(EF-SGD, 2019): with a residual ``e`` per parameter,

    corrected = g + e            (this rank's weighted gradient plus what it still owes)
    sent      = C(corrected)     (what the other ranks decode from this rank's payload)
    e'        = corrected - sent

so over time everything is sent, and sparsification at 1% or less converges like dense training. The
invariant ``sent + e' == g + e`` holds exactly (up to the float rounding of one subtraction) and is tested.

Optional local gradient clipping (Deep Gradient Compression, Lin et al. 2018): each parameter's local
gradient is clipped to L2 norm ``clip_norm`` *before* it is added to the residual, so one spike cannot fill
the residual for many steps. (Clipping after the all-reduce, Lightning's ``gradient_clip_val``, cannot do
that: the residual has already absorbed the spike.) DGC scales a global threshold by ``N^-1/2``; here the
gradients are already weighted by the rank's share, so ``clip_norm`` is applied to that weighted gradient.

Under fp16 loss scaling the gradients carry the loss scale: residuals are kept in those units and rescaled
when the scale changes (:meth:`Compressor.set_grad_scale`), and ``clip_norm`` applies to unscaled values.

Residuals are per parameter, keyed by name, staged per step (discarded with a skipped step). A non-finite
gradient never reaches the residual: the step's residuals for that bucket are left as they were (the
non-finite values still go on the wire, so every rank sees them).

The arithmetic lives in the codec (:class:`~lightning_dist.compression.base.Feedback`): it adds what is owed
in its first pass over the bucket and writes the new residual from its own intermediate values. Each bucket's
residuals live in one of two buffers that alternate between steps, so a step never writes over the committed
residuals that a skipped step must return to, and no step allocates a bucket-sized tensor.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from lightning_dist.compression.base import BucketLayout, Compressor, Feedback
from lightning_dist.compression.state import ParamState, Scratch
from lightning_dist.compression.transport import Transport


class ErrorFeedback(Compressor):
    """Wraps a lossy compressor with per-parameter residuals (and optional local clipping)."""

    summable = False
    light = False

    def __init__(self, inner: Compressor, clip_norm: Optional[float] = None, start_step: int = 0) -> None:
        super().__init__(start_step)
        if not isinstance(inner, Compressor) or isinstance(inner, ErrorFeedback):
            raise ValueError(f"ErrorFeedback wraps one plain Compressor, got {inner!r}")
        if clip_norm is not None and (isinstance(clip_norm, bool) or not isinstance(clip_norm, (int, float))
                                      or not clip_norm > 0):
            raise ValueError(f"clip_norm={clip_norm!r} must be > 0 (the L2 norm each parameter's local gradient "
                             "is clipped to before error feedback) or None")
        self.inner = inner
        self.name = inner.name
        self.lossy = inner.lossy
        self.can_overflow = inner.can_overflow
        self.keeps_sentinel = inner.keeps_sentinel
        self.clip_norm = None if clip_norm is None else float(clip_norm)
        self.residuals = ParamState()
        self._buffers = Scratch()  # per bucket, the two buffers its residuals alternate between
        self._used: set = set()  # the buffers' keys this step used (the others belong to rebuilt layouts)

    def describe(self) -> str:
        clip = "" if self.clip_norm is None else f", clip_norm={self.clip_norm:g}"
        return f"{self.inner.describe()}+ef{clip}"

    def reduce(self, flat: torch.Tensor, layout: BucketLayout, transport: Transport,
               feedback: Optional[Feedback] = None) -> torch.Tensor:
        if feedback is not None:
            raise ValueError("ErrorFeedback cannot be fed back into: wrap a plain Compressor once")
        if self.clip_norm is not None:  # on the device: a `norm > limit` test per parameter would sync the host
            limit = self.clip_norm * self.grad_scale  # the gradient carries the loss scale; the limit does not
            for grad in layout.views(flat):
                norm = grad.norm()
                # over the limit: scaled down to it; else (NaN included: a non-finite gradient is left to be seen) x 1
                grad.mul_(torch.where(norm > limit, limit / norm, 1.0))
        owed = [self._owed(name, flat.device) for name in layout.names]
        fed = Feedback(owed, self._keep_buffer(flat, layout))
        self.inner.reduce(flat, layout, transport, fed)
        finite = fed.finite if fed.finite is not None else torch.isfinite(fed.keep.sum())
        for name, residual in zip(layout.names, layout.views(fed.keep)):
            if isinstance(finite, torch.Tensor):  # the new residual, kept at the commit if finite (read then)
                self.residuals.stage(name, residual.view(-1), keep_if=finite)
            elif finite:  # the new residual: what this rank owes after this step
                self.residuals.stage(name, residual.view(-1))
            else:  # a non-finite gradient: the residuals stay as they were before this step
                self.residuals.unstage(name)
        return flat

    def _owed(self, name: str, device: torch.device) -> Optional[torch.Tensor]:
        residual = self.residuals.get(name)
        if residual is None:
            return None
        if residual.device != device:  # loaded from a checkpoint onto the CPU
            residual = residual.to(device)
        return residual.reshape(-1)

    def _keep_buffer(self, flat: torch.Tensor, layout: BucketLayout) -> torch.Tensor:
        """The buffer of ``layout``'s two that holds none of its committed residuals."""
        self._used.update({(layout.key, 0), (layout.key, 1)})
        first = self._buffers.get((layout.key, 0), flat.numel(), flat.dtype, flat.device)
        committed = self.residuals.committed(layout.names[0])
        if committed is not None and committed.untyped_storage().data_ptr() == first.untyped_storage().data_ptr():
            return self._buffers.get((layout.key, 1), flat.numel(), flat.dtype, flat.device)
        return first

    def _end_step(self) -> None:
        if self._used:  # buffers of layouts this step did not use are let go (residuals keep what they view)
            self._buffers.keep_only(self._used)
        self._used = set()

    def state_bytes(self, layout: BucketLayout, element_size: int) -> int:
        # a residual per gradient element, twice at the step's peak: the committed one and the staged new one
        return 2 * layout.numel * element_size + self.inner.state_bytes(layout, element_size)

    def workspace_bytes(self, numel: int, element_size: int, world_size: int) -> int:
        # the residuals' buffers are counted in state_bytes; the codec writes the new residual in its own pass
        return self.inner.workspace_bytes(numel, element_size, world_size)

    def set_grad_scale(self, scale: float) -> None:
        super().set_grad_scale(scale)
        self.inner.set_grad_scale(scale)

    def rescale(self, factor: float) -> None:
        """Residuals are in scaled gradient units: a new loss scale rescales them (between steps)."""
        self.residuals.scale_(factor)

    def commit(self) -> None:
        super().commit()
        self.inner.commit()
        self.residuals.commit()
        self._end_step()

    def discard(self) -> None:
        self.inner.discard()
        self.residuals.discard()
        self._end_step()

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "inner": self.inner.state_dict(), "residuals": self.residuals.state_dict()}

    def load_state_dict(self, state: dict[str, Any], shared_only: bool = False) -> None:
        super().load_state_dict(state, shared_only)
        self.inner.load_state_dict(state.get("inner", {}), shared_only)
        self.residuals.load_state_dict({} if shared_only else state.get("residuals", {}))
