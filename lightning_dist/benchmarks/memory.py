"""MemoryMonitor, measured: how close its pre-flight estimate comes to the memory a run really takes, and what
watching memory costs a training step.

Run ``python -m lightning_dist.benchmarks.memory`` (about three and a half minutes on a 2-core machine; ``--quick`` is a
smoke run; ``--parts estimate`` or ``--parts cost`` runs one half). Two parts:

**A. The estimate against measurement.** One group of 2 gloo ranks (:func:`~lightning_dist.testing.run_ranks`,
Lightning in-process through :func:`~lightning_dist.testing.launched_externally`) fits each configuration in
turn for a few steps with ``MemoryMonitor(every_n_steps=1)``: a 50.4 M-parameter MLP (three
``Linear(4096, 4096)`` + ReLU and a 10-way head; 64 random samples, batch 4 per rank) under ``ring_ddp`` with
SGD, SGD with momentum, Adam, AdamW, Adam with ``gradient_as_bucket_view=True``, top-k compression with error
feedback (SGD with momentum), and under Lightning's stock DDP with Adam; and a small conv net whose
activations dominate (three 3x3 convolutions of 64 channels on 64x64 images, batch 32 per rank), to show the
activation probe. Before each configuration a rank frees what it can (``gc`` and ``malloc_trim``), restarts
Linux's peak RSS (VmHWM) and reads its RSS; it then builds the model and fits. **measured growth** is the
highest peak RSS of the whole fit minus that RSS: a callback ahead of the monitor reads VmHWM at every hook,
before the monitor restarts it at each reading, so no interval is missed (the optimizer's step included,
which stock DDP's reading right after the step would otherwise hide). ``error`` is
``(estimate - measured growth) / measured growth``: negative means the estimate is short. The table shows
rank 0's figures and the larger ``|error|`` of the two ranks; ``monitor`` is the monitor's own in-job figure
(its largest reading). The issue's target: the estimate within 30% of the measured RSS increase for a model
of at least 50 M parameters (the conv net is smaller: shown, not judged).

**B. The callback's cost.** The step benchmark's ``digits`` workload (:mod:`lightning_dist.benchmarks.step`)
on 2 CPU ranks (Lightning's fork launcher), ``RingDDPStrategy(algorithm="auto")`` and stock ``DDPStrategy()``,
each with and without ``MemoryMonitor()`` at its default interval (the Trainer's ``log_every_n_steps``, 50),
``--steps`` steps per run (so that several readings happen), round-robin for ``--rounds`` rounds (the order
of with and without alternates by round). Two measures:

1. **Step time, paired**: per round, the monitored run's median step over the same round's unmonitored run;
   the median over rounds, with quartiles. The noise floor on a shared 2-core machine is about +-1-2%.
2. **Self-timed work, as a fraction of the step**: rank 0's ``MemoryMonitor.seconds`` (the thread CPU time of
   its own work). The first step's share (the estimate at fit start, the activation probe, the first
   reading) is a one-off and is reported apart (``one-off ms``); the rest divided by the remaining steps and
   by the run's median step is the **steady** fraction, judged against the target: the monitor's own work
   below 1% of the step at the default interval. ``all-in`` divides everything, the one-off included, by
   steps x median step.

Writes ``memory.json``, ``memory.txt``, ``memory.png`` (part A: each configuration's estimate, stacked by
part, beside the measured growth and its +-30% band) and ``memory_cost.png`` (part B) to ``--out`` (default
``bench_results/memory/``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
import time
import warnings
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import lightning as L
import numpy as np
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy, Strategy
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from typing_extensions import override

from lightning_dist.benchmarks._common import (
    environment,
    figure_row,
    format_table,
    output_dir,
    progress,
    quiet_lightning,
    step_boxplot,
    step_times,
    summarize,
    write_results,
)
from lightning_dist.benchmarks.step import COLLECTIVE_TIMEOUT_S, WORKLOADS, WORLD_SIZE, StepTimerCallback
from lightning_dist.callbacks.memory_monitor import MemoryMonitor
from lightning_dist.compression import build_compressor
from lightning_dist.memory import readers
from lightning_dist.strategy import RingDDPStrategy
from lightning_dist.testing import launched_externally, run_ranks

MiB = 2**20
TARGET_ERROR = 0.30  # the estimate within 30% of the measured RSS increase ...
TARGET_MIN_PARAMS = 50_000_000  # ... for a model of at least 50 M parameters
TARGET_FRACTION = 0.01  # the monitor's own work below 1% of the step at its default interval
ESTIMATE_STEPS = 3
ESTIMATE_DEADLINE_S = 900.0
COST_WORKLOAD = "digits"
COST_STEPS, COST_WARMUP, COST_ROUNDS = 300, 10, 12  # 300 steps: 6 readings at the default interval of 50
QUICK_STEPS, QUICK_WARMUP, QUICK_EVERY = 15, 5, 5
QUICK_ESTIMATE_CONFIGS = ("ring/sgd-momentum", "ddp/adam")
# the estimate's parts in the table's and the plot's order; any other part follows
PART_ORDER = ("weights", "gradients", "ddp_buckets", "optimizer_state", "optimizer_step", "compressor_state",
              "comm_workspace", "activations", "activation_grads")
PART_LABELS = {"weights": "weights", "gradients": "grads", "ddp_buckets": "buckets", "optimizer_state": "opt state",
               "optimizer_step": "opt step", "compressor_state": "compressor", "comm_workspace": "comm",
               "activations": "activations", "activation_grads": "act. grads"}


# -- part A: the models and configurations ---------------------------------------------------------------------
def _optimizer(name: str, params: Any) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.01)
    if name == "sgd-momentum":
        return torch.optim.SGD(params, lr=0.01, momentum=0.9)
    if name == "adam":
        return torch.optim.Adam(params, lr=1e-4)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01)
    raise ValueError(f"optimizer {name!r}: use sgd, sgd-momentum, adam or adamw")


class _Classifier(L.LightningModule):
    """A network, an optimizer by name, and a fixed random data set read in order by a DistributedSampler."""

    def __init__(self, net: nn.Module, optimizer: str, inputs: torch.Tensor, labels: torch.Tensor,
                 batch_size: int) -> None:
        super().__init__()
        self.net, self.optimizer_name, self.batch_size = net, optimizer, batch_size
        self._data = TensorDataset(inputs, labels)

    @override
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return _optimizer(self.optimizer_name, self.parameters())

    @override
    def train_dataloader(self) -> DataLoader:
        return DataLoader(self._data, batch_size=self.batch_size, sampler=DistributedSampler(self._data, shuffle=False))


def big_mlp(optimizer: str) -> L.LightningModule:
    """50,384,906 parameters: three Linear(4096, 4096) + ReLU and a 10-way head; 64 samples, batch 4 per rank."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(3):
        layers += [nn.Linear(4096, 4096), nn.ReLU()]
    net = nn.Sequential(*layers, nn.Linear(4096, 10))
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4096, generator=gen)
    return _Classifier(net, optimizer, x, x[:, :10].argmax(1), batch_size=4)


def activation_cnn(optimizer: str) -> L.LightningModule:
    """76 k parameters, ~100 MiB of activations: three 3x3 convolutions (3 -> 64 -> 64 -> 64) + ReLU on 64x64
    images, global average pooling and a 10-way head; batch 32 per rank."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 64, 3, padding=1), nn.ReLU(), nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(),
                        nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                        nn.Linear(64, 10))
    gen = torch.Generator().manual_seed(0)
    n = 32 * WORLD_SIZE * ESTIMATE_STEPS
    return _Classifier(net, optimizer, torch.randn(n, 3, 64, 64, generator=gen),
                       torch.randint(0, 10, (n,), generator=gen), batch_size=32)


@dataclass(frozen=True)
class EstimateConfig:
    name: str
    model: Callable[[], L.LightningModule]
    strategy: Callable[[], Strategy]
    description: str


ESTIMATE_CONFIGS = {c.name: c for c in (
    EstimateConfig("ring/sgd", lambda: big_mlp("sgd"), RingDDPStrategy, "MLP 50M, SGD without momentum"),
    EstimateConfig("ring/sgd-momentum", lambda: big_mlp("sgd-momentum"), RingDDPStrategy,
                   "MLP 50M, SGD momentum 0.9"),
    EstimateConfig("ring/adam", lambda: big_mlp("adam"), RingDDPStrategy, "MLP 50M, Adam"),
    EstimateConfig("ring/adamw", lambda: big_mlp("adamw"), RingDDPStrategy, "MLP 50M, AdamW(weight_decay=0.01)"),
    EstimateConfig("ring/adam-bucket-view", lambda: big_mlp("adam"),
                   lambda: RingDDPStrategy(gradient_as_bucket_view=True), "MLP 50M, Adam, gradient_as_bucket_view"),
    EstimateConfig("ring/topk+ef", lambda: big_mlp("sgd-momentum"),
                   lambda: RingDDPStrategy(compressor=build_compressor("topk", ratio=0.01)),
                   "MLP 50M, top-k 1% with error feedback, SGD momentum"),
    EstimateConfig("ddp/adam", lambda: big_mlp("adam"), DDPStrategy, "MLP 50M, Lightning's DDPStrategy, Adam"),
    EstimateConfig("ring/cnn-activations", lambda: activation_cnn("sgd-momentum"), RingDDPStrategy,
                   "conv net 76k params, batch 32 of 64x64, SGD momentum"),
)}


class PeakTracker(Callback):
    """Reads Linux's peak RSS at every hook and keeps the highest. Put it ahead of the MemoryMonitor in the
    callback list: it then reads each interval's peak before the monitor restarts the counter."""

    def __init__(self) -> None:
        self.peak = 0

    def _read(self, *args: Any, **kwargs: Any) -> None:
        self.peak = max(self.peak, readers.host_rss_peak())

    setup = on_fit_start = on_train_start = on_train_batch_start = on_before_backward = _read
    on_after_backward = on_before_optimizer_step = on_train_batch_end = on_train_end = teardown = _read


def _estimate_ranks(rank: int, world_size: int, names: Sequence[str], steps: int) -> list[dict[str, Any]]:
    """Inside a run_ranks rank: fit every configuration in turn; this rank's figures for each."""
    out = []
    with launched_externally(rank, world_size), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in names:
            config = ESTIMATE_CONFIGS[name]
            L.seed_everything(0, verbose=False)
            readers.release_host_memory()
            readers.reset_host_peak()
            before = readers.host_rss()
            started = time.perf_counter()
            model = config.model()
            tracker, monitor = PeakTracker(), MemoryMonitor(every_n_steps=1)
            trainer = L.Trainer(accelerator="cpu", devices=world_size, strategy=config.strategy(), max_steps=steps,
                                logger=False, enable_checkpointing=False, enable_progress_bar=False,
                                enable_model_summary=False, num_sanity_val_steps=0, use_distributed_sampler=False,
                                callbacks=[tracker, monitor])
            trainer.fit(model)
            peak = max(tracker.peak, readers.host_rss_peak())
            estimate = monitor.estimate
            out.append({
                "config": name, "rank": rank, "description": config.description,
                "params": sum(p.numel() for p in model.parameters()),
                "parts_mib": {k: v / MiB for k, v in estimate.parts.items()},
                "notes": dict(estimate.notes),
                "estimate_mib": estimate.total / MiB,
                "before_mib": before / MiB,
                "grown_mib": (peak - before) / MiB,
                "monitor_measured_mib": monitor._measured / MiB,
                "monitor_readings": monitor.readings,
                "monitor_seconds": monitor.seconds,
                "steps": trainer.global_step,
                "wall_s": time.perf_counter() - started,
            })
            del model, trainer, monitor, tracker, estimate
    return out


def run_estimates(names: Sequence[str], steps: int) -> list[dict[str, Any]]:
    """Every configuration on one group of ranks; one record per (configuration, rank)."""
    per_rank = run_ranks(_estimate_ranks, WORLD_SIZE, list(names), steps, deadline_s=ESTIMATE_DEADLINE_S)
    return [record for records in per_rank for record in records]


def error_pct(estimate_mib: float, grown_mib: float) -> float:
    """100 x (estimate - measured) / measured; NaN when nothing was measured."""
    return 100.0 * (estimate_mib - grown_mib) / grown_mib if grown_mib > 0 else math.nan


def summarize_estimates(records: Sequence[dict[str, Any]], target: float = TARGET_ERROR,
                        min_params: int = TARGET_MIN_PARAMS) -> list[dict[str, Any]]:
    """One row per configuration, in the order first seen: rank 0's figures, the worst ``|error|`` over ranks,
    and the verdict (``None`` where the model is below ``min_params``: the target does not apply)."""
    out = []
    for name in dict.fromkeys(r["config"] for r in records):
        mine = sorted((r for r in records if r["config"] == name), key=lambda r: r["rank"])
        errors = [error_pct(r["estimate_mib"], r["grown_mib"]) for r in mine]
        first = mine[0]
        worst = math.nan if any(math.isnan(e) for e in errors) else max(abs(e) for e in errors)
        applies = first["params"] >= min_params
        met = bool(worst <= 100 * target) if applies and not math.isnan(worst) else None
        out.append({
            "config": name, "description": first["description"], "params": first["params"],
            "parts_mib": dict(first["parts_mib"]), "estimate_mib": first["estimate_mib"],
            "grown_mib": first["grown_mib"], "monitor_measured_mib": first["monitor_measured_mib"],
            "error_pct": errors[0], "errors_pct": errors, "max_abs_error_pct": worst,
            "ranks": [r["rank"] for r in mine], "target_applies": applies, "met": met,
        })
    return out


def _part_names(summary: Sequence[dict[str, Any]]) -> list[str]:
    seen = dict.fromkeys(k for s in summary for k in s["parts_mib"])
    return [k for k in PART_ORDER if k in seen] + [k for k in seen if k not in PART_ORDER]


def estimate_table(summary: Sequence[dict[str, Any]]) -> str:
    parts = _part_names(summary)

    def verdict(s: dict[str, Any]) -> str:
        if s["met"] is None:
            within = not math.isnan(s["max_abs_error_pct"]) and s["max_abs_error_pct"] <= 100 * TARGET_ERROR
            return f"n/a (<{TARGET_MIN_PARAMS // 10**6}M; {'within' if within else 'outside'})"
        return "MET" if s["met"] else "MISSED"

    rows = [[s["config"], f"{s['params'] / 1e6:.2f}M",
             *(f"{s['parts_mib'][p]:.1f}" if p in s["parts_mib"] else "-" for p in parts),
             f"{s['estimate_mib']:.1f}", f"{s['grown_mib']:.1f}", f"{s['monitor_measured_mib']:.1f}",
             f"{s['error_pct']:+.1f}%", f"{s['max_abs_error_pct']:.1f}%", verdict(s)] for s in summary]
    headers = ["config", "params", *(PART_LABELS.get(p, p) for p in parts), "estimate", "measured growth",
               "monitor", "error", "max |error|", f"+-{100 * TARGET_ERROR:.0f}%"]
    return "part A: the estimate against the measured growth of peak RSS (MiB, rank 0)\n" + format_table(headers, rows)


# -- part B: the callback's cost -------------------------------------------------------------------------------
class MonitorTimerCallback(StepTimerCallback):
    """The step benchmark's stamps, plus rank 0's MemoryMonitor seconds: in all, and after the first step."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self._starts = 0
        self._first_s: Optional[float] = None

    @staticmethod
    def _monitor(trainer: L.Trainer) -> Optional[MemoryMonitor]:
        return next((cb for cb in trainer.callbacks if isinstance(cb, MemoryMonitor)), None)

    @override
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self._starts += 1
        monitor = self._monitor(trainer)
        if self._starts == 2 and monitor is not None:  # the first step and the fit's start are behind us
            self._first_s = monitor.seconds

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_end(trainer, pl_module)
        if trainer.is_global_zero:
            monitor = self._monitor(trainer)
            stamps = json.loads(Path(self._path).read_text())
            stamps.update(monitor_s=monitor.seconds if monitor is not None else 0.0,
                          first_s=self._first_s or 0.0, readings=monitor.readings if monitor is not None else 0,
                          every=monitor._every if monitor is not None else 0)
            Path(self._path).write_text(json.dumps(stamps))


COST_STRATEGIES = ("ring_ddp", "ddp")


def _cost_strategy(strategy: str) -> Strategy:
    timeout = timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    if strategy == "ring_ddp":
        return RingDDPStrategy(algorithm="auto", start_method="fork", timeout=timeout)
    return DDPStrategy(start_method="fork", timeout=timeout)


def run_cost_once(strategy: str, monitored: bool, steps: int, warmup: int, every: Optional[int], seed: int,
                  path: str) -> dict[str, Any]:
    """One fit of the digits workload, with or without MemoryMonitor(every_n_steps=every)."""
    workload = WORKLOADS[COST_WORKLOAD]
    L.seed_everything(seed, verbose=False)
    callbacks: list[Callback] = [MonitorTimerCallback(path)]
    if monitored:
        callbacks.append(MemoryMonitor(every_n_steps=every))
    trainer = L.Trainer(accelerator="cpu", devices=WORLD_SIZE, strategy=_cost_strategy(strategy), max_steps=steps,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                        callbacks=callbacks)
    started = time.perf_counter()
    with warnings.catch_warnings():  # stock DDP's all_gather goes through a torch function deprecated upstream
        warnings.filterwarnings("ignore", message=r".*all_gather is deprecated.*")
        trainer.fit(workload.model(), workload.data())
    wall_s = time.perf_counter() - started
    stamps = json.loads(Path(path).read_text())
    times = step_times(stamps["ends"], stamps["epochs"], warmup)
    if not times:
        raise RuntimeError(f"{strategy} (monitored={monitored}): no step left after {warmup} warmup steps; "
                           "raise --steps.")
    stats = summarize(times)
    n = len(stamps["ends"])
    return {"strategy": strategy, "monitored": monitored, "steps": n, "timed_steps": len(times), **stats,
            "wall_s": wall_s, "monitor_s": stamps["monitor_s"], "first_s": stamps["first_s"],
            "readings": stamps["readings"], "every": stamps["every"]}


def cost_fractions(run: dict[str, Any]) -> dict[str, float]:
    """A monitored run's self-timed work: the one-off first step, the per-step rest, and both as fractions
    of the run's median step."""
    steps, median = run["steps"], run["median_s"]
    steady_s = (run["monitor_s"] - run["first_s"]) / max(1, steps - 1)
    return {"one_off_s": run["first_s"], "steady_per_step_s": steady_s, "steady_fraction": steady_s / median,
            "all_in_fraction": run["monitor_s"] / (steps * median)}


def summarize_cost(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per strategy: the paired step-time ratio (median over rounds of monitored / unmonitored median step,
    with quartiles) and the medians over rounds of the monitored runs' self-timed fractions."""
    out = []
    for strategy in dict.fromkeys(r["strategy"] for r in runs):
        mine = [r for r in runs if r["strategy"] == strategy]
        base = {r["round"]: r for r in mine if not r["monitored"]}
        watched = {r["round"]: r for r in mine if r["monitored"]}
        rounds = sorted(set(base) & set(watched))
        if not rounds:
            continue
        paired = [watched[k]["median_s"] / base[k]["median_s"] for k in rounds]
        fractions = [cost_fractions(watched[k]) for k in rounds]
        out.append({
            "strategy": strategy, "rounds": len(rounds), "steps": watched[rounds[0]]["steps"],
            "every": watched[rounds[0]]["every"],
            "readings": int(np.median([watched[k]["readings"] for k in rounds])),
            "base_median_s": float(np.median([base[k]["median_s"] for k in rounds])),
            "monitored_median_s": float(np.median([watched[k]["median_s"] for k in rounds])),
            "paired_ratio": float(np.median(paired)), "paired_p25": float(np.percentile(paired, 25)),
            "paired_p75": float(np.percentile(paired, 75)),
            **{key: float(np.median([f[key] for f in fractions])) for key in fractions[0]},
        })
    return out


def cost_table(summary: Sequence[dict[str, Any]]) -> str:
    rows = [[s["strategy"], s["rounds"], s["steps"], f"{s['every']} ({s['readings']})",
             f"{1e3 * s['base_median_s']:.2f}", f"{1e3 * s['monitored_median_s']:.2f}",
             f"{s['paired_ratio']:.3f}x [{s['paired_p25']:.3f}, {s['paired_p75']:.3f}]",
             f"{1e3 * s['one_off_s']:.2f}", f"{1e6 * s['steady_per_step_s']:.1f}",
             f"{100 * s['steady_fraction']:.3f}%", f"{100 * s['all_in_fraction']:.3f}%"] for s in summary]
    headers = ["strategy", "rounds", "steps", "every (readings)", "step ms", "+MemoryMonitor ms",
               "paired ratio [p25, p75]", "one-off ms", "steady us/step", "steady", "all-in"]
    return ("part B: MemoryMonitor's cost on the digits workload (rank 0; steady and all-in: % of the median step)\n"
            + format_table(headers, rows))


# -- output ---------------------------------------------------------------------------------------------------
def verdicts(estimates: Sequence[dict[str, Any]], cost: Sequence[dict[str, Any]]) -> list[str]:
    lines = []
    judged = [s for s in estimates if s["met"] is not None]
    if judged:
        missed = [s["config"] for s in judged if not s["met"]]
        worst = max(judged, key=lambda s: s["max_abs_error_pct"])
        lines.append(f"target: estimate within {100 * TARGET_ERROR:.0f}% of the measured RSS growth "
                     f"(>= {TARGET_MIN_PARAMS // 10**6}M params, both ranks): "
                     f"{'MET' if not missed else 'MISSED'} on {len(judged) - len(missed)}/{len(judged)} configs"
                     + (f" (missed: {', '.join(missed)})" if missed else "")
                     + f"; worst {worst['config']} {worst['max_abs_error_pct']:.1f}%")
    for s in estimates:
        if s["met"] is None:
            lines.append(f"  {s['config']} ({s['params']:,} params, outside the target): error "
                         f"{s['error_pct']:+.1f}% (estimate {s['estimate_mib']:.1f} MiB, measured "
                         f"{s['grown_mib']:.1f} MiB)")
    for s in cost:
        met = s["steady_fraction"] < TARGET_FRACTION
        lines.append(f"target {s['strategy']}: MemoryMonitor's own work < {100 * TARGET_FRACTION:.0f}% of the step "
                     f"at every_n_steps={s['every']}: {'MET' if met else 'MISSED'} "
                     f"(steady {100 * s['steady_fraction']:.3f}%, all-in {100 * s['all_in_fraction']:.3f}% with the "
                     f"one-off {1e3 * s['one_off_s']:.1f} ms; step time paired {s['paired_ratio']:.3f}x)")
    return lines


def plot_estimates(summary: Sequence[dict[str, Any]], path: Path) -> Path:
    """Per configuration: the estimate stacked by part beside the measured growth, with the +-30% band."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(1.3 * len(summary) + 5.0, 5.0), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    parts = _part_names(summary)
    colors = dict(zip(parts, [f"C{i}" for i in range(len(parts))]))
    x = np.arange(len(summary))
    width = 0.36
    bottom = np.zeros(len(summary))
    for part in parts:
        values = np.array([s["parts_mib"].get(part, 0.0) for s in summary])
        ax.bar(x - width / 2, values, width, bottom=bottom, color=colors[part], label=PART_LABELS.get(part, part))
        bottom += values
    grown = np.array([s["grown_mib"] for s in summary])
    ax.bar(x + width / 2, grown, width, color="white", edgecolor="black", hatch="//",
           label="measured growth (peak RSS)")
    for i, s in enumerate(summary):
        band = [i - width - 0.04, i + width + 0.04]
        ax.fill_between(band, (1 - TARGET_ERROR) * grown[i], (1 + TARGET_ERROR) * grown[i], color="red", alpha=0.1,
                        lw=0, zorder=0, label=f"measured +-{100 * TARGET_ERROR:.0f}% (target)" if i == 0 else None)
        for edge in (1 - TARGET_ERROR, 1 + TARGET_ERROR):
            ax.plot(band, [edge * grown[i]] * 2, color="red", ls="--", lw=1)
        ax.plot(i + width / 2, s["monitor_measured_mib"], "k_", ms=14, mew=2,
                label="the monitor's own measure" if i == 0 else None)
        ax.annotate(f"{s['error_pct']:+.1f}%", (i - width / 2, bottom[i]), ha="center", va="bottom",
                    fontsize="small")
    ax.set_xticks(x, [s["config"] for s in summary], rotation=30, ha="right")
    ax.set(ylabel="MiB per rank (rank 0)", title="MemoryMonitor's estimate (stacked by part, error on top) against\n"
           f"the measured growth of peak RSS over the fit, {WORLD_SIZE} CPU ranks, {ESTIMATE_STEPS} steps")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize="x-small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.savefig(path, dpi=110)
    return path


def plot_cost(runs: Sequence[dict[str, Any]], summary: Sequence[dict[str, Any]], path: Path) -> Path:
    """Per strategy, per-run median step times with and without the monitor; then the self-timed fractions."""
    fig, axes = figure_row(len(summary) + 1, 3.6 * len(summary) + 4.5)
    for ax, s in zip(axes, summary):
        data = [[1e3 * r["median_s"] for r in runs if r["strategy"] == s["strategy"] and r["monitored"] == m]
                for m in (False, True)]
        step_boxplot(ax, data, [s["strategy"], "+ MemoryMonitor"], f"{s['strategy']}: paired {s['paired_ratio']:.3f}x")
    ax = axes[-1]
    names = [s["strategy"] for s in summary]
    x = np.arange(len(names))
    ax.bar(x - 0.18, [100 * s["steady_fraction"] for s in summary], 0.36, label="steady (per step)")
    ax.bar(x + 0.18, [100 * s["all_in_fraction"] for s in summary], 0.36, label="all-in (with the one-off)")
    ax.axhline(100 * TARGET_FRACTION, color="red", ls="--", lw=1, label="target: 1% of the step")
    ax.set_xticks(x, names)
    ax.set(ylabel="% of the median step", title="MemoryMonitor's own work, rank 0")
    ax.legend(fontsize="x-small")
    every = sorted({s["every"] for s in summary})
    fig.suptitle(f"MemoryMonitor's cost on digits ({WORLD_SIZE} CPU ranks, gloo; every_n_steps="
                 f"{'/'.join(map(str, every))})")
    fig.savefig(path, dpi=110)
    return path


def _draw(estimates: Sequence[dict[str, Any]], cost_runs: Sequence[dict[str, Any]],
          cost: Sequence[dict[str, Any]]) -> Callable[[Path], Path]:
    def draw(path: Path) -> Path:
        if estimates:
            plot_estimates(estimates, path)
        if cost:
            plot_cost(cost_runs, cost, path.with_name(path.stem + "_cost.png") if estimates else path)
        return path

    return draw


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m lightning_dist.benchmarks.memory",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", nargs="+", choices=("estimate", "cost"), default=["estimate", "cost"])
    parser.add_argument("--configs", nargs="+", choices=list(ESTIMATE_CONFIGS), default=None,
                        help="part A's configurations (default: all; --quick: ring/sgd-momentum and ddp/adam)")
    parser.add_argument("--strategies", nargs="+", choices=COST_STRATEGIES, default=list(COST_STRATEGIES),
                        help="part B's strategies (default: both)")
    parser.add_argument("--rounds", type=int, default=None, help=f"part B's rounds (default {COST_ROUNDS})")
    parser.add_argument("--steps", type=int, default=None,
                        help=f"part B's steps per run (default {COST_STEPS}; --quick {QUICK_STEPS})")
    parser.add_argument("--quick", action="store_true",
                        help=f"smoke run: part A on {', '.join(QUICK_ESTIMATE_CONFIGS)}; part B 1 round of "
                             f"{QUICK_STEPS} steps with every_n_steps={QUICK_EVERY}")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="output directory (default bench_results/memory/)")
    args = parser.parse_args(argv)
    if args.rounds is not None and args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: need at least 1")
    names = args.configs or (list(QUICK_ESTIMATE_CONFIGS) if args.quick else list(ESTIMATE_CONFIGS))
    rounds = args.rounds or (1 if args.quick else COST_ROUNDS)
    steps = args.steps or (QUICK_STEPS if args.quick else COST_STEPS)
    warmup = QUICK_WARMUP if args.quick else COST_WARMUP
    every = QUICK_EVERY if args.quick else None  # None: the Trainer's log_every_n_steps (50)
    if steps < warmup + 3:
        parser.error(f"--steps {steps} leaves fewer than 3 timed steps after {warmup} warmup steps")
    out = output_dir(args.out, "memory")
    estimate_runs: list[dict[str, Any]] = []
    cost_runs: list[dict[str, Any]] = []
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="lightning_dist_memory_") as workdir, quiet_lightning():
        if "estimate" in args.parts:
            progress(f"[memory] part A: {len(names)} configs on {WORLD_SIZE} ranks, {ESTIMATE_STEPS} steps each "
                     f"({', '.join(names)})")
            estimate_runs = run_estimates(names, ESTIMATE_STEPS)
            for r in estimate_runs:
                if r["rank"] == 0:
                    progress(f"  {r['config']:<22} estimate {r['estimate_mib']:7.1f} MiB, measured growth "
                             f"{r['grown_mib']:7.1f} MiB ({error_pct(r['estimate_mib'], r['grown_mib']):+.1f}%), "
                             f"fit {r['wall_s']:.1f}s")
        if "cost" in args.parts:
            progress(f"[memory] part B: {COST_WORKLOAD}, {rounds} rounds x {2 * len(args.strategies)} runs, "
                     f"{steps} steps per run, every_n_steps={every or 'default'}")
            for round_index in range(rounds):
                for strategy in args.strategies:
                    order = (False, True) if round_index % 2 == 0 else (True, False)
                    for monitored in order:
                        label = f"{strategy}{'+MemoryMonitor' if monitored else ''}"
                        path = os.path.join(workdir, f"cost_{round_index}_{label.replace('+', '_')}.json")
                        record = run_cost_once(strategy, monitored, steps, warmup, every, args.seed, path)
                        record["round"] = round_index
                        cost_runs.append(record)
                        extra = (f", monitor {1e3 * record['monitor_s']:.1f} ms in all, {record['readings']} readings"
                                 if monitored else "")
                        progress(f"  round {round_index + 1}/{rounds} {label:<24} {1e3 * record['median_s']:7.2f} "
                                 f"ms/step (run {record['wall_s']:.1f}s{extra})")
    wall_s = time.perf_counter() - started
    progress(f"[memory] done in {wall_s:.0f}s")
    estimates = summarize_estimates(estimate_runs)
    cost = summarize_cost(cost_runs)
    blocks = ([estimate_table(estimates)] if estimates else []) + ([cost_table(cost)] if cost else [])
    text = "\n\n".join(blocks + ["\n".join(verdicts(estimates, cost))])
    print(text)
    payload = {"meta": {**environment(), "benchmark": "memory", "world_size": WORLD_SIZE, "seed": args.seed,
                        "wall_s": wall_s, "estimate_steps": ESTIMATE_STEPS, "cost_workload": COST_WORKLOAD,
                        "cost_steps": steps, "cost_warmup": warmup, "cost_rounds": rounds,
                        "cost_every_n_steps": every, "target_error": TARGET_ERROR,
                        "target_min_params": TARGET_MIN_PARAMS, "target_fraction": TARGET_FRACTION},
               "estimate": {"runs": estimate_runs, "records": estimates},
               "cost": {"runs": cost_runs, "records": cost}}
    write_results(out, "memory", text, payload, _draw(estimates, cost_runs, cost))
    return payload


if __name__ == "__main__":
    main()
