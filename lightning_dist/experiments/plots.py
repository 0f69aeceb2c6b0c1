"""The notebooks' figures and tables, from :class:`~lightning_dist.experiments.runs.Run` results.

Every plotting function draws into a matplotlib ``Axes`` it is given (``fig, ax = plt.subplots()`` in a
notebook, :func:`lightning_dist.benchmarks._common.figure_row` without a display) and returns it, so a
notebook composes its own panels. Nothing here needs pandas.
"""

from __future__ import annotations

import itertools
import math
from typing import Any, Iterable, Optional, Sequence

import numpy as np

from lightning_dist.benchmarks._common import format_table
from lightning_dist.experiments.records import per_rank, series
from lightning_dist.experiments.runs import Run

RANK_COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown")


def moving_average(values: Sequence[float], window: int) -> np.ndarray:
    """Trailing mean over ``window`` values (shorter at the start), the same length as ``values``."""
    v = np.asarray(values, dtype=float)
    if window <= 1 or len(v) == 0:
        return v
    sums = np.cumsum(np.insert(v, 0, 0.0))
    counts = np.minimum(np.arange(1, len(v) + 1), window)
    return (sums[1:] - sums[np.arange(1, len(v) + 1) - counts]) / counts


def plot_metric(ax: Any, runs: Iterable[Run], key: str, *, smooth: int = 1, ylabel: Optional[str] = None,
                marker: Optional[str] = None, **style: Any) -> Any:
    """One curve per run of a logged metric against the optimizer step (``smooth``: trailing mean window)."""
    for run in runs:
        steps, values = run.series(key)
        if steps:
            ax.plot(steps, moving_average(values, smooth), label=run.name, marker=marker, **style)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(ylabel or (key + (f" (mean of {smooth} steps)" if smooth > 1 else "")))
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    return ax


def plot_bytes(ax: Any, run: Run) -> Any:
    """Cumulative gradient bytes one rank sent against what the dense fp32 ring would have sent, MiB."""
    for key, label, style in (("dist/dense_bytes_per_rank", "dense fp32 ring", "--"),
                              ("dist/bytes_sent_per_rank", f"{run.name}: sent", "-")):
        steps, values = run.series(key)
        if steps:
            ax.plot(steps, np.cumsum(values) / 2**20, style, label=label)
    ax.set(xlabel="optimizer step", ylabel="gradient bytes sent per rank, MiB (cumulative, logged steps)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    return ax


def plot_quality_vs_bytes(ax: Any, runs: Sequence[Run], key: str = "val/acc", *, reference: Optional[str] = None,
                          percent: bool = True) -> Any:
    """Each run's final ``key`` against the gradient bytes rank zero sent per step (log x), labelled.

    ``reference``: the name of the run drawn as a horizontal line (the dense baseline).
    """
    scale = 100.0 if percent else 1.0
    stacked: dict[float, int] = {}  # labels of runs at the same bytes (fp16 and bf16) go one under the other
    for run, color in zip(runs, itertools.cycle(RANK_COLORS + ("tab:pink", "tab:gray", "tab:olive", "tab:cyan"))):
        value = run.final(key)
        if value is None or run.bytes_per_step <= 0:
            continue
        x, y = run.bytes_per_step / 1024, scale * value
        ax.plot([x], [y], "*" if run.name == reference else "o", ms=12 if run.name == reference else 8,
                color=color)
        decade = round(math.log10(x), 2)
        spot = stacked[decade] = stacked.get(decade, -1) + 1
        ax.annotate(run.name, (x, y), textcoords="offset points", xytext=(6, 4 - 11 * spot), fontsize="small",
                    color=color)
        if run.name == reference:
            ax.axhline(y, color="gray", lw=0.8, ls="--")
    ax.set_xscale("log")
    ax.set(xlabel="gradient bytes sent per step by rank 0, KiB (log)",
           ylabel=f"final {key}" + (", %" if percent else ""))
    ax.grid(alpha=0.3, which="both")
    return ax


def plot_timeline(ax: Any, run: Run, steps: Optional[tuple[int, int]] = None, *, title: Optional[str] = None
                  ) -> Any:
    """Every rank's training batches as bars on one time axis, one row per rank (a Gantt chart).

    Each batch is a solid bar for its compute (forward and backward), a hatched one for the time it then
    waited for its peers and the wire, a pale one for the optimizer step and callbacks; the gaps between
    bars are data loading and the loop. ``steps``: ``(first, last)`` global steps to draw (default: the last
    eight of the run).
    """
    rows = run.timeline
    if not rows:
        return ax
    if steps is None:
        top = max(r["step"] for r in rows)
        steps = (max(0, top - 7), top)
    shown = [r for r in rows if steps[0] <= r["step"] <= steps[1]]
    ranks = sorted({r["rank"] for r in shown})
    origin = min(r["start"] for r in shown)
    for r in shown:
        y, color = r["rank"], RANK_COLORS[r["rank"] % len(RANK_COLORS)]
        ax.barh(y, r["compute"], left=r["start"] - origin, height=0.6, color=color)
        ax.barh(y, r["wait"], left=r["compute_end"] - origin, height=0.6, color="white", edgecolor=color,
                hatch="///", lw=0.5)
        ax.barh(y, r["end"] - r["comm_end"], left=r["comm_end"] - origin, height=0.6, color=color, alpha=0.3)
    ax.set_yticks(ranks, [f"rank {r}\n({_mean_samples(shown, r)} samples)" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlabel(f"seconds from step {steps[0]} (solid: compute; hatched: waiting for peers; pale: optimizer)")
    ax.set_title(title or f"{run.name}: steps {steps[0]}-{steps[1]}", fontsize="medium")
    ax.grid(alpha=0.3, axis="x")
    return ax


def _mean_samples(rows: Sequence[dict[str, Any]], rank: int) -> str:
    samples = [r["samples"] for r in rows if r["rank"] == rank and r.get("samples") is not None]
    return f"{np.mean(samples):.0f}" if samples else "?"


def plot_per_rank(ax: Any, run: Run, key: str, *, ylabel: Optional[str] = None, scale: float = 1.0,
                  style: str = "-") -> Any:
    """A timeline field (``"samples"``, ``"compute"``, ``"wait"``, ``"loss"``...) per rank against the step."""
    for rank, (steps, values) in per_rank(run.timeline, key).items():
        ax.plot(steps, np.asarray(values) * scale, style, color=RANK_COLORS[rank % len(RANK_COLORS)],
                label=f"{run.name}: rank {rank}")
    ax.set(xlabel="optimizer step", ylabel=ylabel or key)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    return ax


def plot_rank_metrics(ax: Any, run: Run, name: str, *, ylabel: Optional[str] = None, smooth: int = 1) -> Any:
    """The strategy's per-rank metric ``dist/rank{r}/<name>`` (gathered to rank zero) for every rank."""
    rank = 0
    while True:
        steps, values = series(run.metrics, f"dist/rank{rank}/{name}")
        if not steps:
            break
        ax.plot(steps, moving_average(values, smooth), color=RANK_COLORS[rank % len(RANK_COLORS)],
                label=f"{run.name}: rank {rank}")
        rank += 1
    ax.set(xlabel="optimizer step", ylabel=ylabel or f"dist/rank{{r}}/{name}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    return ax


def plot_epoch_times(ax: Any, runs: Sequence[Run], rank: int = 0) -> Any:
    """Training time of every epoch (rank ``rank``, validation excluded), bars grouped by epoch, one per run."""
    width = 0.8 / max(len(runs), 1)
    epochs = 0
    for i, run in enumerate(runs):
        times = run.epoch_times(rank)
        epochs = max(epochs, len(times))
        ax.bar(np.arange(len(times)) + i * width, times, width=width, label=run.name)
    ax.set(xlabel="epoch", ylabel=f"training time per epoch, s (rank {rank})")
    ax.set_xticks(np.arange(epochs) + 0.4 - width / 2, [str(e) for e in range(epochs)])
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize="small")
    return ax


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e4 else f"{value:.0f}"
    return str(value)


def table(rows: Sequence[dict[str, Any]], columns: Optional[Sequence[str]] = None) -> str:
    """Plain-text table of flat dicts (e.g. ``[run.row() for run in runs]``); ``columns`` picks and orders."""
    if not rows:
        return ""
    columns = list(columns or rows[0].keys())
    return format_table(columns, [[_cell(row.get(c)) for c in columns] for row in rows])
