"""All-reduce benchmark: the ring, the tree and ``auto`` against gloo's native ``all_reduce``, side by side.

Per world size (one group of local gloo ranks) and message size (1 KiB to 64 MiB), the algorithms run once per round in
a shuffled order (:func:`time_rounds`: each call after a barrier, its result checked), the slowest rank's median over
rounds; ``busbw = bytes / time * 2 (N - 1) / N`` as in nccl-tests. The tree/native crossover justifies
``AUTO_TREE_MAX_BYTES``, ``--segment-sweep`` ``DEFAULT_SEGMENT_BYTES``. Method and results: docs/benchmarks.md.
"""

from __future__ import annotations

import functools
import math
import random
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from lightning_dist.benchmarks import _common as bench
from lightning_dist.comm import (
    AUTO_TREE_MAX_BYTES,
    DEFAULT_SEGMENT_BYTES,
    allreduce_,
    choose_algorithm,
    ring_allreduce_,
)
from lightning_dist.testing import run_ranks

KIB, MIB = 1 << 10, 1 << 20
DEFAULT_WORLD_SIZES = (2, 3, 4)
DEFAULT_SIZES = tuple(KIB * 4**k for k in range(9))  # 1K, 4K, ..., 64M
QUICK_SIZES = (KIB, 64 * KIB, 4 * MIB)
DEFAULT_REPEATS = 80  # per algorithm and size; messages >= LARGE_BYTES use a quarter of it
QUICK_REPEATS = 5
LARGE_BYTES = 16 * MIB
MIN_LARGE_REPEATS = 5
SWEEP_SIZES = (4 * MIB, 16 * MIB, 64 * MIB)
SWEEP_SEGMENTS = (256 * KIB, MIB, 4 * MIB, 16 * MIB)

# Targets from the issue, checked at 2 ranks: the ring must come close to gloo's C++ ring on large messages,
# and the tree must not lose to gloo on small ones (else ``auto`` has no reason to exist).
RING_TARGET_MIN_BYTES, RING_TARGET_BUSBW_RATIO = 4 * MIB, 0.9
TREE_TARGET_MAX_BYTES, TREE_TARGET_LATENCY_RATIO = 16 * KIB, 1.1


@dataclass(frozen=True)
class Case:
    """One column of the benchmark: what is called, under what name."""

    label: str  # name in tables and records: "native", "ring", "ring/256K", ...
    algorithm: str  # passed to ``allreduce_``: "native", "ring", "tree" or "auto"
    segment_bytes: Optional[int] = None  # ring pipeline segment; None = DEFAULT_SEGMENT_BYTES


MAIN_CASES = (Case("native", "native"), Case("ring", "ring"), Case("tree", "tree"), Case("auto", "auto"))


def repeats_for(nbytes: int, repeats: int) -> int:
    """Timed repeats for ``nbytes``: a quarter for large messages, but at least 5 (or ``repeats``)."""
    if nbytes >= LARGE_BYTES:
        return min(repeats, max(MIN_LARGE_REPEATS, repeats // 4))
    return repeats


def _call(case: Case, tensor: torch.Tensor) -> None:
    if case.segment_bytes is not None:
        ring_allreduce_(tensor, segment_bytes=case.segment_bytes)
    else:
        allreduce_(tensor, case.algorithm)


def time_rounds(calls: Mapping[str, Callable[[torch.Tensor], Any]], tensor: torch.Tensor,
                orders: Sequence[Sequence[str]], warmup: int, slowest: bool = False) -> dict[str, list[float]]:
    """On one rank of the group: a round per entry of ``orders`` (the same on every rank), the first ``warmup``
    untimed; in each, the calls it names in turn, each on ``tensor`` refilled with ``rank + 1`` after a barrier
    and checked against ``N (N + 1) / 2``. Returns this rank's seconds per timed call, by name (``slowest``: the
    slowest rank's, on every rank: a collective is done when its slowest rank is)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    expected = world_size * (world_size + 1) / 2  # sum over ranks of (rank + 1), exact in float32
    times: dict[str, list[float]] = {name: [] for name in calls}
    for k, order in enumerate(orders):
        for name in order:
            tensor.fill_(rank + 1)
            dist.barrier()
            start = time.perf_counter()
            calls[name](tensor)
            elapsed = time.perf_counter() - start
            if tensor[0].item() != expected or tensor[-1].item() != expected:
                raise RuntimeError(
                    f"{name} all-reduce of {bench.size_label(tensor.numel() * 4)} at N={world_size} returned "
                    f"{tensor[0].item()}..{tensor[-1].item()}, expected {expected}: the collective is wrong; run "
                    "tests/ for the comm package before benchmarking it.")
            if k >= warmup:
                times[name].append(elapsed)
    for name, mine in times.items() if slowest else ():
        seconds = torch.tensor(mine, dtype=torch.float64)
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
        times[name] = seconds.tolist()
    return times


def _measure_on_rank(
    rank: int, world_size: int, cases: Sequence[Case], sizes: Sequence[int], repeats: int, warmup: int
) -> dict[int, dict[str, list[float]]]:
    """On one rank: ``{nbytes: {case label: [seconds per timed repeat]}}``, cases interleaved per repeat."""
    calls = {case.label: functools.partial(_call, case) for case in cases}
    results: dict[int, dict[str, list[float]]] = {}
    for index, nbytes in enumerate(sizes):
        timed = repeats_for(nbytes, repeats)
        if rank == 0:
            bench.progress(f"  N={world_size} {bench.size_label(nbytes):>4} ({index + 1}/{len(sizes)}): "
                           f"{warmup} warmup + {timed} timed rounds of {len(cases)} cases")
        orders = [[case.label for case in random.Random(f"{nbytes}/{repeat}").sample(list(cases), len(cases))]
                  for repeat in range(-warmup, timed)]  # seeded alike on every rank
        results[nbytes] = time_rounds(calls, torch.empty(nbytes // 4, dtype=torch.float32), orders, warmup)
    return results


def measure(
    world_size: int, cases: Sequence[Case], sizes: Sequence[int], repeats: int, warmup: int, deadline_s: float
) -> list[dict[str, Any]]:
    """Run every case at every size on ``world_size`` ranks; one record per (size, case)."""
    per_rank = run_ranks(_measure_on_rank, world_size, tuple(cases), tuple(sizes), repeats, warmup,
                         deadline_s=deadline_s)
    bus_factor = 2 * (world_size - 1) / world_size
    records = []
    for nbytes in sizes:
        medians = {}
        for case in cases:
            stats = bench.summarize(bench.completion_times([result[nbytes][case.label] for result in per_rank]))
            medians[case.label] = stats["median_s"]
            algbw = nbytes / stats["median_s"] / 1e9
            # what actually ran: auto resolves by size and world size, as every rank does in training
            resolved = choose_algorithm(nbytes, "gloo", world_size) if case.algorithm == "auto" else case.algorithm
            records.append({
                "world_size": world_size, "bytes": nbytes, "algorithm": case.label, "resolved_algorithm": resolved,
                "segment_bytes": None if resolved != "ring" else case.segment_bytes or DEFAULT_SEGMENT_BYTES,
                "repeats": repeats_for(nbytes, repeats), **stats, "algbw_GBps": algbw, "busbw_GBps": algbw * bus_factor,
            })
        for record in records[-len(cases):]:
            # busbw / native busbw, which is native time / this time: > 1 means faster than gloo
            record["busbw_ratio_vs_native"] = medians["native"] / record["median_s"]
    return records


def _lookup(records: Sequence[dict[str, Any]]) -> dict[tuple[int, int, str], dict[str, Any]]:
    return {(r["world_size"], r["bytes"], r["algorithm"]): r for r in records}


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:,.0f}" if seconds >= 1e-4 else f"{seconds * 1e6:.1f}"


def crossover(records: Sequence[dict[str, Any]], world_size: int) -> dict[str, Optional[int]]:
    """Where the tree stops beating native (what ``auto`` switches between): the largest size the tree wins
    below native's winning streak.

    ``native_wins_from`` is the smallest size from which native is faster at every larger measured size
    (None if the tree wins at the largest); ``tree_wins_up_to`` the size just below it (None if none).
    """
    by_key = _lookup(records)
    sizes = sorted({r["bytes"] for r in records if r["world_size"] == world_size})
    median = {(s, a): by_key[world_size, s, a]["median_s"] for s in sizes for a in ("native", "tree")}
    native_faster = [median[s, "native"] < median[s, "tree"] for s in sizes]
    start = len(sizes)
    while start > 0 and native_faster[start - 1]:
        start -= 1
    return {"tree_wins_up_to": sizes[start - 1] if start > 0 else None,
            "native_wins_from": sizes[start] if start < len(sizes) else None}


def check_targets(records: Sequence[dict[str, Any]], world_size: int = 2) -> dict[str, Any]:
    """The issue's two targets at ``world_size`` ranks, with the worst ratio found and where."""
    by_key = _lookup(records)
    sizes = sorted({r["bytes"] for r in records if r["world_size"] == world_size})
    ratio = {(s, a): by_key[world_size, s, a]["busbw_ratio_vs_native"] for s in sizes
             for a in ("ring", "tree")}
    # the ring's target is a busbw ratio (higher is better), the tree's a latency ratio (lower is better)
    ring = {s: ratio[s, "ring"] for s in sizes if s >= RING_TARGET_MIN_BYTES}
    tree = {s: 1 / ratio[s, "tree"] for s in sizes if s <= TREE_TARGET_MAX_BYTES}
    result = {}
    for name, ratios, bound, better in (
        ("ring_busbw_vs_native", ring, RING_TARGET_BUSBW_RATIO, "min"),
        ("tree_latency_vs_native", tree, TREE_TARGET_LATENCY_RATIO, "max"),
    ):
        if not ratios:
            continue
        worst = (min if better == "min" else max)(ratios, key=ratios.get)
        met = ratios[worst] >= bound if better == "min" else ratios[worst] <= bound
        result[name] = {"bound": bound, "worst_ratio": ratios[worst], "worst_bytes": worst, "met": met,
                        "ratios": {bench.size_label(s): ratios[s] for s in ratios}}
    return result


def main_table(records: Sequence[dict[str, Any]]) -> str:
    by_key = _lookup(records)
    rows = []
    for n, nbytes in sorted({(r["world_size"], r["bytes"]) for r in records}):
        rec = {c.label: by_key[n, nbytes, c.label] for c in MAIN_CASES}
        rows.append([n, bench.size_label(nbytes), *(_us(rec[c.label]["median_s"]) for c in MAIN_CASES),
                     rec["auto"]["resolved_algorithm"], f"{rec['native']['busbw_GBps']:.3f}",
                     f"{rec['ring']['busbw_GBps']:.3f}", f"{rec['ring']['busbw_ratio_vs_native']:.2f}x",
                     f"{1 / rec['tree']['busbw_ratio_vs_native']:.2f}x"])
    headers = ["N", "size", "native us", "ring us", "tree us", "auto us", "auto=",
               "native busbw GB/s", "ring busbw GB/s", "ring/native busbw", "tree/native time"]
    return bench.format_table(headers, rows)


def sweep_table(records: Sequence[dict[str, Any]], cases: Sequence[Case]) -> str:
    by_key = _lookup(records)
    rows = [[n, bench.size_label(nbytes), f"{by_key[n, nbytes, 'native']['busbw_GBps']:.3f}",
             *(f"{r['busbw_GBps']:.3f} ({r['busbw_ratio_vs_native']:.2f}x)"
               for r in (by_key[n, nbytes, case.label] for case in cases[1:]))]
            for n, nbytes in sorted({(r["world_size"], r["bytes"]) for r in records})]
    headers = ["N", "size", "native"] + [f"{c.label}" for c in cases[1:]]
    return "busbw GB/s (ratio to native)\n" + bench.format_table(headers, rows)


def plot(records: Sequence[dict[str, Any]], labels: Sequence[str], latency_max_bytes: int = MIB) -> Any:
    """busbw vs message size per algorithm, one column per world size; below, latency of small messages."""
    world_sizes = sorted({r["world_size"] for r in records})
    with_latency = any(r["bytes"] <= latency_max_bytes for r in records)
    rows = 2 if with_latency else 1
    fig, axes = bench.figure_grid(rows, len(world_sizes), 4.2 * len(world_sizes), 3.4 * rows)
    for col, n in enumerate(world_sizes):
        for label in labels:
            mine = sorted((r for r in records if r["world_size"] == n and r["algorithm"] == label),
                          key=lambda r: r["bytes"])
            style = {"linestyle": "--", "marker": "x"} if label == "auto" else {"marker": "o", "ms": 3}
            axes[0][col].plot([r["bytes"] for r in mine], [r["busbw_GBps"] for r in mine], label=label, **style)
            if with_latency:
                small = [r for r in mine if r["bytes"] <= latency_max_bytes]
                med = [r["median_s"] * 1e6 for r in small]
                err = [[m - r["p25_s"] * 1e6 for m, r in zip(med, small)],
                       [r["p75_s"] * 1e6 - m for m, r in zip(med, small)]]
                axes[1][col].errorbar([r["bytes"] for r in small], med, yerr=err, label=label, capsize=2,
                                      **style)
        axes[0][col].set(title=f"{n} ranks", ylabel="busbw (GB/s)")
        if with_latency:
            axes[1][col].set(yscale="log", ylabel="latency (us, median, IQR)")
        for row, ax in enumerate(axes[r][col] for r in range(rows)):
            ticks = sorted({r["bytes"] for r in records if row == 0 or r["bytes"] <= latency_max_bytes})
            bench.style(ax, xscale="log", xlabel="message size")
            ax.set_xticks(ticks, [bench.size_label(t) for t in ticks], rotation=45)
            ax.minorticks_off()
    axes[0][0].legend(fontsize="small")
    return fig


def _describe_crossover(c: dict[str, Optional[int]]) -> str:
    low, high = c["tree_wins_up_to"], c["native_wins_from"]
    if high is None:
        return "tree wins at every size"
    if low is None:
        return "native wins at every size"
    return f"tree wins up to {bench.size_label(low)}, native from {bench.size_label(high)}"


def _recommend_threshold(cross: dict[int, dict[str, Optional[int]]]) -> list[str]:
    """The crossover per world size, and one ``AUTO_TREE_MAX_BYTES`` for the world sizes ``auto`` uses the
    tree at (3 and more: at 2 ranks the tree saves no round)."""
    lines = ["tree/native crossover: " + "; ".join(f"{n} ranks: {_describe_crossover(c)}"
                                                  for n, c in sorted(cross.items())) + "."]
    froms, current = [c["native_wins_from"] for n, c in cross.items() if n >= 3], bench.size_label(AUTO_TREE_MAX_BYTES)
    if not froms:
        return lines + [f"recommendation: none without 3 or more ranks (current {current})."]
    # one threshold serves every world size from 3 on
    advice = (f"AUTO_TREE_MAX_BYTES = {bench.size_label(min(froms))}" if None not in froms
              else "the tree wins at the largest size somewhere: measure larger sizes before choosing")
    return lines + [f"recommendation: {advice} (current {current})."]


def _recommend_segment(records: Sequence[dict[str, Any]], cases: Sequence[Case]) -> str:
    score = {}
    for case in cases[1:]:
        ratios = [r["busbw_ratio_vs_native"] for r in records if r["algorithm"] == case.label]
        score[case.segment_bytes] = math.exp(sum(map(math.log, ratios)) / len(ratios))  # the geometric mean
    best = max(score, key=score.get)
    current = score.get(DEFAULT_SEGMENT_BYTES)
    now = (f"current {bench.size_label(DEFAULT_SEGMENT_BYTES)} scores {current:.2f}x" if current is not None
           else f"current {bench.size_label(DEFAULT_SEGMENT_BYTES)} not measured")
    return (f"recommendation: DEFAULT_SEGMENT_BYTES = {bench.size_label(best)} "
            f"(geometric-mean busbw {score[best]:.2f}x native over the sweep; {now}).")


def _parse_args(argv: Optional[Sequence[str]]) -> Any:
    cli = bench.parser("allreduce", __doc__, "sizes 1K 64K 4M, 5 repeats, 2 ranks")
    cli.add_argument("--world-sizes", type=int, nargs="+", default=None,
                     help="ranks per group (default 2 3 4; 2 for --quick and --segment-sweep)")
    cli.add_argument("--sizes", type=bench.parse_size, nargs="+", default=None,
                     help="message sizes, e.g. 1K 64K 4M (default 1K..64M in powers of 4)")
    cli.add_argument("--repeats", type=int, default=None, help=f"timed repeats per algorithm and size (default "
                     f"{DEFAULT_REPEATS}, {QUICK_REPEATS} with --quick; a quarter, at least 5, from "
                     f"{bench.size_label(LARGE_BYTES)})")
    cli.add_argument("--warmup", type=int, default=2, help="untimed rounds before the timed ones (default 2)")
    cli.add_argument("--segment-sweep", action="store_true", help="instead of the main sweep, time the ring at "
                     "segment sizes 256K 1M 4M 16M against native (2 ranks, 4M 16M 64M)")
    cli.add_argument("--deadline-s", type=float, default=1800.0,
                     help="kill a rank group that runs longer than this (default 1800)")
    args = cli.parse_args(argv)
    sizes = args.sizes or (QUICK_SIZES if args.quick else SWEEP_SIZES if args.segment_sweep else DEFAULT_SIZES)
    if any(size % 4 for size in sizes):
        cli.error(f"sizes {[s for s in sizes if s % 4]} are not whole float32 tensors; use multiples of 4 bytes.")
    args.sizes = tuple(sorted(set(sizes)))
    args.world_sizes = tuple(args.world_sizes or ((2,) if args.quick or args.segment_sweep else DEFAULT_WORLD_SIZES))
    if min(args.world_sizes) < 2:
        cli.error(f"--world-sizes {args.world_sizes}: an all-reduce needs at least 2 ranks.")
    args.repeats = (QUICK_REPEATS if args.quick else DEFAULT_REPEATS) if args.repeats is None else args.repeats
    if args.repeats < 1 or args.warmup < 0:
        cli.error(f"--repeats {args.repeats} must be >= 1 and --warmup {args.warmup} >= 0.")
    return args


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    args = _parse_args(argv)
    cases = (Case("native", "native"), *(Case(f"ring/{bench.size_label(s)}", "ring", segment_bytes=s)
                                         for s in SWEEP_SEGMENTS)) if args.segment_sweep else MAIN_CASES
    records: list[dict[str, Any]] = []
    started = time.perf_counter()
    for n in args.world_sizes:
        bench.progress(f"[allreduce] {n} ranks, {len(args.sizes)} sizes, cases {', '.join(c.label for c in cases)}")
        records += measure(n, cases, args.sizes, args.repeats, args.warmup, args.deadline_s)
    payload: dict[str, Any] = {"records": records}
    if args.segment_sweep:
        table = sweep_table(records, cases)
        lines = [_recommend_segment(records, cases)]
    else:
        table = main_table(records)
        cross = {n: crossover(records, n) for n in args.world_sizes}
        targets = check_targets(records) if 2 in args.world_sizes else {}
        payload["crossover"] = {str(n): c for n, c in cross.items()}
        payload["targets_at_2_ranks"] = targets
        lines = _recommend_threshold(cross)
        for key, t in targets.items():
            sign = ">=" if key.startswith("ring") else "<="
            lines.append(bench.verdict(f"{key} {sign} {t['bound']}", t["met"],
                                       f"worst {t['worst_ratio']:.2f}x at {bench.size_label(t['worst_bytes'])}"))
    payload["recommendation"] = lines
    return bench.finish("allreduce", args.out, started, [table, lines], payload,
                        lambda: plot(records, [c.label for c in cases]),
                        "segment_sweep" if args.segment_sweep else "allreduce", repeats=args.repeats,
                        warmup=args.warmup, cases=[asdict(c) for c in cases],
                        default_segment_bytes=DEFAULT_SEGMENT_BYTES, auto_tree_max_bytes=AUTO_TREE_MAX_BYTES)


if __name__ == "__main__":
    main()
