"""Training-step benchmark: ``RingDDPStrategy`` (overlapped and blocking hook, per algorithm) against Lightning's
stock ``DDPStrategy``, on the latency-bound ``digits`` and the bandwidth-bound ``mlp`` workload.

Configurations run round-robin, each a :func:`~lightning_dist.benchmarks._common.timed_fit` from the same seed, its
final weights compared with the round's ddp run. Targets, on the paired ratio: on mlp, ``auto`` and ``native`` <= 1.02x
ddp's step; on digits, ``auto`` <= 1.05x. Method and results: docs/benchmarks.md.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass
from typing import Any, Optional, Sequence

import torch

from lightning_dist.benchmarks import _common as bench
from lightning_dist.benchmarks.workloads import DIGITS, MLP, Workload, make_strategy

QUICK_STEPS, QUICK_WARMUP = 15, 5


@dataclass(frozen=True)
class Config:
    """One column of the benchmark."""

    label: str  # name in tables and records
    algorithm: Optional[str]  # RingDDPStrategy's algorithm; None = Lightning's stock DDPStrategy
    overlap: bool = True  # RingDDPStrategy's overlap (False: the blocking hook)


@dataclass(frozen=True)
class Plan:
    """A workload, how long each run trains, and the configurations measured on it."""

    workload: Workload
    steps: int  # optimizer steps per run
    warmup: int  # leading steps dropped from each run
    rounds: int  # round-robin rounds (--rounds overrides)
    configs: tuple[Config, ...]
    targets: tuple[str, ...]  # labels judged against ``target_ratio`` (paired median)
    target_ratio: float


STOCK = Config("ddp", None)


def _ring(algorithm: str) -> tuple[Config, Config]:
    return Config(f"{algorithm}", algorithm), Config(f"{algorithm}/blocking", algorithm, overlap=False)


WORKLOADS = {
    # ~6 epochs of the 1,437 training digits at 2 x 32; a short step is at the mercy of every hiccup of a shared
    # machine, hence many rounds of long runs
    "digits": Plan(DIGITS, steps=150, warmup=10, rounds=16, configs=(STOCK, *_ring("auto")), targets=("auto",),
                   target_ratio=1.05),
    "mlp": Plan(MLP, steps=40, warmup=10, rounds=10,  # the issue asks for at least 8 rounds
                configs=(STOCK, *(c for a in ("auto", "native", "ring", "tree") for c in _ring(a))),
                targets=("auto", "native"), target_ratio=1.02),
}


def run_once(plan: Plan, config: Config, steps: int, warmup: int, seed: int) -> tuple[dict, dict]:
    """One ``Trainer.fit``; returns (the run's record, its final weights)."""
    workload = plan.workload
    ring = {} if config.algorithm is None else {"overlap": config.overlap}
    strategy = make_strategy(config.algorithm, workload.bucket_cap_mb, **ring)
    times, stamps, model = bench.timed_fit(workload, strategy, steps, warmup, seed)
    measured = [s for s in stamps["steps"][warmup:] if s]  # one per step under RingDDPStrategy, else none
    record = {
        "workload": workload.name, "config": config.label, "algorithm": config.algorithm,
        "overlap": config.overlap if config.algorithm else None, **times,
        "cpu_median_s": bench.median(bench.step_times(stamps["cpu"], stamps["epochs"], warmup)),
        "comm_median_s": bench.median([s["comm_s"] for s in measured]),
        "exposed_median_s": bench.median([s["exposed_s"] for s in measured]),
    }
    return record, {k: v.detach().clone() for k, v in model.state_dict().items()}


def summarize_configs(runs: Sequence[dict[str, Any]], configs: Sequence[Config]) -> list[dict[str, Any]]:
    """Per configuration of one workload: median and quartiles over rounds of the per-run medians, the ratios to ddp
    (of the medians, and paired by round), and the medians of the per-run CPU, comm and exposed times."""
    stock = [r for r in runs if r["config"] == STOCK.label]
    out = []
    for config in configs:
        mine = [r for r in runs if r["config"] == config.label]
        stats = bench.summarize([r["median_s"] for r in mine])
        medians = {key: bench.median([r[key] for r in mine if r[key] is not None])
                   for key in ("cpu_median_s", "comm_median_s", "exposed_median_s")}
        out.append({"workload": mine[0]["workload"], "config": config.label, "algorithm": config.algorithm,
                    "overlap": mine[0]["overlap"], "rounds": len(mine), **stats,
                    "ratio_vs_ddp": stats["median_s"] / bench.median([r["median_s"] for r in stock]),
                    "paired_ratio_vs_ddp": bench.paired_runs(mine, stock)["median"],
                    "cpu_median_s": medians["cpu_median_s"],
                    "cpu_ratio_vs_ddp": medians["cpu_median_s"] / bench.median([r["cpu_median_s"] for r in stock]),
                    "comm_median_s": medians["comm_median_s"], "exposed_median_s": medians["exposed_median_s"],
                    "max_abs_weight_diff_vs_ddp": max(r["max_abs_weight_diff_vs_ddp"] for r in mine)})
    return out


def judge(plan: Plan, summary: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The workload's targets: each target configuration's paired ratio against its bound."""
    return [{"workload": plan.workload.name, "config": s["config"], "bound": plan.target_ratio,
             "paired_ratio": s["paired_ratio_vs_ddp"], "ratio": s["ratio_vs_ddp"],
             "met": bool(s["paired_ratio_vs_ddp"] <= plan.target_ratio)}
            for s in summary if s["config"] in plan.targets]


def table(summary: Sequence[dict[str, Any]]) -> str:
    def ms(s: dict[str, Any], *keys: str) -> list[str]:
        return [bench.cell(s[k], ".2f", 1e3) for k in keys]

    rows = [[s["workload"], s["config"], *ms(s, "median_s", "p25_s", "p75_s"), f"{s['ratio_vs_ddp']:.3f}x",
             f"{s['paired_ratio_vs_ddp']:.3f}x", *ms(s, "cpu_median_s"), f"{s['cpu_ratio_vs_ddp']:.3f}x",
             *ms(s, "comm_median_s", "exposed_median_s"), f"{s['max_abs_weight_diff_vs_ddp']:.1e}"] for s in summary]
    headers = ["workload", "config", "median step ms", "p25 ms", "p75 ms", "vs ddp", "paired vs ddp", "cpu ms",
               "cpu vs ddp", "comm ms", "exposed comm ms", "max |w - w_ddp|"]
    return bench.format_table(headers, rows)


def plot(runs: Sequence[dict[str, Any]], summary: Sequence[dict[str, Any]]) -> Any:
    """Per workload, per-run median step times per configuration (box and points), the stock median and the
    target bound."""
    names = list(dict.fromkeys(s["workload"] for s in summary))
    widths = [len([s for s in summary if s["workload"] == n]) for n in names]
    fig, axes = bench.figure_row(len(names), 1.1 * sum(widths) + 2.5 * len(names), width_ratios=widths)
    for ax, name in zip(axes, names):
        plan, labels = WORKLOADS[name], [s["config"] for s in summary if s["workload"] == name]
        data = [[1e3 * r["median_s"] for r in runs if (r["workload"], r["config"]) == (name, label)]
                for label in labels]
        bench.step_boxplot(ax, data, labels, f"{name}: {plan.workload.description}", rotation=35, ha="right")
        stock_ms = 1e3 * next(s["median_s"] for s in summary if s["workload"] == name)
        ax.axhline(stock_ms, color="gray", lw=1, label="ddp median")
        ax.axhline(plan.target_ratio * stock_ms, color="red", ls="--", lw=1,
                   label=f"{plan.target_ratio}x ddp (target: {', '.join(plan.targets)})")
        ax.title.set_fontsize("small")
        ax.legend(fontsize="x-small")
    fig.suptitle(f"{bench.WORLD_SIZE} CPU ranks, gloo: stock DDP vs ring_ddp (overlapped and /blocking hook)")
    return fig


def _parse_args(argv: Optional[Sequence[str]]) -> Any:
    cli = bench.parser("step", __doc__, f"1 round of ddp and auto per workload, {QUICK_STEPS} steps",
                       seed="seed of every run")
    cli.add_argument("--workloads", nargs="+", choices=sorted(WORKLOADS), default=list(WORKLOADS),
                     help="which workloads to run (default: all)")
    cli.add_argument("--rounds", type=int, default=None,
                     help="round-robin rounds per workload (default: the workload's, 1 with --quick)")
    cli.add_argument("--steps", type=int, default=None,
                     help=f"optimizer steps per run (default: the workload's, {QUICK_STEPS} with --quick)")
    cli.add_argument("--warmup", type=int, default=None,
                     help=f"leading steps dropped per run (default: the workload's, {QUICK_WARMUP} with --quick)")
    args = cli.parse_args(argv)
    if args.quick:
        args.rounds, args.steps = args.rounds or 1, args.steps or QUICK_STEPS
        args.warmup = QUICK_WARMUP if args.warmup is None else args.warmup
    bench.check_counts(cli, rounds=args.rounds)
    for name in args.workloads:
        bench.check_counts(cli, args.steps or WORKLOADS[name].steps,
                           WORKLOADS[name].warmup if args.warmup is None else args.warmup)
    return args


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    args = _parse_args(argv)
    runs, summary, targets = [], [], []
    start = time.perf_counter()
    with bench.quiet_lightning():
        for name in args.workloads:
            plan = WORKLOADS[name]
            configs = plan.configs[:2] if args.quick else plan.configs
            steps, rounds = args.steps or plan.steps, args.rounds or plan.rounds
            warmup = plan.warmup if args.warmup is None else args.warmup
            bench.progress(f"[step] {name}: {rounds} rounds x {len(configs)} configs "
                           f"({', '.join(c.label for c in configs)}), {steps} steps per run, first {warmup} dropped")
            mine: list[dict[str, Any]] = []
            for round_index in range(rounds):
                stock_weights: Optional[dict[str, torch.Tensor]] = None
                for config in configs:  # STOCK first: the round's other runs are compared with its weights
                    record, weights = run_once(plan, config, steps, warmup, args.seed)
                    stock_weights = weights if stock_weights is None else stock_weights
                    diff = max(float((weights[k].double() - stock_weights[k].double()).abs().max()) for k in weights)
                    mine.append({**record, "round": round_index, "max_abs_weight_diff_vs_ddp": diff})
                    bench.progress(f"  {name} round {round_index + 1}/{rounds} {config.label:<16} "
                                   f"{1e3 * record['median_s']:7.2f} ms/step  (run {record['wall_s']:.1f}s, "
                                   f"|w - w_ddp| {diff:.1e})")
            runs += mine
            summary += (rows := summarize_configs(mine, configs))
            targets += judge(plan, rows)
    lines = [bench.verdict(f"{t['workload']} {t['config']} <= {t['bound']}x ddp step time (paired)", t["met"],
                           f"{t['paired_ratio']:.3f}x; unpaired {t['ratio']:.3f}x") for t in targets]
    workloads = {n: {"configs": [asdict(c) for c in p.configs], "rounds": args.rounds or p.rounds,
                     "batch_size": p.workload.batch_size, "bucket_cap_mb": p.workload.bucket_cap_mb,
                     "description": p.workload.description} for n, p in WORKLOADS.items() if n in args.workloads}
    # the machine's load matters more than anything else here: a busy machine inflates every wait
    return bench.finish("step", args.out, start, [table(summary), lines],
                        {"runs": runs, "records": summary, "targets": targets}, lambda: plot(runs, summary),
                        world_size=bench.WORLD_SIZE, seed=args.seed, workloads=workloads,
                        loadavg_at_end=os.getloadavg())

if __name__ == "__main__":
    main()
