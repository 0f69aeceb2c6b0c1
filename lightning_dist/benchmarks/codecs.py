"""Codec cost: milliseconds per bucket and passes over the bucket for every compressor, against one elementwise pass.

Each compressor reduces one bucket through a :class:`~lightning_dist.compression.emulate.MirrorTransport` (no wire),
one thread; the unit (:func:`unit_pass`) is timed exactly as each codec is (:func:`_timed`, on the freshly restored
bucket) in the same rotating rounds, and a codec's figure is the paired ratio. Targets (the mlp bucket, in passes):
int8 <= 10, top-k 1% <= 10, threshold <= 8, PowerSGD r2 <= 10. Method and results: docs/benchmarks.md.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch

from lightning_dist.benchmarks import _common as bench
from lightning_dist.compression import BucketLayout, Compressor, build_compressor
from lightning_dist.compression.emulate import MirrorTransport

WIDTH = 1024
GRAD_STD = 1e-2
TARGETS = {"int8": 10.0, "topk": 10.0, "threshold": 8.0, "powersgd": 10.0}  # passes on the mlp bucket


@dataclass(frozen=True)
class Codec:
    name: str
    build: Callable[[], Compressor]
    target: Optional[str] = None  # the TARGETS key that judges it
    description: str = ""
    exact: Optional[Callable[[], Compressor]] = field(default=None, compare=False)  # for mass kept


CODECS = {c.name: c for c in (
    Codec("fp16", lambda: build_compressor("fp16"), description="float16 cast, no EF"),
    Codec("bf16", lambda: build_compressor("bf16"), description="bfloat16 cast, no EF"),
    Codec("int8", lambda: build_compressor("int8"), "int8", "two-phase int8, EF"),
    Codec("int8/no-ef", lambda: build_compressor("int8", error_feedback=False), description="two-phase int8"),
    Codec("topk1%", lambda: build_compressor("topk", ratio=0.01), "topk", "sampled selection, EF",
          exact=lambda: build_compressor("topk", ratio=0.01, selection="exact")),
    Codec("topk1%/exact", lambda: build_compressor("topk", ratio=0.01, selection="exact"),
          description="torch.topk per layer, EF"),
    Codec("topk1%/no-ef", lambda: build_compressor("topk", ratio=0.01, error_feedback=False),
          description="sampled selection"),
    Codec("threshold", lambda: build_compressor("threshold"), "threshold", "1e-3, cap 5%, EF",
          exact=lambda: build_compressor("threshold", selection="exact")),
    Codec("powersgd-r2", lambda: build_compressor("powersgd", rank=2), "powersgd", "rank 2, EF"),
)}
QUICK_CODECS = ("int8", "topk1%", "threshold", "powersgd-r2")


def bucket_layout(name: str) -> BucketLayout:
    """``mlp`` (WideMLP's five weight matrices, 4,259,840 elements) or a size in MiB of 1024-wide layers."""
    if name == "mlp":
        return BucketLayout.of([("net.0.weight", torch.Size([WIDTH, 64]))]
                               + [(f"net.{2 * i}.weight", torch.Size([WIDTH, WIDTH])) for i in range(1, 5)])
    rows = bench.parse_size(name) // 4 // WIDTH
    if rows < 1:
        raise ValueError(f"bucket {name!r} holds less than one {WIDTH}-wide row; use 'mlp' or at least 4K")
    shapes = [torch.Size([WIDTH, WIDTH])] * (rows // WIDTH)
    if rows % WIDTH:
        shapes.append(torch.Size([rows % WIDTH, WIDTH]))
    return BucketLayout.of([(f"layer{i}.weight", shape) for i, shape in enumerate(shapes)])


def _timer(device: torch.device) -> Callable[[], float]:
    if device.type == "cuda":
        def now() -> float:
            torch.cuda.synchronize(device)
            return time.perf_counter()
        return now
    return time.perf_counter


def mass_kept(codec: Codec, grad: torch.Tensor, layout: BucketLayout) -> Optional[float]:
    """The magnitude a sampled selection keeps over the exact selection's, on ``grad``."""
    if codec.exact is None:
        return None
    sampled, exact = codec.build(), codec.exact()
    sampled, exact = getattr(sampled, "inner", sampled), getattr(exact, "inner", exact)
    return float(grad[sampled.select(grad, layout)].abs().sum() / grad[exact.select(grad, layout)].abs().sum())


def gradient(layout: BucketLayout, seed: int, device: torch.device) -> torch.Tensor:
    """The bucket's gradient: normal, spread ``GRAD_STD``, drawn on the CPU from ``seed`` (the same on every device)."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(layout.numel, generator=gen) * GRAD_STD).to(device)


def unit_pass(bucket: torch.Tensor) -> None:
    """The unit every codec is counted in: one elementwise pass over ``bucket``, read and written in place (so it
    touches no memory a codec's input does not)."""
    torch.abs(bucket, out=bucket)


def _timed(contender: Callable[[torch.Tensor], Any], bucket: torch.Tensor, grad: torch.Tensor,
           now: Callable[[], float]) -> float:
    """Seconds ``contender(bucket)`` takes on ``bucket`` just restored from ``grad``: the codecs and the unit pass
    alike, so that every contender starts from the same cache state (the buffer the copy has just written)."""
    bucket.copy_(grad)
    started = now()
    contender(bucket)
    return now() - started


def measure_bucket(bucket: str, codecs: Sequence[str], rounds: int, world_size: int, device: torch.device,
                   seed: int) -> list[dict[str, Any]]:
    """Every codec on one bucket, round-robin with the unit pass; one record per codec."""
    layout = bucket_layout(bucket)
    grad = gradient(layout, seed, device)
    flat = torch.empty_like(grad)  # every contender's input, restored from grad before each call
    now = _timer(device)
    transport = MirrorTransport(world_size)
    compressors = {name: CODECS[name].build() for name in codecs}
    run: dict[str, Callable[[torch.Tensor], Any]] = {"pass": unit_pass, **{
        name: functools.partial(compressor.reduce, layout=layout, transport=transport)
        for name, compressor in compressors.items()}}
    first_ms: dict[str, float] = {}
    for name in codecs:  # the first call of a fresh compressor: buffers, tables
        first_ms[name] = 1e3 * _timed(run[name], flat, grad, now)
        compressors[name].commit()
    contenders = list(run)
    times: dict[str, dict[int, float]] = {name: {} for name in contenders}
    for r in range(rounds):
        shift = r % len(contenders)
        for name in contenders[shift:] + contenders[:shift]:
            times[name][r] = _timed(run[name], flat, grad, now)
            if name != "pass":
                compressors[name].commit()
    records = []
    pass_ms = 1e3 * float(np.median(list(times["pass"].values())))
    for name in codecs:
        passes = bench.paired(times[name], times["pass"])
        records.append({"bucket": bucket, "numel": layout.numel, "device": device.type, "codec": name,
                        "description": CODECS[name].description, "world_size": world_size,
                        "ms": 1e3 * float(np.median(list(times[name].values()))), "pass_ms": pass_ms,
                        "passes": passes["median"], "passes_p25": passes["p25"], "passes_p75": passes["p75"],
                        "first_ms": first_ms[name], "mass_kept": mass_kept(CODECS[name], grad, layout),
                        "target": TARGETS.get(CODECS[name].target) if bucket == "mlp" else None})
    return records


def table(records: Sequence[dict[str, Any]]) -> str:
    rows = [(f"{r['bucket']} ({r['numel'] / 1e6:.2f} M) {r['device']}", r["codec"], bench.cell(r["ms"], ".2f"),
             f"{r['passes']:.1f} [{r['passes_p25']:.1f}-{r['passes_p75']:.1f}]", bench.cell(r["first_ms"], ".1f"),
             bench.cell(r["mass_kept"], ".3f"), bench.cell(r["target"], ".0f", unit=" max"))
            for r in records]
    return bench.format_table(["bucket", "codec", "ms", "passes [IQR]", "first ms", "mass kept", "target"], rows)


def verdicts(records: Sequence[dict[str, Any]]) -> list[str]:
    return [bench.verdict(f"{r['codec']} <= {r['target']:.0f} passes on the {r['numel'] / 1e6:.2f} M bucket",
                          r["passes"] <= r["target"],
                          f"{r['passes']:.1f} passes, {r['ms']:.1f} ms, one pass {r['pass_ms']:.2f} ms")
            for r in records if r["target"] is not None and r["device"] == "cpu"]


def plot(records: Sequence[dict[str, Any]]) -> Any:
    from matplotlib.ticker import ScalarFormatter

    groups = list(dict.fromkeys((r["device"], r["bucket"]) for r in records))  # in the order measured
    codecs = list(dict.fromkeys(r["codec"] for r in records))
    fig, (ax,) = bench.figure_row(1, min(13.0, 4.0 + 0.25 * len(codecs) * len(groups)), 4.6)
    width = 0.8 / len(groups)
    for g, (device, bucket) in enumerate(groups):
        values = [next((r["passes"] for r in records if (r["device"], r["bucket"], r["codec"]) == (device, bucket, c)),
                       np.nan) for c in codecs]
        ax.bar(np.arange(len(codecs)) + (g - (len(groups) - 1) / 2) * width, values, width,
               label=f"{bucket} ({device})")
    for i, c in enumerate(codecs):
        target = next((r["target"] for r in records if r["codec"] == c and r["target"] is not None), None)
        if target is not None:
            ax.plot([i - 0.45, i + 0.45], [target, target], "k--", lw=1.2)
    ax.set_yscale("log")  # before the formatters: setting the scale resets them
    ax.yaxis.set_major_formatter(ScalarFormatter())
    ax.yaxis.set_minor_formatter(ScalarFormatter())
    ax.set_xticks(range(len(codecs)), codecs, rotation=20, ha="right")
    bench.style(ax, "y", which="both", ylabel="passes over the bucket (one in-place torch.abs = 1)",
                title="codec cost per bucket, one thread (dashed: the targets on the mlp bucket)")
    ax.legend(fontsize="small", ncols=2)
    return fig


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    quick = f"the mlp bucket, {', '.join(QUICK_CODECS)}, 3 rounds"
    cli = bench.parser("codecs", __doc__, quick, seed="the gradients' generator")
    cli.add_argument("--buckets", nargs="+", default=None, help="mlp and/or sizes (default: mlp 1M 4M 25M)")
    cli.add_argument("--codecs", nargs="+", choices=list(CODECS), default=None, help="default: all")
    cli.add_argument("--rounds", type=int, default=None, help="timed rounds per bucket (default 15; --quick 3)")
    cli.add_argument("--world-size", type=int, default=2, help="ranks the mirror transport stands for (default 2)")
    cli.add_argument("--threads", type=int, default=1, help="intra-op threads (default 1, as one rank of 2 cores)")
    args = cli.parse_args(argv)
    bench.check_counts(cli, rounds=args.rounds, world_size=args.world_size, threads=args.threads)
    buckets = args.buckets or (["mlp"] if args.quick else ["mlp", "1M", "4M", "25M"])
    for bucket in buckets:
        try:
            bucket_layout(bucket)
        except ValueError as exc:
            cli.error(str(exc))
    codecs = args.codecs or list(QUICK_CODECS if args.quick else CODECS)
    rounds = args.rounds or (3 if args.quick else 15)
    torch.set_num_threads(args.threads)
    devices = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])
    started = time.perf_counter()
    records: list[dict[str, Any]] = []
    for device in devices:
        for bucket in buckets:
            bench.progress(f"[codecs] {bucket} on {device.type}: {len(codecs)} codecs x {rounds} rounds")
            records += measure_bucket(bucket, codecs, rounds, args.world_size, device, args.seed)
    return bench.finish("codecs", args.out, started, [table(records), verdicts(records)], {"records": records},
                        lambda: plot(records), rounds=rounds, world_size=args.world_size, threads=args.threads,
                        grad_std=GRAD_STD, targets=TARGETS)


if __name__ == "__main__":
    main()
