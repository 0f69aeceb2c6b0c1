"""MemoryMonitor's pre-flight estimate against the memory a run really takes (what watching memory costs a step is in
:mod:`~lightning_dist.benchmarks.callbacks`).

One group of 2 ranks fits each configuration (:data:`ESTIMATE_CONFIGS`) for a few steps with a monitor reading every
step; the **measured growth** is the fit's highest peak RSS (:class:`PeakTracker`) less the RSS before it. Target: the
estimate within 30% for a model of >= 50 M parameters. Method and results: docs/benchmarks.md.
"""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import lightning as L
import numpy as np
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy, Strategy

from lightning_dist.benchmarks import _common as bench
from lightning_dist.benchmarks.workloads import ConvClassifier, big_mlp
from lightning_dist.callbacks.memory_monitor import MemoryMonitor
from lightning_dist.compression import build_compressor
from lightning_dist.memory import readers
from lightning_dist.strategy import RingDDPStrategy
from lightning_dist.testing import launched_externally, quiet_trainer, run_ranks

MiB = 2**20
TARGET_ERROR = 0.30  # the estimate within 30% of the measured RSS increase ...
TARGET_MIN_PARAMS = 50_000_000  # ... for a model of at least 50 M parameters
ESTIMATE_STEPS = 3
ESTIMATE_DEADLINE_S = 900.0
QUICK_ESTIMATE_CONFIGS = ("ring/sgd-momentum", "ddp/adam")
# the estimate's parts in the table's and the plot's order; any other part follows
PART_ORDER = ("weights", "gradients", "ddp_buckets", "optimizer_state", "optimizer_step", "compressor_state",
              "comm_workspace", "activations", "activation_grads")
PART_LABELS = {"weights": "weights", "gradients": "grads", "ddp_buckets": "buckets", "optimizer_state": "opt state",
               "optimizer_step": "opt step", "compressor_state": "compressor", "comm_workspace": "comm",
               "activations": "activations", "activation_grads": "act. grads"}


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
    EstimateConfig("ring/cnn-activations", lambda: ConvClassifier("sgd-momentum", bench.WORLD_SIZE * ESTIMATE_STEPS),
                   RingDDPStrategy, "conv net 76k params, batch 32 of 64x64, SGD momentum"),
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
            trainer = quiet_trainer(devices=world_size, strategy=config.strategy(), max_steps=steps,
                                    use_distributed_sampler=False, callbacks=[tracker, monitor])
            trainer.fit(model)
            peak = max(tracker.peak, readers.host_rss_peak())
            estimate = monitor.estimate
            out.append({
                "config": name, "rank": rank, "description": config.description,
                "params": sum(p.numel() for p in model.parameters()),
                "parts_mib": {k: v / MiB for k, v in estimate.parts.items()}, "notes": dict(estimate.notes),
                "estimate_mib": estimate.total / MiB, "before_mib": before / MiB, "grown_mib": (peak - before) / MiB,
                "monitor_measured_mib": monitor.measured / MiB, "monitor_readings": monitor.readings,
                "monitor_seconds": monitor.seconds, "steps": trainer.global_step,
                "wall_s": time.perf_counter() - started,
            })
            del model, trainer, monitor, tracker, estimate
    return out


def run_estimates(names: Sequence[str], steps: int) -> list[dict[str, Any]]:
    """Every configuration on one group of ranks; one record per (configuration, rank)."""
    per_rank = run_ranks(_estimate_ranks, bench.WORLD_SIZE, list(names), steps, deadline_s=ESTIMATE_DEADLINE_S)
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

    def judged(s: dict[str, Any]) -> str:
        if s["met"] is None:
            within = not math.isnan(s["max_abs_error_pct"]) and s["max_abs_error_pct"] <= 100 * TARGET_ERROR
            return f"n/a (<{TARGET_MIN_PARAMS // 10**6}M; {'within' if within else 'outside'})"
        return "MET" if s["met"] else "MISSED"

    rows = [[s["config"], f"{s['params'] / 1e6:.2f}M",
             *(f"{s['parts_mib'][p]:.1f}" if p in s["parts_mib"] else "-" for p in parts),
             f"{s['estimate_mib']:.1f}", f"{s['grown_mib']:.1f}", f"{s['monitor_measured_mib']:.1f}",
             f"{s['error_pct']:+.1f}%", f"{s['max_abs_error_pct']:.1f}%", judged(s)] for s in summary]
    headers = ["config", "params", *(PART_LABELS.get(p, p) for p in parts), "estimate", "measured growth",
               "monitor", "error", "max |error|", f"+-{100 * TARGET_ERROR:.0f}%"]
    return "the estimate against the measured growth of peak RSS (MiB, rank 0)\n" + bench.format_table(headers, rows)


def verdicts(estimates: Sequence[dict[str, Any]]) -> list[str]:
    lines = []
    judged = [s for s in estimates if s["met"] is not None]
    if judged:
        missed = [s["config"] for s in judged if not s["met"]]
        worst = max(judged, key=lambda s: s["max_abs_error_pct"])
        lines.append(bench.verdict(f"estimate within {100 * TARGET_ERROR:.0f}% of the measured RSS growth "
                                   f"(>= {TARGET_MIN_PARAMS // 10**6}M params, both ranks)", not missed,
                                   f"on {len(judged) - len(missed)}/{len(judged)} configs"
                                   + (f", missed: {', '.join(missed)}" if missed else "")
                                   + f"; worst {worst['config']} {worst['max_abs_error_pct']:.1f}%"))
    for s in estimates:
        if s["met"] is None:
            lines.append(f"  {s['config']} ({s['params']:,} params, outside the target): error "
                         f"{s['error_pct']:+.1f}% (estimate {s['estimate_mib']:.1f} MiB, measured "
                         f"{s['grown_mib']:.1f} MiB)")
    return lines


def plot(summary: Sequence[dict[str, Any]]) -> Any:
    """Per configuration: the estimate stacked by part beside the measured growth, with the +-30% band."""
    fig, (ax,) = bench.figure_row(1, 1.3 * len(summary) + 5.0, 5.0)
    parts = _part_names(summary)
    colors = dict(zip(parts, [f"C{i}" for i in range(len(parts))]))
    x, width, bottom = np.arange(len(summary)), 0.36, np.zeros(len(summary))
    for part in parts:
        values = np.array([s["parts_mib"].get(part, 0.0) for s in summary])
        ax.bar(x - width / 2, values, width, bottom=bottom, color=colors[part], label=PART_LABELS.get(part, part))
        bottom += values
    grown = np.array([s["grown_mib"] for s in summary])
    ax.bar(x + width / 2, grown, width, color="white", edgecolor="black", hatch="//",
           label="measured growth (peak RSS)")
    for i, s in enumerate(summary):
        band = [i - width - 0.04, i + width + 0.04]
        low, high = (1 - TARGET_ERROR) * grown[i], (1 + TARGET_ERROR) * grown[i]
        ax.fill_between(band, low, high, color="red", alpha=0.1, lw=0, zorder=0,
                        label=f"measured +-{100 * TARGET_ERROR:.0f}% (target)" if i == 0 else None)
        ax.hlines([low, high], *band, color="red", ls="--", lw=1)
        ax.plot(i + width / 2, s["monitor_measured_mib"], "k_", ms=14, mew=2,
                label="the monitor's own measure" if i == 0 else None)
        ax.annotate(f"{s['error_pct']:+.1f}%", (i - width / 2, bottom[i]), ha="center", va="bottom",
                    fontsize="small")
    ax.set_xticks(x, [s["config"] for s in summary], rotation=30, ha="right")
    bench.style(ax, "y", ylabel="MiB per rank (rank 0)", title="MemoryMonitor's estimate (stacked by part, error on "
                f"top) against\nthe measured growth of peak RSS over the fit, {bench.WORLD_SIZE} CPU ranks, "
                f"{ESTIMATE_STEPS} steps")
    ax.legend(fontsize="x-small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return fig


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    cli = bench.parser("memory", __doc__, f"{', '.join(QUICK_ESTIMATE_CONFIGS)} only")
    cli.add_argument("--configs", nargs="+", choices=list(ESTIMATE_CONFIGS), default=None,
                     help=f"configurations (default: all; --quick: {' and '.join(QUICK_ESTIMATE_CONFIGS)})")
    args = cli.parse_args(argv)
    names = args.configs or list(QUICK_ESTIMATE_CONFIGS if args.quick else ESTIMATE_CONFIGS)
    started = time.perf_counter()
    bench.progress(f"[memory] {len(names)} configs on {bench.WORLD_SIZE} ranks, {ESTIMATE_STEPS} steps each "
                   f"({', '.join(names)})")
    with bench.quiet_lightning():
        runs = run_estimates(names, ESTIMATE_STEPS)
    for r in runs:
        if r["rank"] == 0:
            bench.progress(f"  {r['config']:<22} estimate {r['estimate_mib']:7.1f} MiB, measured growth "
                           f"{r['grown_mib']:7.1f} MiB ({error_pct(r['estimate_mib'], r['grown_mib']):+.1f}%), "
                           f"fit {r['wall_s']:.1f}s")
    records = summarize_estimates(runs)
    return bench.finish("memory", args.out, started, [estimate_table(records), verdicts(records)],
                        {"estimate": {"runs": runs, "records": records}}, lambda: plot(records),
                        world_size=bench.WORLD_SIZE, estimate_steps=ESTIMATE_STEPS, target_error=TARGET_ERROR,
                        target_min_params=TARGET_MIN_PARAMS)


if __name__ == "__main__":
    main()
