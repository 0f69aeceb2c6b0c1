"""Per-rank batch sizes: how a global batch of ``B`` samples is split among ranks, and when the split changes.

Pure logic, no process group: every rank evaluates the same functions on the same (agreed) inputs and gets
the same answer, which is how the ranks agree on sizes without a collective of their own.

- :func:`split_batch`: integers ``b_i`` with ``sum b_i = B``, proportional to per-rank weights (measured
  throughput, or given speeds), each within ``[min_size, max_i]``: a water-filling of the proportional
  shares between the bounds, then largest-remainder rounding (ties to the lower rank), so the result is
  exact and deterministic.
- :func:`micro_batch_sizes`: a rank's share of a step cut into near-equal micro-batches (per-rank gradient
  accumulation, ``HeteroBatching(accumulate=...)``): as many as its memory cap needs, or as many as given.
- :class:`BatchPlan`: the sizes in force at each optimizer step. A change decided at step ``s`` takes effect
  from a later step (past what the DataLoader has already fetched), and is recorded with that step, so the
  sampler (which produces step ``t``'s indices ahead of time) and the gradient weighting (at step ``t``)
  read the same sizes for the same step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Optional

from lightning_dist.identities import map_ranks


def split_batch(total: int, weights: Sequence[float], min_size: int = 1, max_sizes: Optional[Sequence[int]] = None
                ) -> list[int]:
    """Split ``total`` samples into ``len(weights)`` integer sizes proportional to ``weights``, within bounds.

    Args:
        total: the global batch (every sample goes to exactly one rank).
        weights: per-rank weights > 0 (throughput in samples per second, or relative speeds).
        min_size: the least any rank gets (>= 0; 1 keeps every rank computing).
        max_sizes: per-rank upper bounds (a memory cap, a maximum batch); None: unbounded.

    Raises ``ValueError`` naming the problem when the bounds cannot hold ``total``.
    """
    n = len(weights)
    if n == 0:
        raise ValueError("split_batch needs at least one rank")
    if any(not (isinstance(w, (int, float)) and math.isfinite(w) and w > 0) for w in weights):
        raise ValueError(f"weights={list(weights)}: every rank's speed must be a finite number > 0")
    hi = [total] * n if max_sizes is None else [min(total, int(m)) for m in max_sizes]
    lo = [min(min_size, h) for h in hi]
    if sum(lo) > total:
        raise ValueError(f"a global batch of {total} cannot give each of {n} ranks at least {min_size} sample(s)")
    if sum(hi) < total:
        raise ValueError(f"the per-rank maximums {hi} hold {sum(hi)} samples, fewer than the global batch {total}: "
                         "raise max_batch_size / the memory caps or lower the global batch")
    # water-filling: x_i = clamp(t w_i, lo_i, hi_i) with sum x_i = total (bisection on t: sum is monotone in t)
    low_t, high_t = 0.0, 1.0
    while sum(min(max(high_t * w, a), b) for w, a, b in zip(weights, lo, hi)) < total:
        high_t *= 2
    for _ in range(200):
        mid = (low_t + high_t) / 2
        if sum(min(max(mid * w, a), b) for w, a, b in zip(weights, lo, hi)) < total:
            low_t = mid
        else:
            high_t = mid
    share = [min(max(high_t * w, a), b) for w, a, b in zip(weights, lo, hi)]
    sizes = [max(a, min(b, math.floor(x))) for x, a, b in zip(share, lo, hi)]
    # largest remainder: hand out what flooring left, to the largest fractional parts that still have room
    order = sorted(range(n), key=lambda i: (-(share[i] - math.floor(share[i])), i))
    missing = total - sum(sizes)
    while missing > 0:
        progressed = False
        for i in order:
            if missing and sizes[i] < hi[i]:
                sizes[i] += 1
                missing -= 1
                progressed = True
        if not progressed:  # pragma: no cover - excluded by the sum(hi) check
            raise AssertionError("split_batch could not place every sample")
    while missing < 0:  # the bisection overshot by rounding: take back from the smallest remainders
        for i in reversed(order):
            if missing and sizes[i] > lo[i]:
                sizes[i] -= 1
                missing += 1
    return sizes


def micro_batch_sizes(share: int, cap: Optional[int] = None, count: Optional[int] = None) -> list[int]:
    """``share`` samples cut into micro-batches of near-equal size (they differ by at most one, larger first).

    Args:
        share: the rank's samples of the step (>= 1).
        cap: the most samples one micro-batch may hold (a memory cap): ``ceil(share / cap)`` micro-batches.
        count: the number of micro-batches (a per-rank count given by the user; at most ``share`` of them).

    Neither: one micro-batch, the whole share.
    """
    if share < 1:
        raise ValueError(f"a share of {share} samples cannot be cut into micro-batches")
    if count is None:
        count = 1 if cap is None else math.ceil(share / cap)
    count = min(count, share)
    base, extra = divmod(share, count)
    return [base + 1] * extra + [base] * (count - extra)


class BatchPlan:
    """The per-rank sizes in force at each optimizer step (0-based, counted over the whole fit).

    ``sizes_at(step, total)`` splits a global batch of ``total`` by the weights in force at ``step``; the
    last batch of an epoch may be smaller than ``B`` and is split by the same weights.
    """

    def __init__(self, world_size: int, weights: Sequence[float], min_size: int = 1,
                 max_sizes: Optional[Sequence[int]] = None) -> None:
        if len(weights) != world_size:
            raise ValueError(f"{len(weights)} weights for {world_size} ranks: give one per rank")
        self.world_size = world_size
        self.min_size = min_size
        self.max_sizes = None if max_sizes is None else list(max_sizes)
        # (first step, weights), in step order; the first entry covers every step before the second
        self.changes: list[tuple[int, tuple[float, ...]]] = [(0, tuple(float(w) for w in weights))]
        self._cache: dict[tuple[tuple[float, ...], int], list[int]] = {}

    def weights_at(self, step: int) -> tuple[float, ...]:
        current = self.changes[0][1]
        for first, weights in self.changes:
            if first > step:
                break
            current = weights
        return current

    def sizes_at(self, step: int, total: int) -> list[int]:
        weights = self.weights_at(step)
        key = (weights, total)
        sizes = self._cache.get(key)
        if sizes is None:
            min_size = self.min_size if total >= self.min_size * self.world_size else 1
            sizes = self._cache[key] = split_batch(total, weights, min_size, self.max_sizes)
        return sizes

    def change(self, from_step: int, weights: Sequence[float]) -> None:
        """From ``from_step`` on, split by ``weights`` (steps before keep what they had)."""
        if len(weights) != self.world_size:
            raise ValueError(f"{len(weights)} weights for {self.world_size} ranks")
        if from_step <= self.changes[-1][0]:
            raise ValueError(f"a change from step {from_step} would rewrite steps already planned "
                             f"(the last change starts at {self.changes[-1][0]})")
        self.changes.append((from_step, tuple(float(w) for w in weights)))

    def state_dict(self) -> dict:
        return {"changes": [[first, list(weights)] for first, weights in self.changes]}

    def load_state_dict(self, state: dict) -> None:
        self.changes = [(int(first), tuple(float(w) for w in weights)) for first, weights in state["changes"]]
        self._cache.clear()

    def carry_over(self, state: dict, old_identities: Optional[Sequence[str]],
                   new_identities: Optional[Sequence[str]]) -> None:
        """Take over a plan saved at another world size (an elastic restart): each rank that was in the old world
        (the same identity, :func:`lightning_dist.identities.node_identity`) keeps its last weight (its measured or
        given speed), a newcomer gets the mean of the old weights; without identities, every rank weighs the same."""
        old = [float(w) for w in state["changes"][-1][1]]
        if old_identities is None or new_identities is None or len(old_identities) != len(old):
            weights = [1.0] * self.world_size
        else:
            mean = sum(old) / len(old)
            weights = [old[r] if r is not None else mean for r in map_ranks(old_identities, new_identities)]
        self.changes = [(0, tuple(weights))]
        self._cache.clear()

