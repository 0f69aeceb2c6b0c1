"""``sync="auto"``'s settings, checked before any process starts: :class:`AutoSettings`, to which
:class:`~lightning_dist.sync.auto.Auto` adds what binds them to a fit."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

from lightning_dist.compression import COMPRESSORS
from lightning_dist.sync.auto_rule import DENSE, DILOCO_CANDIDATES, Limits

# the per-step compressors measured by default (their conf/compression defaults)
COMPRESSOR_CANDIDATES = ("fp16", "int8", "powersgd", "topk")


@dataclass
class AutoSettings:
    """``sync="auto"``: measure during the fit's first dense steps, pick the way of syncing with the most progress per
    second under the product's quality tables, switch on every rank in the same step, pick again when the cluster
    changes (module docstring; docs/auto.md).

    Args:
        warmup_steps: dense steps first, not timed (DDP rebuilds its buckets after the first).
        steps: timed dense steps (their medians are the measurement).
        rounds: timed rounds of every candidate codec over the kept buckets (after one untimed round).
        long_s: a candidate whose untimed round took longer than this many seconds (a slow link's wire, which no
            warm-up changes) counts it as its one timed round: the measurement costs a few dense steps at most; and a
            first timed step whose communication left exposed after backward took longer than this on some rank ends
            the measuring steps there (one timed step, not ``steps``: on a slow link each dense step costs seconds).
        compressors: the per-step compressors measured, by name (their conf/compression defaults).
        max_bytes_per_step: bytes this rank may send per step, at most (None: any): dense is excluded below its own.
        exact: no change to the optimisation: dense and the lossless casts only.
        methods: only these candidates' labels (``"int8"``, ``"onebit_adam"``, ``"diloco50"``, ``"diloco50/int8"``,
            ...), dense always beside them; None: every one.
        drift: pick again when the mean step since the last check is this many times the prediction (0: never).
        check_every: optimizer steps between the drift checks (for DiLoCo: whole cycles of H, at least one).
    """

    warmup_steps: int = 1
    steps: int = 3
    rounds: int = 3
    long_s: float = 0.25
    compressors: Sequence[str] = COMPRESSOR_CANDIDATES
    max_bytes_per_step: Optional[float] = None
    exact: bool = False
    methods: Optional[Sequence[str]] = None
    drift: float = 2.0
    check_every: int = 50
    # what this fit's settings refuse, per candidate (refuses(), at set-up; read by bind)
    _refused: dict[str, str] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for key, low in (("warmup_steps", 1), ("steps", 1), ("rounds", 1), ("check_every", 1)):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"Auto({key}={value!r}): an int >= {low}")
        unknown = [n for n in self.compressors if n not in COMPRESSORS or n == DENSE]
        if unknown:
            raise ValueError(f"Auto(compressors={list(self.compressors)}): unknown {unknown}; choose from "
                             f"{[n for n in COMPRESSORS if n != DENSE]}")
        self.compressors = tuple(self.compressors)
        if self.methods is not None:
            known = {*self.compressors, "onebit_adam", *(d.label for d in DILOCO_CANDIDATES)}
            bad = [m for m in self.methods if m not in known]
            if bad:
                raise ValueError(f"Auto(methods={list(self.methods)}): unknown {bad}; choose from {sorted(known)}")
            self.methods = tuple(self.methods)
        if not self.long_s > 0:
            raise ValueError(f"Auto(long_s={self.long_s!r}): seconds, > 0")
        if self.max_bytes_per_step is not None and not self.max_bytes_per_step >= 0:
            raise ValueError(f"Auto(max_bytes_per_step={self.max_bytes_per_step!r}): bytes, >= 0, or None for any")
        if not (self.drift == 0 or self.drift > 1):
            raise ValueError(f"Auto(drift={self.drift!r}): a factor above 1 (2.0: twice the prediction), 0 for never")

    @property
    def limits(self) -> Limits:
        return Limits(self.max_bytes_per_step, self.exact, self.methods)

    def describe(self) -> str:
        extra = "".join(f", {k}={v!r}" for k, v in (("max_bytes_per_step", self.max_bytes_per_step),
                                                     ("exact", self.exact), ("methods", self.methods))
                        if v not in (None, False))
        return (f"Auto(measure={self.warmup_steps}+{self.steps}, rounds={self.rounds}, long_s={self.long_s}, "
                f"compressors={list(self.compressors)}, "
                f"drift={self.drift}, check_every={self.check_every}{extra})")
