"""``sync="auto"``'s decision, pure: from what the fit measured (the compute-only step, each bucket's ready time, every
candidate codec's coding and wire time and bytes on the real buckets and links) and the optimizer family, the way of
syncing that reaches dense quality soonest.

The rule (docs/auto.md):

1. **Candidates.** Dense every step; each per-step compressor measured; OneBitAdam (Adam or AdamW only); DiLoCo at the
   H and pseudo-gradient codecs the product measured quality for (:data:`DILOCO_CANDIDATES`).
2. **Predicted step.** A per-step method: the compute-only step plus what the communication worker's FIFO queue of
   buckets runs past backward's end (:func:`predict_step`). OneBitAdam: the compute-only step plus every bucket through
   ``sign`` and every ``refresh``-th step through ``int4``. DiLoCo: the compute-only step plus the sync's coding and
   wire over H.
3. **Quality.** Each candidate's cost from the product's measured tables (:data:`QUALITY`): a per-step compressor's
   measured cost must be within the bound for the optimizer family (Adam: the LM's held-out loss, at most
   :data:`ADAM_LOSS_BOUND`; SGD: the digits job's accuracy, at most :data:`SGD_ACCURACY_BOUND` points; a cost never
   measured excludes it); DiLoCo and OneBitAdam carry a *steps factor*, the steps they need to reach the loss dense
   reaches in one (DiLoCo's by optimizer family: Adam's measured on the sync benchmark's LM, SGD's on the digits job).
4. **Limits** the user sets narrow the candidates: bytes per step, or no change to the optimisation (dense and the
   lossless casts only).
5. **Choice.** The least predicted seconds per dense-equivalent step (predicted step x steps factor), unless dense is
   within :data:`DENSE_MARGIN` of it: then dense (what cannot pay for its risk is not taken).

Not every candidate is measured: :mod:`~lightning_dist.sync.auto_bound` measures only what can change the decision.

Every input is the same on every rank (the measurements are agreed first, each figure its maximum over the ranks), so
the decision is the same on every rank.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Optional, Sequence

DENSE = "none"  # the dense codec's name (build_compressor's)
ADAM, SGD, OTHER = "adam", "sgd", "other"  # optimizer families
ADAM_LOSS_BOUND = 0.01  # Adam: a per-step compressor with a measured held-out loss cost above this is excluded
SGD_ACCURACY_BOUND = 1.0  # SGD: ... with a measured accuracy cost above this many points is excluded
DENSE_MARGIN = 0.05  # a method must beat dense's predicted time by more than this to be chosen
# The fewest syncs left in the fit for a DiLoCo to be a candidate, by optimizer family and workers. Adam (the LM), 4
# flat workers: its quality was measured at 32 syncs (1,600 steps at H=50), and at 16 (800 steps) it ends +5.5% above
# dense, at 8 +8.7%; 2 workers of 2 ranks (two_tier): at 16 syncs H=50 reaches dense's own final loss (the auto
# benchmark, 800 steps). SGD (the digits job, 800 steps): at 16 syncs H=50 reaches dense's final loss by step 550 on
# both. Another family counts as Adam.
MIN_SYNCS = {ADAM: {"flat": 24, "two_tier": 16}, SGD: {"flat": 16, "two_tier": 16}}

# What the product measured of each per-step compressor's quality, by optimizer family: (cost, unit, source).
# Adam: the sync benchmark's LM (ByteLM 0.47 M, AdamW, 4 ranks, 1,600 steps), held-out loss above dense's, as a
# fraction. SGD: the compression benchmark's digits job, validation accuracy below dense's, in points (its table is
# lightning_dist.compression.accuracy.ACCURACY_COST: measured with Adam on the small CNN, where the casts and int8 cost
# nothing and top-k 1% + EF five points; the LM shows top-k far worse under AdamW).
QUALITY: dict[tuple[str, str], tuple[float, str, str]] = {
    ("topk", ADAM): (0.3465, "loss", "docs/benchmarks.md#fig-topk-lm1600 (+34.65%)"),
    ("fp16", SGD): (-0.09, "pt", "digits 98.33% vs 98.24%"),
    ("bf16", SGD): (0.09, "pt", "digits 98.15% vs 98.24%"),
    ("int8", SGD): (-0.09, "pt", "digits, EF: 98.33% vs 98.24%"),
    ("int4", SGD): (-0.09, "pt", "digits, EF: 98.24% vs 98.15%"),
    ("powersgd", SGD): (0.55, "pt", "digits r2, start_step=2, EF: 97.69% vs 98.24%"),
    ("topk", SGD): (5.0, "pt", "digits 1%, EF: 93.24% vs 98.24%"),
    ("threshold", SGD): (1.48, "pt", "digits 0.1, EF: 96.76% vs 98.24%"),
    ("sign", SGD): (5.28, "pt", "digits chunk 256, EF: 92.87% vs 98.15%"),
}
LOSSLESS = ("fp16", "bf16")  # casts: what "no change to the optimisation" still allows beside dense


@dataclass(frozen=True)
class StepsFactor:
    """The steps a DiLoCo needs per dense step to reach the loss dense reaches, measured on one job: by workers
    (``flat``: a worker per rank; ``two_tier``: a worker per host), and where it was measured."""

    flat: float
    hosts: float
    source: str

    def of(self, workers: str) -> float:
        return self.hosts if workers == "two_tier" else self.flat


@dataclass(frozen=True)
class DiLoCoCandidate:
    """A DiLoCo the product measured: H, its pseudo-gradient codec, and its steps factor per optimizer family (Adam's
    on the LM, SGD's on the digits job; another family counts as Adam)."""

    every: int
    codec: str  # DENSE or a codec name
    adam: StepsFactor
    sgd: StepsFactor

    @property
    def label(self) -> str:
        return f"diloco{self.every}" + ("" if self.codec == DENSE else f"/{self.codec}")

    def factor(self, optimizer: str) -> StepsFactor:
        return self.sgd if optimizer == SGD else self.adam


# Adam: from the sync benchmark's LM at a constant rate (docs/benchmarks.md, the tables of commits f0f7c1b and a46a766):
# dense DDP's time to the method's final loss over its steps' time gives the dense steps to that loss; the factor is the
# method's 1,600 steps over them. Flat (4 workers of one rank): H=50 1,600 / 1,306; H=50 int8 1,600 / 1,294; H=10 int8
# 1,600 / 1,000. Two workers of 2 ranks: H=50 reaches dense's own final loss at about its step count (1.0); H=10 int8
# ends above it, dense reaching its loss at step 1,195 (1.34).
# SGD: from the auto benchmark's digits job (DigitsCNN, SGD with momentum 0.9 at 2e-3, 800 steps, docs/benchmarks.md):
# the step where the method's held-out loss first reaches dense's final loss over dense's 800. DiLoCo is faster than
# dense there (its outer Nesterov step adds the momentum a low SGD rate lacks): H=10 int8 at step 340 (0.43), H=50 at
# step 550 (0.69), on 4 flat workers and on 2 of 2 ranks alike.
DILOCO_CANDIDATES = (
    DiLoCoCandidate(50, DENSE, StepsFactor(1.23, 1.0, "LM 1,600 steps: flat +1.13% at equal samples, 2 hosts -2.41%"),
                    StepsFactor(0.69, 0.69, "digits 800 steps: dense's final loss at step 550, flat and 2 hosts")),
    DiLoCoCandidate(50, "int8", StepsFactor(1.24, 1.0, "LM 1,600 steps: flat +1.10% at equal samples, 2 hosts "
                                                       "-2.20%"),
                    StepsFactor(0.69, 0.69, "digits 800 steps: dense's final loss at step 550, flat and 2 hosts")),
    DiLoCoCandidate(10, "int8", StepsFactor(1.6, 1.34, "LM 1,600 steps: flat +4.59% at equal samples, 2 hosts +1.77%"),
                    StepsFactor(0.43, 0.43, "digits 800 steps: dense's final loss at step 340, flat and 2 hosts")),
)


def diloco_codecs() -> list[str]:
    """DiLoCo's pseudo-gradient codecs among the candidates, in one order on every rank (each rank measures them in
    this order: a collective each)."""
    return list(dict.fromkeys(d.codec for d in DILOCO_CANDIDATES))


# OneBitAdam's steps factor: within a percent of dense at equal samples under constant, cosine and WSD rates (measured
# -0.44% to +1.39%), counted as dense's
ONEBIT_FACTOR, ONEBIT_SOURCE = 1.0, "LM within 1% of dense AdamW at equal samples (docs/onebit-adam.md)"
ONEBIT_REFRESH = 25  # OneBitAdam's default refresh: every 25th step the gradient travels through int4
ONEBIT_CODECS = ("sign", "int4")  # OneBitAdam's two codecs, measured under Adam


def replay(ready_s: Sequence[float], cost_s: Sequence[float]) -> float:
    """When the communication worker finishes the last bucket: FIFO, bucket ``i`` handed over at ``ready_s[i]``
    (ascending, from a common start) and busy for ``cost_s[i]``."""
    if len(ready_s) != len(cost_s):
        raise ValueError(f"{len(ready_s)} ready times for {len(cost_s)} bucket costs")
    free = 0.0
    for ready, cost in zip(ready_s, cost_s):
        free = max(free, ready) + cost
    return free


def predict_step(compute_s: float, ready_s: Sequence[float], cost_s: Sequence[float]) -> float:
    """The step time: the compute-only step plus what the replayed communication adds past backward's end (the
    last hand-over, ``ready_s[-1]``)."""
    if not ready_s:
        return compute_s
    return compute_s + max(0.0, replay(ready_s, cost_s) - ready_s[-1])


def family(optimizers: Sequence[Any]) -> str:
    """The optimizer family: ``adam`` (Adam, AdamW), ``sgd`` (SGD), else ``other`` (treated as Adam is: a per-step
    compressor is a candidate only where its cost was measured for this family)."""
    import torch

    if optimizers and all(isinstance(o, torch.optim.Adam) or isinstance(o, torch.optim.AdamW) for o in optimizers):
        return ADAM
    if optimizers and all(isinstance(o, torch.optim.SGD) for o in optimizers):
        return SGD
    return OTHER


@dataclass(frozen=True)
class Limits:
    """What the user allows ``auto`` to choose (``Auto(max_bytes_per_step=..., exact=...)``)."""

    max_bytes_per_step: Optional[float] = None  # bytes this rank sends per step, at most (None: any)
    exact: bool = False  # True: no change to the optimisation (dense and the lossless casts only)
    methods: Optional[tuple[str, ...]] = None  # only these labels (and dense, always measured), None: every one


@dataclass
class Row:
    """One candidate: what it is, what it is predicted to cost, and whether the rule may take it."""

    label: str  # "dense", a compressor's name, "onebit_adam", "diloco50", "diloco50/int8"
    kind: str  # "dense", "compressor", "onebit_adam", "diloco"
    predicted_step_s: Optional[float]  # None: not measured (excluded before any measurement)
    bytes_per_step: Optional[float]
    factor: float = 1.0  # steps per dense step to dense's loss
    quality: str = ""  # the measured quality it is judged by
    excluded: Optional[str] = None  # why the rule may not take it (None: it may)
    every: int = 1  # H (DiLoCo)
    codec: str = DENSE  # the compressor (per step) or the pseudo-gradient's codec (DiLoCo)

    @property
    def score(self) -> float:
        """Predicted seconds per dense-equivalent step (``inf``: not measured)."""
        return float("inf") if self.predicted_step_s is None else self.predicted_step_s * self.factor


@dataclass
class Decision:
    """The rule's answer: the chosen row's label, why, and every row (the table)."""

    choice: str
    why: str
    rows: list[Row] = field(default_factory=list)

    def row(self, label: Optional[str] = None) -> Row:
        label = self.choice if label is None else label
        return next(r for r in self.rows if r.label == label)

    def as_dict(self) -> dict[str, Any]:
        return {"choice": self.choice, "why": self.why, "rows": [asdict(r) for r in self.rows]}


def candidate_rows(measured: dict[str, Any], codecs: dict[str, dict[str, list[float]]], optimizer: str,
                   workers: str = "flat", across: Optional[dict[str, dict[str, list[float]]]] = None,
                   bytes_scale: float = 1.0, remaining_steps: float = float("inf"),
                   compressors: Optional[Sequence[str]] = None) -> list[Row]:
    """Every candidate with its predicted step, bytes and quality (the exclusions by quality, not yet by limits).

    Args:
        measured: the dense step: ``compute_s`` and ``ready_s`` (per bucket, ascending).
        codecs: per codec name, per bucket ``coding_s``, ``wire_s``, ``bytes`` over every rank (``none`` among them).
        optimizer: the family (:func:`family`).
        workers: ``flat`` (DiLoCo's workers are ranks) or ``two_tier`` (hosts).
        across: under ``two_tier``, per codec the sync's figures across hosts (this rank's part), else None.
        bytes_scale: a DiLoCo worker's bytes per byte measured in ``across`` (ranks per host).
        remaining_steps: the fit's steps after the decision (``inf``: unknown): a DiLoCo with fewer than
            :data:`MIN_SYNCS` (by family and ``workers``) syncs in them is excluded.
        compressors: the per-step compressors among ``codecs`` (None: every codec; the others are measured for
            OneBitAdam's and DiLoCo's rows only).
    """
    compute, ready = measured["compute_s"], measured["ready_s"]
    rows: list[Row] = []
    for name, c in codecs.items():
        cost = [a + b for a, b in zip(c["coding_s"], c["wire_s"])]
        step = predict_step(compute, ready, cost)
        if name == DENSE:
            rows.append(Row("dense", "dense", step, sum(c["bytes"]), quality="dense"))
            continue
        if compressors is not None and name not in compressors:
            continue
        quality, excluded = compressor_quality(name, optimizer)
        rows.append(Row(name, "compressor", step, sum(c["bytes"]), quality=quality, excluded=excluded, codec=name))
    for name in compressors or ():  # excluded by quality before any measurement: shown, never timed
        if name not in codecs:
            quality, excluded = compressor_quality(name, optimizer)
            rows.append(Row(name, "compressor", None, None, quality=quality,
                            excluded=f"{excluded} (not measured)" if excluded else "not measured", codec=name))
    if optimizer == ADAM and "sign" in codecs and "int4" in codecs:
        sign, int4 = codecs["sign"], codecs["int4"]
        step = (compute + sum(sign["coding_s"]) + sum(sign["wire_s"])
                + (sum(int4["coding_s"]) + sum(int4["wire_s"])) / ONEBIT_REFRESH)
        rows.append(Row("onebit_adam", "onebit_adam", step, sum(sign["bytes"]) + sum(int4["bytes"]) / ONEBIT_REFRESH,
                        factor=ONEBIT_FACTOR, quality=ONEBIT_SOURCE))
    sync = across if across is not None else codecs
    for d in DILOCO_CANDIDATES:
        if d.codec not in sync:
            continue
        c = sync[d.codec]
        seconds = sum(c["coding_s"]) + sum(c["wire_s"])
        quality = d.factor(optimizer)
        least = MIN_SYNCS[SGD if optimizer == SGD else ADAM][workers]
        # the last, partial cycle ends in the final sync (inf: the fit's length is unknown)
        syncs = math.ceil(remaining_steps / d.every) if math.isfinite(remaining_steps) else math.inf
        few = syncs < least
        rows.append(Row(d.label, "diloco", compute + seconds / d.every, bytes_scale * sum(c["bytes"]) / d.every,
                        factor=quality.of(workers), quality=quality.source, every=d.every, codec=d.codec,
                        excluded=(f"{remaining_steps:.0f} steps left hold {syncs} syncs, fewer "
                                  f"than the {least} its quality was measured at") if few else None))
    return rows


def candidate_codecs(optimizer: str, compressors: Sequence[str]) -> list[str]:
    """The codecs to measure, in one order on every rank: dense, the compressors the quality tables allow under this
    family (the others are shown excluded, unmeasured), OneBitAdam's under Adam, DiLoCo's pseudo-gradients'."""
    names = [DENSE, *(n for n in compressors if compressor_quality(n, optimizer)[1] is None)]
    if optimizer == ADAM:
        names += [n for n in ONEBIT_CODECS if n not in names]
    return names + [n for n in diloco_codecs() if n not in names]


def compressor_quality(name: str, optimizer: str) -> tuple[str, Optional[str]]:
    """A per-step compressor's measured quality under this optimizer family, and why it is excluded (None: it is
    not)."""
    measured = QUALITY.get((name, optimizer))
    if measured is None:
        return "not measured", f"its quality under {optimizer} was never measured"
    cost, unit, source = measured
    if unit == "loss":
        text = f"{cost:+.2%} loss ({source})"
        return text, (f"{cost:+.2%} held-out loss, above the {ADAM_LOSS_BOUND:.0%} bound" if cost > ADAM_LOSS_BOUND
                      else None)
    text = f"{-cost:+.2f} pt ({source})"
    return text, (f"{-cost:+.2f} pt accuracy, beyond the {SGD_ACCURACY_BOUND:.1f} pt bound" if cost > SGD_ACCURACY_BOUND
                  else None)


def limited(row: Row, limits: Limits) -> Optional[str]:
    """Why ``limits`` exclude ``row`` (None: they do not); a row whose bytes are not known yet is not excluded by
    bytes."""
    if limits.exact and row.kind != "dense" and row.label not in LOSSLESS:
        return "exact=True: it changes the optimisation"
    if limits.max_bytes_per_step is not None and (row.bytes_per_step or 0.0) > limits.max_bytes_per_step:
        return f"{row.bytes_per_step:.0f} bytes per step, above max_bytes_per_step={limits.max_bytes_per_step:.0f}"
    if limits.methods is not None and row.kind != "dense" and row.label not in limits.methods:
        return f"not among methods={list(limits.methods)}"
    return None


def decide(rows: Sequence[Row], limits: Limits = Limits()) -> Decision:
    """The choice among ``rows`` (with ``dense`` among them) under ``limits``: the least predicted seconds per
    dense-equivalent step, unless dense is within :data:`DENSE_MARGIN` of it."""
    rows = [Row(**asdict(r)) for r in rows]  # copies: the limits' exclusions are this decision's
    dense = next((r for r in rows if r.kind == "dense"), None)
    if dense is None:
        raise ValueError("auto: the dense row is missing (the base of every comparison)")
    for r in rows:
        if r.excluded is None:
            r.excluded = limited(r, limits)
    allowed = [r for r in rows if r.excluded is None]
    if not allowed:  # the fit goes on as it started: dense, and says why (raised, it would end a running fit)
        return Decision("dense", "no candidate is allowed (" + "; ".join(f"{r.label}: {r.excluded}" for r in rows)
                        + "): dense kept; raise max_bytes_per_step or widen methods=", rows)
    best = min(allowed, key=lambda r: (r.score, r.label))
    if best is dense:
        why = "dense is the fastest allowed"
    elif dense.excluded is None and dense.score <= best.score * (1 + DENSE_MARGIN):
        why = (f"{best.label} is predicted {dense.score / best.score:.2f}x faster than dense, within the "
               f"{DENSE_MARGIN:.0%} margin: dense kept")
        best = dense
    else:
        base = f"{dense.score / best.score:.2f}x dense's predicted time to the same loss" if dense.excluded is None \
            else f"dense excluded ({dense.excluded})"
        why = (f"{best.label}: {1e3 * best.predicted_step_s:.1f} ms per step x {best.factor:.2f} steps per dense "
               f"step = {1e3 * best.score:.1f} ms, {base}")
    return Decision(best.label, why, rows)


def table(decision: Decision) -> str:
    """The decision as the log prints it: every candidate, predicted step, bytes, quality, the choice and why."""
    width = max(12, *(len(r.label) + 2 for r in decision.rows))
    lines = [f"{'candidate':<{width}}{'step ms':>9}{'x steps':>9}{'ms/dense':>10}{'MB/step':>10}  quality / excluded"]
    for r in sorted(decision.rows, key=lambda r: (r.excluded is not None, r.score)):
        mark = "*" if r.label == decision.choice else " "
        if r.predicted_step_s is None:
            figures = f"{'-':>9}{r.factor:>9.2f}{'-':>10}{'-':>10}"
        else:
            mb = r.bytes_per_step / 1e6
            figures = (f"{1e3 * r.predicted_step_s:>9.1f}{r.factor:>9.2f}{1e3 * r.score:>10.1f}"
                       f"{mb if mb >= 0.01 else float(f'{mb:.1e}'):>10.3g}")
        lines.append(f"{mark}{r.label:<{width - 1}}{figures}  "
                     f"{r.quality if r.excluded is None else 'excluded: ' + r.excluded}")
    lines.append(f"auto chose {decision.choice}: {decision.why}")
    return "\n".join(lines)
