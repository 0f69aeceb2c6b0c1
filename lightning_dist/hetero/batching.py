"""``HeteroBatching``: per-rank batch sizes that follow each rank's speed, for ``RingDDPStrategy(hetero=...)``.

Three ways to size, one mechanism:

- ``batch_sizes=[48, 16]``: fixed sizes (they must add up to the global batch);
- ``speeds=[3, 1]``: fixed sizes proportional to given relative speeds;
- neither: start even and **rebalance online** from measured throughput.

The global batch ``B`` (default: world size x the training loader's batch size) never changes, so the
optimisation is the same as uniform training's; only who computes which sample changes (see
:mod:`.sampler`). Gradients are weighted by sample count (each rank's share, :meth:`HeteroBatching.share`), so a step
equals one single-process step over the union of the ranks' batches, for a loss that is a mean over the
samples of a batch (token-level losses would need token counts instead).

Per-rank gradient accumulation (``accumulate``). A rank whose share of a step does not fit its memory
(``memory_caps``, ``max_batch_size``) keeps its share and runs it as ``ceil(share / cap)`` micro-batches inside the
one training step (``accumulate="auto"``, the default when a cap is set), or as a given number per rank
(``accumulate=[1, 3]``); the strategy runs them (:mod:`lightning_dist.strategy.micro`). With ``accumulate="off"`` a cap
bounds the share instead, and the samples it leaves go to the other ranks.

Online rebalancing. Every rank's compute time and sample count per step (``compute_s``: forward and backward
less the communication backward waited for, so a fast rank's waiting for a slow one is not counted as its
work) ride on the strategy's per-step exchange; every rank keeps the same moving window of them, so
every rank reaches the same decision without a collective of its own. When the spread of the window's mean
compute times, ``max / min - 1``, exceeds ``threshold``, the sizes change to ones that equalise compute
time (from a time model per rank, ``a_i + c_i b``, fitted to the sizes measured before and after the last
change; with one measurement, proportional to throughput), at the next epoch boundary, and with
``every_n_steps`` also within an epoch, taking effect past what the DataLoader has already fetched. Once
new sizes are in force the window starts afresh (hysteresis: no decision on a mix of old and new sizes).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from lightning_dist.hetero.loader import hetero_dataloader, prefetch_horizon
from lightning_dist.hetero.plan import BatchPlan, micro_batch_sizes, split_batch


@dataclass
class HeteroBatching:
    """Settings for heterogeneous batching (a dict of the same keys works too, as Hydra gives it).

    Args:
        speeds: relative speeds per rank (> 0): fixed sizes proportional to them.
        batch_sizes: fixed per-rank sizes; they must add up to ``global_batch_size``.
        global_batch_size: ``B``; None: world size x the training loader's ``batch_size``.
        min_batch_size: the least a rank gets (>= 1).
        max_batch_size: the most a rank gets (None: no limit).
        memory_caps: per-rank limits (samples that fit in each rank's memory); None: none.
        accumulate: how a rank fits a share above its cap: ``"auto"`` (default when ``memory_caps`` or
            ``max_batch_size`` is set) runs it as ``ceil(share / cap)`` micro-batches in one step, so shares follow
            speed alone; a list of per-rank counts (``[1, 3]``: rank 1 runs its share as 3 micro-batches, each at most
            the cap); ``"off"`` (the default without a cap): a cap bounds the share and moves samples to other ranks.
        rebalance: rebalance online from measured speed (default: when neither speeds nor batch_sizes is given).
        every_n_steps: also rebalance within an epoch, every this many steps (None: at epoch boundaries only).
        window: steps of measurements a decision is based on.
        threshold: the compute-time spread (max / min - 1) above which sizes change.
        elastic: the same global batches at every world size, each sample once per epoch (an elastic run under
            ``torchrun --nnodes MIN:MAX``, :mod:`lightning_dist.elastic`); needs ``global_batch_size``.
    """

    speeds: Optional[list[float]] = None
    batch_sizes: Optional[list[int]] = None
    global_batch_size: Optional[int] = None
    min_batch_size: int = 1
    max_batch_size: Optional[int] = None
    memory_caps: Optional[list[int]] = None
    accumulate: Union[str, list[int], None] = None
    rebalance: Optional[bool] = None
    every_n_steps: Optional[int] = None
    window: int = 10
    threshold: float = 0.05
    elastic: bool = False
    # runtime state (not settings)
    identities: Optional[list[str]] = field(default=None, init=False, repr=False)  # every rank's, elastic runs
    # DiLoCo under elastic restarts: (first unsynced global batch, old ranks whose workers were lost); the loader
    # trains their pieces since then again (lightning_dist.hetero.loader)
    lost_workers: Optional[tuple[int, list[int]]] = field(default=None, init=False, repr=False)
    plan: Optional[BatchPlan] = field(default=None, init=False, repr=False)
    global_batch: int = field(default=0, init=False, repr=False)
    sampler: Any = field(default=None, init=False, repr=False)  # this rank's HeteroBatchSampler, once built
    horizon: int = field(default=2, init=False, repr=False)  # batches the loader may have drawn ahead
    events: list[dict[str, Any]] = field(default_factory=list, init=False, repr=False)
    _window: deque = field(default_factory=deque, init=False, repr=False)
    _previous: Optional[list[tuple[float, float]]] = field(default=None, init=False, repr=False)
    _last_point: Optional[list[tuple[float, float]]] = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        problems = []
        if self.speeds is not None and self.batch_sizes is not None:
            problems.append("give speeds or batch_sizes, not both")
        if self.speeds is not None and any(not _positive(s) for s in self.speeds):
            problems.append(f"speeds={self.speeds}: every speed must be a number > 0")
        if self.batch_sizes is not None and any(not (isinstance(b, int) and b >= 1) for b in self.batch_sizes):
            problems.append(f"batch_sizes={self.batch_sizes}: every size must be an int >= 1")
        if self.global_batch_size is not None and not (isinstance(self.global_batch_size, int)
                                                       and self.global_batch_size >= 1):
            problems.append(f"global_batch_size={self.global_batch_size}: an int >= 1, or None")
        if not (isinstance(self.min_batch_size, int) and self.min_batch_size >= 1):
            problems.append(f"min_batch_size={self.min_batch_size}: an int >= 1")
        if self.max_batch_size is not None and not (isinstance(self.max_batch_size, int)
                                                    and self.max_batch_size >= self.min_batch_size):
            problems.append(f"max_batch_size={self.max_batch_size}: an int >= min_batch_size, or None")
        if self.memory_caps is not None and any(not (isinstance(c, int) and c >= 1) for c in self.memory_caps):
            problems.append(f"memory_caps={self.memory_caps}: every cap must be an int >= 1 (samples)")
        if isinstance(self.accumulate, Sequence) and not isinstance(self.accumulate, str):
            self.accumulate = list(self.accumulate)
            if not self.accumulate or any(not (isinstance(k, int) and not isinstance(k, bool) and k >= 1)
                                          for k in self.accumulate):
                problems.append(f"accumulate={self.accumulate}: every per-rank count of micro-batches must be an int "
                                ">= 1 (1: the share in one pass)")
        elif self.accumulate not in (None, "auto", "off"):
            problems.append(f"accumulate={self.accumulate!r}: use 'auto' (micro-batches as the memory caps need), "
                            "'off' (caps move samples to other ranks) or per-rank counts such as [1, 3]")
        if self.every_n_steps is not None and not (isinstance(self.every_n_steps, int) and self.every_n_steps >= 1):
            problems.append(f"every_n_steps={self.every_n_steps}: an int >= 1, or None")
        if not (isinstance(self.window, int) and self.window >= 1):
            problems.append(f"window={self.window}: an int >= 1 (steps)")
        if not (_positive(self.threshold) or self.threshold == 0):
            problems.append(f"threshold={self.threshold}: a compute-time spread >= 0, e.g. 0.05")
        if self.elastic and self.global_batch_size is None:
            problems.append("elastic=true needs a fixed global_batch_size (the global batch must not change with the "
                            "world size), e.g. global_batch_size=96")
        if self.elastic and (self.speeds is not None or self.batch_sizes is not None or self.memory_caps is not None
                             or isinstance(self.accumulate, list)):
            problems.append("elastic=true with per-rank lists (speeds, batch_sizes, memory_caps, accumulate): the "
                            "ranks change with the world; use online rebalancing, max_batch_size (with "
                            "accumulate='auto'), or drop elastic")
        if self.rebalance and self.batch_sizes is not None:
            problems.append("rebalance=true with fixed batch_sizes: drop one of them")
        if problems:
            raise ValueError("invalid HeteroBatching:\n  " + "\n  ".join(problems))
        if self.rebalance is None:
            self.rebalance = self.speeds is None and self.batch_sizes is None
        if self.accumulate is None:
            self.accumulate = "off" if self.max_batch_size is None and self.memory_caps is None else "auto"

    # -- checks that need the world size / the loader -------------------------------------------------------
    def check_world(self, world_size: int) -> None:
        """Lengths against the world size: called in the launching process, before any rank starts."""
        counts = ("accumulate",) if isinstance(self.accumulate, list) else ()
        for name in ("speeds", "batch_sizes", "memory_caps", *counts):
            value = getattr(self, name)
            if value is not None and len(value) != world_size:
                raise ValueError(f"hetero.{name}={value} has {len(value)} entries for {world_size} ranks: give one "
                                 "per rank")
        if self.batch_sizes is not None and self.global_batch_size is not None \
                and sum(self.batch_sizes) != self.global_batch_size:
            raise ValueError(f"hetero.batch_sizes={self.batch_sizes} add up to {sum(self.batch_sizes)}, not the global "
                             f"batch {self.global_batch_size}")

    def make_plan(self, world_size: int, loader_batch_size: int) -> BatchPlan:
        """The plan for a fit: B, the bounds, and the first weights."""
        self.check_world(world_size)
        total = self.global_batch_size or world_size * loader_batch_size
        if self.batch_sizes is not None and sum(self.batch_sizes) != total:
            raise ValueError(f"hetero.batch_sizes={self.batch_sizes} add up to {sum(self.batch_sizes)}, not the global "
                             f"batch {total} (world size {world_size} x the loader's batch size {loader_batch_size}); "
                             "make them add up, or set hetero.global_batch_size")
        caps = self.share_caps(world_size, total)
        weights = list(self.batch_sizes or self.speeds or [1.0] * world_size)
        split_batch(total, weights, self.min_batch_size, caps)  # raises now if the bounds cannot hold B
        self.plan = BatchPlan(world_size, weights, self.min_batch_size, caps)
        self.global_batch = total
        self._window.clear()
        self._previous = None
        return self.plan

    def share_caps(self, world_size: int, total: int) -> Optional[list[int]]:
        """The most samples a share may hold, per rank: the cap itself with ``accumulate="off"``, ``count x cap``
        with per-rank counts, none with ``"auto"`` (micro-batches absorb any share)."""
        caps = self.micro_caps(world_size, total)
        if caps is None or self.accumulate == "auto":
            return None
        if isinstance(self.accumulate, list):
            return [k * c for k, c in zip(self.accumulate, caps)]
        return caps

    def micro_caps(self, world_size: int, total: int) -> Optional[list[int]]:
        """Per rank, the most samples one pass (a micro-batch) may hold: ``max_batch_size`` and ``memory_caps``."""
        if self.max_batch_size is None and self.memory_caps is None:
            return None
        caps = [self.max_batch_size or total] * world_size
        if self.memory_caps is not None:
            caps = [min(c, m) for c, m in zip(caps, self.memory_caps)]
        return caps

    @property
    def accumulates(self) -> bool:
        """Whether a rank may run its share as several micro-batches (``accumulate`` is on)."""
        if isinstance(self.accumulate, list):
            return max(self.accumulate) > 1
        return self.accumulate == "auto" and self.micro_caps(1, 1) is not None

    def without_micro_batches(self) -> Optional[str]:
        """Under manual optimization (the user's ``training_step`` runs backward itself, so nobody else can cut it into
        micro-batches): per-rank counts above 1 are refused; ``"auto"`` becomes ``"off"``, the caps bounding the
        shares. Returns what changed, if anything."""
        if isinstance(self.accumulate, list) and max(self.accumulate) > 1:
            raise ValueError(f"hetero.accumulate={self.accumulate} needs automatic optimization: under manual "
                             "optimization training_step runs its own backward, which cannot be cut into "
                             "micro-batches; accumulate in training_step yourself and set hetero.accumulate='off'")
        if not self.accumulates:
            return None
        self.accumulate = "off"
        return ("manual optimization: hetero.accumulate='auto' becomes 'off' (the memory caps bound each rank's share, "
                "and the samples they leave go to the other ranks)")

    def micro_sizes(self, epoch: int, batch_idx: int, rank: int) -> list[int]:
        """Rank ``rank``'s micro-batches of batch ``batch_idx`` of ``epoch``: its share, cut into as many near-equal
        pieces as its cap needs (``"auto"``) or as its count says; ``[share]`` with ``accumulate="off"``."""
        share = self.sampler.sizes(epoch, batch_idx)[rank]
        if isinstance(self.accumulate, list):
            return micro_batch_sizes(share, count=self.accumulate[rank])
        caps = self.micro_caps(self.plan.world_size, self.global_batch) if self.accumulate == "auto" else None
        return micro_batch_sizes(share, cap=None if caps is None else caps[rank])

    # -- each step ------------------------------------------------------------------------------------------
    def observe(self, compute_s: Sequence[float], samples: Sequence[float]) -> None:
        """Every rank's compute time and samples of one step (the same values on every rank)."""
        if min(samples) <= 0 or min(compute_s) <= 0:
            return  # a step without measurements (the first one)
        if self._window and self._window[-1][1] != tuple(samples):
            self._window.clear()  # new sizes took effect (or the epoch's short last batch): measure them afresh
        self._window.append((tuple(compute_s), tuple(samples)))
        while len(self._window) > self.window:
            self._window.popleft()

    def spread(self) -> Optional[float]:
        """max / min - 1 of the window's mean compute time per step (None: the window is not full)."""
        if len(self._window) < self.window:
            return None
        n = len(self._window[0][0])
        times = [sum(row[0][r] for row in self._window) / len(self._window) for r in range(n)]
        return max(times) / min(times) - 1.0

    def throughput(self) -> list[float]:
        """Samples per second of compute, per rank, over the window."""
        n = len(self._window[0][0])
        return [sum(row[1][r] for row in self._window) / sum(row[0][r] for row in self._window) for r in range(n)]

    def balanced_sizes(self) -> list[float]:
        """Real-valued sizes that give every rank the same compute time, by a time model per rank.

        A step on rank ``i`` takes ``a_i + c_i b`` (a fixed part, and a part per sample). With measurements at
        two different sizes (the window now and the one before the last change) both are fitted; with one,
        ``a_i = 0`` (time proportional to samples, i.e. sizes proportional to throughput). Equal times ``T``
        with ``sum b_i = B`` give ``b_i = (T - a_i) / c_i``, ``T = (B + sum a_i / c_i) / sum 1 / c_i``.
        """
        n = len(self._window[0][0])
        now = [(self._window[-1][1][r], sum(row[0][r] for row in self._window) / len(self._window)) for r in range(n)]
        fixed, per_sample = [], []
        for r, (b, t) in enumerate(now):
            a, c = 0.0, t / b
            if self._previous is not None:
                b0, t0 = self._previous[r]
                slope = (t - t0) / (b - b0) if b0 != b else 0.0
                # a fit through two noisy points can be wild: keep it only where it is plausible (a fixed part
                # of at most 80% of the step); otherwise time is taken as proportional to samples
                if 0.2 * t / b <= slope <= t / b:
                    c, a = slope, t - slope * b
            fixed.append(a)
            per_sample.append(c)
        self._last_point = now
        equal = (self.global_batch + sum(a / c for a, c in zip(fixed, per_sample))) / sum(1 / c for c in per_sample)
        return [max((equal - a) / c, 1e-6) for a, c in zip(fixed, per_sample)]

    def after_exchange(self, compute_s: Sequence[float], samples: Sequence[float], step: int,
                       batches_in_epoch: int) -> Optional[dict[str, Any]]:
        """The strategy's hand-over after each exchange: observe the step, and decide when a decision is due.

        Due at the epoch's last batch (new sizes from the next epoch, whose sampler has not started yet) and,
        with ``every_n_steps``, every that many optimizer steps (new sizes past what the loader may already have
        drawn). Returns the rebalance event, if any.
        """
        self.observe(compute_s, samples)
        epoch, next_batch = self.sampler.consumed
        per_epoch = self.sampler.steps_per_epoch
        current = epoch * per_epoch + next_batch - 1
        if next_batch >= min(per_epoch, batches_in_epoch):
            first = (epoch + 1) * per_epoch
        elif self.every_n_steps and (step + 1) % self.every_n_steps == 0:
            first = current + self.horizon + 1
        else:
            return None
        return self.maybe_rebalance(current, first)

    def maybe_rebalance(self, step: int, from_step: int) -> Optional[dict[str, Any]]:
        """Decide at ``step`` (the same on every rank); a change applies from ``from_step``. Returns the event."""
        spread = self.spread()
        if not self.rebalance or self.plan is None or spread is None or spread <= self.threshold:
            return None
        old = self.plan.sizes_at(from_step, self.global_batch)
        weights = self.balanced_sizes()
        new = split_batch(self.global_batch, weights, self.plan.min_size, self.plan.max_sizes)
        if new == old:
            return None
        self.plan.change(from_step, weights)
        self._previous = self._last_point  # the point the next fit of the time model starts from
        self._window.clear()  # hysteresis: the next decision sees only the new sizes
        event = {"step": step, "from_step": from_step, "spread": spread, "old": old, "new": new}
        if self.plan.max_sizes is not None:  # does a cap hold a fast rank back? what it costs, by the weights
            free = split_batch(self.global_batch, weights, self.plan.min_size)
            if free != new:
                slowest = max(b / w for b, w in zip(new, weights)) / max(b / w for b, w in zip(free, weights))
                event["capped"] = {"without_caps": free, "step_time_lost": slowest - 1.0}
        self.events.append(event)
        return event

    # -- the strategy's hand-overs during a fit --------------------------------------------------------------
    def training_loader(self, dataloader: Any, world_size: int, rank: int) -> Any:
        """This rank's training loader, rebuilt around the plan (:func:`~lightning_dist.hetero.hetero_dataloader`),
        whose sampler the fit's hand-overs below drive."""
        loader = hetero_dataloader(dataloader, self, world_size, rank)
        self.sampler, self.horizon = loader.batch_sampler, prefetch_horizon(loader)
        return loader

    @property
    def attached(self) -> bool:
        return self.sampler is not None

    def start_batch(self, epoch: int, batch_idx: int, rank: int, among: Optional[Sequence[int]] = None) -> float:
        """Batch ``batch_idx`` of ``epoch`` starts on this rank: mark it consumed (rebalancing never changes a
        batch the loop has reached) and return this rank's :meth:`share` of it."""
        self.sampler.consumed = (epoch, batch_idx + 1)
        return self.share(epoch, batch_idx, rank, among)

    def sizes_of(self, epoch: int, batch_idx: int) -> list[int]:
        """Every rank's size of batch ``batch_idx`` of ``epoch``, from the plan every rank holds."""
        return list(self.sampler.sizes(epoch, batch_idx))

    def finish_step(self) -> None:
        """An optimizer step ended (taken or skipped): every batch started so far is done with; a checkpoint written
        from now on resumes after them (:meth:`~lightning_dist.hetero.loader.HeteroDataLoader.state_dict`)."""
        self.sampler.completed = self.sampler.consumed

    def share(self, epoch: int, batch_idx: int, rank: int, among: Optional[Sequence[int]] = None) -> float:
        """What rank ``rank``'s loss gradient for batch ``batch_idx`` of ``epoch`` is multiplied by: its share of
        the global batch, from the plan (every rank knows every rank's size for every batch before any gradient
        travels), so the sum over ranks is the mean over every sample of the global batch.

        Under gradient accumulation Lightning divides each micro-batch's loss by ``accumulate_grad_batches``;
        with every global batch of a window holding ``B`` samples that makes the step the mean over all of the
        window's samples. (The epoch's last window may hold a smaller batch, or fewer batches; then Lightning,
        and stock DDP with it, weighs each micro-batch's mean alike: so does this, to train the same weights.)

        ``among``: the ranks whose gradients this rank's is averaged with (syncing every H steps, the ranks of its
        worker: :mod:`lightning_dist.sync`); None: every rank.
        """
        sizes = self.sampler.sizes(epoch, batch_idx)
        return sizes[rank] / sum(sizes[r] for r in (range(len(sizes)) if among is None else among))


def describe_event(event: dict[str, Any]) -> list[str]:
    """What a rebalance event says in the log: the new sizes, and what a binding cap costs."""
    lines = [f"compute-time spread {100 * event['spread']:.1f}% -> batch sizes {event['old']} -> {event['new']} "
             f"from batch {event['from_step']}"]
    if "capped" in event:
        lines.append(f"a batch-size cap binds: {event['new']} instead of {event['capped']['without_caps']}, "
                     f"~{100 * event['capped']['step_time_lost']:.0f}% longer steps than without it")
    return lines


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def as_hetero(hetero: Any) -> Optional[HeteroBatching]:
    """What ``RingDDPStrategy(hetero=...)`` accepts: a HeteroBatching, a dict of its arguments (Hydra's), or None
    (a dict with ``enabled: false``, Hydra's ``hetero=none``, is None too)."""
    if hetero is None or isinstance(hetero, HeteroBatching):
        return hetero
    if isinstance(hetero, Mapping):  # a dict, or Hydra's DictConfig
        options = {k: list(v) if isinstance(v, Sequence) and not isinstance(v, str) else v
                   for k, v in hetero.items() if k not in ("_target_", "enabled")}
        if not hetero.get("enabled", True):
            return None
        try:
            return HeteroBatching(**options)
        except TypeError as err:
            raise ValueError(f"hetero={hetero}: {err}") from None
    raise ValueError(f"hetero={hetero!r}: pass a lightning_dist.hetero.HeteroBatching, a dict of its arguments or None")
