"""What a callback costs a step when it has nothing to do: ``NaNRecovery`` on a clean run and ``MemoryMonitor`` at its
default interval, each with and without, round-robin (:data:`CASES`).

Two measures: the step time paired with the same round's run without it, and the callback's self-timed work on rank 0
as a fraction of the median step (MemoryMonitor's first-step one-off apart from the **steady** rest, which is judged).
Target: each below 1% of the step. Method and results: docs/benchmarks.md.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import lightning as L
import numpy as np

from lightning_dist.benchmarks import _common as bench
from lightning_dist.benchmarks.workloads import DIGITS, MLP, Workload, make_strategy
from lightning_dist.callbacks import MemoryMonitor, NaNRecovery
from lightning_dist.strategy import features_of

TARGET_FRACTION = 0.01
WARMUP = 10  # leading steps dropped from each run
QUICK_STEPS, QUICK_WARMUP, QUICK_EVERY = 15, 5, 5
WORKLOADS = {w.name: w for w in (DIGITS, MLP)}


@dataclass(frozen=True)
class Case:
    """One callback on one workload under one strategy, with and without it."""

    callback: str
    workload: Workload
    strategy: str  # "ring_ddp" (algorithm auto) or "ddp" (Lightning's stock DDPStrategy)
    steps: int  # optimizer steps per run (--steps overrides)
    rounds: int  # round-robin rounds (--rounds overrides)

    @property
    def label(self) -> str:
        return "auto" if self.strategy == "ring_ddp" else self.strategy


CASES = (Case("NaNRecovery", DIGITS, "ring_ddp", 150, 10), Case("NaNRecovery", MLP, "ring_ddp", 40, 8),
         Case("MemoryMonitor", DIGITS, "ring_ddp", 300, 12),  # 300 steps: 6 readings at the default interval
         Case("MemoryMonitor", DIGITS, "ddp", 300, 12))


def _find(trainer: L.Trainer, kind: type) -> Any:
    return next((cb for cb in trainer.callbacks if isinstance(cb, kind)), None)


class GuardCost:
    """NaNRecovery's cost: the guard's hook sums, its decision and the callback, per step, on rank 0."""

    name, key, watched, alternate = "NaNRecovery", "nan_recovery", "guarded", False
    parts = {"hook": "hook sums (worker, overlapped)", "decide": "decision (after backward)", "callback": "callback"}

    def make(self, every: Optional[int]) -> NaNRecovery:
        return NaNRecovery()

    def probe(self, trainer: L.Trainer) -> dict[str, float]:
        guard, recovery = features_of(trainer.strategy).step_guard, _find(trainer, NaNRecovery)
        return {"steps": guard.steps, "hook_s": guard.hook_seconds, "decide_s": guard.seconds,
                "callback_s": recovery.seconds if recovery is not None else 0.0}

    def fields(self, on: bool, median_s: float, stamps: dict[str, Any]) -> dict[str, Any]:
        last = stamps["last"]
        per_step = {part: last[f"{part}_s"] / max(1, last["steps"]) for part in self.parts}
        return {**{f"{part}_s_per_step": value for part, value in per_step.items()},
                **{f"{part}_fraction": value / median_s for part, value in per_step.items()}}

    def summary(self, runs: Sequence[dict[str, Any]]) -> dict[str, float]:
        fractions = {part: float(np.median([r[f"{part}_fraction"] for r in runs])) for part in self.parts}
        return {**{f"{part}_fraction": value for part, value in fractions.items()},
                "own_fraction": sum(fractions.values()),
                "exposed_fraction": fractions["decide"] + fractions["callback"]}

    def table(self, summary: Sequence[dict[str, Any]]) -> str:
        rows = [[s["workload"], f"{1e3 * s['base_median_s']:.2f}", f"{1e3 * s['guarded_median_s']:.2f}",
                 bench.spread(s), *(f"{100 * s[f'{part}_fraction']:.2f}%" for part in (*self.parts, "own"))]
                for s in summary]
        headers = ["workload", "step ms", "+NaNRecovery ms", "paired ratio [p25, p75]", "hook sums", "decision",
                   "callback", "guard work, all"]
        return "NaNRecovery's cost on a clean run (rank 0; % of the median step)\n" + bench.format_table(headers, rows)

    def verdict(self, s: dict[str, Any]) -> str:
        return bench.verdict(f"{s['workload']}: guard work < {100 * TARGET_FRACTION:.0f}% of the step",
                             s["own_fraction"] < TARGET_FRACTION,
                             f"{100 * s['own_fraction']:.2f}%; on the training thread "
                             f"{100 * s['exposed_fraction']:.2f}%; step time paired {s['paired_ratio']:.3f}x")

    def plot_fractions(self, ax: Any, summary: Sequence[dict[str, Any]]) -> str:
        bottom = np.zeros(len(summary))
        for part, label in self.parts.items():
            values = np.array([100 * s[f"{part}_fraction"] for s in summary])
            ax.bar([s["workload"] for s in summary], values, bottom=bottom, label=label)
            bottom += values
        ax.set_title("guard work, self-timed on rank 0")
        return f"NaNRecovery's cost on a clean run ({bench.WORLD_SIZE} CPU ranks, gloo, ring_ddp auto)"


def cost_fractions(run: dict[str, Any]) -> dict[str, float]:
    """A monitored run's self-timed work: the one-off first step, the per-step rest, and both as fractions
    of the run's median step."""
    steps, median_s = run["steps"], run["median_s"]
    steady_s = (run["monitor_s"] - run["first_s"]) / max(1, steps - 1)
    return {"one_off_s": run["first_s"], "steady_per_step_s": steady_s, "steady_fraction": steady_s / median_s,
            "all_in_fraction": run["monitor_s"] / (steps * median_s)}


class MonitorCost:
    """MemoryMonitor's cost: its own seconds, the one-off first step apart from the steady rest, on rank 0."""

    name, key, watched, alternate = "MemoryMonitor", "memory_monitor", "monitored", True

    def make(self, every: Optional[int]) -> MemoryMonitor:
        return MemoryMonitor(every_n_steps=every)

    def probe(self, trainer: L.Trainer) -> dict[str, float]:
        monitor = _find(trainer, MemoryMonitor)
        if monitor is None:
            return {"monitor_s": 0.0, "readings": 0, "every": 0}
        return {"monitor_s": monitor.seconds, "readings": monitor.readings, "every": monitor.interval}

    def fields(self, on: bool, median_s: float, stamps: dict[str, Any]) -> dict[str, Any]:
        return {"monitored": on, **stamps["last"], "first_s": stamps["first"].get("monitor_s", 0.0)}

    def summary(self, runs: Sequence[dict[str, Any]]) -> dict[str, float]:
        fractions = [cost_fractions(r) for r in runs]
        return {"steps": runs[0]["steps"], "every": runs[0]["every"],
                "readings": int(np.median([r["readings"] for r in runs])),
                **{key: float(np.median([f[key] for f in fractions])) for key in fractions[0]}}

    def table(self, summary: Sequence[dict[str, Any]]) -> str:
        rows = [[s["strategy"], s["rounds"], s["steps"], f"{s['every']} ({s['readings']})",
                 f"{1e3 * s['base_median_s']:.2f}", f"{1e3 * s['monitored_median_s']:.2f}", bench.spread(s),
                 f"{1e3 * s['one_off_s']:.2f}", f"{1e6 * s['steady_per_step_s']:.1f}",
                 f"{100 * s['steady_fraction']:.3f}%", f"{100 * s['all_in_fraction']:.3f}%"] for s in summary]
        headers = ["strategy", "rounds", "steps", "every (readings)", "step ms", "+MemoryMonitor ms",
                   "paired ratio [p25, p75]", "one-off ms", "steady us/step", "steady", "all-in"]
        return ("MemoryMonitor's cost on the digits workload (rank 0; steady and all-in: % of the median step)\n"
                + bench.format_table(headers, rows))

    def verdict(self, s: dict[str, Any]) -> str:
        return bench.verdict(f"{s['strategy']}: MemoryMonitor's own work < {100 * TARGET_FRACTION:.0f}% of the step at "
                             f"every_n_steps={s['every']}", s["steady_fraction"] < TARGET_FRACTION,
                             f"steady {100 * s['steady_fraction']:.3f}%, all-in {100 * s['all_in_fraction']:.3f}% with "
                             f"the one-off {1e3 * s['one_off_s']:.1f} ms; step time paired {s['paired_ratio']:.3f}x")

    def plot_fractions(self, ax: Any, summary: Sequence[dict[str, Any]]) -> str:
        x = np.arange(len(summary))
        ax.bar(x - 0.18, [100 * s["steady_fraction"] for s in summary], 0.36, label="steady (per step)")
        ax.bar(x + 0.18, [100 * s["all_in_fraction"] for s in summary], 0.36, label="all-in (with the one-off)")
        ax.set_xticks(x, [s["strategy"] for s in summary])
        ax.set_title("MemoryMonitor's own work, rank 0")
        every = "/".join(map(str, sorted({s["every"] for s in summary})))
        return f"MemoryMonitor's cost on digits ({bench.WORLD_SIZE} CPU ranks, gloo; every_n_steps={every})"


SUBJECTS = {s.name: s for s in (GuardCost(), MonitorCost())}


def run_once(case: Case, on: bool, steps: int, warmup: int, every: Optional[int], seed: int) -> dict[str, Any]:
    """One fit of the case's workload, with or without its callback."""
    subject = SUBJECTS[case.callback]
    strategy = make_strategy("auto" if case.strategy == "ring_ddp" else None, case.workload.bucket_cap_mb)
    callbacks = [subject.make(every)] if on else []
    times, stamps, _ = bench.timed_fit(case.workload, strategy, steps, warmup, seed, callbacks, subject.probe)
    return {"workload": case.workload.name, "strategy": case.strategy,
            "config": case.label + (f"+{case.callback}" if on else ""), **times,
            **subject.fields(on, times["median_s"], stamps)}


def summarize_runs(runs: Sequence[dict[str, Any]], subject: Any) -> list[dict[str, Any]]:
    """Per workload and strategy: the step time with the callback paired with the same round's without it (median
    and quartiles over rounds), both runs' medians over rounds, and the callback's own work in the runs with it."""
    out = []
    for workload, strategy in dict.fromkeys((r["workload"], r["strategy"]) for r in runs):
        mine = [r for r in runs if (r["workload"], r["strategy"]) == (workload, strategy)]
        watched = [r for r in mine if "+" in r["config"]]
        ratio = bench.paired_runs(watched, [r for r in mine if "+" not in r["config"]])
        if ratio is None:
            continue
        paired = [r for r in watched if any(o["round"] == r["round"] and "+" not in o["config"] for o in mine)]
        out.append({"workload": workload, "strategy": strategy, "rounds": ratio["pairs"],
                    "description": WORKLOADS[workload].description, "base_median_s": ratio["base"],
                    f"{subject.watched}_median_s": ratio["mine"], "paired_ratio": ratio["median"],
                    "paired_p25": ratio["p25"], "paired_p75": ratio["p75"], **subject.summary(paired)})
    return out


def plot(results: dict[str, dict[str, Any]]) -> Any:
    """A row per callback: per case, per-run median step times without and with it; then its own work."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    shown = [(SUBJECTS[name], result) for name, result in results.items() if result["records"]]
    panels = max(len(result["records"]) for _, result in shown) + 1
    fig = Figure(figsize=(4.2 * panels + 0.3, 4.2 * len(shown)), layout="constrained")
    FigureCanvasAgg(fig)
    for sub, (subject, result) in zip(fig.subfigures(len(shown), 1, squeeze=False)[:, 0], shown):
        summary = result["records"]
        axes = sub.subplots(1, len(summary) + 1, squeeze=False)[0]
        for ax, s in zip(axes, summary):
            data = [[1e3 * r["median_s"] for r in result["runs"] if (r["workload"], r["strategy"], "+" in r["config"])
                     == (s["workload"], s["strategy"], on)] for on in (False, True)]
            bench.step_boxplot(ax, data, [s["strategy"], f"+ {subject.name}"],
                               f"{s['workload']}, {s['strategy']}: paired {s['paired_ratio']:.3f}x")
        ax = axes[-1]
        sub.suptitle(subject.plot_fractions(ax, summary))
        ax.axhline(100 * TARGET_FRACTION, color="red", ls="--", lw=1, label="target: 1% of the step")
        ax.set_ylabel("% of the median step")
        ax.legend(fontsize="x-small")
    return fig


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    cli = bench.parser("callbacks", __doc__, f"1 round of {QUICK_STEPS} steps, MemoryMonitor every {QUICK_EVERY} steps",
                       seed="seed of every run")
    cli.add_argument("--callbacks", nargs="+", choices=list(SUBJECTS), default=list(SUBJECTS))
    cli.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS),
                     help="NaNRecovery's workloads (default: both)")
    cli.add_argument("--strategies", nargs="+", choices=("ring_ddp", "ddp"), default=["ring_ddp", "ddp"],
                     help="MemoryMonitor's strategies (default: both)")
    cli.add_argument("--rounds", type=int, default=None, help="round-robin rounds (default: the case's; --quick 1)")
    cli.add_argument("--steps", type=int, default=None,
                     help=f"steps per run (default: the case's; --quick {QUICK_STEPS})")
    args = cli.parse_args(argv)
    warmup = QUICK_WARMUP if args.quick else WARMUP
    bench.check_counts(cli, args.steps, warmup, rounds=args.rounds)
    every = QUICK_EVERY if args.quick else None  # None: the Trainer's log_every_n_steps (50)
    cases = [c for c in CASES if c.callback in args.callbacks and (
        c.workload.name in args.workloads if c.callback == "NaNRecovery" else c.strategy in args.strategies)]
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in args.callbacks}
    started = time.perf_counter()
    with bench.quiet_lightning():
        # the cases of one callback and workload share rounds: each round runs every strategy, without and with
        for name, workload in dict.fromkeys((c.callback, c.workload.name) for c in cases):
            group = [c for c in cases if (c.callback, c.workload.name) == (name, workload)]
            rounds = args.rounds or (1 if args.quick else group[0].rounds)
            steps = args.steps or (QUICK_STEPS if args.quick else group[0].steps)
            bench.progress(f"[callbacks] {name} on {workload}: {rounds} rounds x {2 * len(group)} runs "
                           f"({', '.join(c.strategy for c in group)}), {steps} steps per run")
            for round_index in range(rounds):
                for case in group:
                    order = (True, False) if SUBJECTS[name].alternate and round_index % 2 else (False, True)
                    for on in order:
                        record = run_once(case, on, steps, warmup, every, args.seed)
                        runs[name].append({**record, "round": round_index})
                        bench.progress(f"  {workload} round {round_index + 1}/{rounds} {record['config']:<22} "
                                       f"{1e3 * record['median_s']:7.2f} ms/step (run {record['wall_s']:.1f}s)")
    results = {name: {"runs": mine, "records": summarize_runs(mine, SUBJECTS[name])} for name, mine in runs.items()}
    tables = [SUBJECTS[name].table(r["records"]) for name, r in results.items() if r["records"]]
    lines = [SUBJECTS[name].verdict(s) for name, r in results.items() for s in r["records"]]
    return bench.finish("callbacks", args.out, started, [*tables, lines],
                        {SUBJECTS[name].key: result for name, result in results.items()}, lambda: plot(results),
                        world_size=bench.WORLD_SIZE, seed=args.seed, quick=args.quick, every_n_steps=every,
                        target_fraction=TARGET_FRACTION, warmup=warmup,
                        cases=[{"callback": c.callback, "workload": c.workload.name, "strategy": c.strategy,
                                "steps": c.steps, "rounds": c.rounds} for c in cases])


if __name__ == "__main__":
    main()
