"""What every benchmark here shares: byte-size labels, robust summaries, output files and progress lines.

Conventions: a timed quantity is summarised by its median and quartiles over repeats (a mean is dragged by
the one repeat that met a page fault or a scheduler hiccup); for a collective, one repeat's time is the
maximum over ranks, since the collective is done only when its slowest rank is. Results are written as one
JSON file (``meta`` with the environment and command line, ``records`` with one flat dict per measurement)
and a plain-text copy of the printed table, into a directory under ``bench_results/`` (gitignored).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import platform
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

import numpy as np
import torch

RESULTS_ROOT = Path("bench_results")
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def size_label(nbytes: int) -> str:
    """``1024 -> "1K"``, ``4 << 20 -> "4M"``; sizes that are not a whole number of units stay in bytes."""
    for suffix in ("G", "M", "K"):
        if nbytes >= _UNITS[suffix] and nbytes % _UNITS[suffix] == 0:
            return f"{nbytes // _UNITS[suffix]}{suffix}"
    return str(nbytes)


def parse_size(text: str) -> int:
    """``"64K" -> 65536``, ``"4M" -> 4194304``, ``"1000" -> 1000`` (binary units, case-insensitive)."""
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    suffix = text[-1] if text and text[-1] in "KMG" else ""
    number = text[: len(text) - len(suffix)]
    try:
        value = int(number) * _UNITS[suffix]
    except ValueError:
        raise ValueError(f"size {text!r} is not understood; write a whole number and K, M or G: 64K, 4M.")
    if value <= 0:
        raise ValueError(f"size {text!r} must be positive.")
    return value


def completion_times(per_rank: Sequence[Sequence[float]]) -> list[float]:
    """Per repeat, the slowest rank's time: ``per_rank[rank][repeat] -> [repeat]``."""
    return [max(times) for times in zip(*per_rank, strict=True)]


def summarize(seconds: Sequence[float]) -> dict[str, float]:
    """Median, quartiles and minimum of a list of timings, in seconds."""
    values = np.asarray(seconds, dtype=float)
    return {
        "median_s": float(np.median(values)),
        "p25_s": float(np.percentile(values, 25)),
        "p75_s": float(np.percentile(values, 75)),
        "min_s": float(values.min()),
    }


def environment() -> dict[str, Any]:
    """Enough to tell two result files apart: when, where, with what, and how invoked."""
    return {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "host": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        # other processes' load when the run started: above the core count, timings include their share
        "load_average_1m": os.getloadavg()[0],
        "argv": sys.argv[1:],
    }


def output_dir(path: str | os.PathLike | None, default_name: str) -> Path:
    """``path``, or ``bench_results/<default_name>`` when it is None; created if missing."""
    out = Path(path) if path is not None else RESULTS_ROOT / default_name
    out.mkdir(parents=True, exist_ok=True)
    return out


def write_json(path: Path, payload: dict[str, Any]) -> Path:
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


def write_results(out: Path, name: str, text: str, payload: dict[str, Any], draw: Any) -> None:
    """A benchmark's three outputs in ``out``: ``<name>.txt`` (the printed table), ``<name>.json`` and the
    ``<name>.png`` that ``draw(path)`` makes; then say where they are."""
    (out / f"{name}.txt").write_text(text + "\n")
    write_json(out / f"{name}.json", payload)
    draw(out / f"{name}.png")
    progress(f"[{name}] wrote {out / name}.{{json,txt,png}}")


def format_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A right-aligned plain-text table (first column left-aligned); cells are ``str()``-ed."""
    cells = [[str(c) for c in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]

    def line(row: list[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), rule] + [line(row) for row in cells[1:]])


def figure_row(panels: int, width: float, height: float = 4.2, **subplots: Any) -> tuple[Any, list[Any]]:
    """A matplotlib figure (Agg, no display needed) with ``panels`` axes side by side; ``subplots`` go to
    ``Figure.subplots`` (``width_ratios=[2, 1]``)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig, list(fig.subplots(1, panels, squeeze=False, **subplots)[0])


def step_boxplot(ax: Any, data: Sequence[Sequence[float]], labels: Sequence[str], title: str,
                 **tick_options: Any) -> None:
    """Per-run median step times (ms) of several configurations: a box per configuration, every run as a dot."""
    ax.boxplot(data, showfliers=False)
    ax.set_xticks(range(1, len(labels) + 1), labels, **tick_options)
    for i, values in enumerate(data, start=1):
        ax.plot(np.full(len(values), i) + np.linspace(-0.08, 0.08, len(values)), values, "o", ms=3, alpha=0.6)
    ax.set(ylabel="step time, ms (per-run median)", title=title)
    ax.grid(alpha=0.3, axis="y")


def progress(message: str) -> None:
    """A progress line on stderr, so stdout holds only the results."""
    print(message, file=sys.stderr, flush=True)


@contextlib.contextmanager
def quiet_lightning() -> Iterator[None]:
    """Lightning's per-fit banners and one known deprecation warning off, so stderr holds our progress."""
    loggers = [logging.getLogger(name) for name in ("lightning.pytorch", "lightning.fabric")]
    levels = [lg.level for lg in loggers]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*treespec, LeafSpec.*")
        for lg in loggers:
            lg.setLevel(logging.WARNING)
        try:
            yield
        finally:
            for lg, level in zip(loggers, levels):
                lg.setLevel(level)


def step_times(ends: Sequence[float], epochs: Sequence[int], warmup: int) -> list[float]:
    """Gaps between consecutive batch ends of one epoch, from the step after ``warmup`` on, in seconds."""
    return [ends[i] - ends[i - 1] for i in range(max(warmup, 1), len(ends)) if epochs[i] == epochs[i - 1]]
