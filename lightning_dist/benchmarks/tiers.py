"""Two-tier reduction on a simulated cluster: ``python -m lightning_dist.benchmarks.cluster --two-tier``.

2 hosts of ``L`` ranks each (``torchrun --nproc-per-node L`` in each :class:`~lightning_dist.simcluster.SimCluster`
host: a host's ranks talk over its loopback, unshaped, and share its one shaped link), for ``L`` in
``--ranks-per-host`` (default 2 and 4) at each of ``--rates`` (default 100 and 1000 Mbit/s). Each setting runs:

- **the all-reduce of 16 MiB** float32, flat (gloo's own ``all_reduce`` over all ``2 L`` ranks) against two_tier dense
  (:class:`~lightning_dist.strategy.tiers.TwoTier` without a compressor: reduce-scatter inside the host, gloo's
  all-reduce of each part between hosts, all-gather inside the host; in 4 MiB buckets as the strategy sends a
  gradient, so one bucket's part crosses while the next is reduce-scattered), alternating after one untimed call of each
  (:func:`~lightning_dist.benchmarks.allreduce.time_rounds`), the median of the slowest rank's time; then one more
  call of each between barriers, reading what left host 0 through its link
  (:func:`~lightning_dist.simcluster.link_bytes_sent`: the kernel's count, TCP/IP headers included);
- **training steps** of the cluster benchmark's WideMLP (5.3 M parameters, 21 MiB of fp32 gradients, batch 16 per
  rank, 4 MiB buckets) under ``topology="flat"`` and ``"two_tier"`` for dense, int8, top-k 1% and PowerSGD rank 2:
  the median step after the warm-up, the bytes rank 0 counted per tier (``bytes_inter_host``, ``bytes_intra_host``)
  and what left host 0 per step through its link.

Every job gets a fresh SimCluster. All hosts share this machine's cores: at 2 x 4 ranks on 2 cores, compute is
oversubscribed four times, alike for both topologies.

Targets: at 2 hosts of 4 ranks and 100 Mbit/s, the two_tier dense all-reduce >= 1.5x faster than flat
(ideal 1.75x: ``2 (N - 1) / N`` of the buffer crosses a flat ring's host boundary, ``2 (H - 1) / H`` two_tier's) and
two_tier top-k's bytes across the link <= 1/10 of flat top-k's; at 2 hosts of 2, a two_tier step no slower than flat
with any compressor (within :data:`NO_SLOWER_MARGIN`, the noise of medians on a shared machine). The plot: the
all-reduce, the steps, and the bytes that leave a host per step as ranks per host grow, measured where it fits
these cores, :func:`host_bytes` beyond.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist

from lightning_dist.benchmarks import _common as bench
from lightning_dist.benchmarks._cluster import (
    ALLREDUCE_BYTES,
    BATCH_SIZE,
    BUCKET_CAP_MB,
    DEFAULT_RATES,
    MLP_DEPTH,
    MLP_WIDTH,
    QUICK_ITERATIONS,
    QUICK_STEPS,
    TOPK,
    failure_message,
    launch_job,
    mb_cell,
    ms_cell,
    run_record,
)
from lightning_dist.benchmarks.allreduce import time_rounds
from lightning_dist.comm import CommStats
from lightning_dist.comm.topology import TOPOLOGIES as REQUESTS
from lightning_dist.comm.topology import resolve_topology
from lightning_dist.compression import BucketLayout, NoCompressor
from lightning_dist.examples import WideMLP
from lightning_dist.simcluster import link_bytes_sent, unavailable
from lightning_dist.strategy.tiers import TwoTier

HOSTS = 2
DEFAULT_PER_HOST, QUICK_PER_HOST = (2, 4), (2,)
CONFIGS = ("dense", "int8", "topk1%", "powersgd-r2")
QUICK_CONFIGS = ("dense", "topk1%")
DEFAULT_STEPS, DEFAULT_ITERATIONS = 15, 4
TOPOLOGIES = tuple(t for t in REQUESTS if t != "auto")  # what "auto" resolves to: each one measured
TARGET_PER_HOST, TARGET_RATE = 4, 100
ALLREDUCE_TARGET, TOPK_BYTES_TARGET = 1.5, 0.1
NO_SLOWER_PER_HOST, NO_SLOWER_MARGIN = 2, 1.05  # two_tier's median step at most 5% above flat's
PLOT_PER_HOST = (1, 2, 4, 8, 16)
BASE_PORT = 29700


def defaults(args: argparse.Namespace) -> None:
    """The two-tier run's defaults, before the cluster benchmark's own fill what is left."""
    args.hosts = (HOSTS,)
    args.ranks_per_host = tuple(args.ranks_per_host or (QUICK_PER_HOST if args.quick else DEFAULT_PER_HOST))
    args.rates = tuple(args.rates or ((TARGET_RATE,) if args.quick else DEFAULT_RATES))
    args.configs = tuple(args.configs or (QUICK_CONFIGS if args.quick else CONFIGS))
    args.steps = args.steps or (QUICK_STEPS if args.quick else DEFAULT_STEPS)
    args.iterations = args.iterations or (QUICK_ITERATIONS if args.quick else DEFAULT_ITERATIONS)


# -- the all-reduce worker (every rank of one job, under torchrun) ---------------------------------------------------
def allreduce_worker(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=args.collective_timeout))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    nodes: list[Any] = [None] * world_size
    dist.all_gather_object(nodes, int(os.environ["GROUP_RANK"]))
    topology = resolve_topology("two_tier", nodes)
    tiers = TwoTier.create(topology, rank, "native", CommStats(keep_records=False))
    codec, bucket = NoCompressor(), BUCKET_CAP_MB << 18  # float32 elements per bucket

    def two_tier(tensor: torch.Tensor) -> None:
        # as the strategy sends a gradient: in buckets, each one's reduce-scatter issued as it comes, then each
        # one's part across hosts while the next bucket's reduce-scatter and the last one's all-gather run
        spans = [(a, min(a + bucket, tensor.numel())) for a in range(0, tensor.numel(), bucket)]
        flights = [tiers.begin(tensor[a:b], BucketLayout.single(b - a), slot) for slot, (a, b) in enumerate(spans)]
        for done in [tiers.finish(flight, codec) for flight in flights]:
            done.wait()

    calls = {"flat": dist.all_reduce, "two_tier": two_tier}
    tensor = torch.empty(args.nbytes // 4, dtype=torch.float32)
    orders = [("flat", "two_tier") if k % 2 == 0 else ("two_tier", "flat") for k in range(-1, args.iterations)]
    times = time_rounds(calls, tensor, orders, warmup=1)
    for name, mine in times.items():  # the collective is done when its slowest rank is
        slowest = torch.tensor(mine, dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        times[name] = slowest.tolist()
    link = {}
    for name, call in calls.items():  # what one call puts on host 0's link, between barriers
        tensor.fill_(1.0)
        dist.barrier()
        before = link_bytes_sent()
        call(tensor)
        dist.barrier()
        link[name] = link_bytes_sent() - before
    if rank == 0:
        Path(args.out).write_text(json.dumps({"world_size": world_size, "per_host": topology.ranks_per_host,
                                              "bytes": args.nbytes, "times": times, "link_sent": link}))
    dist.destroy_process_group()


# -- pure summaries (tested without a cluster) ------------------------------------------------------------------------
def allreduce_record(raw: dict[str, Any], per_host: int, rate_mbit: float) -> dict[str, Any]:
    """Flat and two_tier medians, the speed-up, and the bytes one call put on host 0's link."""
    rec: dict[str, Any] = {"per_host": per_host, "rate_mbit": rate_mbit, "bytes": raw["bytes"]}
    for name in TOPOLOGIES:
        rec[f"{name}_median_s"] = bench.median(raw["times"][name])
        rec[f"{name}_times_s"] = list(raw["times"][name])
        rec[f"{name}_link_bytes"] = raw["link_sent"][name]
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
    bus = next((a for a in allreduce if (a["per_host"], a["rate_mbit"]) == (TARGET_PER_HOST, TARGET_RATE)), None)
    if bus is not None and bus.get("speedup") is not None:
        out["allreduce_speedup"] = {"value": bus["speedup"], "bound": ALLREDUCE_TARGET,
                                    "met": bus["speedup"] >= ALLREDUCE_TARGET}
    topk = next((r for r in records if (r["per_host"], r["rate_mbit"], r["config"], r["topology"])
                 == (TARGET_PER_HOST, TARGET_RATE, TOPK, "two_tier")), None)
    if topk is not None and topk.get("link_vs_flat") is not None:
        out["topk_link_bytes"] = {"value": topk["link_vs_flat"], "bound": TOPK_BYTES_TARGET,
                                  "met": topk["link_vs_flat"] <= TOPK_BYTES_TARGET}
    for r in records:
        if r["per_host"] == NO_SLOWER_PER_HOST and r["topology"] == "two_tier" and r.get("flat_over_two_tier"):
            out[f"no_slower/{r['config']}@{r['rate_mbit']:g}"] = {
                "value": r["flat_over_two_tier"], "bound": 1 / NO_SLOWER_MARGIN,
                "met": r["flat_over_two_tier"] >= 1 / NO_SLOWER_MARGIN}
    return out


def target_lines(targets: dict[str, dict[str, Any]], configs: Sequence[str], rates: Sequence[float]) -> list[str]:
    where = f"{HOSTS} hosts of {TARGET_PER_HOST} @ {TARGET_RATE:g} Mbit/s"
    t = targets.get("allreduce_speedup")
    lines = [bench.verdict(f"{where}: two_tier dense all-reduce >= {ALLREDUCE_TARGET:g}x faster than flat",
                           bool(t and t["met"]), f"{t['value']:.2f}x" if t else "not measured")]
    t = targets.get("topk_link_bytes")
    lines.append(bench.verdict(f"{where}: two_tier top-k bytes on the link <= {TOPK_BYTES_TARGET:g} of flat's",
                               bool(t and t["met"]), f"{t['value']:.3f} (1/{1 / t['value']:.1f})" if t
                               else "not measured"))
    for config, rate in itertools.product(configs, rates):
        t = targets.get(f"no_slower/{config}@{rate:g}")
        lines.append(bench.verdict(
            f"{HOSTS} hosts of {NO_SLOWER_PER_HOST} @ {rate:g} Mbit/s: two_tier {config} step no slower than flat "
            f"(within {NO_SLOWER_MARGIN - 1:.0%})", bool(t and t["met"]),
            f"flat / two_tier {t['value']:.2f}x" if t else "not measured"))
    return lines


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
    rows = []
    for a in allreduce:
        if a.get("error"):
            rows.append([f"{HOSTS}x{a['per_host']}", f"{a['rate_mbit']:g}", "FAILED", "-", "-", "-", "-",
                         a["error"][:40]])
            continue
        rows.append([f"{HOSTS}x{a['per_host']}", f"{a['rate_mbit']:g}", ms_cell(a["flat_median_s"]),
                     ms_cell(a["two_tier_median_s"]), bench.cell(a["speedup"], ".2f", unit="x"),
                     mb_cell(a["flat_link_bytes"]), mb_cell(a["two_tier_link_bytes"]),
                     bench.cell(a["flat_link_bytes"] / a["two_tier_link_bytes"], ".2f", unit="x")])
    headers = ["hosts x ranks", "Mbit/s", "flat ms", "two_tier ms", "speed-up", "flat MB out of host 0",
               "two_tier MB out", "flat/two_tier bytes"]
    return f"all-reduce of {ALLREDUCE_BYTES >> 20} MiB float32\n" + bench.format_table(headers, rows)


def step_table(records: Sequence[dict[str, Any]]) -> str:
    rows = []
    for r in records:
        where = [f"{HOSTS}x{r['per_host']}", f"{r['rate_mbit']:g}", r["config"], r["topology"]]
        if r.get("error"):
            rows.append([*where, "FAILED", "-", "-", "-", "-", "-", r["error"][:40]])
            continue
        rows.append([*where, ms_cell(r["median_s"]), mb_cell(r["link_bytes_per_step"]),
                     mb_cell(r["inter_host_bytes_per_step"]), mb_cell(r["intra_host_bytes_per_step"]),
                     bench.cell(r.get("flat_over_two_tier"), ".2f", unit="x"), bench.cell(r.get("link_vs_flat"), ".3f"),
                     f"{r['wall_s']:.0f}"])
    headers = ["hosts x ranks", "Mbit/s", "config", "topology", "median step ms", "MB out of host 0/step",
               "rank 0 inter MB", "rank 0 intra MB", "flat/two_tier step", "link vs flat", "run s"]
    return bench.format_table(headers, rows)


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
    ax.set(yscale="log", ylabel="median ms (log)", title=f"all-reduce {ALLREDUCE_BYTES >> 20} MiB, dense")
    ax.legend(fontsize="x-small")
    ax.grid(alpha=0.3, axis="y")
    groups = list(dict.fromkeys((r["per_host"], r["rate_mbit"], r["config"]) for r in records))
    by_key = {(r["per_host"], r["rate_mbit"], r["config"], r["topology"]): r for r in records}
    x = np.arange(len(groups))
    for offset, name in ((-0.2, "flat"), (0.2, "two_tier")):
        values = [1e3 * (by_key.get((*g, name), {}).get("median_s") or np.nan) for g in groups]
        bx.bar(x + offset, values, 0.4, label=name)
    short = {"powersgd-r2": "psgd", TOPK: "topk"}
    bx.set_xticks(x, [f"{short.get(c, c)}\n{HOSTS}x{p}\n{r:g}" for p, r, c in groups], fontsize="xx-small")
    bx.set(yscale="log", ylabel="median step ms (log)", title="WideMLP training step")
    bx.legend(fontsize="x-small")
    bx.grid(alpha=0.3, axis="y")
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
        cx.set(xscale="log", yscale="log", xticks=PLOT_PER_HOST, xlabel="ranks per host (2 hosts)",
               ylabel="MB out of a host per step (log)",
               title="out of a host: lines formula, o dense / ^ top-k measured")
        cx.set_xticklabels([str(p) for p in PLOT_PER_HOST])
        cx.legend(fontsize="xx-small")
        cx.grid(alpha=0.3)
    return fig


def _topk_pairs(ratio: float) -> int:
    """Index-value pairs one rank's top-k sends for the whole WideMLP (every parameter sends at least one)."""
    model = WideMLP(width=MLP_WIDTH, depth=MLP_DEPTH)
    return sum(max(1, math.ceil(ratio * p.numel())) for p in model.parameters())


# -- driver ----------------------------------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> dict[str, Any]:
    out = bench.output_dir(args.out, "cluster")
    meta = bench.environment("cluster_two_tier", hosts=HOSTS, ranks_per_host=list(args.ranks_per_host),
                             rates_mbit=list(args.rates), steps=args.steps, warmup=args.warmup,
                             iterations=args.iterations, allreduce_bytes=ALLREDUCE_BYTES,
                             model=f"WideMLP(width={MLP_WIDTH}, depth={MLP_DEPTH})",
                             batch_size=BATCH_SIZE, bucket_cap_mb=BUCKET_CAP_MB,
                             configs=list(args.configs))
    reason = unavailable()
    if reason is not None:
        bench.progress(f"[cluster --two-tier] skipped: {reason}")
        print(f"cluster benchmark (two-tier) skipped: {reason}")
        return {"meta": meta, "skipped": reason, "allreduce": [], "records": [], "targets": {}}
    logs = out / "logs"
    logs.mkdir(exist_ok=True)
    allreduce: list[dict[str, Any]] = []
    records: list[dict[str, Any]] = []
    ports = itertools.count(BASE_PORT + 1)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="lightning_dist_tiers_") as workdir:
        def job(per_host: int, rate: float, tag: str, *worker_args: str) -> tuple[Optional[dict], Optional[str], float]:
            result = Path(workdir) / f"{per_host}_{rate:g}_{tag}.json"
            log = logs / f"two_tier_{HOSTS}x{per_host}_r{rate:g}_{tag}.log"
            codes, wall = launch_job(HOSTS, rate, [*worker_args, "--out", str(result)], next(ports),
                                          args.run_timeout, log, per_host=per_host)
            if codes == [0] * HOSTS and result.exists():
                return json.loads(result.read_text()), None, wall
            return None, failure_message(codes, log), wall

        for rate in args.rates:
            for per_host in args.ranks_per_host:
                where = f"{HOSTS}x{per_host} @ {rate:g} Mbit/s"
                raw, error, wall = job(per_host, rate, "allreduce", "--worker-tiers", "--iterations",
                                       str(args.iterations))
                rec = ({"per_host": per_host, "rate_mbit": rate} if raw is None
                       else allreduce_record(raw, per_host, rate))
                rec.update(error=error, wall_s=wall)
                allreduce.append(rec)
                bench.progress(f"[two-tier] {where} all-reduce FAILED: {error}" if raw is None else
                               f"[two-tier] {where} all-reduce: flat {ms_cell(rec['flat_median_s'])} ms, two_tier "
                               f"{ms_cell(rec['two_tier_median_s'])} ms ({rec['speedup']:.2f}x; run {wall:.0f}s)")
                for label in args.configs:
                    for topology in TOPOLOGIES:
                        tag = f"{label.replace('%', 'pct')}_{topology}"
                        raw, error, wall = job(per_host, rate, tag, "--worker", "--config", label, "--topology",
                                               topology, "--steps", str(args.steps))
                        rec = {"per_host": per_host, "rate_mbit": rate, "config": label, "topology": topology,
                               "wall_s": wall}
                        if raw is None:
                            rec.update(median_s=None, error=error)
                            bench.progress(f"[two-tier] {where} {label} {topology} FAILED: {error}")
                        else:
                            rec.update(run_record(raw, args.warmup), error=None)
                            bench.progress(f"[two-tier] {where} {label:<12} {topology:<8} "
                                           f"{ms_cell(rec['median_s']):>9} ms/step, "
                                           f"{mb_cell(rec['link_bytes_per_step'])} MB/step out of host 0 "
                                           f"(run {wall:.0f}s)")
                        records.append(rec)
    total = time.perf_counter() - start
    add_ratios(records)
    targets = check_targets(allreduce, records)
    params = next((r["params"] for r in records if r.get("params")), None)
    payload = {"meta": {**meta, "wall_s": total}, "skipped": None, "allreduce": allreduce, "records": records,
               "targets": targets}
    return bench.write_results(out, "cluster_two_tier",
                               [allreduce_table(allreduce), step_table(records),
                                target_lines(targets, args.configs, args.rates)],
                               payload, lambda: plot(allreduce, records, params))
