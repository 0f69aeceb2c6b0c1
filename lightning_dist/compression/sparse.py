"""What top-k and threshold sparsification share: (index, value) payloads, gathered and summed in rank order.

A sparse payload cannot be summed on the wire (two ranks pick different indices), so every rank's
``(indices, values)`` pairs are all-gathered (one message: int32 indices and the values, packed as bytes)
and each rank adds them into a zeroed bucket in rank order. Every rank adds the same numbers in the same
order, so the result is bit-identical on every rank.

Bytes: an all-gather sends the local payload ``N - 1`` times, so at ``k`` of ``n`` elements each rank sends
``(N - 1) k (4 + v)`` bytes (``v`` bytes per value) against the dense ring's ``2 (N - 1) / N x 4 n``: the
saving is ``8 n / (N k (4 + v))``, and shrinks as ranks are added (the known limit of sparse all-gathers).

Non-finite values are always selected (top-k ranks NaN and Inf first; threshold keeps them explicitly), so
a NaN or Inf in any rank's bucket reaches every rank.

Selection near memory speed (:func:`largest`, :func:`candidates`; Deep Gradient Compression's sampled
threshold, Lin et al. 2018): a threshold ``t`` is read off a strided sample of the magnitudes, aimed a little
below the wanted count; the bucket is seen as ``R`` strided rows and only the columns whose largest magnitude
(``amax`` and ``amin`` of the signed values: nothing is written over the bucket) reaches ``t`` are searched,
and an exact ``torch.topk`` runs over the candidates only. Whenever there are at least ``k`` candidates they
hold the exact top ``k``, so the selection *is* the exact top-k (up to ties); with fewer, ``t`` is lowered and,
failing that, ``torch.topk`` of the layer decides. Comparisons are written ``not (|x| < t)``, so a NaN is always
a candidate. Together that costs a few passes over the bucket, several times fewer than ``torch.topk`` of every
layer (docs/benchmarks.md, ``codecs``, has the figures).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from lightning_dist.compression.base import BucketLayout, Compressor, Feedback
from lightning_dist.compression.transport import Transport

VALUE_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
SELECTIONS = ("sampled", "exact")
SMALL = 1 << 16  # below this many elements (or at a density over 1/8) torch.topk is as cheap as sampling
_MARGIN = 1.3  # the sampled threshold aims at this many times the wanted count, so it rarely falls short


def _prime_at_most(n: int) -> int:
    """The largest prime <= ``n`` (1 for n < 2): a sample stride that cannot line up with a row length."""
    for candidate in range(max(n, 1), 1, -1):
        if all(candidate % d for d in range(2, math.isqrt(candidate) + 1)):
            return candidate
    return 1


def sampled_threshold(x: torch.Tensor, count: int, offset: int = 0, margin: float = _MARGIN) -> float:
    """A magnitude about ``margin x count`` entries of ``x`` reach, read off a strided sample of 128 entries per
    expected crossing (at least 4096 entries). ``offset`` (the step count) moves the sample, so a resumed run
    samples as the uninterrupted one did."""
    n = x.numel()
    stride = _prime_at_most(n // max(4096, math.ceil(128 * n / max(count, 1))))
    sample = x[offset % stride :: stride].abs()
    rank = max(1, min(sample.numel(), math.ceil(margin * count * sample.numel() / n)))
    return float(torch.topk(sample, rank, sorted=False).values.min())


def candidates(x: torch.Tensor, t: float, density: float = 0.013) -> tuple[torch.Tensor, torch.Tensor]:
    """The indices (int64) of ``x``'s entries with ``not |x| < t`` (NaN included) and their magnitudes,
    searching only the columns of an ``(R, n / R)`` view whose extremes reach ``t``: R = 8 rows where under 2.5%
    of the entries are expected to reach it (``density``), else 4 (most columns of 8 would hold a hit)."""
    n = x.numel()
    rows = (8 if density < 0.025 else 4) if n >= 8 * 1024 else 1
    cols = n // rows
    view = x[: rows * cols].view(rows, cols)
    reach = view.amax(0)
    torch.maximum(reach, view.amin(0).neg_(), out=reach)  # NaN propagates: a NaN column is searched
    col = torch.lt(reach, t).logical_not_().nonzero().view(-1)
    found = torch.index_select(view, 1, col).abs_().view(-1)  # (rows, hit columns), flattened
    where = torch.lt(found, t).logical_not_().nonzero().view(-1)
    width = max(col.numel(), 1)
    index = (where // width) * cols + col.index_select(0, where % width)
    magnitude = found.index_select(0, where)
    if rows * cols < n:  # fewer than `rows` entries outside the view: always candidates
        tail = torch.arange(rows * cols, n, device=x.device)
        index, magnitude = torch.cat([index, tail]), torch.cat([magnitude, x[rows * cols :].abs()])
    return index, magnitude


def largest(x: torch.Tensor, k: int, offset: int = 0, exact: bool = False) -> torch.Tensor:
    """The indices (int64) of the ``k`` largest ``|x|`` (NaN and Inf first): the exact top-k up to ties."""
    n = x.numel()
    if k >= n:
        return torch.arange(n, device=x.device)
    if not exact and n >= SMALL and 8 * k < n:
        t = sampled_threshold(x, k, offset)
        for _ in range(2):  # a sample that aimed too high: lower the threshold once, then give up on it
            if not t > 0:  # mostly zeros (or NaN in the sample): torch.topk decides
                break
            index, magnitude = candidates(x, t)
            if index.numel() >= k:
                return index.index_select(0, torch.topk(magnitude, k, sorted=False).indices)
            t /= 4
    return torch.topk(x.abs(), k, sorted=False).indices


class SparseCompressor(Compressor):
    """Base of top-k and threshold: subclasses choose the indices (:meth:`select`)."""

    summable = False
    light = False
    lossy = True
    wants_error_feedback = True
    keeps_sentinel = False
    fixed_count = False  # True when every rank sends the same number of pairs (no count exchange needed)

    def __init__(self, value_dtype: str = "bf16", selection: str = "sampled", start_step: int = 0) -> None:
        super().__init__(start_step)
        if value_dtype not in VALUE_DTYPES:
            raise ValueError(f"{self.name} value_dtype={value_dtype!r}: use one of {sorted(VALUE_DTYPES)}")
        if selection not in SELECTIONS:
            raise ValueError(f"{self.name} selection={selection!r}: use 'sampled' (a sampled threshold, then an exact "
                             "top-k of the candidates) or 'exact' (torch.topk of every layer)")
        self.value_dtype, self.selection = value_dtype, selection
        self._dtype = VALUE_DTYPES[value_dtype]

    def select(self, flat: torch.Tensor, layout: BucketLayout) -> torch.Tensor:
        """The (int64) indices of ``flat`` to send."""
        raise NotImplementedError

    def sent_fraction(self) -> float:
        """The most of a bucket one rank sends in a step (for the memory estimate)."""
        return 1.0

    def workspace_bytes(self, numel: int, element_size: int, world_size: int) -> int:
        # the column extremes (a quarter of the bucket), the candidates (a few k), then the chosen pairs: int64
        # indices, values, and every rank's (int32 index, value) payload gathered; exact selection: |g|
        k = math.ceil(self.sent_fraction() * numel)
        pair = 4 + self._dtype.itemsize
        search = numel * element_size if self.selection == "exact" else numel * element_size // 4 + 4 * k * 12
        return search + k * (8 + self._dtype.itemsize) + world_size * k * pair

    def reduce(self, flat: torch.Tensor, layout: BucketLayout, transport: Transport,
               feedback: Optional[Feedback] = None) -> torch.Tensor:
        source = flat if feedback is None else feedback.add_owed(flat, layout, feedback.keep)
        index = self.select(source, layout)
        values = source.index_select(0, index).to(self._dtype)
        if feedback is not None:  # what was sent is no longer owed; every non-finite entry is among the sent
            source.scatter_add_(0, index, torch.neg(values).to(source.dtype))
            feedback.finite = torch.isfinite(values).all()  # a device flag, read at the commit
        count = index.numel()
        if self.fixed_count:
            counts = [count] * transport.world_size
        else:
            counts = transport.all_gather(torch.tensor([count], dtype=torch.int64, device=flat.device)).view(-1)
            counts = counts.tolist()
        longest = max(counts)
        flat.zero_()
        if longest == 0:
            return flat
        # indices, then values; the values' part is padded to whole 4-byte words so that every rank's part of
        # the gathered tensor starts aligned for the int32 view
        value_bytes = -(-longest * values.element_size() // 4) * 4
        payload = torch.zeros(4 * longest + value_bytes, dtype=torch.uint8, device=flat.device)
        payload[: 4 * count] = index.to(torch.int32).view(torch.uint8)
        payload[4 * longest : 4 * longest + count * values.element_size()] = values.view(torch.uint8)
        gathered = transport.all_gather(payload)
        for rank, part in enumerate(gathered):  # in rank order: the same sum on every rank
            k = counts[rank]
            rank_index = part[: 4 * longest].view(torch.int32)[:k].long()
            rank_values = part[4 * longest : 4 * longest + k * values.element_size()].view(self._dtype)
            flat.scatter_add_(0, rank_index, rank_values.to(flat.dtype))
        return flat
