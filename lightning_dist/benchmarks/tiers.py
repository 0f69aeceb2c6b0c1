"""Two-tier reduction on a simulated cluster: ``python -m lightning_dist.benchmarks.cluster --two-tier``.

2 hosts of ``L`` ranks (one shaped link each): a 16 MiB all-reduce flat against two_tier
(:class:`~lightning_dist.strategy.tiers.TwoTier` in the strategy's 4 MiB buckets), and the WideMLP's steps under both
topologies. Targets: at 2 x 4 and 100 Mbit/s, two_tier's all-reduce >= 1.5x faster and its top-k link bytes <= 1/10 of
flat's; at 2 x 2, no step slower than flat (:data:`NO_SLOWER_MARGIN`). Method and results: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import time
from typing import Any, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist

from lightning_dist.benchmarks import _common as bench
from lightning_dist.benchmarks._cluster import (
    ALLREDUCE_BYTES,
    BATCH_SIZE,
    BUCKET_CAP_MB,
    MLP_DEPTH,
    MLP_WIDTH,
    QUICK_STEPS,
    TOPK,
    Jobs,
    allreduce_fields,
    mb_cell,
    ms_cell,
    skipped,
)
from lightning_dist.comm import CommStats
from lightning_dist.comm.topology import TOPOLOGIES as REQUESTS
from lightning_dist.comm.topology import resolve_topology
from lightning_dist.compression import BucketLayout, NoCompressor
from lightning_dist.examples import WideMLP
from lightning_dist.strategy.tiers import TwoTier

HOSTS = 2
DEFAULT_PER_HOST, QUICK_PER_HOST = (2, 4), (2,)
CONFIGS = ("dense", "int8", "topk1%", "powersgd-r2")
QUICK_CONFIGS = ("dense", "topk1%")
DEFAULT_STEPS = 15
TOPOLOGIES = tuple(t for t in REQUESTS if t != "auto")  # what "auto" resolves to: each one measured
TARGET_PER_HOST, TARGET_RATE = 4, 100
ALLREDUCE_TARGET, TOPK_BYTES_TARGET = 1.5, 0.1
NO_SLOWER_PER_HOST, NO_SLOWER_MARGIN = 2, 1.05  # two_tier's median step at most 5% above flat's
PLOT_PER_HOST = (1, 2, 4, 8, 16)
BASE_PORT = 29700


def defaults(args: argparse.Namespace) -> None:
    """The two-tier run's defaults, before the cluster benchmark's own (rates, iterations) fill what is left."""
    args.hosts = (HOSTS,)
    bench.quick_defaults(args, ranks_per_host=(DEFAULT_PER_HOST, QUICK_PER_HOST), configs=(CONFIGS, QUICK_CONFIGS),
                         steps=(DEFAULT_STEPS, QUICK_STEPS))


# -- the all-reduce worker (every rank of one job, under torchrun) ---------------------------------------------------
def contenders() -> tuple[dict[str, Any], dict[str, Any]]:
    """Flat (gloo's all-reduce) and two_tier, as the strategy sends a gradient: in buckets, each one's reduce-scatter
    issued as it comes, then each one's part across hosts while the next bucket's reduce-scatter and the last one's
    all-gather run."""
    nodes: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(nodes, int(os.environ["GROUP_RANK"]))
    topology = resolve_topology("two_tier", nodes)
    tiers = TwoTier.create(topology, dist.get_rank(), "native", CommStats(keep_records=False))
    codec, bucket = NoCompressor(), BUCKET_CAP_MB << 18  # float32 elements per bucket

    def two_tier(tensor: torch.Tensor) -> None:
        spans = [(a, min(a + bucket, tensor.numel())) for a in range(0, tensor.numel(), bucket)]
        flights = [tiers.begin(tensor[a:b], BucketLayout.single(b - a), slot) for slot, (a, b) in enumerate(spans)]
        for done in [tiers.finish(flight, codec) for flight in flights]:
            done.wait()

    return {"flat": dist.all_reduce, "two_tier": two_tier}, {"per_host": topology.ranks_per_host}


# -- pure summaries (tested without a cluster) ------------------------------------------------------------------------
def allreduce_record(raw: dict[str, Any], per_host: int, rate_mbit: float) -> dict[str, Any]:
    """Flat and two_tier medians, the speed-up, and the bytes one call put on host 0's link."""
    rec = {"per_host": per_host, "rate_mbit": rate_mbit, "bytes": raw["bytes"], **allreduce_fields(raw),
           **{f"{name}_link_bytes": raw["link_sent"][name] for name in TOPOLOGIES}}
    flat, tiered = rec["flat_median_s"], rec["two_tier_median_s"]
    rec["speedup"] = flat / tiered if flat and tiered else None
    return rec


def add_ratios(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """On every two_tier step record: ``flat_over_two_tier`` (flat's median step over its own: > 1 is faster) and
    ``link_vs_flat`` (its bytes on the link per step over flat's), against flat's record of the same setting."""
    flat = {(r["per_host"], r["rate_mbit"], r["config"]): r for r in records if r["topology"] == "flat"}
    for r in records:
        base = flat.get((r["per_host"], r["rate_mbit"], r["config"])) if r["topology"] == "two_tier" else None
        r["flat_over_two_tier"] = (base["median_s"] / r["median_s"]
                                   if base and base.get("median_s") and r.get("median_s") else None)
        r["link_vs_flat"] = (r["link_bytes_per_step"] / base["link_bytes_per_step"]
                             if base and base.get("link_bytes_per_step") and r.get("link_bytes_per_step") else None)
    return records


def check_targets(allreduce: Sequence[dict[str, Any]], records: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The targets above; one whose measurement is missing is absent (and reported as missed)."""
    out: dict[str, dict[str, Any]] = {}
    bus = next((a for a in allreduce if (a["per_host"], a["rate_mbit"]) == (TARGET_PER_HOST, TARGET_RATE)), {})
    if bus.get("speedup") is not None:
        out["allreduce_speedup"] = bench.target(bus["speedup"], ALLREDUCE_TARGET, most=False)
    topk = next((r for r in records if (r["per_host"], r["rate_mbit"], r["config"], r["topology"])
                 == (TARGET_PER_HOST, TARGET_RATE, TOPK, "two_tier")), {})
    if topk.get("link_vs_flat") is not None:
        out["topk_link_bytes"] = bench.target(topk["link_vs_flat"], TOPK_BYTES_TARGET)
    for r in records:
        if r["per_host"] == NO_SLOWER_PER_HOST and r["topology"] == "two_tier" and r.get("flat_over_two_tier"):
            out[f"no_slower/{r['config']}@{r['rate_mbit']:g}"] = bench.target(r["flat_over_two_tier"],
                                                                              1 / NO_SLOWER_MARGIN, most=False)
    return out


def target_lines(targets: dict[str, dict[str, Any]], configs: Sequence[str], rates: Sequence[float]) -> list[str]:
    where = f"{HOSTS} hosts of {TARGET_PER_HOST} @ {TARGET_RATE:g} Mbit/s"
    return [bench.judged(f"{where}: two_tier dense all-reduce >= {ALLREDUCE_TARGET:g}x faster than flat",
                         targets.get("allreduce_speedup"), "{value:.2f}x"),
            bench.judged(f"{where}: two_tier top-k bytes on the link <= {TOPK_BYTES_TARGET:g} of flat's",
                         targets.get("topk_link_bytes"), lambda t: f"{t['value']:.3f} (1/{1 / t['value']:.1f})"),
            *(bench.judged(f"{HOSTS} hosts of {NO_SLOWER_PER_HOST} @ {rate:g} Mbit/s: two_tier {config} step no "
                           f"slower than flat (within {NO_SLOWER_MARGIN - 1:.0%})",
                           targets.get(f"no_slower/{config}@{rate:g}"), "flat / two_tier {value:.2f}x")
              for config, rate in itertools.product(configs, rates))]


def host_bytes(path: str, per_host: int, hosts: int, dense_bytes: float, topk_payload: float) -> float:
    """Bytes that leave one host per all-reduce, ``hosts`` hosts of ``per_host`` ranks numbered
    host by host: ``dense_flat`` (a ring's crossing edge: ``2 (N - 1) / N`` of the buffer), ``dense_two_tier``
    (``per_host`` parts of ``1 / per_host`` each, ``2 (H - 1) / H`` of it: the buffer at ``H = 2``), ``topk_flat_ring``
    (gloo's ring all-gather relays every other rank's payload over the crossing edge: ``N - 1`` payloads),
    ``topk_flat_direct`` (every local payload sent to every remote rank: ``L (N - L)``) and
    ``topk_two_tier`` (one summed payload per host part: ``H - 1`` payloads of ``1 / per_host`` each, per rank)."""
    n = hosts * per_host
    return {
        "dense_flat": 2 * (n - 1) / n * dense_bytes if n > 1 else 0.0,
        "dense_two_tier": 2 * (hosts - 1) / hosts * dense_bytes,
        "topk_flat_ring": (n - 1) * topk_payload,
        "topk_flat_direct": per_host * (n - per_host) * topk_payload,
        "topk_two_tier": (hosts - 1) * topk_payload,
    }[path]


def allreduce_table(allreduce: Sequence[dict[str, Any]]) -> str:
    def cells(a: dict[str, Any]) -> list[str]:
        return [ms_cell(a["flat_median_s"]), ms_cell(a["two_tier_median_s"]), bench.cell(a["speedup"], ".2f", unit="x"),
                mb_cell(a["flat_link_bytes"]), mb_cell(a["two_tier_link_bytes"]),
                bench.cell(a["flat_link_bytes"] / a["two_tier_link_bytes"], ".2f", unit="x")]

    headers = ["hosts x ranks", "Mbit/s", "flat ms", "two_tier ms", "speed-up", "flat MB out of host 0",
               "two_tier MB out", "flat/two_tier bytes"]
    return f"all-reduce of {ALLREDUCE_BYTES >> 20} MiB float32\n" + bench.table(
        allreduce, headers, lambda a: [f"{HOSTS}x{a['per_host']}", f"{a['rate_mbit']:g}"], cells)


def step_table(records: Sequence[dict[str, Any]]) -> str:
    return bench.table(records, ["hosts x ranks", "Mbit/s", "config", "topology", "median step ms",
                                 "MB out of host 0/step", "rank 0 inter MB", "rank 0 intra MB", "flat/two_tier step",
                                 "link vs flat", "run s"],
                       lambda r: [f"{HOSTS}x{r['per_host']}", f"{r['rate_mbit']:g}", r["config"], r["topology"]],
                       lambda r: [ms_cell(r["median_s"]), *map(mb_cell, (r["link_bytes_per_step"],
                                  r["inter_host_bytes_per_step"], r["intra_host_bytes_per_step"])),
                                  bench.cell(r.get("flat_over_two_tier"), ".2f", unit="x"),
                                  bench.cell(r.get("link_vs_flat"), ".3f"), f"{r['wall_s']:.0f}"])


def plot(allreduce: Sequence[dict[str, Any]], records: Sequence[dict[str, Any]], params: Optional[int]) -> Any:
    """Left: the all-reduce, flat vs two_tier. Middle: median steps per configuration. Right: bytes out of a host per
    step against ranks per host, the formulas (lines) and host 0's link (points)."""
    fig, (ax, bx, cx) = bench.figure_row(3, 20, 5.0, width_ratios=[1, 2.2, 1.3])
    ok = [a for a in allreduce if not a.get("error")]
    x = np.arange(len(ok))
    for offset, name in ((-0.2, "flat"), (0.2, "two_tier")):
        bars = ax.bar(x + offset, [1e3 * a[f"{name}_median_s"] for a in ok], 0.4, label=name)
        if name == "two_tier":
            ax.bar_label(bars, [f"{a['speedup']:.2f}x" for a in ok], fontsize="x-small")
    ax.set_xticks(x, [f"{HOSTS}x{a['per_host']}\n{a['rate_mbit']:g} Mbit/s" for a in ok])
    bench.style(ax, "y", "x-small", yscale="log", ylabel="median ms (log)",
                title=f"all-reduce {ALLREDUCE_BYTES >> 20} MiB, dense")
    groups = list(dict.fromkeys((r["per_host"], r["rate_mbit"], r["config"]) for r in records))
    by_key = {(r["per_host"], r["rate_mbit"], r["config"], r["topology"]): r for r in records}
    x = np.arange(len(groups))
    for offset, name in ((-0.2, "flat"), (0.2, "two_tier")):
        values = [1e3 * (by_key.get((*g, name), {}).get("median_s") or np.nan) for g in groups]
        bx.bar(x + offset, values, 0.4, label=name)
    short = {"powersgd-r2": "psgd", TOPK: "topk"}
    bx.set_xticks(x, [f"{short.get(c, c)}\n{HOSTS}x{p}\n{r:g}" for p, r, c in groups], fontsize="xx-small")
    bench.style(bx, "y", "x-small", yscale="log", ylabel="median step ms (log)", title="WideMLP training step")
    if params:
        dense, payload = 4.0 * params, 6.0 * _topk_pairs(0.01)
        per_host = np.array(PLOT_PER_HOST)
        styles = {"dense_flat": ("C0", "-"), "dense_two_tier": ("C1", "-"), "topk_flat_ring": ("C0", "--"),
                  "topk_flat_direct": ("C2", ":"), "topk_two_tier": ("C1", "--")}
        for path, (color, style) in styles.items():
            cx.plot(per_host, [host_bytes(path, p, HOSTS, dense, payload) / 1e6 for p in per_host], style,
                    color=color, label=path.replace("_", " "))
        for r in records:
            if r["config"] in ("dense", TOPK) and r.get("link_bytes_per_step"):
                color = "C0" if r["topology"] == "flat" else "C1"
                marker = "o" if r["config"] == "dense" else "^"
                cx.plot(r["per_host"], r["link_bytes_per_step"] / 1e6, marker, color=color, ms=6, mfc="none")
        bench.style(cx, legend="xx-small", xscale="log", yscale="log", xlabel="ranks per host (2 hosts)",
                    ylabel="MB out of a host per step (log)",
                    title="out of a host: lines formula, o dense / ^ top-k measured")
        cx.set_xticks(PLOT_PER_HOST, [str(p) for p in PLOT_PER_HOST])
    return fig


def _topk_pairs(ratio: float) -> int:
    """Index-value pairs one rank's top-k sends for the whole WideMLP (every parameter sends at least one)."""
    model = WideMLP(width=MLP_WIDTH, depth=MLP_DEPTH)
    return sum(max(1, math.ceil(ratio * p.numel())) for p in model.parameters())


# -- driver ----------------------------------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> dict[str, Any]:
    meta = dict(hosts=HOSTS, ranks_per_host=list(args.ranks_per_host), rates_mbit=list(args.rates), steps=args.steps,
                warmup=args.warmup, iterations=args.iterations, allreduce_bytes=ALLREDUCE_BYTES,
                model=f"WideMLP(width={MLP_WIDTH}, depth={MLP_DEPTH})", batch_size=BATCH_SIZE,
                bucket_cap_mb=BUCKET_CAP_MB, configs=list(args.configs))
    if (payload := skipped("two-tier", "cluster_two_tier", meta, "allreduce", "records")) is not None:
        return payload
    allreduce, records = [], []
    start = time.perf_counter()
    with Jobs(bench.output_dir(args.out, "cluster"), "two-tier", args.run_timeout, BASE_PORT + 1) as jobs:
        for rate, per_host in itertools.product(args.rates, args.ranks_per_host):
            where, tag = f"{HOSTS}x{per_host} @ {rate:g} Mbit/s", f"two_tier_{HOSTS}x{per_host}_r{rate:g}"
            allreduce.append(jobs.measure(HOSTS, rate, f"{tag}_allreduce", [
                "--worker", "tiers", "--iterations", str(args.iterations)], f"{where} all-reduce",
                {"per_host": per_host, "rate_mbit": rate},
                lambda raw: allreduce_record(raw, per_host, rate),
                lambda a: f": flat {ms_cell(a['flat_median_s'])} ms, two_tier "
                          f"{ms_cell(a['two_tier_median_s'])} ms ({a['speedup']:.2f}x)", per_host))
            for label, topology in itertools.product(args.configs, TOPOLOGIES):
                records.append(jobs.train(HOSTS, rate, f"{tag}_{label.replace('%', 'pct')}_{topology}", [
                    "--worker", "train", "--config", label, "--topology", topology, "--steps", str(args.steps)],
                    args.warmup, {"per_host": per_host, "rate_mbit": rate, "config": label, "topology": topology},
                    f"{where} {label:<12} {topology:<8}", per_host))
    add_ratios(records)
    targets = check_targets(allreduce, records)
    params = next((r["params"] for r in records if r.get("params")), None)
    return bench.finish("cluster", args.out, start, [allreduce_table(allreduce), step_table(records),
                                                     target_lines(targets, args.configs, args.rates)],
                        {"skipped": None, "allreduce": allreduce, "records": records, "targets": targets},
                        lambda: plot(allreduce, records, params), "cluster_two_tier", **meta)
