"""Simulated-cluster benchmark: training steps and all-reduce bus bandwidth across real, shaped network links.

Every run gets a fresh :class:`~lightning_dist.simcluster.SimCluster` (root and iproute2; else the payload says why it
was skipped), one rank per host under a static multi-node ``torchrun``, every rank's output in ``logs/``: the WideMLP
under :data:`CONFIGS` (with advise's prediction of each from one more job), and a 16 MiB all-reduce, ring vs gloo's.
``--two-tier`` runs :mod:`~lightning_dist.benchmarks.tiers` instead. Targets (2 hosts, 100 Mbit/s): ``topk1%`` >= 5x
faster per step than dense; ring busbw >= 0.9x native's. Method and results: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
from dataclasses import asdict
from typing import Any, Optional, Sequence

import lightning as L
import numpy as np
import torch
import torch.distributed as dist

from lightning_dist.advise import DENSE as ADVISE_DENSE
from lightning_dist.advise import AdviseConf, Advisor
from lightning_dist.benchmarks import _common as bench
from lightning_dist.benchmarks import tiers
from lightning_dist.benchmarks._cluster import (
    ALLREDUCE_BYTES,
    BATCH_SIZE,
    BUCKET_CAP_MB,
    CONFIGS,
    DEFAULT_RATES,
    DENSE,
    MLP_DEPTH,
    MLP_WIDTH,
    QUICK_ITERATIONS,
    QUICK_STEPS,
    TOPK,
    Jobs,
    allreduce_fields,
    allreduce_worker,
    mb_cell,
    ms_cell,
    skipped,
)
from lightning_dist.comm import ring_allreduce_
from lightning_dist.comm.topology import TOPOLOGIES
from lightning_dist.compression import build_compressor
from lightning_dist.examples import SyntheticDataModule, WideMLP
from lightning_dist.simcluster import link_bytes_sent
from lightning_dist.strategy import RingDDPStrategy
from lightning_dist.testing import quiet_trainer

DEFAULT_HOSTS = (2, 3)
DEFAULT_STEPS, DEFAULT_WARMUP = 30, 5
DEFAULT_ITERATIONS = 4
MIN_PARAMS = 5_000_000
TARGET_HOSTS, TARGET_RATE = 2, 100
TOPK_SPEEDUP_TARGET, RING_BUSBW_TARGET = 5.0, 0.9
BASE_PORT = 29600
ADVISE_WARMUP, ADVISE_STEPS, ADVISE_ROUNDS = 2, 6, 3  # advise's dense steps (untimed, timed) and codec rounds
QUICK_ADVISE_STEPS, QUICK_ADVISE_ROUNDS = 3, 2
QUICK_CONFIGS = (DENSE, TOPK)


# -- workers (run inside the hosts under torchrun) ------------------------------------------------------------
def _train_worker(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)  # hosts share the machine's cores
    config = CONFIGS[args.config]
    L.seed_everything(0, verbose=False)
    model = WideMLP(width=MLP_WIDTH, depth=MLP_DEPTH)
    params = sum(p.numel() for p in model.parameters())
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"[worker] {config.label} ({args.topology}): WideMLP {params:,} parameters", flush=True)
    strategy = RingDDPStrategy(algorithm=config.algorithm, compressor=build_compressor(**config.compressor),
                               bucket_cap_mb=BUCKET_CAP_MB, timeout=args.collective_timeout, topology=args.topology)
    # rank 0 writes its stamps, the model's size and what had left its host by its second step and at the end
    recorder = bench.StepRecorder(args.out, probe=lambda trainer: {"params": params, "link_sent": link_bytes_sent()})
    trainer = quiet_trainer(devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")), num_nodes=args.nodes,
                            strategy=strategy, max_steps=args.steps, limit_val_batches=0, callbacks=[recorder])
    trainer.fit(model, SyntheticDataModule(batch_size=BATCH_SIZE))


def advise_candidates(labels: Sequence[str]) -> dict[str, dict]:
    """The compressor configurations among ``labels`` as advise's candidates; dense is advise's ``none``."""
    out = {ADVISE_DENSE: {"name": "none"}}
    out.update({label: dict(CONFIGS[label].compressor) for label in labels
                if CONFIGS[label].algorithm == "auto" and CONFIGS[label].compressor.get("name") != "none"})
    return out


def _advise_worker(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    settings = AdviseConf(compressors=[], warmup_steps=ADVISE_WARMUP, steps=args.advise_steps,
                          rounds=args.advise_rounds, timeout_s=args.collective_timeout)
    strategy = RingDDPStrategy(algorithm="auto", bucket_cap_mb=BUCKET_CAP_MB, timeout=args.collective_timeout)
    callback = Advisor(advise_candidates(args.configs), settings, args.out)
    trainer = quiet_trainer(devices=1, num_nodes=args.nodes, strategy=strategy, limit_val_batches=0,
                            max_steps=ADVISE_WARMUP + args.advise_steps, callbacks=[callback])
    trainer.fit(WideMLP(width=MLP_WIDTH, depth=MLP_DEPTH), SyntheticDataModule(batch_size=BATCH_SIZE))


def add_predictions(records: list[dict[str, Any]], advice: dict[tuple[int, float], dict[str, Any]]
                    ) -> list[dict[str, Any]]:
    """``predicted_s`` and ``predicted_vs_measured`` on every record whose (hosts, rate) has advise's report."""
    for r in records:
        rows = (advice.get((r["hosts"], r["rate_mbit"])) or {}).get("compressors", {})
        row = rows.get(ADVISE_DENSE if r["config"] == DENSE else r["config"])
        r["predicted_s"] = row["predicted_step_s"] if row else None
        r["predicted_vs_measured"] = (r["predicted_s"] / r["median_s"]
                                      if r["predicted_s"] and r.get("median_s") else None)
    return records


# -- pure summaries (tested without a cluster) -----------------------------------------------------------------
def add_speedups(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``speedup_vs_dense`` on every record: dense's step time over the record's, same (hosts, rate)."""
    dense = {(r["hosts"], r["rate_mbit"]): r["median_s"] for r in records
             if r["config"] == DENSE and r.get("median_s")}
    for r in records:
        base = dense.get((r["hosts"], r["rate_mbit"]))
        r["speedup_vs_dense"] = base / r["median_s"] if base and r.get("median_s") else None
    return records


def busbw_record(raw: dict[str, Any], hosts: int, rate_mbit: float) -> dict[str, Any]:
    """Ring and native median times and bus bandwidths of one all-reduce run."""
    rec = {"hosts": hosts, "rate_mbit": rate_mbit, "bytes": raw["bytes"], "line_GBps": rate_mbit * 1e6 / 8 / 1e9,
           **allreduce_fields(raw)}
    for name in ("ring", "native"):
        seconds = rec[f"{name}_median_s"]
        rec[f"{name}_busbw_GBps"] = 2 * (hosts - 1) / hosts * raw["bytes"] / seconds / 1e9 if seconds else None
    ring, native = rec["ring_busbw_GBps"], rec["native_busbw_GBps"]
    rec["ring_vs_native"] = ring / native if ring and native else None
    return rec


def check_targets(records: Sequence[dict[str, Any]], busbw: Sequence[dict[str, Any]],
                  hosts: int = TARGET_HOSTS, rate_mbit: float = TARGET_RATE) -> dict[str, dict[str, Any]]:
    """The two targets at (hosts, rate); a target whose measurement is missing is absent."""
    out: dict[str, dict[str, Any]] = {}
    topk = next((r for r in records if (r["hosts"], r["rate_mbit"], r["config"]) == (hosts, rate_mbit, TOPK)), None)
    if topk is not None and topk.get("speedup_vs_dense") is not None:
        out["topk_speedup_vs_dense"] = bench.target(topk["speedup_vs_dense"], TOPK_SPEEDUP_TARGET, most=False)
    bus = next((b for b in busbw if (b["hosts"], b["rate_mbit"]) == (hosts, rate_mbit)), None)
    if bus is not None and bus.get("ring_vs_native") is not None:
        out["ring_busbw_vs_native"] = bench.target(bus["ring_vs_native"], RING_BUSBW_TARGET, most=False)
    return out


def target_lines(targets: dict[str, dict[str, Any]], hosts: int = TARGET_HOSTS,
                 rate_mbit: float = TARGET_RATE) -> list[str]:
    where = f"{hosts} hosts @ {rate_mbit:g} Mbit/s"
    return [bench.judged(f"{where}: topk 1% + EF >= {TOPK_SPEEDUP_TARGET:g}x faster per step than dense",
                         targets.get("topk_speedup_vs_dense"), "{value:.1f}x"),
            bench.judged(f"{where}: ring busbw >= {RING_BUSBW_TARGET:g}x native's", targets.get("ring_busbw_vs_native"),
                         "{value:.2f}x")]


def step_table(records: Sequence[dict[str, Any]]) -> str:
    def times(value: Optional[float]) -> str:
        return bench.cell(value, ".2f", unit="x")

    return bench.table(records, ["hosts", "Mbit/s", "config", "median step ms", "exposed comm ms", "comm ms",
                                 "MB sent/step", "vs dense", "advise ms", "advise/measured", "run s"],
                       lambda r: [r["hosts"], f"{r['rate_mbit']:g}", r["config"]],
                       lambda r: [*map(ms_cell, (r["median_s"], r["exposed_median_s"], r["comm_median_s"])),
                                  mb_cell(r["bytes_sent_per_step"]), times(r.get("speedup_vs_dense")),
                                  ms_cell(r.get("predicted_s")), times(r.get("predicted_vs_measured")),
                                  f"{r['wall_s']:.0f}"])


def busbw_table(busbw: Sequence[dict[str, Any]]) -> str:
    return f"all-reduce of {ALLREDUCE_BYTES >> 20} MiB float32\n" + bench.table(
        busbw, ["hosts", "Mbit/s", "ring ms", "native ms", "ring busbw GB/s", "native busbw GB/s", "line GB/s",
                "ring/native"], lambda b: [b["hosts"], f"{b['rate_mbit']:g}"],
        lambda b: [ms_cell(b["ring_median_s"]), ms_cell(b["native_median_s"]),
                   *(bench.cell(b[key], ".4f") for key in ("ring_busbw_GBps", "native_busbw_GBps", "line_GBps")),
                   bench.cell(b["ring_vs_native"], ".2f", unit="x")])


def plot(records: Sequence[dict[str, Any]], busbw: Sequence[dict[str, Any]]) -> Any:
    """Left: step time per configuration, grouped by (hosts, rate), log y. Right: busbw ring vs native."""
    groups = list(dict.fromkeys((r["hosts"], r["rate_mbit"]) for r in records))
    configs = list(dict.fromkeys(r["config"] for r in records))
    fig, (ax, bx) = bench.figure_row(2, 6 + 1.8 * max(len(groups), 1), 4.6, width_ratios=[2, 1])
    width = 0.8 / max(len(configs), 1)
    by_key = {(r["hosts"], r["rate_mbit"], r["config"]): r for r in records}
    for i, config in enumerate(configs):
        values = [1e3 * (by_key.get((*g, config), {}).get("median_s") or np.nan) for g in groups]
        ax.bar(np.arange(len(groups)) + (i - (len(configs) - 1) / 2) * width, values, width, label=config)
    ax.set_xticks(range(len(groups)), [f"{h} hosts\n{r:g} Mbit/s" for h, r in groups])
    bench.style(ax, "y", "x-small", yscale="log", ylabel="median step time, ms (log)",
                title="WideMLP, 5.3M params: median step time")
    bgroups = [b for b in busbw if not b.get("error")]
    x = np.arange(len(bgroups))
    for offset, name in ((-0.2, "ring"), (0.2, "native")):
        values = [b[f"{name}_busbw_GBps"] / b["line_GBps"] for b in bgroups]
        bars = bx.bar(x + offset, values, 0.4, label=name)
        bx.bar_label(bars, [f"{b[f'{name}_busbw_GBps'] * 1e3:.0f}" for b in bgroups], fontsize="x-small")
    bx.axhline(1.0, color="red", ls="--", lw=1, label="line rate")
    bx.set_xticks(x, [f"{b['hosts']}h\n{b['rate_mbit']:g}" for b in bgroups])
    bench.style(bx, "y", ylim=(0, 1.2), ylabel="busbw / line rate (labels: MB/s)",
                title=f"all-reduce {ALLREDUCE_BYTES >> 20} MiB")
    bx.legend(fontsize="x-small", loc="lower right")
    return fig


WORKERS = {"train": _train_worker, "advise": _advise_worker,
           "tiers": lambda args: allreduce_worker(args, tiers.contenders, link=True),
           "allreduce": lambda args: allreduce_worker(args, lambda: ({"ring": ring_allreduce_,
                                                                      "native": dist.all_reduce}, {}))}


def _parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    cli = bench.parser("cluster", __doc__, f"2 hosts, 100 Mbit/s, dense and topk1%, {QUICK_STEPS} steps, "
                                           f"{QUICK_ITERATIONS} iterations")
    cli.add_argument("--hosts", type=int, nargs="+", default=None, help="host counts (default 2 3)")
    cli.add_argument("--rates", type=float, nargs="+", default=None, help="link rates, Mbit/s (default 100 1000)")
    cli.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=None,
                        help=f"training configurations (default all: {' '.join(CONFIGS).replace('%', '%%')})")
    cli.add_argument("--steps", type=int, default=None, help=f"optimizer steps per run (default {DEFAULT_STEPS})")
    cli.add_argument("--warmup", type=int, default=DEFAULT_WARMUP, help="leading steps dropped (default 5)")
    cli.add_argument("--iterations", type=int, default=None,
                        help=f"timed all-reduce iterations per algorithm (default {DEFAULT_ITERATIONS})")
    cli.add_argument("--run-timeout", type=float, default=420.0, help="one run's hard deadline, s (default 420)")
    cli.add_argument("--two-tier", action="store_true",
                     help="instead: flat against two_tier on 2 hosts of several ranks each (lightning_dist.benchmarks."
                          "tiers; default 2 and 4 ranks per host, 100 and 1000 Mbit/s)")
    cli.add_argument("--ranks-per-host", type=int, nargs="+", default=None,
                     help="with --two-tier: ranks on each host (default 2 4)")
    # what each host runs under torchrun: one rank of a job (WORKERS), and the job's settings
    cli.add_argument("--worker", default=None, choices=WORKERS, help=argparse.SUPPRESS)
    cli.add_argument("--topology", default="auto", choices=TOPOLOGIES, help=argparse.SUPPRESS)
    cli.add_argument("--advise-steps", type=int, default=None, help=argparse.SUPPRESS)
    cli.add_argument("--advise-rounds", type=int, default=None, help=argparse.SUPPRESS)
    cli.add_argument("--config", default=DENSE, choices=list(CONFIGS), help=argparse.SUPPRESS)
    cli.add_argument("--nodes", type=int, default=1, help=argparse.SUPPRESS)
    cli.add_argument("--nbytes", type=int, default=ALLREDUCE_BYTES, help=argparse.SUPPRESS)
    cli.add_argument("--collective-timeout", type=float, default=300.0, help=argparse.SUPPRESS)
    args = cli.parse_args(argv)
    if args.two_tier:
        tiers.defaults(args)
    bench.quick_defaults(args, hosts=(DEFAULT_HOSTS, (TARGET_HOSTS,)), rates=(DEFAULT_RATES, (TARGET_RATE,)),
                         configs=(CONFIGS, QUICK_CONFIGS), steps=(DEFAULT_STEPS, QUICK_STEPS),
                         iterations=(DEFAULT_ITERATIONS, QUICK_ITERATIONS),
                         advise_steps=(ADVISE_STEPS, QUICK_ADVISE_STEPS),
                         advise_rounds=(ADVISE_ROUNDS, QUICK_ADVISE_ROUNDS))
    if not args.worker:
        if min(args.hosts) < 2:
            cli.error(f"--hosts {args.hosts}: a cluster needs at least 2 hosts.")
        bench.check_counts(cli, args.steps, args.warmup)
    return args


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    """Run the benchmark (``--two-tier``: :func:`tiers.run`), or with ``--worker`` one rank of one of its jobs."""
    args = _parse_args(argv)
    if args.worker:
        WORKERS[args.worker](args)
        return {}
    if args.two_tier:
        return tiers.run(args)

    meta = dict(hosts=list(args.hosts), rates_mbit=list(args.rates), steps=args.steps, warmup=args.warmup,
                iterations=args.iterations, allreduce_bytes=ALLREDUCE_BYTES, batch_size=BATCH_SIZE,
                model=f"WideMLP(width={MLP_WIDTH}, depth={MLP_DEPTH})", bucket_cap_mb=BUCKET_CAP_MB,
                configs={label: asdict(CONFIGS[label]) for label in args.configs})
    if (payload := skipped("cluster", "cluster", meta, "records", "allreduce")) is not None:
        return payload
    records, busbw = [], []
    advice: dict[tuple[int, float], dict[str, Any]] = {}  # (hosts, rate) -> advise's report
    start = time.perf_counter()
    with Jobs(bench.output_dir(args.out, "cluster"), "cluster", args.run_timeout, BASE_PORT + 1) as jobs:
        for rate, hosts in itertools.product(args.rates, args.hosts):
            where = f"{hosts} hosts @ {rate:g} Mbit/s"
            for label in args.configs:
                config = CONFIGS[label]
                records.append(jobs.train(hosts, rate, f"h{hosts}_r{rate:g}_{_safe(label)}", [
                    "--worker", "train", "--config", label, "--steps", str(args.steps)], args.warmup, {
                    "hosts": hosts, "rate_mbit": rate, "config": label, "algorithm": config.algorithm,
                    "compressor": config.compressor}, f"{where} {label:<12}"))
            advice[(hosts, rate)] = jobs.measure(hosts, rate, f"h{hosts}_r{rate:g}_advise", [
                "--worker", "advise", "--configs", *args.configs, "--advise-steps", str(args.advise_steps),
                "--advise-rounds", str(args.advise_rounds)], f"{where} advise", {}, dict, lambda raw: ": " + ", ".join(
                f"{label} {ms_cell(row['predicted_step_s'])} ms" for label, row in raw["compressors"].items()))
            busbw.append(jobs.measure(hosts, rate, f"h{hosts}_r{rate:g}_allreduce", [
                "--worker", "allreduce", "--iterations", str(args.iterations)], f"{where} all-reduce",
                {"hosts": hosts, "rate_mbit": rate}, lambda raw: busbw_record(raw, hosts, rate),
                lambda b: f": ring {b['ring_busbw_GBps'] * 1e3:.1f} MB/s, native "
                          f"{b['native_busbw_GBps'] * 1e3:.1f} MB/s busbw ({b['ring_vs_native']:.2f}x)"))
    add_predictions(add_speedups(records), advice)
    targets = check_targets(records, busbw)
    payload = {"skipped": None, "records": records, "allreduce": busbw, "targets": targets,
               "advise": [{"hosts": h, "rate_mbit": r, **rep} for (h, r), rep in advice.items()]}
    return bench.finish("cluster", args.out, start, [step_table(records), busbw_table(busbw), target_lines(targets)],
                        payload, lambda: plot(records, busbw), **meta)


def _safe(label: str) -> str:
    return label.replace("/", "_").replace("%", "pct")


if __name__ == "__main__":
    main(sys.argv[1:])
