"""Training-step benchmark: ``RingDDPStrategy`` (auto, ring, tree, native) against Lightning's DDPStrategy.

Run ``python -m lightning_dist.benchmarks.step`` (about four minutes on a 2-core machine); ``--quick`` is a
smoke run (one round of stock DDP and ``auto``, a few steps).

Method:

1. A run is one ``Trainer.fit`` of the default model and data (``DigitsCNN``, ``DigitsDataModule`` with
   ``batch_size=32``) on 2 CPU processes over gloo, started with ``fork``, for a fixed ``--steps``; no
   logger, checkpointing, progress bar, model summary or validation. Every run starts from
   ``L.seed_everything(seed)``: same initial weights, same data order.
2. Inside the ranks, :class:`StepTimerCallback` stamps ``time.perf_counter()`` (and the process's CPU time)
   at every ``on_train_batch_end``. A step's time is the gap between two consecutive stamps of one epoch,
   so it holds all that a step costs: fetching the batch, forward, backward with its gradient all-reduce,
   ring_ddp's per-step control exchange, the optimizer and every callback. The first ``--warmup`` steps
   (DDP rebuilds its buckets after step one; allocator and caches warm up) and gaps that span an epoch
   boundary (epoch-end metric sync, a new sampler iterator) are dropped. The fork launcher runs rank 0 in a
   child process too, so rank 0 writes its stamps to a file in a temporary directory; a run's time is the
   median of its steps.
3. Configurations run round-robin, ``ddp, auto, ring, tree, native, ddp, auto, ...``, for ``--rounds``
   rounds, so that drift and bursts from other processes on the machine hit every configuration alike.
   A configuration's step time is the median over rounds of its per-run medians, with quartiles over
   rounds. ``vs ddp`` divides those medians; ``paired`` is the median over rounds of each run's time over
   the same round's ddp run, which cancels drift slower than one round. ``cpu ms`` is rank 0's process CPU
   time per step (all threads): the work a step does, much less sensitive than wall time to a loaded
   machine, though blind to time spent waiting for the peer.
4. Correctness in the same run: Lightning's launcher loads rank 0's final weights back into the parent's
   model, and every run's final weights are compared with its round's stock DDP run (max abs difference).
   Both divide each gradient by N before summing, so at 2 ranks they agree bit for bit.

The target (from the issue): ring_ddp with ``algorithm="auto"`` costs at most 1.05x the stock DDP step.

Outputs in ``--out`` (default ``bench_results/step/``): ``step.json`` (one record per run in ``runs``, one
per configuration in ``records``, and the target), ``step.txt`` (the printed table) and ``step.png``
(per-run medians per configuration, with the stock DDP median and the 1.05x bound).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import lightning as L
import numpy as np
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy, Strategy
from typing_extensions import override

from lightning_dist.benchmarks._common import (
    environment,
    format_table,
    output_dir,
    progress,
    summarize,
    write_json,
)
from lightning_dist.examples.cnn import DigitsCNN
from lightning_dist.examples.digits import DigitsDataModule
from lightning_dist.strategy import RingDDPStrategy

WORLD_SIZE = 2
BATCH_SIZE = 32  # per rank: DigitsDataModule's default
DEFAULT_ROUNDS = 12  # 5 configurations x 12 rounds x ~3.5 s per run on a busy 2-core machine: ~3.5 minutes
DEFAULT_STEPS = 60  # optimizer steps per run: ~2.5 epochs of the 1,437 training digits at 2 x 32
DEFAULT_WARMUP = 10  # leading steps dropped from each run
QUICK_STEPS, QUICK_WARMUP = 15, 5
TARGET_RATIO = 1.05  # ring_ddp (auto) step time / stock DDP step time
COLLECTIVE_TIMEOUT_S = 120.0  # a hung collective fails the run after this long instead of hanging it


@dataclass(frozen=True)
class Config:
    """One column of the benchmark."""

    label: str  # name in tables and records
    algorithm: Optional[str]  # RingDDPStrategy's algorithm; None = Lightning's stock DDPStrategy


STOCK = Config("ddp", None)
CONFIGS = (STOCK,) + tuple(Config(f"ring_ddp/{a}", a) for a in ("auto", "ring", "tree", "native"))
QUICK_CONFIGS = CONFIGS[:2]
TARGET_LABEL = "ring_ddp/auto"


class StepTimerCallback(Callback):
    """Stamps the end of every training batch; rank 0 writes the stamps to ``path`` when training ends.

    Written to ``path`` as JSON: ``ends`` (``perf_counter`` seconds at each ``on_train_batch_end``),
    ``cpu`` (the process's CPU seconds, all threads, at the same moments), ``epochs`` (the epoch of each
    stamp) and, under RingDDPStrategy, ``comm_s`` (rank 0's seconds inside gradient all-reduces for each
    step, from ``strategy.last_step``; empty under stock DDP).
    """

    def __init__(self, path: str) -> None:
        self._path = path
        self._ends: list[float] = []
        self._cpu: list[float] = []
        self._epochs: list[int] = []
        self._comm_s: list[float] = []

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self._ends.append(time.perf_counter())
        self._cpu.append(time.process_time())
        self._epochs.append(trainer.current_epoch)
        last_step = getattr(trainer.strategy, "last_step", None)  # RingDDPStrategy: this rank's own values
        if last_step:
            self._comm_s.append(last_step["comm_s"])

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.is_global_zero:
            stamps = {"ends": self._ends, "cpu": self._cpu, "epochs": self._epochs, "comm_s": self._comm_s}
            Path(self._path).write_text(json.dumps(stamps))


def step_times(ends: Sequence[float], epochs: Sequence[int], warmup: int) -> list[float]:
    """Gaps between consecutive batch ends of one epoch, from the step after ``warmup`` on, in seconds."""
    return [ends[i] - ends[i - 1] for i in range(max(warmup, 1), len(ends)) if epochs[i] == epochs[i - 1]]


def make_strategy(config: Config) -> Strategy:
    if config.algorithm is None:
        return DDPStrategy(start_method="fork", timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    return RingDDPStrategy(algorithm=config.algorithm, start_method="fork", timeout=COLLECTIVE_TIMEOUT_S)


def run_once(config: Config, steps: int, warmup: int, seed: int, path: str) -> tuple[dict, dict]:
    """One ``Trainer.fit``, rank 0's stamps written to ``path``; returns (the run's record, final weights)."""
    L.seed_everything(seed, verbose=False)
    model = DigitsCNN()
    trainer = L.Trainer(
        accelerator="cpu", devices=WORLD_SIZE, strategy=make_strategy(config), max_steps=steps,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0, callbacks=[StepTimerCallback(path)],
    )
    start = time.perf_counter()
    trainer.fit(model, DigitsDataModule(batch_size=BATCH_SIZE))
    wall_s = time.perf_counter() - start
    stamps = json.loads(Path(path).read_text())
    times = step_times(stamps["ends"], stamps["epochs"], warmup)
    if not times:
        raise RuntimeError(f"{config.label}: no step left after {warmup} warmup steps; raise --steps.")
    cpu_times = step_times(stamps["cpu"], stamps["epochs"], warmup)
    comm = stamps["comm_s"][warmup:]  # one entry per step, aligned with ``ends``
    record = {
        "config": config.label, "algorithm": config.algorithm, "steps": steps, "timed_steps": len(times),
        **summarize(times), "cpu_median_s": float(np.median(cpu_times)), "wall_s": wall_s,
        "grad_allreduce_median_s": float(np.median(comm)) if comm else None,
    }
    return record, {k: v.detach().clone() for k, v in model.state_dict().items()}


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def summarize_configs(runs: Sequence[dict[str, Any]], configs: Sequence[Config]) -> list[dict[str, Any]]:
    """Per configuration: median and quartiles over rounds of the per-run medians, and the ratios to ddp."""
    by_round = {(r["round"], r["config"]): r for r in runs}
    rounds = sorted({r["round"] for r in runs})
    stock = [by_round[k, STOCK.label] for k in rounds]
    stock_s = float(np.median([r["median_s"] for r in stock]))
    stock_cpu_s = float(np.median([r["cpu_median_s"] for r in stock]))
    out = []
    for config in configs:
        mine = [by_round[k, config.label] for k in rounds]
        stats = summarize([r["median_s"] for r in mine])
        cpu_s = float(np.median([r["cpu_median_s"] for r in mine]))
        comm = [r["grad_allreduce_median_s"] for r in mine if r["grad_allreduce_median_s"] is not None]
        out.append({
            "config": config.label, "algorithm": config.algorithm, "rounds": len(mine), **stats,
            "ratio_vs_ddp": stats["median_s"] / stock_s,
            "paired_ratio_vs_ddp": float(np.median([r["median_s"] / s["median_s"]
                                                    for r, s in zip(mine, stock)])),
            "cpu_median_s": cpu_s,
            "cpu_ratio_vs_ddp": cpu_s / stock_cpu_s,
            "grad_allreduce_median_s": float(np.median(comm)) if comm else None,
            "max_abs_weight_diff_vs_ddp": max(r["max_abs_weight_diff_vs_ddp"] for r in mine),
        })
    return out


def table(summary: Sequence[dict[str, Any]]) -> str:
    def ms(seconds: Optional[float]) -> str:
        return "-" if seconds is None else f"{seconds * 1e3:.2f}"

    rows = [[s["config"], ms(s["median_s"]), ms(s["p25_s"]), ms(s["p75_s"]), f"{s['ratio_vs_ddp']:.3f}x",
             f"{s['paired_ratio_vs_ddp']:.3f}x", ms(s["cpu_median_s"]), f"{s['cpu_ratio_vs_ddp']:.3f}x",
             ms(s["grad_allreduce_median_s"]), f"{s['max_abs_weight_diff_vs_ddp']:.1e}"] for s in summary]
    headers = ["config", "median step ms", "p25 ms", "p75 ms", "vs ddp", "paired vs ddp", "cpu ms",
               "cpu vs ddp", "grad all-reduce ms", "max |w - w_ddp|"]
    return format_table(headers, rows)


def plot(runs: Sequence[dict[str, Any]], summary: Sequence[dict[str, Any]], path: Path) -> Path:
    """Per-run median step times per configuration (box and points), the stock median and the target bound."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # Agg: no display, no pyplot global state
    from matplotlib.figure import Figure

    labels = [s["config"] for s in summary]
    data = [[1e3 * r["median_s"] for r in runs if r["config"] == label] for label in labels]
    fig = Figure(figsize=(1.4 * len(labels) + 2.5, 4), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    ax.boxplot(data, showfliers=False)
    ax.set_xticks(range(1, len(labels) + 1), labels, rotation=20)
    for i, values in enumerate(data, start=1):
        ax.plot(np.full(len(values), i) + np.linspace(-0.08, 0.08, len(values)), values, "o", ms=3, alpha=0.6)
    stock_ms = 1e3 * summary[0]["median_s"]
    ax.axhline(stock_ms, color="gray", lw=1, label="ddp median")
    ax.axhline(TARGET_RATIO * stock_ms, color="red", ls="--", lw=1, label=f"{TARGET_RATIO}x ddp (target)")
    ax.set(ylabel="step time, ms (per-run median)",
           title=f"{WORLD_SIZE} CPU ranks, gloo, DigitsCNN, batch {BATCH_SIZE} per rank")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize="small")
    fig.savefig(path, dpi=110)
    return path


@contextlib.contextmanager
def _quiet_lightning() -> Iterator[None]:
    """Lightning's per-fit banners and one known deprecation warning off, so stderr holds our progress."""
    loggers = [logging.getLogger(name) for name in ("lightning.pytorch", "lightning.fabric")]
    levels = [lg.level for lg in loggers]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*treespec, LeafSpec.*")
        for lg in loggers:
            lg.setLevel(logging.WARNING)
        try:
            yield
        finally:
            for lg, level in zip(loggers, levels):
                lg.setLevel(level)


def _parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m lightning_dist.benchmarks.step",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=None,
                        help=f"round-robin rounds (default {DEFAULT_ROUNDS}, 1 with --quick)")
    parser.add_argument("--steps", type=int, default=None,
                        help=f"optimizer steps per run (default {DEFAULT_STEPS}, {QUICK_STEPS} with --quick)")
    parser.add_argument("--warmup", type=int, default=None,
                        help=f"leading steps dropped per run (default {DEFAULT_WARMUP}, "
                             f"{QUICK_WARMUP} with --quick)")
    parser.add_argument("--seed", type=int, default=0, help="seed of every run (default 0)")
    parser.add_argument("--quick", action="store_true",
                        help=f"smoke run: 1 round of ddp and {TARGET_LABEL}, {QUICK_STEPS} steps")
    parser.add_argument("--out", default=None, help="output directory (default bench_results/step/)")
    args = parser.parse_args(argv)
    args.rounds = args.rounds or (1 if args.quick else DEFAULT_ROUNDS)
    args.steps = args.steps or (QUICK_STEPS if args.quick else DEFAULT_STEPS)
    if args.warmup is None:
        args.warmup = QUICK_WARMUP if args.quick else DEFAULT_WARMUP
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: need at least 1.")
    if args.steps < args.warmup + 3:
        parser.error(f"--steps {args.steps} leaves fewer than 3 timed steps after --warmup {args.warmup}; "
                     f"use --steps >= {args.warmup + 3}.")
    return args


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    """Run the benchmark, print the table and the verdict, write JSON/TXT/PNG; return the JSON payload."""
    args = _parse_args(argv)
    out = output_dir(args.out, "step")
    configs = QUICK_CONFIGS if args.quick else CONFIGS
    progress(f"[step] {args.rounds} rounds x {len(configs)} configs ({', '.join(c.label for c in configs)}), "
             f"{args.steps} steps per run, first {args.warmup} dropped")
    runs: list[dict[str, Any]] = []
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="lightning_dist_step_") as workdir, _quiet_lightning():
        for round_index in range(args.rounds):
            stock_weights: Optional[dict[str, torch.Tensor]] = None
            for config in configs:  # STOCK first: the round's other runs are compared with its weights
                path = os.path.join(workdir, f"r{round_index}_{config.label.replace('/', '_')}.json")
                record, weights = run_once(config, args.steps, args.warmup, args.seed, path)
                if stock_weights is None:
                    stock_weights = weights
                record["round"] = round_index
                record["max_abs_weight_diff_vs_ddp"] = diff = max_abs_diff(weights, stock_weights)
                runs.append(record)
                progress(f"  round {round_index + 1}/{args.rounds} {config.label:<16} "
                         f"{1e3 * record['median_s']:7.2f} ms/step  (run {record['wall_s']:.1f}s, "
                         f"|w - w_ddp| {diff:.1e})")
    progress(f"[step] {len(runs)} runs in {time.perf_counter() - start:.0f}s")

    summary = summarize_configs(runs, configs)
    target = next(s for s in summary if s["config"] == TARGET_LABEL)
    met = bool(target["ratio_vs_ddp"] <= TARGET_RATIO)
    line = (f"target {TARGET_LABEL} <= {TARGET_RATIO}x ddp step time: {'MET' if met else 'MISSED'} "
            f"({target['ratio_vs_ddp']:.3f}x; paired {target['paired_ratio_vs_ddp']:.3f}x)")
    text = table(summary) + "\n\n" + line
    print(text)
    payload = {
        "meta": {**environment(), "benchmark": "step", "world_size": WORLD_SIZE, "batch_size": BATCH_SIZE,
                 "rounds": args.rounds, "steps": args.steps, "warmup": args.warmup, "seed": args.seed,
                 "configs": [asdict(c) for c in configs],
                 # the machine's load matters more than anything else here: a busy machine inflates every wait
                 "loadavg_at_end": os.getloadavg() if hasattr(os, "getloadavg") else None},
        "runs": runs,
        "records": summary,
        "target": {"config": TARGET_LABEL, "bound": TARGET_RATIO, "ratio": target["ratio_vs_ddp"],
                   "paired_ratio": target["paired_ratio_vs_ddp"], "met": met},
    }
    (out / "step.txt").write_text(text + "\n")
    write_json(out / "step.json", payload)
    plot(runs, summary, out / "step.png")
    progress(f"[step] wrote {out}/step.{{json,txt,png}}")
    return payload


if __name__ == "__main__":
    main()
