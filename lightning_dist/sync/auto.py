"""``RingDDPStrategy(sync="auto")``: the fit measures its own links, model and optimizer, picks the way of syncing that
reaches dense quality soonest, and picks again when the cluster changes. docs/auto.md is the user's page.

How a fit goes:

1. **Measuring.** The first ``warmup_steps + steps`` optimizer steps run dense (every step's all-reduce through the comm
   hook, exactly as ``sync=None``). The timed steps record the step time, each bucket's ready time and the exposed
   communication (:class:`~lightning_dist.sync.auto_measure.BucketRecorder`), and keep a copy of the gradient buckets.
2. **Deciding**, after the last measuring step, on every rank: candidate codecs reduce copies of the real buckets over
   the real links (:func:`~lightning_dist.sync.auto_measure.measure_codecs`; under ``two_tier`` DiLoCo's also this
   rank's part across hosts, as its workers sync), each figure agreed (its maximum over the ranks), one codec at a
   time from the candidate with the least bound up, until no unmeasured candidate can change the decision
   (:func:`~lightning_dist.sync.auto_bound.measure_what_can_win`). The pure rule
   (:func:`~lightning_dist.sync.auto_rule.decide`) picks; the table, what was measured and its seconds go to the log.
3. **Switching**, in the same step on every rank: to a per-step compressor (the comm hook's, its ``start_step`` counted
   from the fit's start, so the measuring steps are its warm-up), to OneBitAdam (bound with its warm-up counted from
   the fit's start: the measuring steps were dense Adam steps) or to DiLoCo (bound from the parameters every rank
   holds, the measuring steps its dense start). The strategy re-derives what follows from the new driver's workers
   (:meth:`~lightning_dist.sync.SyncContext.regroup`).
4. **Watching.** Every ``check_every`` steps (for DiLoCo, whole cycles), the mean step time since the last check is
   agreed across ranks; above ``drift`` times the prediction (a link that degraded), the candidates are measured
   again on the kept buckets (as in 2) and the rule decides again. A different choice switches: DiLoCo lands what is
   in flight and ends on the workers' mean (its final sync), a compressor's residuals are flushed into the next step's
   gradient (:mod:`~lightning_dist.sync.auto_flush`), OneBitAdam's compressed momentum is dropped with a message.
5. **Resuming.** A checkpoint keeps the decision, its history and the cluster it was made on (world size, hosts). A
   resume on the same cluster binds the chosen method at once and restores its state; on a changed one (an elastic
   restart with another world size, a host joined or left) the fit measures and decides again.
"""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import asdict, dataclass
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_dist.compression import NoCompressor, build_compressor
from lightning_dist.sync.auto_bound import Figures, Unit, measure_what_can_win, no_cost
from lightning_dist.sync.auto_flush import OwedResiduals
from lightning_dist.sync.auto_measure import BucketRecorder, agree_step, conf_compressor, dense_step, unit_measurer
from lightning_dist.sync.auto_rule import (
    DENSE,
    DILOCO_CANDIDATES,
    Decision,
    Row,
    candidate_codecs,
    candidate_rows,
    decide,
    diloco_codecs,
    family,
    table,
)
from lightning_dist.sync.auto_settings import AutoSettings
from lightning_dist.sync.buckets import cut_buckets
from lightning_dist.sync.context import SyncContext
from lightning_dist.sync.diloco_driver import DiLoCo, DiLoCoDriver
from lightning_dist.sync.driver import FitSettings, SyncDriver, SyncReport, SyncSettings
from lightning_dist.sync.onebit_adam import OneBitAdam, OneBitAdamDriver


class Auto(AutoSettings, SyncSettings):
    __doc__ = AutoSettings.__doc__
    name = "auto"
    chooses_compressor = True

    def check(self, *, compressor: Any, hetero: Any, topology: str) -> None:
        if compressor.name != DENSE:
            raise ValueError(f"compressor={compressor.describe()} with sync='auto': auto chooses the compressor "
                             "itself; drop compressor= (to try only it: Auto(methods=['" + compressor.name + "']))")

    def refuses(self, fit: FitSettings) -> Optional[str]:
        """Nothing: dense runs under every setting. A candidate the fit's settings refuse is left out (the reason shows
        in the decision's table)."""
        self._refused = {}
        for label, settings in _method_settings():
            problem = settings.refuses(fit)
            if problem is None:
                try:
                    settings.check(compressor=NoCompressor(), hetero=fit.hetero, topology=fit.topology or "flat")
                except ValueError as err:
                    problem = str(err)
            if problem is not None:
                self._refused[label] = problem
        return None

    def bind(self, context: SyncContext) -> AutoDriver:
        return AutoDriver(self, context, dict(self._refused))


def _method_settings() -> list[tuple[str, SyncSettings]]:
    """The sync drivers among the candidates, by label, at their defaults (DiLoCo at H and codec)."""
    out: list[tuple[str, SyncSettings]] = [("onebit_adam", OneBitAdam())]
    for d in DILOCO_CANDIDATES:
        out.append((d.label, DiLoCo(every=d.every, compressor=None if d.codec == DENSE else d.codec)))
    return out


@dataclass
class Cluster:
    """What a decision holds for: a resume on another cluster decides again."""

    world_size: int
    hosts: int

    @classmethod
    def of(cls, context: SyncContext) -> Cluster:
        return cls(context.world_size, len(context.topology.hosts) if context.topology is not None else 1)


# a decision's reason after the measuring steps: all of them, or the first timed one, longer than long_s
MEASURED = "the measuring steps are over"
MEASURED_ONCE = "the first timed step's exposed communication took longer than long_s"


class AutoDriver(SyncDriver):
    """One rank's ``auto``: the measuring steps, the decision and the driver it chose (every hook delegates to it)."""

    MEASURING, RUNNING = "measuring", "running"

    def __init__(self, settings: Auto, context: SyncContext, refused: dict[str, str]) -> None:
        self.settings, self.context, self.refused = settings, context, refused
        self.inner: SyncDriver = SyncDriver()  # every step's, until the decision
        self.phase = self.MEASURING
        self.measure_from = 0  # the global step the measuring steps start after (a resume that decides again)
        self.decision: Optional[Decision] = None
        self.history: list[dict[str, Any]] = []  # every decision: step, choice, why, reason
        self.cluster = Cluster.of(context)
        self.compressor_kwargs: Optional[dict[str, Any]] = None  # the chosen per-step compressor's arguments
        self._recorder = BucketRecorder()
        self._steps: list[dict[str, Any]] = []  # the timed measuring steps
        self._buckets: list[Any] = []  # the last timed step's gradient buckets (kept for the re-decisions)
        self._measured: Optional[dict[str, Any]] = None  # the dense step, agreed
        self._units: dict[Unit, Figures] = {}  # what the last decision measured
        self._started = 0.0  # perf_counter at the step's first before_forward
        self._in_step = False  # a step's first forward ran and its after_step has not yet
        self._window: list[float] = []  # step seconds since the last drift check
        self._owed = OwedResiduals(context)  # a replaced compressor's residuals, flushed at the next step
        context.observe(self._recorder, True)

    # -- delegation -------------------------------------------------------------------------------------------------
    @property
    def gradient_ranks(self) -> Optional[Sequence[Sequence[int]]]:
        return self.inner.gradient_ranks

    def meets(self, global_step: int) -> bool:
        return self.inner.meets(global_step) or self._decides(global_step) or self._checks(global_step)

    def before_batch(self, sizes: Sequence[int], micro: Optional[list[int]]) -> tuple[Optional[list[int]], bool]:
        return self.inner.before_batch(sizes, micro)

    def before_forward(self) -> Optional[bool]:
        if not self._in_step:  # the step's first forward (under accumulation: its first micro-batch's)
            self._in_step, self._started = True, time.perf_counter()
            self._owed.gather()  # a compressor replaced in the last step: its residuals, every rank's summed
            if self.phase == self.MEASURING:
                rec = self._recorder
                rec.clear()
                rec.active = True
                rec.keep = self.context.global_step - self.measure_from >= self.settings.warmup_steps
        return self.inner.before_forward()

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], step: Callable[..., Any]) -> Any:
        if self._owed.pending:  # the residuals join the reduced gradient before the optimizer (and clipping) see it
            closure = self._owed.after(closure)
        return self.inner.optimizer_step(optimizer, closure, step)

    def after_step(self, global_step: int) -> None:
        ended, self._in_step = time.perf_counter(), False
        self.inner.after_step(global_step)
        if self.phase == self.MEASURING:
            if global_step - self.measure_from > self.settings.warmup_steps:
                measured = self._recorder.step(self._started, ended)
                if measured is not None:
                    self._steps.append(measured)
                    self._buckets = list(self._recorder.buckets)
            if self._decides(global_step):
                reason = MEASURED
            elif self._long_step(global_step):
                reason = f"{MEASURED_ONCE} ({self.settings.long_s:g} s)"
            else:
                return
            self._recorder.active = False
            self._decide(global_step, reason)
            return
        self._window.append(ended - self._started)
        if self._checks(global_step):
            self._check_drift(global_step)

    def validation(self, starting: bool) -> None:
        self.inner.validation(starting)

    def end_of_fit(self) -> None:
        self.inner.end_of_fit()

    def close(self) -> None:
        self.context.observe(self._recorder, False)
        self.inner.close()

    def report(self) -> SyncReport:
        inner = self.inner.report()
        metrics = dict(inner.metrics)
        if self.decision is not None:
            row = self.decision.row()
            metrics.update({"sync/auto_decisions": float(len(self.history)),
                            "sync/auto_predicted_step_s": row.predicted_step_s,
                            "sync/auto_bytes_per_step": row.bytes_per_step,
                            "sync/auto_every": float(row.every)})
        return SyncReport(syncs=inner.syncs + len(self.history), metrics=metrics, memory=inner.memory,
                          validation=inner.validation)

    def run_summary(self) -> dict[str, Any]:
        """The ``auto`` section of the run's ``summary.json``: the current choice and every decision."""
        return {"choice": self.decision.choice if self.decision is not None else None, "decisions": list(self.history),
                "cluster": asdict(self.cluster)}

    # -- when -------------------------------------------------------------------------------------------------------
    def _decides(self, global_step: int) -> bool:
        return (self.phase == self.MEASURING
                and global_step - self.measure_from == self.settings.warmup_steps + self.settings.steps)

    def _long_step(self, global_step: int) -> bool:
        """After the first timed step: whether the communication it left exposed after backward took longer than
        ``long_s`` on some rank (agreed: every rank ends the measuring in the same step). A slow link's wire, which
        more steps would not change: the measuring ends with it, rather than pay for ``steps`` of them (a step slow by
        its compute, a big model or a loaded machine, measures on)."""
        if self.phase != self.MEASURING or global_step - self.measure_from != self.settings.warmup_steps + 1:
            return False
        return self.context.agree(bool(self._steps) and self._steps[-1]["exposed_s"] > self.settings.long_s)

    def _window_steps(self) -> int:
        every = self.decision.row().every if self.decision is not None else 1
        return every * max(1, math.ceil(self.settings.check_every / every))

    def _checks(self, global_step: int) -> bool:
        if self.phase != self.RUNNING or not self.settings.drift:
            return False
        return global_step % self._window_steps() == 0

    # -- deciding ---------------------------------------------------------------------------------------------------
    def _measure(self) -> list[Row]:
        """Every candidate's row, from the kept buckets over the links as they are now, each measured only where it
        can change the decision (:func:`~lightning_dist.sync.auto_bound.measure_what_can_win`; a collective of every
        rank, whose every branch follows agreed figures)."""
        context = self.context
        if self._measured is None:
            if not self._steps:
                raise RuntimeError(
                    f"sync='auto': no measuring step had a gradient bucket (warmup_steps={self.settings.warmup_steps}, "
                    f"steps={self.settings.steps}); DDP reduced nothing: train with a model whose parameters get "
                    "gradients, without accumulate_grad_batches over the measuring steps")
            local = dense_step(self._steps)
        else:
            local = self._measured
        if not self._buckets:  # resumed: the parameters stand in for a gradient, cut as buckets of DDP's size
            named = [(n, p) for n, p in context.module.named_parameters() if p.requires_grad]
            self._buckets = [(b.layout, torch.cat([p.detach().reshape(-1) for p in b.params]))
                             for b in cut_buckets(named, lambda numel, p: p.new_empty(0))]
        group, topology = context.exchange_group, context.topology
        optimizer = family(context.optimizers)
        candidates = {n: conf_compressor(n) for n in candidate_codecs(optimizer, self.settings.compressors)}
        two_tier = topology is not None and topology.kind == "two_tier"
        workers = "two_tier" if two_tier else "flat"
        with context.long_collective("sync='auto' measures the candidates over the links"), unit_measurer(
                candidates, self._buckets, context.algorithm, group, topology, context.rank, context.timeout,
                self.settings.rounds, self.settings.long_s) as measure:
            measured = self._measured = agree_step(local, group)

            def rows_of(figures: dict[Unit, Figures]) -> list[Row]:
                flat = {codec: f for (where, codec), f in figures.items() if where == "flat"}
                across = {codec: f for (where, codec), f in figures.items() if where == "across"} if two_tier else None
                rows = candidate_rows(measured, flat, optimizer, workers, across,
                                      bytes_scale=topology.ranks_per_host if two_tier else 1.0,
                                      remaining_steps=context.estimated_steps - context.global_step,
                                      compressors=self.settings.compressors)
                for r in rows:
                    if r.excluded is None and r.label in self.refused:
                        r.excluded = f"this fit refuses it: {self.refused[r.label]}"
                return rows

            zeros = no_cost(candidates, len(measured["ready_s"]), diloco_codecs() if two_tier else ())
            rows, self._units = measure_what_can_win(rows_of, zeros, measure, workers, self.settings.limits)
        return rows

    def _decide(self, global_step: int, reason: str) -> None:
        started = time.perf_counter()
        rows = self._measure()
        decision = decide(rows, self.settings.limits)
        measure_s = self._longest(time.perf_counter() - started)  # (the history is the same on every rank)
        previous = self.decision.choice if self.decision is not None else None
        units = sorted(f"{codec} across hosts" if where == "across" else codec for where, codec in self._units)
        self.history.append({"step": global_step, "choice": decision.choice, "why": decision.why, "reason": reason,
                             "measured": units, "measure_s": measure_s, "rows": decision.as_dict()["rows"]})
        rank_zero_info(f"sync='auto' at step {global_step} ({reason}; measured {', '.join(units)} in "
                       f"{measure_s:.2f} s):\n{table(decision)}")
        self.decision = decision
        if decision.choice != previous:
            self._switch(decision.row(), global_step)
        self.phase = self.RUNNING
        self._window = []

    def _check_drift(self, global_step: int) -> None:
        window, self._window = self._window, []
        if not window:
            return
        predicted = self.decision.row().predicted_step_s
        ratio = self._longest((sum(window) / len(window)) / predicted if predicted > 0 else 0.0)
        if ratio > self.settings.drift:
            self._decide(global_step, f"the step took {ratio:.2f}x its prediction over {len(window)} steps")

    def _longest(self, value: float) -> float:
        """``value``'s maximum over the ranks (one all-reduce)."""
        if self.context.world_size == 1:
            return value
        agreed = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=self.context.exchange_group)
        return float(agreed.item())

    # -- switching ----------------------------------------------------------------------------------------------------
    def _switch(self, row: Row, global_step: int, in_step: bool = True) -> None:
        """Hand over from the current driver to ``row``'s, on every rank in this step (``in_step``: from
        ``after_step``, before the strategy commits the step's compressor state; else at a resume, between steps)."""
        context = self.context
        old = self.inner
        if isinstance(old, DiLoCoDriver):  # DiLoCo: what is in flight lands, every worker ends on the workers' mean
            old.end_of_fit()
        elif isinstance(old, OneBitAdamDriver) and global_step > (old.warmup_steps or 0):
            warnings.warn("sync='auto': switching away from OneBitAdam drops its compressed momentum's error feedback "
                          "(Adam's own moments stay)", stacklevel=2)
        if self.compressor_kwargs is not None and self.compressor_kwargs.get("name") != DENSE:
            if getattr(context.compressor(), "residuals", None) is not None:  # flushed at the next step
                self._owed.hold(context.compressor(), self.compressor_kwargs["name"])
        old.close()
        self.inner, self.compressor_kwargs = SyncDriver(), None
        context.set_compressor(None)
        if row.kind == "compressor":
            kwargs = conf_compressor(row.codec)
            # the compressor's warm-up counts from the fit's start: the dense steps so far were its first
            compressor = build_compressor(**{**kwargs, "start_step": max(int(kwargs.get("start_step", 0)),
                                                                          global_step)})
            _set_steps(compressor, global_step - 1 if in_step else global_step)  # (the step's commit counts it)
            context.set_compressor(compressor)
            self.compressor_kwargs = kwargs
        elif row.kind == "onebit_adam":
            self.inner = OneBitAdam().bind(context)
            self.inner.adopt_warmup(global_step)  # the dense steps so far were its warm-up
        elif row.kind == "diloco":
            self.inner = DiLoCo(every=row.every, compressor=None if row.codec == DENSE else row.codec).bind(context)
        context.regroup()

    # -- checkpoints --------------------------------------------------------------------------------------------------
    def state_dict(self, local: bool = False) -> Optional[dict[str, Any]]:
        return {"settings": self.settings.describe(), "phase": self.phase, "cluster": asdict(self.cluster),
                "decision": self.decision.as_dict() if self.decision is not None else None,
                "history": list(self.history), "measured": self._measured,
                "owed": None if local else self._owed.state_dict(), "inner": self.inner.state_dict(local)}

    def load_state_dict(self, state: Optional[dict[str, Any]]) -> Optional[list[Any]]:
        if state is None:
            return None
        self.history = list(state.get("history", []))
        self._owed.load_state_dict(state.get("owed"))  # a switch step's residuals: flushed in the first step
        if state.get("decision") is None:  # saved while measuring: measure again from here
            self.measure_from = self.context.global_step
            return None
        if Cluster(**state["cluster"]) != self.cluster:
            rank_zero_info(f"sync='auto': the checkpoint's decision ({state['decision']['choice']}) was made on "
                           f"{state['cluster']}, this fit runs on {asdict(self.cluster)}: measuring again")
            self.measure_from = self.context.global_step
            self.history.append({"step": self.context.global_step, "choice": None, "why": "the cluster changed",
                                 "reason": f"resumed on {asdict(self.cluster)} from {state['cluster']}"})
            return None
        decision = state["decision"]
        self.decision = Decision(decision["choice"], decision["why"], [Row(**r) for r in decision["rows"]])
        self._measured = state.get("measured")
        self._switch(self.decision.row(), self.context.global_step, in_step=False)
        self.phase = self.RUNNING
        return self.inner.load_state_dict(state.get("inner"))


def _set_steps(compressor: Any, steps: int) -> None:
    """As if the compressor had committed ``steps`` steps (the fit's dense steps so far)."""
    compressor.steps = steps
    inner = getattr(compressor, "inner", None)
    if inner is not None:
        inner.steps = steps


__all__ = ["Auto", "AutoDriver", "Cluster"]
