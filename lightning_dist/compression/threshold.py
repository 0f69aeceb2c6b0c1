"""threshold: send every gradient entry with ``|g| >= threshold`` (Strom 2015), as (index, value) pairs.

What the guide sketched (``grad[abs(grad) < threshold] = 0``), done properly:

- error feedback (on by default): entries below the threshold are not lost but accumulate in a
  per-parameter residual until they cross it;
- a real wire format: only the selected pairs travel, and ranks first exchange their counts (one tiny
  all-gather), since each rank selects a different number;
- a cap: at most ``max_ratio`` of the bucket's entries are sent (the largest, by magnitude), so a step with
  large gradients (early training, a spike) cannot send more than a dense all-reduce would;
- an empty selection (nothing above the threshold on any rank) sends nothing and yields a zero update: with
  error feedback the residual keeps growing until something crosses;
- NaN and Inf entries are always selected (``NaN >= t`` is false, so a plain mask would drop them).

At the usual settings the cap is what binds (at a gradient spread of 1e-2, most entries cross 1e-3), and the
first version spent most of its time on it (docs/benchmarks.md, ``codecs``): a ``torch.topk`` of the whole
bucket for the cap, the ``abs`` temporary, a mostly-full mask and its ``nonzero``. Now the threshold is raised,
where the cap binds, to one read off a sample (aimed at 90% of the cap), and the entries that reach it are found
as top-k finds its candidates (:func:`~lightning_dist.compression.sparse.candidates`); only a selection still over
the cap is trimmed to its largest entries.
"""

from __future__ import annotations

import math

import torch

from lightning_dist.compression.base import BucketLayout
from lightning_dist.compression.sparse import SMALL, SparseCompressor, candidates, sampled_threshold


class ThresholdCompressor(SparseCompressor):
    """Sends the entries whose magnitude reaches ``threshold``, at most ``max_ratio`` of the bucket."""

    name = "threshold"
    fixed_count = False

    def __init__(self, threshold: float = 1e-3, max_ratio: float = 0.05, value_dtype: str = "bf16",
                 selection: str = "sampled", start_step: int = 0) -> None:
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not threshold > 0:
            raise ValueError(f"threshold={threshold!r} must be > 0: entries with |g| >= threshold are sent "
                             "(try 1e-3 and check dist/compression_ratio)")
        if isinstance(max_ratio, bool) or not isinstance(max_ratio, (int, float)) or not 0.0 < max_ratio <= 1.0:
            raise ValueError(f"threshold max_ratio={max_ratio!r} must be in (0, 1]: the most of a bucket sent "
                             "in one step")
        super().__init__(value_dtype, selection, start_step)
        self.threshold, self.max_ratio = float(threshold), float(max_ratio)

    def describe(self) -> str:
        exact = ", exact" if self.selection == "exact" else ""
        return (f"threshold(threshold={self.threshold:g}, max_ratio={self.max_ratio:g}, values={self.value_dtype}"
                f"{exact})")

    def sent_fraction(self) -> float:
        return self.max_ratio

    def select(self, flat: torch.Tensor, layout: BucketLayout) -> torch.Tensor:
        t = self.threshold * self.grad_scale  # on unscaled values
        cap = max(1, math.floor(self.max_ratio * flat.numel()))
        if self.selection == "exact" or flat.numel() < SMALL:
            magnitude = flat.abs()
            index = (~(magnitude < t)).nonzero().view(-1)
            if index.numel() > cap:  # the largest `cap` entries (NaN ranks first in topk)
                index = torch.topk(magnitude, cap, sorted=False).indices
            return index
        if cap < flat.numel():  # aim below the cap where it binds
            t = max(t, sampled_threshold(flat, cap, self.steps, margin=0.9))
        index, magnitude = candidates(flat, t, density=min(1.0, cap / flat.numel()))
        if index.numel() > cap:  # the sample aimed low: the largest `cap` of the candidates
            index = index.index_select(0, torch.topk(magnitude, cap, sorted=False).indices)
        return index
