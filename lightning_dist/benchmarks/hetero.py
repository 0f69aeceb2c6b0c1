"""Heterogeneous-batching benchmark: epoch time of even batches against batches that follow measured speed,
on ranks made slower by a known factor (:class:`lightning_dist.testing.Slowdown`).

Scenarios: speeds ``1 / 0.5`` on 2 ranks (judged) and ``1 / 1 / 0.33`` on 3 (reported only: 3 processes on 2
cores mostly measure contention). Each runs three modes from ``seed_everything(seed)``: ``uniform``
(``RingDDPStrategy()``, the slow rank sets the pace), ``balanced`` (``HeteroBatching(window=5, every_n_steps=5)``:
starts even, measures every rank's compute time per sample and moves work to the fast ranks, the global batch
staying ``N x 64``) and ``static`` (``HeteroBatching(speeds=...)``: the true speeds' sizes from the first step).
The model is a wider ``DigitsCNN(channels=128, hidden=256)``, so that a step's compute grows with its samples
rather than being fixed overhead; batch 64 per rank, 10 epochs, validated once at the end. A run's epoch time is
the median of its last 5 epochs (after rebalancing has settled; rank 0, from an epoch's first batch start to its
last batch end). The compute-time spread is ``max / min - 1`` of the ranks' mean compute time per step (less the
communication each waited for) over those epochs: what the balancer equalises (per step, it would add every
step's noise).

Targets (2 ranks): ``balanced``'s speed-up over ``uniform`` at least 0.9 of the ideal ``sum(s) / (N x min(s))``;
compute-time spread after rebalancing <= 6%; final accuracy within one point of uniform's (a point is about 4
of the 360 validation digits). The plot: epoch time per epoch, per mode.
"""

from __future__ import annotations

import statistics
import time
import warnings
from typing import Any, Optional, Sequence

import lightning as L

from lightning_dist.benchmarks import _common as bench
from lightning_dist.benchmarks.workloads import make_strategy
from lightning_dist.examples import DigitsCNN, DigitsDataModule
from lightning_dist.hetero import HeteroBatching
from lightning_dist.testing import RanksFailed, Slowdown, launched_externally, quiet_trainer, run_ranks

SCENARIOS = {"2 ranks 1/0.5": (1.0, 0.5), "3 ranks 1/1/0.33": (1.0, 1.0, 0.33)}
GATED = "2 ranks 1/0.5"
MODES = ("uniform", "balanced", "static")
BATCH, EPOCHS, TIMED_EPOCHS = 64, 10, 5


def _run(rank: int, world_size: int, speeds: Sequence[float], mode: str, epochs: int, seed: int) -> dict[str, Any]:
    hetero = {"uniform": None, "balanced": HeteroBatching(window=5, every_n_steps=5),
              "static": HeteroBatching(speeds=list(speeds))}[mode]
    recorder = bench.StepRecorder()
    slow = Slowdown({r: 1.0 / s for r, s in enumerate(speeds) if s < 1.0})
    with launched_externally(rank, world_size), warnings.catch_warnings(), bench.quiet_lightning():
        warnings.simplefilter("ignore")
        L.seed_everything(seed, verbose=False)
        model, data = DigitsCNN(channels=128, hidden=256), DigitsDataModule(batch_size=BATCH, seed=seed)
        strategy = make_strategy("auto", start_method="popen", hetero=hetero)
        trainer = quiet_trainer(devices=world_size, strategy=strategy, max_epochs=epochs,
                                check_val_every_n_epoch=epochs, log_every_n_steps=1, callbacks=[recorder, slow])
        trainer.fit(model, datamodule=data)  # validates once, after the last epoch
        accuracy = float(trainer.callback_metrics["val/acc"])
    events = [] if hetero is None else [{k: e[k] for k in ("step", "from_step", "spread", "old", "new")}
                                        for e in hetero.events]
    # an epoch: from its first batch's start to its last batch's end (before validation runs)
    bounds = {e: (recorder.starts[recorder.epochs.index(e)], end) for e, end in zip(recorder.epochs, recorder.ends)}
    # every step's per-rank compute times and batch sizes, from the exchange
    steps = [{"epoch": e, "compute_s": [m[f"dist/rank{r}/compute_ms"] / 1e3 for r in range(world_size)],
              "samples": [m[f"dist/rank{r}/samples"] for r in range(world_size)]}
             for e, m in zip(recorder.epochs, recorder.step_metrics) if m]
    return {"epoch_s": [end - start for start, end in bounds.values()], "steps": steps, "val_acc": accuracy,
            "events": events}


def run_once(name: str, mode: str, epochs: int, seed: int) -> dict[str, Any]:
    speeds = SCENARIOS[name]
    started = time.perf_counter()
    try:
        out = run_ranks(_run, len(speeds), speeds, mode, epochs, seed, deadline_s=600)[0]
    except RanksFailed as err:
        return {"scenario": name, "mode": mode, "seed": seed, "error": str(err)[-2000:]}
    timed = out["epoch_s"][-min(TIMED_EPOCHS, len(out["epoch_s"])):]
    last_epochs = {e for e in range(epochs - len(timed), epochs)}
    timed_steps = [s for s in out["steps"] if s["epoch"] in last_epochs and min(s["compute_s"]) > 0]
    n = len(speeds)
    means = [statistics.fmean(s["compute_s"][r] for s in timed_steps) for r in range(n)] if timed_steps else None
    sizes = out["steps"][-1]["samples"] if out["steps"] else None
    return {"scenario": name, "mode": mode, "seed": seed, "speeds": list(speeds), "epoch_s": out["epoch_s"],
            "epoch_median_s": statistics.median(timed),
            "compute_spread": max(means) / min(means) - 1 if means else None,
            "compute_ms_mean": [1e3 * m for m in means] if means else None,
            "val_acc": out["val_acc"], "final_sizes": sizes, "events": out["events"],
            "wall_s": time.perf_counter() - started}


def judge(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = {r["mode"]: r for r in records if r["scenario"] == GATED and "error" not in r}
    if not {"uniform", "balanced"} <= set(rows):
        return []
    speeds = rows["uniform"]["speeds"]
    ideal = sum(speeds) / (len(speeds) * min(speeds))
    achieved = rows["uniform"]["epoch_median_s"] / rows["balanced"]["epoch_median_s"]
    spread = rows["balanced"]["compute_spread"]
    uniform_acc, balanced_acc = 100 * rows["uniform"]["val_acc"], 100 * rows["balanced"]["val_acc"]
    gap = uniform_acc - balanced_acc
    return [
        {"target": "speed-up / ideal >= 0.9", "met": achieved / ideal >= 0.9,
         "detail": f"{achieved:.2f}x of an ideal {ideal:.2f}x = {achieved / ideal:.2f}"},
        {"target": "compute-time spread after rebalancing <= 6%", "met": spread is not None and spread <= 0.06,
         "detail": f"{100 * spread:.1f}%" if spread is not None else "not measured"},
        {"target": "final accuracy as uniform's (within 1 point)", "met": gap <= 1.0,
         "detail": f"balanced {balanced_acc:.2f}% vs uniform {uniform_acc:.2f}%"},
    ]


def table(records: Sequence[dict[str, Any]]) -> str:
    rows = []
    uniform = {r["scenario"]: r for r in records if r["mode"] == "uniform" and "error" not in r}
    for r in records:
        if "error" in r:
            rows.append([r["scenario"], r["mode"], "failed", "", "", "", "", ""])
            continue
        base = uniform.get(r["scenario"])
        speeds = r["speeds"]
        rows.append([r["scenario"], r["mode"], f"{r['epoch_median_s']:.2f}",
                     f"{base['epoch_median_s'] / r['epoch_median_s']:.2f}x" if base else "-",
                     f"{sum(speeds) / (len(speeds) * min(speeds)):.2f}x",
                     "-" if r["compute_spread"] is None else f"{100 * r['compute_spread']:.1f}%",
                     str([int(s) for s in r["final_sizes"]]) if r["final_sizes"] else "-",
                     f"{100 * r['val_acc']:.2f}%"])
    headers = ["scenario", "mode", "epoch s", "speed-up", "ideal", "compute spread", "sizes", "val acc"]
    return bench.format_table(headers, rows)


def plot(records: Sequence[dict[str, Any]]) -> Any:
    names = list(dict.fromkeys(r["scenario"] for r in records))
    fig, axes = bench.figure_row(len(names), 6.5 * len(names), 4.6)
    for ax, name in zip(axes, names):
        for r in records:
            if r["scenario"] == name and "error" not in r:
                ax.plot(range(1, len(r["epoch_s"]) + 1), r["epoch_s"], marker="o", label=r["mode"])
        ax.set(xlabel="epoch", ylabel="epoch time, s (rank 0)", ylim=(0, None))
        ax.set_title(f"{name} (relative speeds)", fontsize="small")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle("heterogeneous batching: even batches against batches that follow measured speed")
    return fig


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    cli = bench.parser("hetero", __doc__, "2 ranks, 2 epochs", seed="seed of every run")
    args = cli.parse_args(argv)
    out = bench.output_dir(args.out, "hetero")
    epochs = 2 if args.quick else EPOCHS
    records = []
    for name in [GATED] if args.quick else list(SCENARIOS):
        for mode in MODES:
            records.append(record := run_once(name, mode, epochs, args.seed))
            bench.progress(f"[hetero] {name} {mode}: FAILED" if "error" in record else
                           f"[hetero] {name} {mode:<9} epoch {record['epoch_median_s']:.2f}s  sizes "
                           f"{record['final_sizes']}  acc {100 * record['val_acc']:.2f}%  "
                           f"(run {record['wall_s']:.0f}s)")
    targets = judge(records)
    lines = [bench.verdict(t["target"], t["met"], t["detail"]) for t in targets]
    meta = bench.environment("hetero", quick=args.quick, epochs=epochs, batch_per_rank=BATCH, timed_epochs=TIMED_EPOCHS)
    return bench.write_results(out, "hetero", [table(records), lines],
                               {"meta": meta, "records": records, "targets": targets}, lambda: plot(records))


if __name__ == "__main__":
    main()
