"""Which of ``sync="auto"``'s candidates to measure, pure: only what can change the decision.

A candidate's predicted step is at least the compute-only step (its communication costing nothing), so its seconds per
dense-equivalent step are at least the compute-only step x its steps factor (:mod:`~lightning_dist.sync.auto_rule`).
Candidates are measured from the least such bound up, and one whose bound cannot beat what is already measured (nor
keep dense within its margin) is shown as not measured: the choice is the one measuring every candidate would make,
for a part of the measurement (under SGD, DiLoCo's factor below 1 rules out every per-step method once its own sync
is measured).
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Sequence

from lightning_dist.sync.auto_rule import DENSE_MARGIN, ONEBIT_CODECS, Limits, Row, limited

FIGURES = ("coding_s", "wire_s", "bytes")
Figures = dict[str, list[float]]  # one codec's per bucket ``coding_s``, ``wire_s``, ``bytes``
Unit = tuple[str, str]  # what one measurement covers: (``flat``: every bucket over every rank, or ``across``: this
# rank's part across hosts, DiLoCo's sync under two_tier; a codec name)


def units_of(row: Row, workers: str) -> set[Unit]:
    """The measurements ``row``'s prediction reads."""
    if row.kind == "onebit_adam":
        return {("flat", codec) for codec in ONEBIT_CODECS}
    if row.kind == "diloco" and workers == "two_tier":
        return {("across", row.codec)}
    return {("flat", row.codec)}


def worth_measuring(rows: Sequence[Row], pending: dict[str, set[Unit]], limits: Limits) -> Optional[Unit]:
    """The measurement to make next, or None when no unmeasured candidate can change the decision.

    ``rows``: every candidate, each predicted with its unmeasured units at no cost (a lower bound on its score: the
    predicted step only grows with a codec's seconds); ``pending``: per label, its units not measured yet. A candidate
    can change the decision when its bound is at most the best measured score and, beside a measured dense, its bound
    within :data:`DENSE_MARGIN` would not leave dense kept (dense: when its bound is within the margin of the best).
    Of those, the one with the least bound goes first (dense first on a tie)."""
    allowed = [r for r in rows if r.excluded is None and limited(r, limits) is None]
    known = [r for r in allowed if not pending[r.label]]
    best = min((r.score for r in known), default=math.inf)
    dense = next((r for r in known if r.kind == "dense"), None)

    def can_win(r: Row) -> bool:
        if r.kind == "dense":
            return r.score <= best * (1 + DENSE_MARGIN)
        return r.score <= best and (dense is None or r.score * (1 + DENSE_MARGIN) < dense.score)

    open_ = sorted((r for r in allowed if pending[r.label] and can_win(r)),
                   key=lambda r: (r.score, r.kind != "dense", r.label))
    return min(pending[open_[0].label]) if open_ else None


def measure_what_can_win(rows_of: Callable[[dict[Unit, Figures]], list[Row]], zeros: dict[Unit, Figures],
                         measure: Callable[[Unit], Figures], workers: str, limits: Limits
                         ) -> tuple[list[Row], dict[Unit, Figures]]:
    """Every candidate's row, measuring only what can change the decision (:func:`worth_measuring`, until it has
    nothing left): ``rows_of`` builds the rows from per-unit figures, ``zeros`` holds every unit at no cost,
    ``measure`` makes one measurement (on every rank alike: a collective, its figures agreed). A candidate left
    unmeasured is excluded, with its bound and what it could not beat; the choice is the one measuring every candidate
    would make. Returns the rows and the figures measured."""
    known: dict[Unit, Figures] = {}
    while True:
        rows = rows_of({**zeros, **known})
        pending = {r.label: units_of(r, workers) - known.keys() for r in rows}
        unit = worth_measuring(rows, pending, limits)
        if unit is None:
            break
        known[unit] = measure(unit)
    measured = [r for r in rows if not pending[r.label] and r.excluded is None and limited(r, limits) is None]
    best = min(measured, key=lambda r: (r.score, r.label), default=None)
    dense = next((r for r in measured if r.kind == "dense"), None)
    for r in rows:
        if not pending[r.label]:
            continue
        score, r.predicted_step_s, r.bytes_per_step = r.score, None, None
        bound = f"at least {1e3 * score:.1f} ms per dense step"
        if r.excluded is not None or limited(r, limits) is not None:
            why = r.excluded or limited(r, limits)
            r.excluded = why if why.endswith("(not measured)") else f"{why} (not measured)"
        elif r.kind != "dense" and dense is not None and score * (1 + DENSE_MARGIN) >= dense.score:
            r.excluded = (f"not measured: {bound}, within the {DENSE_MARGIN:.0%} margin of dense's "
                          f"{1e3 * dense.score:.1f} ms")
        else:
            r.excluded = f"not measured: {bound}, above {best.label}'s {1e3 * best.score:.1f} ms"
    return rows, known


def no_cost(flat: Sequence[str], buckets: int, across: Sequence[str] = ()) -> dict[Unit, Figures]:
    """Every unit at no cost: ``flat`` codecs over ``buckets`` buckets, ``across`` codecs as one total each."""
    zeros = {("flat", c): {k: [0.0] * buckets for k in FIGURES} for c in flat}
    return {**zeros, **{("across", c): {k: [0.0] for k in FIGURES} for c in across}}
