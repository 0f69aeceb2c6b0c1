"""``sync="auto"`` against every fixed way of syncing on the simulated cluster: ``python -m
lightning_dist.benchmarks.auto``.

Two jobs of the sync benchmark (:mod:`lightning_dist.benchmarks.sync`, 4 ranks, the same samples for every method):
``lm``, ByteLM 0.47 M under AdamW, and ``digits``, the digits CNN (22 k parameters) under SGD with momentum, whose
fixed methods are the per-step compressors auto may take under SGD (fp16, int8, PowerSGD rank 2) beside top-k and
DiLoCo, and no OneBitAdam (an Adam method). Per job and cell (shape: ``flat``, 4 hosts of 1, and ``two_tier``, 2 hosts
of 2; link: 10, 100 and 1,000 Mbit/s and ``unshaped``, a 100 Gbit/s token bucket no step comes near):

1. **auto's decision and every fixed method's time per step on the shaped cluster**, in one job per shape whose hosts
   run, per link in turn (the launcher sets it between fits): a real fit with ``sync="auto"`` under torchrun, stopped a
   few steps after its decision (the choice, the table, and the seconds from the fit's first step to the end of the
   decision's step: the dense measuring steps and the measurement over the links), then the sync benchmark's timing fit
   of every fixed method (:func:`~lightning_dist.benchmarks.sync.timing_fit`). DiLoCo's local steps, the same
   computation under every H and codec, are timed once per cell (:func:`pooled_local_steps`): each DiLoCo method
   differs from its twins by its sync step only, not by the machine's drift between two fits.
2. **Curves on loopback ranks** (a method's loss against steps does not depend on the link): every fixed method, and
   auto forced to each choice it made (``Auto(methods=[choice])`` with a bytes budget under dense's), so auto's curve is
   its own: dense measuring steps, then the choice. Each is only as long as the cells need (:func:`shape_curves`):
   dense's runs whole, once per seed (the same mean gradient on both shapes); every other ends at its first point at
   or below dense's final loss, and a fixed method's also where it could no longer come within :data:`CONTENDER` of
   the best fixed method so far in any cell (:func:`curve_cap`: its ranking is clear) or, under a constant rate, where
   the target is out of its reach (:class:`~lightning_dist.benchmarks.sync.CurveStop`).
3. **Time to the target loss**: the target is dense's final loss at equal samples or, where no other method's curve
   reaches it, the lowest loss another method's curve reaches (the loss dense and at least one other method both
   reach). A fixed method's time is its first curve point at or below the target x its time per step; auto's is its
   measured time to the decision (its first step counted as a steady dense step, as no fixed method's first step is
   counted) plus the steps after it to the target x its choice's time per step. The digits job's curves run at 3 seeds
   (:data:`SEEDS`; the fixed methods far from a cell's best at the first seed run it alone): per seed its own target
   and times; a method's time is its median over the seeds, auto's ratios the medians of its per-seed ratios.

``--scenario slowdown`` (the LM): on ``flat`` at 1 Gbit/s, where dense is the best fixed method, every host's link
drops to a tenth (100 Mbit/s) after step ``SLOW_AT`` of ``SLOW_STEPS``: auto (its drift check every 50 steps) against
the fixed methods that were best before the change (the cell's best and auto's choice there), in one job on the same
hosts, each fit's wall time to the target (the loss every one of them reaches, evaluations left out) and where auto
decided again. The fixed methods run first, each fit ending at its first point at or below the loss the fits before
it all reach.

Left out: fits of 1,600 steps (``--steps``: the default 800 keeps the whole run under an hour here; DiLoCo at H=50 then
leaves fewer syncs than auto's bound on flat workers and is out of auto's candidates there, while it still runs as a
fixed method).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Optional, Sequence

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_dist.benchmarks import _common as bench
from lightning_dist.benchmarks import sync as S
from lightning_dist.simcluster import SimCluster, unavailable
from lightning_dist.strategy import features_of
from lightning_dist.sync import Auto, SyncSettings
from lightning_dist.testing import free_port

WORKER_MODULE = "lightning_dist.benchmarks.auto"
UNSHAPED = 100_000.0  # Mbit/s: a token bucket far above anything a step sends (the "unshaped" link)
FIXED = ("dense", "topk1%", "onebit-adam", "diloco10/int8", "diloco50", "diloco50/int8")  # the LM's
FIXED_LABEL = {"onebit_adam": "onebit-adam", "powersgd": "powersgd-r2"}  # auto's label -> the fixed method's
AFTER = 4  # steps the decision job runs after auto's decision
# the slowdown: 1,400 steps from 1 Gbit/s (dense the best there), the links at a tenth after step 100 (auto decides
# again at step 150, the drift check's first window after it all slow: 1,250 steps left, 25 syncs at H=50, so DiLoCo
# at H=50 is a candidate again, its quality measured at 24). From 100 Mbit/s (the first measurement,
# docs/benchmarks.md) auto starts on DiLoCo, whose sync over H keeps the step within the drift factor at 10 Mbit/s:
# there is nothing to re-decide
SLOW_AT, SLOW_STEPS, SLOW_FACTOR, SLOW_RATE, SLOW_SHAPE = 100, 1400, 10.0, 1000.0, "flat"
# targets: auto's time to the target within 15% of the best fixed method's, and within 5% of dense's
VS_BEST, VS_DENSE = 1.15, 1.05
REDECIDE_WITHIN = 50  # steps after the change
# curve seeds per job (--quick: at most 2). The digits job's loss crosses its target at a shallow slope, where two
# curves that differ in their first steps alone (auto's dense start, DiLoCo from the start) reach it up to 30 steps
# (9%) apart either way from seed to seed: its cells are judged on 3 seeds, paired. CONTENDER: a fixed method runs the
# extra seeds where its first seed's time is within this of a cell's best (dense always: each seed's target)
SEEDS, CONTENDER = {"lm": 1, "digits": 3}, 1.5


@dataclass(frozen=True)
class AutoMethod(S.Method):
    """A way of training of the sync benchmark's kind whose sync is ``Auto(**auto)``; ``cycle_steps``: the H of the
    DiLoCo it is forced to (its curve read at synced models, and ended at the fit's steps), else 1."""

    auto: Optional[dict] = None
    cycle_steps: int = 1

    @property
    def cycle(self) -> int:
        return self.cycle_steps

    def settings(self) -> Optional[SyncSettings]:
        return Auto(**self.auto) if self.auto is not None else super().settings()


def forced(choice: str, rows: Sequence[dict[str, Any]]) -> AutoMethod:
    """auto that decides ``choice`` whatever the links say: only it among the candidates, dense excluded by a bytes
    budget under dense's bytes (from the decision's rows: between the choice's and dense's). Where dense was not
    measured, the choice beat dense by its steps factor, so it is a DiLoCo, which sends 1/H of its sync's bytes per
    step (H >= 10): twice its own bytes are far below dense's."""
    row = next(r for r in rows if r["label"] == choice)
    dense = next(r["bytes_per_step"] for r in rows if r["kind"] == "dense")
    budget = (row["bytes_per_step"] + dense) / 2 if dense is not None else 2 * row["bytes_per_step"]
    return AutoMethod(f"auto:{choice}", auto={"methods": [choice], "max_bytes_per_step": budget},
                      cycle_steps=row["every"] if row["kind"] == "diloco" else 1)


FULL = replace(S.FULL, steps=800, horizon=1200, rates=(10.0, 100.0, 1000.0, UNSHAPED), methods=FIXED)
QUICK = replace(S.QUICK, rates=(100.0,), methods=("dense", "topk1%", "onebit-adam"))
# the digits job: 800 steps as the LM's (DiLoCo at H=50 a candidate on two_tier only, as there)
DIGITS = replace(S.DIGITS, rates=FULL.rates)
# --quick: every per-step method auto may take under SGD is timed (a choice needs its time per step: a quick run once
# chose fp16 when only int8 was)
DIGITS_QUICK = replace(S.DIGITS_QUICK, rates=(100.0,), methods=("dense", "fp16", "int8", "powersgd-r2", "topk1%"))
WORKLOADS = {"lm": (FULL, QUICK), "digits": (DIGITS, DIGITS_QUICK)}  # (sizes, --quick's)
QUICK_SLOW = (16, 48)  # --quick slowdown: the change at step 16 of 48 (the drift check every 16 steps)


# -- the workers (every rank, under torchrun in a simulated host) ------------------------------------------------------
class StopAfterDecision(Callback):
    """Stops the fit ``AFTER`` steps after auto's first decision (the fit's length stays the planned one, so auto's
    candidates are those of the real fit)."""

    @override
    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        driver = features_of(trainer.strategy).sync
        if driver.history and trainer.global_step >= driver.history[0]["step"] + AFTER:
            trainer.should_stop = True


class LinkSwitch(Callback):
    """Rank 0 asks the launcher to slow the links after step ``at`` and waits until it did (the peers wait in the next
    step's collectives): files ``slow`` and ``slowed`` in ``folder``."""

    def __init__(self, folder: Path, at: int, tag: str) -> None:
        self.folder, self.at, self.tag = folder, at, tag

    @override
    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.at and trainer.is_global_zero:
            _ask(self.folder, f"slow_{self.tag}")


def _ask(folder: Path, what: str, rate: str = "", timeout_s: float = 120.0) -> None:
    """Writes the request ``what`` (``rate``: the link's Mbit/s it asks for, else the scenario's) and waits until the
    launcher answered it."""
    (folder / what).write_text(rate)
    deadline = time.monotonic() + timeout_s
    while not (folder / f"{what}.done").exists():
        if time.monotonic() > deadline:
            raise RuntimeError(f"the launcher did not answer {what} in {timeout_s:.0f}s")
        time.sleep(0.02)


def _history(trainer: L.Trainer) -> list[dict[str, Any]]:
    return list(features_of(trainer.strategy).sync.history)


def _worker(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)  # hosts share the machine's cores
    sizes, out, rank = args.sizes, Path(args.out), int(os.environ.get("RANK", "0"))
    shape = S.SHAPES[args.shape]
    if args.worker == "cells":  # per link in turn (rank 0 has the launcher set it): auto's decision, the timing fits
        for i, rate in enumerate(args.rates):
            if rank == 0 and i:
                _ask(out, f"rate_{i}", str(rate))
            record = S.FitRecord()
            raw, trainer = _fit(AutoMethod("auto", auto={}), shape, sizes, sizes.steps, record, [StopAfterDecision()])
            if rank == 0:
                (out / f"decide_{i}.json").write_text(json.dumps({"history": _history(trainer),
                                                                  "starts": record.starts, "ends": record.ends}))
            for label in args.methods:
                timing = S.timing_fit(S.METHODS[label], shape, sizes)
                if rank == 0:
                    (out / f"timing_{i}_{S.file_label(label)}.json").write_text(json.dumps(timing))
        return
    # slowdown: each fixed method, then auto, every fit slowed at SLOW_AT (the launcher restores between fits). A fit
    # ends at its first point at or below the highest final loss of the fixed fits before it: the loss every fixed fit
    # reaches stays their highest final (a fit that reaches it ends there; one that does not raises it, and every fit
    # before went below it), and a later point moves no figure
    at, steps = args.slow_at, args.slow_steps
    finals: list[float] = []  # the fixed fits' final losses, rank 0's on every rank (each rank stops at one step)
    for i, label in enumerate(args.methods):
        method = AutoMethod("auto", auto={"check_every": args.check_every}) if label == "auto" else S.METHODS[label]
        stop = S.CurveStop(max(finals)) if finals else None
        record = S.FitRecord(S.eval_every(method, sizes), S.val_batch(sizes), stop=stop, agreed=False)
        raw, trainer = _fit(method, shape, sizes, steps, record, [LinkSwitch(out, at, str(i))])
        if label != "auto":
            final = [raw["curve"][-1][1] if raw["curve"] else None]  # (the curve is rank 0's)
            torch.distributed.broadcast_object_list(final, src=0)
            finals += [final[0]] if final[0] is not None else []
        if rank == 0:
            (out / f"slow_{i}.json").write_text(json.dumps({
                "method": label, "curve": raw["curve"], "starts": record.starts, "ends": record.ends,
                "history": _history(trainer) if label == "auto" else []}))
            _ask(out, f"fast_{i}")


def _fit(method: S.Method, shape: S.Shape, sizes: S.Sizes, steps: int, record: S.FitRecord,
         callbacks: Sequence[Callback]) -> tuple[dict[str, Any], L.Trainer]:
    trainers: list[L.Trainer] = []

    class Keep(Callback):
        @override
        def on_train_end(self, trainer: L.Trainer, *args: Any) -> None:
            trainers.append(trainer)

    raw = S.fit(method, shape, sizes, steps, curve=record.every is not None, record=record,
                callbacks=[*callbacks, Keep()])
    return raw, trainers[0]


# -- the launcher -----------------------------------------------------------------------------------------------------
def cluster_job(args: argparse.Namespace, shape_name: str, rate: float, worker: list[str], log: Path,
                answer: bool = False) -> tuple[Optional[dict[str, Any]], Optional[str], float]:
    """One job on fresh hosts at ``rate`` running :func:`_worker`; with ``answer``, a thread answers the workers'
    requests to set the links: ``slow_<i>`` to rate / SLOW_FACTOR, ``fast_<i>`` back to ``rate``, ``rate_<i>`` to the
    Mbit/s the request holds. Returns what rank 0 wrote (by file name), why the job failed, its wall time."""
    shape = S.SHAPES[shape_name]
    started = time.perf_counter()
    with bench.scratch("auto") as out, SimCluster(shape.hosts, rate_mbit=rate) as cluster, open(log, "w") as fh:
        stop = threading.Event()

        def answer_requests() -> None:
            while not stop.is_set():
                for request in [p for kind in ("slow", "fast", "rate") for p in sorted(out.glob(f"{kind}_*"))]:
                    if request.suffix or (out / f"{request.name}.done").exists():
                        continue
                    kind = request.name.split("_")[0]
                    asked = float(request.read_text()) if kind == "rate" else rate
                    cluster.shape(asked / SLOW_FACTOR if kind == "slow" else asked, cluster.delay_ms)
                    (out / f"{request.name}.done").write_text(f"{time.perf_counter()}")
                time.sleep(0.02)

        watcher = threading.Thread(target=answer_requests, daemon=True)
        if answer:
            watcher.start()
        cmd = ["-m", WORKER_MODULE, *worker, "--out", str(out), *(["--quick"] * args.quick), "--steps",
               str(args.sizes.steps), "--workload", args.sizes.workload, "--shape", shape_name, "--nodes",
               str(shape.hosts)]
        env = {**cluster.env(), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
        port = free_port()
        procs = [cluster.popen(i, cluster.torchrun(i, cmd, port=port, nproc=shape.per_host), env=env, stdout=fh,
                               stderr=subprocess.STDOUT) for i in range(shape.hosts)]
        codes = cluster.wait(procs, args.run_timeout)
        stop.set()
        results = {p.stem: json.loads(p.read_text()) for p in out.glob("*.json")}
    wall = time.perf_counter() - started
    error = None if codes == [0] * shape.hosts else (
        f"{'timed out' if None in codes else f'exit codes {list(codes)}'}; see {log}")
    return results or None, error, wall


# -- pure: the cells' times and the targets ---------------------------------------------------------------------------
def decision_record(shape: str, rate: float, d: Optional[dict[str, Any]], error: Optional[str],
                    workload: str = "lm") -> dict[str, Any]:
    """auto's decision in a cell (``d``: what its fit's rank 0 wrote): the choice, its rows, the decision's step, the
    seconds from the first step's start to the end of the decision's step and the first step's own."""
    if d is None:
        return {"workload": workload, "shape": shape, "rate_mbit": rate, "error": error or "no result written"}
    first = d["history"][0]
    step = first["step"]
    return {"workload": workload, "shape": shape, "rate_mbit": rate, "choice": first["choice"], "why": first["why"],
            "rows": first["rows"], "step": step, "reason": first["reason"],
            "decided_s": d["ends"][step - 1] - d["starts"][0], "first_step_s": d["ends"][0] - d["starts"][0],
            "error": None}


def target_loss(curves: dict[str, dict[str, Any]]) -> Optional[float]:
    """Dense's final loss, or where no other method's curve reaches it, the lowest loss another method's reaches."""
    dense = curves.get("dense")
    if dense is None or dense.get("final_loss") is None:
        return None
    others = [min(c["curve_loss"]) for label, c in curves.items() if label != "dense" and c.get("curve_loss")]
    return max(dense["final_loss"], min(others)) if others else dense["final_loss"]


def curve_cap(label: str, step_s: dict[float, dict[str, float]], best_s: dict[float, float], every: int
              ) -> Optional[int]:
    """The step after which ``label``'s curve can no longer reach the target within :data:`CONTENDER` x the best time
    so far in any of its shape's cells (``step_s``: per link, every method's time per step; ``best_s``: per link, the
    best fixed method's time so far), on its evaluation grid ``every``; None where it has no time per step."""
    bounds = [CONTENDER * best_s[rate] / mine[label] for rate, mine in step_s.items()
              if mine.get(label) and best_s.get(rate) is not None]
    return every * math.ceil(max(bounds) / every) if bounds else None


def best_times(curves: Sequence[dict[str, Any]], target: float, step_s: dict[float, dict[str, float]]
               ) -> dict[float, float]:
    """Per link, the least time to ``target`` of the fixed methods' ``curves`` (None where none reached it)."""
    out = {}
    for rate, mine in step_s.items():
        times = [S.time_to_loss(c["curve_steps"], c["curve_loss"], target, mine.get(c["method"])) for c in curves
                 if not c.get("error") and not c["method"].startswith("auto:")]
        reached = [t for t in times if t is not None]
        out[rate] = min(reached) if reached else None
    return out


def shape_curves(args: argparse.Namespace, shape: str, methods: dict[str, S.Method],
                 step_s: dict[float, dict[str, float]], dense: Optional[dict[str, Any]] = None
                 ) -> list[dict[str, Any]]:
    """One seed's curves on ``shape``, only as long as the cells need them: dense's whole (its final loss the target;
    ``dense``: another shape's, taken as this one's), every other ending at its first point at or below that target,
    and a fixed one stopped where it could no longer come within :data:`CONTENDER` of the best fixed method so far in
    any cell (:func:`curve_cap`; a ranking already clear). Dense first, then DiLoCo (the best so far sooner), the
    per-step methods, auto's."""
    def order(label: str) -> int:
        return 0 if label == "dense" else 3 if label.startswith("auto:") else 1 if methods[label].cycle > 1 else 2

    sizes, done = args.sizes, []
    if dense is not None and "dense" in methods:  # (its wall time is the shape's it ran on)
        done.append({**dense, "shape": shape, "run_on": dense["shape"], "wall_s": 0.0})
    for label in sorted((label for label in methods if not (done and label == "dense")), key=order):
        ran = next((c for c in done if c["method"] == "dense" and not c.get("error")), None)
        target = ran["final_loss"] if ran is not None else None
        cap = None
        if target is not None and not label.startswith("auto:"):
            cap = curve_cap(label, step_s, best_times(done, target, step_s), S.eval_every(methods[label], sizes))
        stop = None
        if label != "dense" and target is not None:  # (a fixed one also where it is out of reach: CurveStop)
            stop = S.CurveStop(target, out_of_reach=not label.startswith("auto:") and sizes.schedule == "constant")
        done += S.run_curves(args, shape, {label: methods[label]}, sizes.steps, sizes.horizon, stop=stop, cap=cap,
                             agreed=False)
    return done


def pooled_local_steps(timings: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The timings with every DiLoCo method's ``per_step_s`` rebuilt on its cell's one local step.

    A DiLoCo fit's H - 1 local steps are the same computation whatever its H and codec (no communication), so
    differences between the fits' local steps are the machine's drift from fit to fit, not the methods' (on this
    machine up to 24% between two fits of one job). Per cell, the local step is the median over its DiLoCo fits of
    ``(cycle_s - sync_step_s) / (H - 1)``; a fit's ``per_step_s`` becomes ``((H - 1) local + its own sync step) / H``,
    its measured one kept as ``measured_per_step_s``. Records without a cycle (dense, per-step methods) are unchanged.
    """
    def pooled(t: dict[str, Any]) -> bool:
        return (t.get("every") or 1) > 1 and t.get("cycle_s") is not None and t.get("sync_step_s") is not None

    def cell(t: dict[str, Any]) -> tuple[str, str, float]:
        return _workload(t), t["shape"], t["rate_mbit"]

    local: dict[tuple[str, str, float], list[float]] = {}
    for t in timings:
        if pooled(t):
            local.setdefault(cell(t), []).append((t["cycle_s"] - t["sync_step_s"]) / (t["every"] - 1))
    out = []
    for t in timings:
        if pooled(t):
            step = bench.median(local[cell(t)])
            t = {**t, "measured_per_step_s": t["per_step_s"],
                 "per_step_s": ((t["every"] - 1) * step + t["sync_step_s"]) / t["every"]}
        out.append(t)
    return out


def cell_rows(decisions: Sequence[dict[str, Any]], curves: Sequence[dict[str, Any]],
              timings: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per cell: every fixed method's time to the target, auto's, and the ratios the targets judge (DiLoCo's times per
    step on its cell's one local step: :func:`pooled_local_steps`).

    Curves of several seeds (a record's ``seed``, 0 where none) are judged per seed, each against its own dense's
    target: a method's time is its median over the seeds it ran, auto's ratios the medians of its per-seed ratios to
    that seed's best fixed method and dense (paired: a seed's start and samples are every method's)."""
    rows = []
    timings = pooled_local_steps(timings)
    for d in decisions:
        job, shape, rate = _workload(d), d["shape"], d["rate_mbit"]
        per_step = {t["method"]: t.get("per_step_s") for t in timings
                    if (_workload(t), t["shape"], t["rate_mbit"]) == (job, shape, rate)}
        mine = [c for c in curves if (_workload(c), c["shape"]) == (job, shape) and not c.get("error")]
        seeds = [_seed_cell(d, {c["method"]: c for c in mine if c.get("seed", 0) == seed}, per_step)
                 for seed in sorted({c.get("seed", 0) for c in mine})]
        labels = list(dict.fromkeys(label for cell in seeds for label in cell["times_s"]))
        times = {label: _median_reached([c["times_s"][label] for c in seeds if label in c["times_s"]])
                 for label in labels}
        row = {"workload": job, "shape": shape, "rate_mbit": rate,
               "target_loss": bench.median([c["target_loss"] for c in seeds if c["target_loss"] is not None]),
               "times_s": times, "choice": d.get("choice"),
               "auto_s": _median_reached([c["auto_s"] for c in seeds]) if seeds else None,
               "best": None, "best_s": None, "vs_best": None, "vs_dense": None, "error": d.get("error"),
               "seeds": seeds}
        reached = {k: v for k, v in times.items() if v is not None}
        if reached:
            row["best"], row["best_s"] = min(reached.items(), key=lambda kv: kv[1])
        if row["auto_s"] is not None:
            row["vs_best"] = bench.median([c["vs_best"] for c in seeds if c["vs_best"] is not None])
            row["vs_dense"] = bench.median([c["vs_dense"] for c in seeds if c["vs_dense"] is not None])
        rows.append(row)
    return rows


def _seed_cell(d: dict[str, Any], mine: dict[str, dict[str, Any]], per_step: dict[str, Optional[float]]
               ) -> dict[str, Any]:
    """One seed's curves in a cell: the target, every fixed method's time to it, auto's, its ratios."""
    fixed = {label: c for label, c in mine.items() if not label.startswith("auto:")}
    target = target_loss(fixed)
    times = {label: S.time_to_loss(c["curve_steps"], c["curve_loss"], target, per_step.get(label))
             for label, c in fixed.items()} if target is not None else {}
    out = {"seed": next((c.get("seed", 0) for c in mine.values()), 0), "target_loss": target, "times_s": times,
           "auto_s": None, "vs_best": None, "vs_dense": None}
    if d.get("error") is None and target is not None:
        choice = d["choice"]
        curve = fixed.get("dense") if choice == "dense" else mine.get(f"auto:{choice}")
        label = FIXED_LABEL.get(choice, choice)
        step_s = per_step.get(label) if label in per_step else per_step.get(choice)
        if curve is not None and step_s is not None:
            at = next((s for s, loss in zip(curve["curve_steps"], curve["curve_loss"], strict=True)
                       if loss <= target), None)
            out["auto_s"] = None if at is None else _decision_s(d, per_step.get("dense")) + max(
                0, at - d["step"]) * step_s
    reached = [v for v in times.values() if v is not None]
    if out["auto_s"] is not None and reached:
        out["vs_best"] = out["auto_s"] / min(reached)
        out["vs_dense"] = out["auto_s"] / times["dense"] if times.get("dense") else None
    return out


def _median_reached(values: Sequence[Optional[float]]) -> Optional[float]:
    """The median, a run that never reached the target counted as the slowest (None when the median is one)."""
    if not values:
        return None
    ordered = sorted(values, key=lambda v: (v is None, v or 0.0))
    n = len(ordered)
    middle = ordered[(n - 1) // 2: n // 2 + 1]
    return None if None in middle else sum(middle) / len(middle)


def contenders(rows: Sequence[dict[str, Any]], shape: str) -> set[str]:
    """The fixed methods that run the extra seeds on ``shape``: dense (every seed's target), and each within
    :data:`CONTENDER` of the best in one of the shape's cells at the first seed (the others' ranking is already
    clear)."""
    out = {"dense"}
    for r in rows:
        if r["shape"] == shape and r["best_s"]:
            out |= {label for label, t in r["times_s"].items() if t is not None and t <= CONTENDER * r["best_s"]}
    return out


def _decision_s(decision: dict[str, Any], dense_step_s: Optional[float]) -> float:
    """auto's seconds to the end of its decision's step, its first step counted as a steady dense step: a fixed
    method's time is its steady step x its steps, its own first step (DDP's first backward, the gloo pairs' first
    exchange) not counted either. A record without the first step's time (the LM cells' runs) counts all of it."""
    first = decision.get("first_step_s")
    if first is None or dense_step_s is None:
        return decision["decided_s"]
    return decision["decided_s"] - first + dense_step_s


def _workload(record: dict[str, Any]) -> str:
    """A record's job (one written before the digits job ran is the LM's)."""
    return record.get("workload", "lm")


def _where(row: dict[str, Any]) -> str:
    return f"{_workload(row)} {row['shape']} @ {_rate(row['rate_mbit'])}"


def slowdown_record(raw: Optional[dict[str, Any]], at: int, error: Optional[str]) -> dict[str, Any]:
    """The slowdown scenario: each fit's seconds to the loss every one reaches (evaluations left out), and where auto
    decided again."""
    if raw is None:
        return {"error": error or "no result written"}
    fits = [raw[k] for k in sorted(raw) if k.startswith("slow_")]
    finals = [f["curve"][-1][1] for f in fits if f["curve"]]
    target = max(finals) if finals else None
    out = {"at": at, "target_loss": target, "fits": {}, "error": error}
    for f in fits:
        start, evals, seconds = f["starts"][0], 0.0, None
        for step, loss, _, end, eval_s in f["curve"]:
            if loss <= target:
                seconds = end - start - evals
                break
            evals += eval_s
        out["fits"][f["method"]] = {"seconds_to_target": seconds, "final_loss": f["curve"][-1][1] if f["curve"] else
                                    None, "history": [{k: h[k] for k in ("step", "choice", "reason")}
                                                      for h in f["history"]]}
    auto = out["fits"].get("auto", {})
    again = [h for h in auto.get("history", [])[1:] if h["step"] > at]
    out["redecided_at"] = again[0]["step"] if again else None
    out["choices"] = [h["choice"] for h in auto.get("history", [])]
    return out


def check_targets(rows: Sequence[dict[str, Any]], slow: Optional[dict[str, Any]]) -> list[str]:
    lines = []
    judged = [r for r in rows if r.get("vs_best") is not None]
    worst = max(judged, key=lambda r: r["vs_best"], default=None)
    lines.append(bench.verdict(f"auto within {VS_BEST - 1:.0%} of the best fixed method in every cell",
                               bool(judged) and len(judged) == len(rows) and worst["vs_best"] <= VS_BEST,
                               f"{len(judged)} of {len(rows)} cells judged; worst {worst['vs_best']:.2f}x in "
                               f"{_where(worst)}" if worst else "no cell judged"))
    vs_dense = [r for r in rows if r.get("vs_dense") is not None]
    slowest = max(vs_dense, key=lambda r: r["vs_dense"], default=None)
    lines.append(bench.verdict(f"auto never more than {VS_DENSE - 1:.0%} slower than dense",
                               bool(vs_dense) and slowest["vs_dense"] <= VS_DENSE,
                               f"worst {slowest['vs_dense']:.2f}x dense's time in {_where(slowest)}" if slowest
                               else "no cell judged"))
    if slow is not None and not slow.get("error"):
        at, again = slow["at"], slow["redecided_at"]
        lines.append(bench.verdict(f"auto decides again within {REDECIDE_WITHIN} steps of the link's change",
                                   again is not None and again - at <= REDECIDE_WITHIN,
                                   f"at step {again} (change after step {at}); choices {slow['choices']}"))
        fits = slow["fits"]
        auto_s = fits.get("auto", {}).get("seconds_to_target")
        others = {k: v["seconds_to_target"] for k, v in fits.items() if k != "auto"}
        beaten = auto_s is not None and all(v is None or auto_s < v for v in others.values())
        lines.append(bench.verdict("auto beats every fixed method that was best before the change", beaten,
                                   f"auto {bench.cell(auto_s, '.1f')} s; " + ", ".join(
                                       f"{k} {bench.cell(v, '.1f')} s" for k, v in others.items())))
    return lines


def cells_table(rows: Sequence[dict[str, Any]], workload: str = "lm") -> str:
    """One job's cells: its fixed methods' times (every method timed in one of its cells), auto's and the ratios."""
    rows = [r for r in rows if _workload(r) == workload]
    labels = list(dict.fromkeys(label for r in rows for label in r["times_s"]))

    def cells(r: dict[str, Any]) -> list[str]:
        return [bench.cell(r["target_loss"], ".4f"), str(r["choice"]), bench.cell(r["auto_s"], ",.1f"),
                *(bench.cell(r["times_s"].get(label), ",.1f") for label in labels), str(r["best"]),
                bench.cell(r["vs_best"], ".2f", unit="x"), bench.cell(r["vs_dense"], ".2f", unit="x")]

    headers = ["shape", "Mbit/s", "target loss", "auto chose", "auto s", *(f"{label} s" for label in labels),
               "best fixed", "auto / best", "auto / dense"]
    seeds = max((len(r.get("seeds", ())) for r in rows), default=1)
    over = f"; medians over {seeds} seeds, the ratios paired by seed" if seeds > 1 else ""
    return (f"{workload}: seconds to the target loss (curve x time per step on the shaped cluster; auto: its measured "
            f"time to the decision, then its choice{over})\n"
            + bench.table(rows, headers, lambda r: [r["shape"], _rate(r["rate_mbit"])], cells))


def _rate(rate: float) -> str:
    return "unshaped" if rate >= UNSHAPED else f"{rate:g}"


def plot(rows: Sequence[dict[str, Any]]) -> Any:
    """Seconds to the target against the link, a panel per job (rows) and shape (columns)."""
    jobs = list(dict.fromkeys(_workload(r) for r in rows)) or ["lm"]
    fig, grid = bench.figure_grid(len(jobs), 2, 12, 4.2 * len(jobs))
    labels = dict.fromkeys(label for r in rows for label in r["times_s"])
    colors = {**{label: f"C{i % 10}" for i, label in enumerate(labels)}, "auto": "black"}  # one per method, every panel
    for (job, shape), ax in zip(itertools.product(jobs, ("flat", "two_tier")), [ax for row in grid for ax in row],
                                  strict=True):
        mine = [r for r in rows if (_workload(r), r["shape"]) == (job, shape)]
        fixed = dict.fromkeys(label for r in mine for label in r["times_s"])
        for label in (*fixed, "auto"):
            xs = [i for i, r in enumerate(mine) if (r["auto_s"] if label == "auto" else r["times_s"].get(label))]
            ys = [mine[i]["auto_s"] if label == "auto" else mine[i]["times_s"][label] for i in xs]
            ax.plot(xs, ys, marker="o" if label == "auto" else ".", lw=2.5 if label == "auto" else 1, label=label,
                    color=colors[label])
        ax.set_xticks(range(len(mine)), [_rate(r["rate_mbit"]) for r in mine])
        ax.set_yscale("log")
        ax.set_xlabel("link, Mbit/s")
        ax.set_ylabel("seconds to the target loss")
        bench.style(ax, legend="small")
        ax.set_title(f"{job}, {shape}")
    return fig


# -- the command ------------------------------------------------------------------------------------------------------
def _parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    cli = bench.parser("auto", __doc__, "flat at 100 Mbit/s, a tiny ByteLM (dense, top-k, OneBitAdam) and the digits "
                                        f"CNN (dense, int8, top-k), {QUICK.steps} steps; the slowdown at step "
                                        f"{QUICK_SLOW[0]} of {QUICK_SLOW[1]}")
    add = cli.add_argument
    add("--scenario", choices=("cells", "slowdown", "all"), default="all")
    add("--workloads", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS),
        help="the cells' jobs: lm (AdamW) and digits (SGD), default both (the slowdown runs the LM)")
    add("--shapes", nargs="+", choices=list(S.SHAPES), help="default flat two_tier (--quick flat)")
    add("--rates", type=float, nargs="+", help=f"Mbit/s (default 10 100 1000 and {UNSHAPED:g}: unshaped)")
    add("--steps", type=int, help=f"steps of every curve (default {FULL.steps}, --quick {QUICK.steps})")
    add("--run-timeout", type=float, help="one job's hard deadline, s (default 3600, --quick 150)")
    add("--worker", choices=("cells", "slow"), help=argparse.SUPPRESS)
    add("--shape", choices=list(S.SHAPES), default="flat", help=argparse.SUPPRESS)
    add("--methods", nargs="+", help=argparse.SUPPRESS)
    add("--slow-at", type=int, help=argparse.SUPPRESS)
    add("--slow-steps", type=int, help=argparse.SUPPRESS)
    add("--check-every", type=int, default=50, help=argparse.SUPPRESS)
    add("--nodes", type=int, default=1, help=argparse.SUPPRESS)
    add("--workload", choices=list(WORKLOADS), default="lm", help=argparse.SUPPRESS)  # a worker's job
    args = cli.parse_args(argv)
    args.sizes = _sizes(args, args.workload)
    args.shapes = tuple(args.shapes or (("flat",) if args.quick else ("flat", "two_tier")))
    args.rates = tuple(args.rates or args.sizes.rates)
    args.run_timeout = args.run_timeout or args.sizes.run_timeout
    return args


def _sizes(args: argparse.Namespace, workload: str) -> S.Sizes:
    """A job's sizes, ``--steps`` where given."""
    sizes = WORKLOADS[workload][bool(args.quick)]
    if args.steps is not None:
        sizes = replace(sizes, steps=args.steps, horizon=max(sizes.horizon, args.steps * 3 // 2))
    return sizes


def _job(args: argparse.Namespace, workload: str) -> argparse.Namespace:
    """The command's arguments with one job's sizes (what its cluster jobs pass to their workers)."""
    return argparse.Namespace(**{**vars(args), "sizes": _sizes(args, workload)})


def run_cells(args: argparse.Namespace, logs: Path) -> dict[str, Any]:
    """Per job: auto's decision in every cell, every fixed method's time per step, the curves (each record names its
    job)."""
    measured: dict[str, list[dict[str, Any]]] = {"decisions": [], "timings": [], "curves": []}
    for workload in args.workloads:
        job = _job(args, workload)
        decisions, timings = cluster_cells(job, workload, logs)
        measured["decisions"] += decisions
        measured["timings"] += timings
        measured["curves"] += job_curves(job, workload, decisions, timings)
    return measured


def cluster_cells(job: argparse.Namespace, workload: str, logs: Path
                  ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """One cluster job per shape: per link in turn, auto's decision and every fixed method's timing fit. Returns the
    decisions and the timing records."""
    decisions: list[dict[str, Any]] = []
    timings: list[dict[str, Any]] = []
    timed = [label for label in job.sizes.methods if S.METHODS[label].steady]
    for shape in job.shapes:
        raw, error, wall = cluster_job(job, shape, job.rates[0],
                                       ["--worker", "cells", "--rates", *map(str, job.rates), "--methods", *timed],
                                       logs / f"cells_{workload}_{shape}.log", answer=True)
        raw = raw or {}
        for i, rate in enumerate(job.rates):
            d = decision_record(shape, rate, raw.get(f"decide_{i}"), error, workload)
            bench.progress(f"[auto] {_where(d)}: chose {d.get('choice')} at step {d.get('step')} after "
                           f"{bench.cell(d.get('decided_s'), '.1f')} s" + (f"; {error}" if error else ""))
            decisions.append(d)
            timings += [{**S.timing_record(label, raw.get(f"timing_{i}_{S.file_label(label)}"), shape, rate,
                                           job.sizes, error), "workload": workload} for label in timed]
        bench.progress(f"[auto] {workload} {shape}: the cells' job {wall:.0f}s")
    return decisions, timings


def job_curves(job: argparse.Namespace, workload: str, decisions: Sequence[dict[str, Any]],
               timings: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every seed's curves on every shape (:func:`shape_curves`): the fixed methods and auto forced to each of its
    choices; from the second seed on, only auto's and the first seed's contenders (:func:`contenders`)."""
    methods = {}
    for shape in job.shapes:
        methods[shape] = {label: S.METHODS[label] for label in job.sizes.methods}
        for d in decisions:
            if d["shape"] == shape and not d.get("error") and d["choice"] != "dense":
                method = forced(d["choice"], d["rows"])
                methods[shape][method.label] = method
    step_s: dict[str, dict[float, dict[str, float]]] = {}  # per shape and link, every method's time per step
    for t in pooled_local_steps(timings):
        if t.get("per_step_s") is not None:
            step_s.setdefault(t["shape"], {}).setdefault(t["rate_mbit"], {})[t["method"]] = t["per_step_s"]
    curves: list[dict[str, Any]] = []
    first: list[dict[str, Any]] = []
    for seed in range(SEEDS[workload] if not job.quick else min(2, SEEDS[workload])):
        curve_args = argparse.Namespace(sizes=replace(job.sizes, seed=seed), run_timeout=job.run_timeout)
        if seed == 1:  # the first seed's ranking: who runs the others
            first = cell_rows(decisions, curves, timings)
        dense = None  # dense's curve, run on the first shape: the same mean gradient on every shape
        for shape in job.shapes:
            keep = contenders(first, shape) if seed else set()
            run = {label: m for label, m in methods[shape].items()
                   if not seed or label.startswith("auto:") or label in keep}
            mine = shape_curves(curve_args, shape, run, step_s.get(shape, {}), dense)
            dense = dense or next((c for c in mine if c["method"] == "dense" and not c.get("error")), None)
            curves += [{**c, "workload": workload, "seed": seed} for c in mine]
    return curves


def run_slowdown(args: argparse.Namespace, logs: Path, rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """auto against the fixed methods that were best before the change: the cells' best at the scenario's link and
    auto's own choice there (dense where the cells did not run)."""
    at, steps = QUICK_SLOW if args.quick else (SLOW_AT, SLOW_STEPS)
    cell = next((r for r in rows if (_workload(r), r["shape"], r["rate_mbit"]) == ("lm", SLOW_SHAPE, SLOW_RATE)), {})
    before = [cell.get("best"), FIXED_LABEL.get(cell.get("choice"), cell.get("choice"))]
    methods = [*dict.fromkeys(m for m in before if m in S.METHODS), "auto"] if cell else ["dense", "auto"]
    check = at if args.quick else 50
    lm = _job(args, "lm")
    raw, error, wall = cluster_job(lm, SLOW_SHAPE, SLOW_RATE,
                                   ["--worker", "slow", "--methods", *methods, "--slow-at", str(at), "--slow-steps",
                                    str(steps), "--check-every", str(check)], logs / "slowdown.log", answer=True)
    record = slowdown_record(raw, at, error)
    bench.progress(f"[auto] slowdown: {methods}, auto's choices {record.get('choices')}, again at "
                   f"{record.get('redecided_at')} ({wall:.0f}s job)")
    return {**record, "methods": methods, "steps": steps}


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    args = _parse_args(argv)
    if args.worker:
        _worker(args)
        return {}
    started = time.perf_counter()
    out = bench.output_dir(args.out, "auto")
    (out / "logs").mkdir(exist_ok=True)
    if (reason := unavailable()) is not None:
        bench.progress(f"[auto] skipped: the simulated cluster cannot run here ({reason})")
        return {"skipped": reason}
    measured: dict[str, Any] = {"decisions": [], "timings": [], "curves": []}
    if args.scenario in ("cells", "all"):
        measured = run_cells(args, out / "logs")
    rows = cell_rows(measured["decisions"], measured["curves"], measured["timings"])
    slow = run_slowdown(args, out / "logs", rows) if args.scenario in ("slowdown", "all") else None
    targets = check_targets(rows, slow)
    blocks = [*(cells_table(rows, job) for job in args.workloads),
              [f"decision in {_where(d)}: {d.get('choice')}: {d.get('why') or d.get('error')}"
               for d in measured["decisions"]], targets]
    sizes = {job: asdict(_sizes(args, job)) for job in args.workloads}
    payload = {"sizes": sizes, **measured, "cells": rows, "slowdown": slow, "targets": targets}
    return bench.finish("auto", args.out, started, blocks, payload, lambda: plot(rows), shapes=list(args.shapes),
                        rates_mbit=list(args.rates), scenario=args.scenario, workloads=list(args.workloads))


if __name__ == "__main__":
    main(sys.argv[1:])
