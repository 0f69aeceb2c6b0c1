"""Heterogeneous-batching benchmark: epoch time of even batches against batches that follow measured speed, on ranks
slowed by a known factor (:class:`~lightning_dist.testing.Slowdown`); what per-rank accumulation buys a rank whose
memory cannot hold its share (:data:`CAPPED`), and what one micro-batch costs (:data:`COST`), paired by round.

Targets (2 ranks): balanced's speed-up >= 0.9 of the ideal, compute spread <= 6%, accuracy within a point of uniform's;
capped, auto within 10% of uncapped's step; one micro-batch 1.00 +/- 0.02 of today's. Method and results:
docs/benchmarks.md.
"""

from __future__ import annotations

import statistics
import time
import warnings
from collections import Counter
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
CAPPED, COST = "2 ranks 1/0.5, rank 0 capped at 29", "2 ranks 1/0.5, cost of one micro-batch"
CAPPED_SPEEDS = SCENARIOS[GATED]  # the capped and cost scenarios: rank 1 twice as slow (Slowdown({1: 2.0}))
CAPPED_MODES, COST_MODES = ("uncapped", "capped, off", "capped, auto"), ("today", "one micro-batch")
CAP = 29  # rank 0's memory cap: a third of its share of 85, rounded up (ceil(85 / 29) = 3 micro-batches)
CAPPED_EPOCHS, CAPPED_ROUNDS, COST_EPOCHS, COST_ROUNDS = 4, 3, 4, 8  # per run; round-robin rounds
QUICK_EPOCHS, QUICK_CAPPED_EPOCHS, QUICK_COST_EPOCHS = 2, 1, 1  # --quick: one round of each paired scenario
AUTO_TARGET, COST_TOLERANCE = 1.10, 0.02  # capped, auto / uncapped step time; |paired ratio - 1|


def make_hetero(mode: str, speeds: Sequence[float]) -> Optional[HeteroBatching]:
    """The heterogeneous batching of a mode (None: even batches). The capped modes cap rank 0 at :data:`CAP`; a cap of
    the global batch (every other rank's, and both in ``one micro-batch``) never binds."""
    speeds, whole = list(speeds), len(speeds) * BATCH
    caps = [CAP] + [whole] * (len(speeds) - 1)
    if mode == "uniform":
        return None
    if mode == "balanced":
        return HeteroBatching(window=5, every_n_steps=5)
    if mode in ("static", "uncapped", "today"):
        return HeteroBatching(speeds=speeds)
    if mode == "capped, off":
        return HeteroBatching(speeds=speeds, memory_caps=caps, accumulate="off")
    if mode == "capped, auto":
        return HeteroBatching(speeds=speeds, memory_caps=caps)  # accumulate defaults to "auto" with a cap
    if mode == "one micro-batch":
        return HeteroBatching(speeds=speeds, memory_caps=[whole] * len(speeds))
    raise ValueError(f"mode {mode!r}: use one of {MODES + CAPPED_MODES + COST_MODES}")


class CountedCNN(DigitsCNN):
    """:class:`DigitsCNN` that records every ``training_step`` call: ``(epoch, batch_idx, samples)``. Under per-rank
    accumulation one Lightning step calls it once per micro-batch, so the calls are the micro-batches a rank ran."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.calls: list[tuple[int, int, int]] = []

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        self.calls.append((self.current_epoch, batch_idx, len(batch[0])))
        return super().training_step(batch, batch_idx)


def micro_batches_run(calls: Sequence[tuple[int, int, int]]) -> dict[str, Any]:
    """One rank's ``training_step`` calls, per step: the most frequent micro-batch sizes (an epoch's short last batch
    may differ) and the mean number of calls per step."""
    steps: dict[tuple[int, int], list[int]] = {}
    for epoch, batch_idx, samples in calls:
        steps.setdefault((epoch, batch_idx), []).append(samples)
    pattern = Counter(tuple(sizes) for sizes in steps.values()).most_common(1)
    return {"sizes": list(pattern[0][0]) if pattern else [],
            "calls_per_step": len(calls) / len(steps) if steps else 0.0}


def _run(rank: int, world_size: int, speeds: Sequence[float], mode: str, epochs: int, seed: int,
         validate: bool) -> dict[str, Any]:
    hetero = make_hetero(mode, speeds)
    recorder = bench.StepRecorder()
    slow = Slowdown({r: 1.0 / s for r, s in enumerate(speeds) if s < 1.0})
    with launched_externally(rank, world_size), warnings.catch_warnings(), bench.quiet_lightning():
        warnings.simplefilter("ignore")
        L.seed_everything(seed, verbose=False)
        model, data = CountedCNN(channels=128, hidden=256), DigitsDataModule(batch_size=BATCH, seed=seed)
        strategy = make_strategy("auto", start_method="popen", hetero=hetero)
        validation = {"check_val_every_n_epoch": epochs} if validate else {"limit_val_batches": 0}
        trainer = quiet_trainer(devices=world_size, strategy=strategy, max_epochs=epochs, log_every_n_steps=1,
                                callbacks=[recorder, slow], **validation)
        trainer.fit(model, datamodule=data)  # validates once, after the last epoch (or never)
        accuracy = float(trainer.callback_metrics["val/acc"]) if validate else None
    events = [] if hetero is None else [{k: e[k] for k in ("step", "from_step", "spread", "old", "new")}
                                        for e in hetero.events]
    # an epoch: from its first batch's start to its last batch's end (before validation runs)
    bounds = {e: (recorder.starts[recorder.epochs.index(e)], end) for e, end in zip(recorder.epochs, recorder.ends)}
    # every step's per-rank compute times and batch sizes, from the exchange
    steps = [{"epoch": e, "compute_s": [m[f"dist/rank{r}/compute_ms"] / 1e3 for r in range(world_size)],
              "samples": [m[f"dist/rank{r}/samples"] for r in range(world_size)]}
             for e, m in zip(recorder.epochs, recorder.step_metrics) if m]
    return {"epoch_s": [end - start for start, end in bounds.values()], "steps": steps, "val_acc": accuracy,
            "events": events, "ends": recorder.ends, "epochs": recorder.epochs, "micro": micro_batches_run(model.calls)}


def run_once(name: str, mode: str, epochs: int, seed: int, timed_epochs: Optional[int] = None,
             validate: bool = True) -> dict[str, Any]:
    """One fit of scenario ``name`` in ``mode`` on launched ranks, timed over its last ``timed_epochs`` epochs
    (default: :data:`TIMED_EPOCHS`, at most all)."""
    speeds = CAPPED_SPEEDS if name in (CAPPED, COST) else SCENARIOS[name]
    started = time.perf_counter()
    try:
        outs = run_ranks(_run, len(speeds), speeds, mode, epochs, seed, validate, deadline_s=600)
    except RanksFailed as err:
        return {"scenario": name, "mode": mode, "seed": seed, "error": str(err)[-2000:]}
    out = outs[0]
    timed = min(timed_epochs or TIMED_EPOCHS, len(out["epoch_s"]))
    # rank 0's step time: gaps between consecutive batch ends of one timed epoch
    gaps = bench.step_times(out["ends"], out["epochs"], out["epochs"].index(epochs - timed))
    timed_steps = [s for s in out["steps"] if s["epoch"] >= epochs - timed and min(s["compute_s"]) > 0]
    means = [statistics.fmean(s["compute_s"][r] for s in timed_steps) for r in range(len(speeds)) if timed_steps]
    return {"scenario": name, "mode": mode, "seed": seed, "speeds": list(speeds), "epoch_s": out["epoch_s"],
            "epoch_median_s": statistics.median(out["epoch_s"][-timed:]),
            **({f"step_{k}": v for k, v in bench.summarize(gaps).items()} if gaps else {"step_median_s": None}),
            "timed_steps": len(gaps), "compute_spread": max(means) / min(means) - 1 if means else None,
            "compute_ms_mean": [1e3 * m for m in means] if means else None, "val_acc": out["val_acc"],
            "final_sizes": out["steps"][-1]["samples"] if out["steps"] else None, "events": out["events"],
            "micro_sizes": [o["micro"]["sizes"] for o in outs],
            "micro_calls_per_step": [o["micro"]["calls_per_step"] for o in outs],
            "wall_s": time.perf_counter() - started}


def judge(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The balance targets: ``balanced`` against ``uniform`` and the ideal, on :data:`GATED`."""
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


def paired_summary(records: Sequence[dict[str, Any]], scenario: str, mode: str, base: str) -> Optional[dict[str, Any]]:
    """``scenario``'s runs paired by round: ``mode``'s median step time over the same round's ``base`` run's (median
    and quartiles over rounds; the epoch times' paired median too), and both modes' median step times over rounds;
    None when no round holds both."""
    mine, other = _timed(records, scenario, mode), _timed(records, scenario, base)
    step = bench.paired_runs(mine, other, "step_median_s")
    if step is None:
        return None
    return {"rounds": step["pairs"], "step_s": step["mine"], "base_step_s": step["base"],
            "paired_ratio": step["median"], "paired_p25": step["p25"], "paired_p75": step["p75"],
            "epoch_ratio": bench.paired_runs(mine, other, "epoch_median_s")["median"],
            "timed_steps": min(r["timed_steps"] for r in mine + other)}


def _timed(records: Sequence[dict[str, Any]], scenario: str, mode: str) -> list[dict[str, Any]]:
    """``scenario``'s runs of ``mode`` that ran and timed steps."""
    return [r for r in records if (r["scenario"], r["mode"]) == (scenario, mode) and r.get("step_median_s")]


def judge_accumulation(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The per-rank accumulation targets, on rank 0's median step paired by round: ``capped, auto`` against
    ``uncapped`` on :data:`CAPPED` (``capped, off``'s ratio in the detail), and ``one micro-batch`` against ``today``
    on :data:`COST`. A target without its runs is left out."""
    verdicts = []
    auto, off = (paired_summary(records, CAPPED, mode, "uncapped") for mode in ("capped, auto", "capped, off"))
    if auto is not None:
        slower = "" if off is None else f"; capped, off {bench.spread(off, '.2f')} (epoch {off['epoch_ratio']:.2f}x)"
        verdicts.append({
            "target": f"capped, auto: step time within {100 * (AUTO_TARGET - 1):.0f}% of uncapped's",
            "met": auto["paired_ratio"] <= AUTO_TARGET,
            "detail": f"{bench.spread(auto)} over {auto['rounds']} round(s), {1e3 * auto['step_s']:.1f} against "
                      f"{1e3 * auto['base_step_s']:.1f} ms/step (epoch {auto['epoch_ratio']:.3f}x){slower}"})
    if (cost := paired_summary(records, COST, "one micro-batch", "today")) is not None:
        verdicts.append({
            "target": f"one micro-batch: paired step time 1.00 +/- {COST_TOLERANCE:.2f} of today's",
            "met": abs(cost["paired_ratio"] - 1.0) <= COST_TOLERANCE,
            "detail": f"{bench.spread(cost)} over {cost['rounds']} round(s); today {1e3 * cost['base_step_s']:.1f} "
                      f"ms/step, one micro-batch {1e3 * cost['step_s']:.1f} ms/step (medians over rounds)"})
    return verdicts


def table(records: Sequence[dict[str, Any]]) -> str:
    """The balance scenarios' table (:data:`SCENARIOS`)."""
    records = [r for r in records if r["scenario"] in SCENARIOS]
    uniform = {r["scenario"]: r for r in records if r["mode"] == "uniform" and "error" not in r}
    rows = [[r["scenario"], r["mode"], "failed", "", "", "", "", ""] if "error" in r else [
        r["scenario"], r["mode"], f"{r['epoch_median_s']:.2f}",
        bench.cell(bench.ratio(uniform.get(r["scenario"], {}).get("epoch_median_s"), r["epoch_median_s"]), ".2f",
                   unit="x"), f"{sum(r['speeds']) / (len(r['speeds']) * min(r['speeds'])):.2f}x",
        bench.cell(r["compute_spread"], ".1f", 100, "%"),
        str([int(s) for s in r["final_sizes"]]) if r["final_sizes"] else "-", f"{100 * r['val_acc']:.2f}%"]
        for r in records]
    return bench.format_table(["scenario", "mode", "epoch s", "speed-up", "ideal", "compute spread", "sizes",
                               "val acc"], rows)


def _micro_cell(r: dict[str, Any]) -> str:
    return " | ".join("/".join(map(str, sizes)) for sizes in r["micro_sizes"])


def capped_table(records: Sequence[dict[str, Any]]) -> str:
    """The capped scenario's modes side by side: shares, the micro-batches each rank ran, epoch and step times (medians
    over rounds) and the step time paired with the same round's ``uncapped``."""
    rows = []
    for mode in CAPPED_MODES:
        runs, done = [r for r in records if (r["scenario"], r["mode"]) == (CAPPED, mode)], _timed(records, CAPPED, mode)
        if not done:
            rows.append([mode, f"failed ({len(runs)} runs)" if runs else "not run", "", "", "", "", "", ""])
            continue
        first, paired = done[0], paired_summary(records, CAPPED, mode, "uncapped")
        spreads = [r["compute_spread"] for r in done if r["compute_spread"] is not None]
        accuracies = [r["val_acc"] for r in done if r["val_acc"] is not None]
        rows.append([mode, " / ".join(str(int(s)) for s in first["final_sizes"]) if first["final_sizes"] else "-",
                     _micro_cell(first), f"{len(done)}/{len(runs)}",
                     f"{bench.median([r['epoch_median_s'] for r in done]):.2f}",
                     f"{1e3 * bench.median([r['step_median_s'] for r in done]):.1f}",
                     "reference" if mode == "uncapped" else "-" if paired is None else bench.spread(paired),
                     bench.cell(bench.median(spreads), ".1f", 100, "%"),
                     bench.cell(bench.median(accuracies), ".2f", 100, "%")])
    headers = ["mode", "shares", "micro-batches run (rank 0 | rank 1)", "rounds", "epoch s", "step ms",
               "step / uncapped, paired [p25, p75]", "compute spread", "val acc"]
    return (f"{CAPPED} (rank 1 twice as slow, B = {2 * BATCH}; rank 0's times, medians over rounds)\n"
            + bench.format_table(headers, rows))


def cost_table(records: Sequence[dict[str, Any]]) -> str:
    """The paired cost of one micro-batch, or a line saying why there is none."""
    cost = paired_summary(records, COST, "one micro-batch", "today")
    if cost is None:
        return f"{COST}: no round with both runs"
    row = [cost["rounds"], cost["timed_steps"], _micro_cell(_timed(records, COST, "one micro-batch")[0]),
           f"{1e3 * cost['base_step_s']:.1f}", f"{1e3 * cost['step_s']:.1f}", bench.spread(cost)]
    headers = ["rounds", "timed steps per run", "micro-batches run (rank 0 | rank 1)", "today ms",
               "one micro-batch ms", "paired ratio [p25, p75]"]
    return (f"{COST} (caps [128, 128] that never bind, accumulate auto, against HeteroBatching(speeds=[1, 0.5]); "
            "rank 0's median step, medians over rounds)\n" + bench.format_table(headers, [row]))


def _plot_capped(ax: Any, records: Sequence[dict[str, Any]]) -> None:
    colors = {"uncapped": "tab:gray", "capped, off": "tab:red", "capped, auto": "tab:green"}
    modes = [m for m in CAPPED_MODES if _timed(records, CAPPED, m)]
    steps = {mode: [1e3 * r["step_median_s"] for r in _timed(records, CAPPED, mode)] for mode in modes}
    for i, mode in enumerate(modes):
        ax.bar(i, bench.median(steps[mode]), color=colors[mode], alpha=0.8)
        ax.plot([i] * len(steps[mode]), steps[mode], "k.", ms=5)
        paired = paired_summary(records, CAPPED, mode, "uncapped")
        ratio = "" if paired is None or mode == "uncapped" else f"\n{paired['paired_ratio']:.2f}x uncapped"
        ax.annotate(_micro_cell(_timed(records, CAPPED, mode)[0]) + ratio, (i, max(steps[mode])), ha="center",
                    va="bottom", fontsize="x-small", xytext=(0, 4), textcoords="offset points")
    top = max((v for values in steps.values() for v in values), default=0.0)
    base = paired_summary(records, CAPPED, "uncapped", "uncapped")
    if base is not None:
        ax.axhline(1e3 * AUTO_TARGET * base["step_s"], color="red", ls="--", lw=1,
                   label=f"target for auto: {AUTO_TARGET:.2f}x uncapped")
        ax.legend(fontsize="x-small", loc="upper left")
    ax.set_xticks(range(len(modes)), modes)
    bench.style(ax, "y", ylabel="step time, ms (rank 0; bar: median over rounds)", ylim=(0, 1.3 * top or 1))
    ax.set_title(f"rank 0 capped at {CAP}: micro-batches run, rank 0 | rank 1", fontsize="small")


def plot(records: Sequence[dict[str, Any]]) -> Any:
    names = [n for n in dict.fromkeys(r["scenario"] for r in records) if n in SCENARIOS]
    capped = any(r["scenario"] == CAPPED for r in records)
    cost = paired_summary(records, COST, "one micro-batch", "today")
    panels = len(names) + capped + (cost is not None)
    fig, axes = bench.figure_row(panels, 5.5 * panels, 4.6)
    for ax, name in zip(axes, names):
        for r in records:
            if r["scenario"] == name and "error" not in r:
                ax.plot(range(1, len(r["epoch_s"]) + 1), r["epoch_s"], marker="o", label=r["mode"])
        bench.style(ax, legend="small", xlabel="epoch", ylabel="epoch time, s (rank 0)", ylim=(0, None))
        ax.set_title(f"{name} (relative speeds)", fontsize="small")
    rest = axes[len(names):]
    if capped:
        _plot_capped(rest.pop(0), records)
    if cost is not None:
        data = [[1e3 * r["step_median_s"] for r in _timed(records, COST, mode)] for mode in COST_MODES]
        bench.step_boxplot(rest.pop(0), data, list(COST_MODES),
                           f"one micro-batch vs today: paired {cost['paired_ratio']:.3f}x, {cost['rounds']} round(s)")
    fig.suptitle("heterogeneous batching: even batches against batches that follow measured speed; "
                 "per-rank accumulation under a memory cap")
    return fig


def _progress(r: dict[str, Any]) -> dict[str, Any]:
    """Says how run ``r`` went; returns it."""
    bench.progress(f"[hetero] {r['scenario']} {r['mode']}: FAILED" if "error" in r else
                   f"[hetero] {r['scenario']} {r['mode']:<15} epoch {r['epoch_median_s']:.2f}s  "
                   f"step {bench.cell(r.get('step_median_s'), '.1f', 1e3, ' ms')}  sizes {r['final_sizes']}  "
                   f"micro {_micro_cell(r)}  acc {bench.cell(r['val_acc'], '.2f', 100, '%')}  (run {r['wall_s']:.0f}s)")
    return r


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    cli = bench.parser("hetero", __doc__, f"2 ranks: {QUICK_EPOCHS} epochs per balance mode, one round of "
                       f"{QUICK_CAPPED_EPOCHS} epoch per capped mode and per cost arm", seed="seed of every run")
    args = cli.parse_args(argv)
    epochs = QUICK_EPOCHS if args.quick else EPOCHS
    capped_epochs, capped_rounds = (QUICK_CAPPED_EPOCHS, 1) if args.quick else (CAPPED_EPOCHS, CAPPED_ROUNDS)
    cost_epochs, cost_rounds = (QUICK_COST_EPOCHS, 1) if args.quick else (COST_EPOCHS, COST_ROUNDS)
    started = time.perf_counter()
    records = []
    for name in [GATED] if args.quick else list(SCENARIOS):
        records += [_progress(run_once(name, mode, epochs, args.seed)) for mode in MODES]
    # the paired scenarios, round-robin: the order turns by round, so that no mode always runs first
    for name, modes, per_run, rounds, validate in ((CAPPED, CAPPED_MODES, capped_epochs, capped_rounds, True),
                                                    (COST, COST_MODES, cost_epochs, cost_rounds, False)):
        for round_index in range(rounds):
            turn = round_index % len(modes)
            for mode in modes[turn:] + modes[:turn]:
                record = run_once(name, mode, per_run, args.seed, timed_epochs=max(1, per_run - 1), validate=validate)
                records.append(_progress({**record, "round": round_index}))
    targets = judge(records) + judge_accumulation(records)
    lines = [bench.verdict(t["target"], t["met"], t["detail"]) for t in targets]
    blocks = [table(records), capped_table(records), cost_table(records), lines]
    return bench.finish("hetero", args.out, started, blocks, {"records": records, "targets": targets},
                        lambda: plot(records), quick=args.quick, epochs=epochs, batch_per_rank=BATCH,
                        timed_epochs=TIMED_EPOCHS, cap=CAP, capped_epochs=capped_epochs, capped_rounds=capped_rounds,
                        cost_epochs=cost_epochs, cost_rounds=cost_rounds)


if __name__ == "__main__":
    main()
