"""The compressor interface that the comm hook calls between weighting and transport.

A compressor sees one DDP gradient bucket at a time: a flat tensor holding several parameters' gradients
end to end, described by a :class:`BucketLayout` (the parameters' names, shapes and offsets). Every rank's
bucket arrives already weighted by its share of the step, so a plain **sum** across ranks is the average
gradient; compressors only have to reproduce that sum.

Two ways to reduce, one interface:

- **Summable** compressors (``summable = True``: the identity, fp16, bf16) turn the bucket into a payload
  whose sum across ranks is meaningful: ``compress`` -> a sum all-reduce of the payload by the configured
  algorithm (ring, tree, native, auto) -> ``decompress`` into the bucket. The hook may issue the native
  all-reduce asynchronously and decompress in its completion callback.
- Every compressor can :meth:`Compressor.reduce` the bucket through a :class:`~lightning_dist.compression.
  transport.Transport`, which offers the sum all-reduce and also all-gather and all-to-all, for payloads
  that cannot be summed on the way (top-k indices, int8 codes with per-chunk scales, PowerSGD's two
  rounds with an orthogonalisation between them). The default ``reduce`` is the summable path.

Error feedback reaches a codec through one seam: ``reduce(..., feedback=Feedback(owed, keep))``. The codec
reduces ``flat + owed`` (what this rank still owes from earlier steps) and writes into ``keep`` what it did not
send (``flat + owed - sent``), each from its own intermediate values: a sparse codec subtracts at the indices it
sent, int8 from its codes, PowerSGD with rank-r updates. So error feedback costs a codec a few passes over the
bucket, not a decode of its own payload and three more (docs/compression.md has the figures). The base class
gives every codec a generic form.

State (error-feedback residuals, PowerSGD factors, random generators) is **per parameter, keyed by
name** (DDP rebuilds and renumbers its buckets after the first step and in every new process), and
**staged per step**: what a step changes becomes the state only at :meth:`Compressor.commit`, which the
strategy calls after the optimizer stepped; :meth:`Compressor.discard` drops it, so a step the ranks agree
to skip leaves the state as it was. ``state_dict`` / ``load_state_dict`` carry it into checkpoints (only
tensors, numbers and strings: checkpoints load with ``weights_only=True``).

Non-finite gradients never vanish inside a compressor: a NaN or Inf in any rank's bucket comes out of the
reduction as non-finite on every rank (so a NaN check after backward sees it), and no state keeps it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Union

import torch

from lightning_dist.comm._common import chunk_bounds

if TYPE_CHECKING:
    from lightning_dist.compression.transport import Transport


class Feedback:
    """Error feedback's hand-over to a codec for one bucket (made by :class:`~lightning_dist.compression.
    ErrorFeedback`, filled by the codec's :meth:`Compressor.reduce`).

    ``owed``: per parameter of the layout, what this rank still owes (a flat tensor), or None where nothing;
    the codec reduces ``flat + owed``. ``keep``: a bucket-sized buffer in the bucket's layout; on return it holds
    ``flat + owed - sent``, where ``sent`` is this rank's contribution as the other ranks decode it. It may
    hold a committed residual of this same bucket only where it is also ``owed`` (a bucket reduced twice in a
    step): codecs read ``owed`` before they write ``keep``, element by element. ``finite``: the codec sets it
    when it can tell cheaply whether ``flat + owed`` was finite (None: error feedback checks ``keep``), as a 0-dim
    bool tensor on the bucket's device: it is read once per step at the commit, never on the communication worker
    (a ``bool()`` there would wait for every kernel backward has queued).
    """

    __slots__ = ("owed", "keep", "finite")

    def __init__(self, owed: list[Optional[torch.Tensor]], keep: torch.Tensor) -> None:
        self.owed, self.keep = owed, keep
        self.finite: Optional[Union[bool, torch.Tensor]] = None

    def add_owed(self, flat: torch.Tensor, layout: BucketLayout, out: torch.Tensor) -> torch.Tensor:
        """``out = flat + owed``, parameter by parameter (one pass; ``out`` may be ``flat``)."""
        for (_, start, end, _), owed in zip(layout.spans(), self.owed):
            if owed is not None:
                torch.add(flat[start:end], owed, out=out[start:end])
            elif out is not flat:
                out[start:end].copy_(flat[start:end])
        return out


def gather_by_name(flat: torch.Tensor, layout: BucketLayout, feedback: Optional[Feedback],
                   out: torch.Tensor) -> list[tuple[int, int]]:
    """``flat`` plus what ``feedback`` says is owed, parameter by parameter in name order, into the start of ``out``
    (the rest zeroed); returns the bucket's ``(start, end)`` ranges in that order. A codec that cuts a bucket into
    chunks and regions (int8, int4, sign) takes the parameters in name order, not DDP's: DDP's first step in every
    process lays a bucket out in a different order than its rebuilt buckets do, and chunks, regions and noise would
    follow the order (a resumed run would then code its first step differently from an uninterrupted one)."""
    order = sorted(range(len(layout.names)), key=layout.names.__getitem__)
    every = layout.spans()
    spans = [(every[i][1], every[i][2]) for i in order]
    offset = 0
    for i, (start, end) in zip(order, spans):
        owed = None if feedback is None else feedback.owed[i]
        part = out[offset: offset + end - start]
        if owed is None:
            part.copy_(flat[start:end])
        else:
            torch.add(flat[start:end], owed, out=part)
        offset += end - start
    out[offset:].zero_()
    return spans


@dataclass(frozen=True)
class BucketLayout:
    """Which parameters a flat gradient bucket holds, in order: DDP lays them end to end, no padding."""

    names: tuple[str, ...]
    shapes: tuple[torch.Size, ...]
    offsets: tuple[int, ...]  # where each parameter starts in the flat bucket
    numel: int

    @classmethod
    def of(cls, named_shapes: list[tuple[str, torch.Size]]) -> BucketLayout:
        names, shapes, offsets, offset = [], [], [], 0
        for name, shape in named_shapes:
            names.append(name)
            shapes.append(torch.Size(shape))
            offsets.append(offset)
            offset += math.prod(shape)
        return cls(tuple(names), tuple(shapes), tuple(offsets), offset)

    @classmethod
    def single(cls, numel: int, name: str = "tensor") -> BucketLayout:
        """One flat tensor seen as one parameter (for reducing a tensor outside DDP)."""
        return cls.of([(name, torch.Size([numel]))])

    @property
    def key(self) -> str:
        return ",".join(self.names)

    def sizes(self) -> list[int]:
        return [math.prod(shape) for shape in self.shapes]

    def spans(self) -> list[tuple[str, int, int, torch.Size]]:
        """(name, start, end, shape) for every parameter."""
        return [(n, o, o + s, sh) for n, o, s, sh in zip(self.names, self.offsets, self.sizes(), self.shapes)]

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter's part of ``flat``, in its own shape (views: writing them writes ``flat``)."""
        return [flat[start:end].view(shape) for _, start, end, shape in self.spans()]

    def split(self, parts: int) -> list[tuple[BucketLayout, list[tuple[int, int]]]]:
        """Every parameter cut into ``parts`` slices; slice ``i`` of every parameter, in bucket order, makes part
        ``i``: its layout and where each of its pieces lies in the bucket (``(start, end)``, flat).

        A parameter with at least ``parts`` rows is cut between rows (slice ``i`` is a ``(rows_i, *shape[1:])``
        block, so PowerSGD still sees a matrix); a smaller one between elements (1-D slices). Sizes differ by at
        most one row. A piece is named ``name#i/parts``: the name depends on the parameter and ``parts`` only, never
        on where DDP put the parameter in its bucket (DDP rebuilds its buckets after the first step, in the order
        gradients became ready), so per-piece state (error feedback, PowerSGD's factors) follows the piece across
        rebuilds, processes and checkpoints. Empty slices are left out.

        A two-tier reduction (:mod:`lightning_dist.strategy.tiers`) hands part ``i`` to the ``i``-th rank of every
        host.
        """
        if isinstance(parts, bool) or not isinstance(parts, int) or parts < 1:
            raise ValueError(f"parts={parts!r} must be an int >= 1")
        pieces: list[list[tuple[str, torch.Size]]] = [[] for _ in range(parts)]
        spans: list[list[tuple[int, int]]] = [[] for _ in range(parts)]
        for name, start, end, shape in self.spans():
            for i, (a, b, piece_shape) in enumerate(_slices(shape, end - start, parts)):
                if b > a:
                    pieces[i].append((f"{name}#{i}/{parts}", piece_shape))
                    spans[i].append((start + a, start + b))
        return [(BucketLayout.of(pieces[i]), spans[i]) for i in range(parts)]


def _slices(shape: torch.Size, numel: int, parts: int) -> list[tuple[int, int, torch.Size]]:
    """A parameter's ``parts`` slices: (first element, end, shape), between rows where there are enough rows."""
    if len(shape) >= 1 and shape[0] >= parts:
        row = numel // shape[0]
        return [(r0 * row, r1 * row, torch.Size([r1 - r0, *shape[1:]])) for r0, r1 in chunk_bounds(shape[0], parts)]
    return [(a, b, torch.Size([b - a])) for a, b in chunk_bounds(numel, parts)]


class Compressor:
    """Base class: the identity, no state beyond the step count. Subclasses override what they change.

    Args:
        start_step: optimizer steps sent uncompressed before compression starts (a warm-up: the first
            steps' large, fast-changing gradients are where compression hurts most, as DGC observed).
    """

    name = "none"
    summable = True  # payloads can be all-reduced by sum; False: reduce() goes its own way through a Transport
    # compress/decompress cost little next to the transport (a cast, nothing at all): the hook may run them on
    # the autograd thread when the transport is asynchronous anyway; heavy compressors set False and always
    # run on the communication worker
    light = True
    lossy = False  # True: the result differs from the dense sum
    wants_error_feedback = False  # build_compressor wraps it in ErrorFeedback unless told otherwise
    start_step = 0  # (class defaults too, for subclasses that do not call __init__)
    steps = 0
    # the loss scale the gradients this compressor sees carry (fp16 mixed precision; 1.0 otherwise): state in
    # gradient units follows it (rescale), thresholds compare against gradient / grad_scale
    grad_scale = 1.0
    # the payload's format can turn finite gradients into Inf (fp16's range ends at 65504): the step guard then
    # checks every element of the reduced bucket, not only the sentinel (lightning_dist.strategy.skip)
    can_overflow = False
    # whether a NaN in the bucket's first element (the step guard's sentinel) reaches the first element of every rank's
    # result: a sparse payload sends k of a layer's largest entries, and among more than k NaN entries (a NaN loss
    # makes them all NaN) the first need not be one; the step guard then checks every element of the reduced bucket
    keeps_sentinel = True

    def __init__(self, start_step: int = 0) -> None:
        if isinstance(start_step, bool) or not isinstance(start_step, int) or start_step < 0:
            raise ValueError(f"start_step={start_step!r} must be an int >= 0 (uncompressed warm-up steps)")
        self.start_step = start_step
        self.steps = 0  # optimizer steps committed since training started (restored from checkpoints)

    @property
    def warming_up(self) -> bool:
        """True while the first ``start_step`` steps go uncompressed (the hook then sends the dense bucket)."""
        return self.steps < self.start_step

    def describe(self) -> str:
        """The compressor and its settings, for logs and for matching a checkpoint's state."""
        return self.name

    # -- the summable path ----------------------------------------------------------------------------------
    def compress(self, flat: torch.Tensor, layout: BucketLayout) -> tuple[torch.Tensor, Any]:
        """Return the payload to sum across ranks and a context for :meth:`decompress`."""
        return flat, None

    def decompress(self, payload: torch.Tensor, ctx: Any, out: torch.Tensor) -> torch.Tensor:
        """Write the (reduced) payload into ``out`` and return it."""
        if payload.data_ptr() != out.data_ptr():
            out.copy_(payload)
        return out

    # -- the general path ----------------------------------------------------------------------------------
    def reduce(self, flat: torch.Tensor, layout: BucketLayout, transport: Transport,
               feedback: Optional[Feedback] = None) -> torch.Tensor:
        """Replace ``flat`` (this rank's weighted gradients) by the compressed sum over ranks; return it.

        With ``feedback`` (error feedback), reduce ``flat + feedback.owed`` and leave in ``feedback.keep`` what
        was not sent (see :class:`Feedback`). Runs on one thread at a time.
        """
        if feedback is None:
            payload, ctx = self.compress(flat, layout)
            transport.allreduce_(payload)
            return self.decompress(payload, ctx, flat)
        # the generic form: keep = corrected; payload from it; keep -= what the others decode from the payload
        keep = feedback.add_owed(flat, layout, feedback.keep)
        payload, ctx = self.compress(keep, layout)
        if payload.data_ptr() == keep.data_ptr():
            payload = payload.clone()
        keep -= self.decompress(payload, ctx, flat)
        transport.allreduce_(payload)
        return self.decompress(payload, ctx, flat)

    # -- loss scaling -----------------------------------------------------------------------------------------
    def set_grad_scale(self, scale: float) -> None:
        """The loss scale of the coming step's gradients (the strategy calls this before each backward under
        fp16 loss scaling). When it changed, state kept in scaled gradient units is rescaled to match."""
        scale = float(scale)
        if not (scale > 0 and scale < float("inf")):
            raise ValueError(f"grad_scale={scale!r} must be a positive finite loss scale")
        old, self.grad_scale = self.grad_scale, scale
        if scale != old:
            self.rescale(scale / old)

    def rescale(self, factor: float) -> None:
        """Multiply state held in scaled gradient units (error-feedback residuals) by ``factor``."""

    # -- memory (MemoryMonitor's pre-flight estimate) ---------------------------------------------------------
    def state_bytes(self, layout: BucketLayout, element_size: int) -> int:
        """Bytes of state this compressor holds for the parameters in ``layout`` (gradients of
        ``element_size`` bytes) at its peak: during a step, the staged state beside the committed one."""
        return 0

    def workspace_bytes(self, numel: int, element_size: int, world_size: int) -> int:
        """Bytes of temporaries while it reduces one bucket of ``numel`` elements (freed after the bucket);
        the transport's own buffers are counted by the caller."""
        return 0

    # -- state ---------------------------------------------------------------------------------------------
    def commit(self) -> None:
        """The optimizer stepped: what this step staged becomes the state."""
        self.steps += 1

    def discard(self) -> None:
        """The ranks skipped this step: drop what it staged (the state stays as before the step)."""

    def state_dict(self) -> dict[str, Any]:
        """This rank's state: tensors, numbers and strings only (``weights_only=True`` loads it)."""
        return {"compressor": self.describe(), "steps": self.steps, "grad_scale": self.grad_scale}

    def load_state_dict(self, state: dict[str, Any], shared_only: bool = False) -> None:
        """Restore :meth:`state_dict`'s output. ``shared_only``: the checkpoint came from a different world
        size, so only what every rank holds alike (step count, PowerSGD's factors) applies; per-rank state
        (residuals, random generators) starts afresh."""
        self.steps = int(state.get("steps", 0))
        # the scale the saved state is in units of; the next set_grad_scale rescales it to the run's scale
        self.grad_scale = float(state.get("grad_scale", 1.0))


class NoCompressor(Compressor):
    """Sends the gradient as it is: the default."""
