"""The pipeline every benchmark here shares: the step recorder, the timed fit, statistics (medians, quartiles, paired
ratios), targets and verdicts, tables, figures and the output files.

Contenders run interleaved (round-robin over rounds or seeds) and are compared by the *paired* ratio: per round one's
time over the other's, then the median over rounds, which cancels drift slower than a round. A step's time is the gap
between two consecutive batch ends of one epoch; a collective's, the slowest rank's. Every benchmark writes
``<name>.txt``, ``<name>.json`` (``meta``, then its records) and ``<name>.png`` into ``--out`` (:func:`finish`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import platform
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional, Sequence

import lightning as L
import numpy as np
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_dist.strategy import features_of
from lightning_dist.testing import quiet_trainer

RESULTS_ROOT = Path("bench_results")
WORLD_SIZE = 2  # CPU ranks of the benchmarks that train in processes of this machine (not cluster's hosts)
COLLECTIVE_TIMEOUT_S = 120.0  # a hung collective fails the run after this long instead of hanging it
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


# -- sizes and statistics ------------------------------------------------------------------------------------
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


def summarize(values: Sequence[float], suffix: str = "_s") -> dict[str, float]:
    """Median, quartiles and minimum (``median_s``, ``p25_s``, ``p75_s``, ``min_s``; other units: ``suffix``)."""
    array = np.asarray(values, dtype=float)
    return {f"median{suffix}": float(np.median(array)), f"p25{suffix}": float(np.percentile(array, 25)),
            f"p75{suffix}": float(np.percentile(array, 75)), f"min{suffix}": float(array.min())}


def ratio(mine: Optional[float], base: Optional[float]) -> Optional[float]:
    """``mine / base``, or None when either is unknown (or ``base`` is 0)."""
    return mine / base if mine is not None and base else None


def median(values: Sequence[float]) -> Optional[float]:
    """The median, or None when there is nothing to take it of."""
    return float(np.median(values)) if len(values) else None


def paired(mine: Mapping[Any, float], base: Mapping[Any, float]) -> Optional[dict[str, float]]:
    """The paired ratio: per key both have (a round, a seed) ``mine / base``, summarised (``median``, ``p25``,
    ``p75``, ``min``); None when no key pairs."""
    ratios = [mine[key] / base[key] for key in mine if key in base]
    return summarize(ratios, suffix="") if ratios else None


def paired_runs(mine: Sequence[dict[str, Any]], base: Sequence[dict[str, Any]], key: str = "median_s",
                by: str = "round") -> Optional[dict[str, float]]:
    """Runs paired by ``by`` (a round, a seed): :func:`paired` of their ``key`` (``median``, ``p25``, ``p75``,
    ``min``), the medians over the paired runs (``mine``, ``base``) and how many pair (``pairs``); None when none."""
    ours, theirs = ({r[by]: r[key] for r in runs if r.get(key)} for runs in (mine, base))
    keys = [k for k in ours if k in theirs]
    if not keys:
        return None
    return {**paired(ours, theirs), "mine": median([ours[k] for k in keys]), "base": median([theirs[k] for k in keys]),
            "pairs": len(keys)}


def step_times(ends: Sequence[float], epochs: Sequence[int], warmup: int) -> list[float]:
    """Gaps between consecutive batch ends of one epoch, from the step after ``warmup`` on, in seconds."""
    return [ends[i] - ends[i - 1] for i in range(max(warmup, 1), len(ends)) if epochs[i] == epochs[i - 1]]


# -- one fit, recorded -------------------------------------------------------------------------------------------
class StepRecorder(Callback):
    """What the benchmarks record of a fit, on every rank; put it first among the callbacks.

    Per training batch: ``starts`` and ``ends`` (``perf_counter`` seconds at its start and end), ``cpu`` (the
    process's CPU seconds, all threads, at its end), ``epochs``, ``losses`` (this rank's batch loss) and, under
    RingDDPStrategy (:func:`~lightning_dist.strategy.features_of`; empty dicts otherwise), ``steps`` (this rank's
    own measurements of the step, ``last_step``) and ``step_metrics`` (every rank's, from the last exchange); after
    each validation, ``val_acc``. ``probe(trainer)``, if given, is read at the start of the second batch
    (``first``: what the fit's start and its first step cost) and when training ends (``last``). With ``path``,
    rank 0 writes it all there as JSON when training ends: Lightning's fork launcher runs rank 0 in a child.
    """

    def __init__(self, path: Optional[str] = None, probe: Optional[Callable[[L.Trainer], dict]] = None) -> None:
        self.path, self.probe = path, probe
        self.starts: list[float] = []
        self.ends: list[float] = []
        self.cpu: list[float] = []
        self.epochs: list[int] = []
        self.losses: list[float] = []
        self.steps: list[dict[str, float]] = []
        self.step_metrics: list[dict[str, float]] = []
        self.val_acc: list[float] = []
        self.first: dict = {}

    @override
    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self.starts.append(time.perf_counter())
        if len(self.starts) == 2 and self.probe is not None:
            self.first = self.probe(trainer)

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, *args: Any) -> None:
        self.ends.append(time.perf_counter())
        self.cpu.append(time.process_time())
        self.epochs.append(trainer.current_epoch)
        self.losses.append(float(outputs["loss"] if isinstance(outputs, dict) else outputs))
        features = features_of(trainer.strategy)
        self.steps.append(dict(features.last_step) if features else {})
        self.step_metrics.append(dict(features.step_metrics) if features else {})

    @override
    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking and "val/acc" in trainer.callback_metrics:
            self.val_acc.append(float(trainer.callback_metrics["val/acc"]))

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.path is not None and trainer.is_global_zero:
            Path(self.path).write_text(json.dumps(self.record(trainer)))

    def record(self, trainer: L.Trainer) -> dict[str, Any]:
        """Everything recorded, as plain data."""
        return {"starts": self.starts, "ends": self.ends, "cpu": self.cpu, "epochs": self.epochs,
                "losses": self.losses, "steps": self.steps, "step_metrics": self.step_metrics, "val_acc": self.val_acc,
                "first": self.first, "last": self.probe(trainer) if self.probe is not None else {}}


def timed_fit(workload: Any, strategy: Any, steps: int, warmup: int, seed: int, callbacks: Sequence[Callback] = (),
              probe: Optional[Callable[[L.Trainer], dict]] = None
              ) -> tuple[dict[str, Any], dict[str, Any], L.LightningModule]:
    """One fit of ``workload`` (:class:`~lightning_dist.benchmarks.workloads.Workload`) on :data:`WORLD_SIZE` ranks
    under ``strategy`` (Lightning's fork launcher) from ``seed_everything(seed)``, ``steps`` optimizer steps, no
    validation. Returns the run's step times after ``warmup`` (:func:`summarize`, with ``steps``,
    ``timed_steps`` and the fit's ``wall_s``), rank 0's :class:`StepRecorder` record (through a file: rank 0
    runs in a child), and the model (the launcher loads rank 0's final weights back into it)."""
    L.seed_everything(seed, verbose=False)
    model = workload.model()
    with tempfile.TemporaryDirectory(prefix="lightning_dist_fit_") as workdir:
        path = Path(workdir) / "stamps.json"
        trainer = quiet_trainer(devices=WORLD_SIZE, strategy=strategy, max_steps=steps, limit_val_batches=0,
                                callbacks=[StepRecorder(str(path), probe), *callbacks])
        started = time.perf_counter()
        trainer.fit(model, workload.data())
        wall_s = time.perf_counter() - started
        stamps = json.loads(path.read_text())
    times = step_times(stamps["ends"], stamps["epochs"], warmup)
    if not times:
        raise RuntimeError(f"{workload.name}: no step left after {warmup} warmup steps; raise --steps.")
    return {"steps": steps, "timed_steps": len(times), **summarize(times), "wall_s": wall_s}, stamps, model


# -- output -------------------------------------------------------------------------------------------------------
def parser(name: str, doc: str, quick: str, seed: Optional[str] = None) -> argparse.ArgumentParser:
    """The command line of ``python -m lightning_dist.benchmarks.<name>``, with the flags every benchmark has:
    ``--out``, ``--quick`` (``quick`` says what the smoke run does) and, where ``seed`` says what it seeds,
    ``--seed`` (default 0)."""
    cli = argparse.ArgumentParser(prog=f"python -m lightning_dist.benchmarks.{name}", description=doc.split("\n\n")[0])
    cli.add_argument("--out", default=None, help=f"output directory (default bench_results/{name}/)")
    # argparse %-formats help strings: a literal % (a compressor label such as "topk1%") is escaped here, once
    cli.add_argument("--quick", action="store_true", help=f"smoke run: {quick}".replace("%", "%%"))
    if seed is not None:
        cli.add_argument("--seed", type=int, default=0, help=f"{seed} (default 0)".replace("%", "%%"))
    return cli


def check_counts(cli: argparse.ArgumentParser, steps: Optional[int] = None, warmup: int = 0, /,
                 **counts: Optional[int]) -> None:
    """A usage error where a count given on the command line (``rounds=args.rounds``) is below 1, or where
    ``steps`` leave fewer than 3 timed steps after ``warmup``."""
    for name, value in counts.items():
        if value is not None and value < 1:
            cli.error(f"--{name} {value}: need at least 1.")
    if steps is not None and steps < warmup + 3:
        cli.error(f"--steps {steps} leaves fewer than 3 timed steps after {warmup} warmup steps; "
                  f"use --steps >= {warmup + 3}.")


def quick_defaults(args: argparse.Namespace, **options: tuple[Any, Any]) -> None:
    """Each option of ``options`` not given on the command line takes its ``(full, quick)`` default by ``--quick``;
    a sequence becomes a tuple."""
    for name, (full, quick) in options.items():
        value = getattr(args, name) or (quick if args.quick else full)
        setattr(args, name, tuple(value) if isinstance(value, (list, tuple, dict)) else value)


def environment(benchmark: str, **fields: Any) -> dict[str, Any]:
    """A result file's ``meta``: enough to tell two apart (when, where, with what, how invoked), the benchmark's
    name and its ``fields``."""
    return {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "host": platform.node(),
            # platform.platform() would run `uname -p` in a subprocess; these three read os.uname()
            "platform": f"{platform.system()}-{platform.release()}-{platform.machine()}",
            "python": platform.python_version(), "torch": torch.__version__, "cpu_count": os.cpu_count(),
            # other processes' load when the run started: above the core count, timings include their share
            "load_average_1m": os.getloadavg()[0], "argv": sys.argv[1:], "benchmark": benchmark, **fields}


def output_dir(path: str | os.PathLike | None, default_name: str) -> Path:
    """``path``, or ``bench_results/<default_name>`` when it is None; created if missing."""
    out = Path(path) if path is not None else RESULTS_ROOT / default_name
    out.mkdir(parents=True, exist_ok=True)
    return out


def write_results(out: Path, name: str, blocks: Sequence[str | Sequence[str]], payload: dict[str, Any],
                  draw: Callable[[], Any]) -> dict[str, Any]:
    """Print ``blocks`` (a table, or a list of lines such as verdicts; a blank line between two) and write them to
    ``out/<name>.txt``, ``payload`` (returned) to ``<name>.json`` and the figure ``draw()`` returns to ``.png``."""
    text = "\n\n".join(block if isinstance(block, str) else "\n".join(block) for block in blocks)
    print(text)
    (out / f"{name}.txt").write_text(text + "\n")
    (out / f"{name}.json").write_text(json.dumps(payload, indent=2) + "\n")
    draw().savefig(out / f"{name}.png", dpi=110)
    progress(f"[{name}] wrote {out / name}.{{json,txt,png}}")
    return payload


def finish(name: str, out: Optional[str], started: float, blocks: Sequence[str | Sequence[str]],
           payload: dict[str, Any], draw: Callable[[], Any], file: Optional[str] = None, **meta: Any) -> dict[str, Any]:
    """How every benchmark's ``main`` ends: ``payload`` headed by its ``meta`` (:func:`environment` with ``meta`` and
    ``wall_s``, the ``perf_counter`` seconds since ``started``), :func:`write_results` into ``--out`` (``out``; default
    ``bench_results/<name>/``) as ``<file>.*`` (default ``name``)."""
    wall_s = time.perf_counter() - started
    progress(f"[{name}] done in {wall_s:.0f}s")
    payload = {"meta": environment(file or name, **meta, wall_s=wall_s), **payload}
    return write_results(output_dir(out, name), file or name, blocks, payload, draw)


def verdict(what: str, met: bool, detail: str) -> str:
    """The line that judges a target: ``target <what>: MET (<detail>)`` or ``MISSED``."""
    return f"target {what}: {'MET' if met else 'MISSED'} ({detail})"


def judged(what: str, record: Optional[dict[str, Any]], detail: str | Callable[[dict[str, Any]], str]) -> str:
    """:func:`verdict` on a :func:`target` record, ``detail`` a format string over its keys or a function of it;
    MISSED and "not measured" where there is no record."""
    if record is None:
        return verdict(what, False, "not measured")
    return verdict(what, record["met"], detail(record) if callable(detail) else detail.format(**record))


def target(value: float, bound: float, most: bool = True) -> dict[str, Any]:
    """A target's record: ``value`` against ``bound`` (at most; ``most=False``: at least), and whether it is ``met``."""
    return {"value": value, "bound": bound, "met": bool(value <= bound if most else value >= bound)}


def table(records: Iterable[dict[str, Any]], headers: Sequence[str], lead: Callable[[dict[str, Any]], list],
          cells: Callable[[dict[str, Any]], list], error_width: int = 40) -> str:
    """:func:`format_table` of ``records``, a row each: ``lead(record)`` then ``cells(record)``, or for a record
    with an ``error``, ``FAILED``, dashes and the error's first ``error_width`` characters."""
    def row(r: dict[str, Any]) -> list:
        first = lead(r)
        if not r.get("error"):
            return [*first, *cells(r)]
        return [*first, "FAILED", *["-"] * (len(headers) - len(first) - 2), r["error"][:error_width]]

    return format_table(headers, [row(r) for r in records])


def cell(value: Optional[float], spec: str, scale: float = 1.0, unit: str = "") -> str:
    """A table cell: ``scale * value`` formatted by ``spec``, then ``unit``; ``-`` where there is no value."""
    return "-" if value is None else format(scale * value, spec) + unit


def spread(r: dict[str, Any], spec: str = ".3f", key: str = "paired") -> str:
    """A paired ratio with its quartiles, ``1.012x [0.998, 1.030]``: ``r``'s ``<key>_ratio``, ``_p25`` and ``_p75``."""
    return f"{r[f'{key}_ratio']:{spec}}x [{r[f'{key}_p25']:{spec}}, {r[f'{key}_p75']:{spec}}]"


def format_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A right-aligned plain-text table (first column left-aligned); cells are ``str()``-ed."""
    cells = [[str(c) for c in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]

    def line(row: list[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), rule] + [line(row) for row in cells[1:]])


def figure_grid(rows: int, cols: int, width: float, height: float, **subplots: Any) -> tuple[Any, list[list[Any]]]:
    """A matplotlib figure (Agg, no display needed) of ``width`` x ``height`` inches with ``rows`` x ``cols`` axes;
    ``subplots`` go to ``Figure.subplots`` (``width_ratios=[2, 1]``)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig, [list(row) for row in fig.subplots(rows, cols, squeeze=False, **subplots)]


def figure_row(panels: int, width: float, height: float = 4.2, **subplots: Any) -> tuple[Any, list[Any]]:
    """:func:`figure_grid` of one row of ``panels`` axes."""
    fig, grid = figure_grid(1, panels, width, height, **subplots)
    return fig, grid[0]


def style(ax: Any, grid: Optional[str] = "both", legend: Optional[str] = None, which: str = "major",
          **settings: Any) -> None:
    """``ax.set(**settings)``, a light grid along ``grid`` (``"both"``, ``"x"``, ``"y"``; None: none) at ``which``
    ticks and, with ``legend`` (a font size), the legend."""
    ax.set(**settings)
    if grid:
        ax.grid(alpha=0.3, axis=grid, which=which)
    if legend:
        ax.legend(fontsize=legend)


def step_boxplot(ax: Any, data: Sequence[Sequence[float]], labels: Sequence[str], title: str,
                 **tick_options: Any) -> None:
    """Per-run median step times (ms) of several configurations: a box per configuration, every run as a dot."""
    ax.boxplot(data, showfliers=False)
    ax.set_xticks(range(1, len(labels) + 1), labels, **tick_options)
    for i, values in enumerate(data, start=1):
        ax.plot(np.full(len(values), i) + np.linspace(-0.08, 0.08, len(values)), values, "o", ms=3, alpha=0.6)
    style(ax, "y", ylabel="step time, ms (per-run median)", title=title)


def progress(message: str) -> None:
    """A progress line on stderr, so stdout holds only the results."""
    print(message, file=sys.stderr, flush=True)


@contextlib.contextmanager
def scratch(name: str, keep: bool = False) -> Iterator[Path]:
    """A directory for a benchmark's runs, removed at the end unless ``keep`` (then its path is printed)."""
    path = Path(tempfile.mkdtemp(prefix=f"lightning_dist_{name}_"))
    try:
        yield path
    finally:
        if keep:
            progress(f"[{name}] run directories kept in {path}")
        else:
            shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def quiet_lightning() -> Iterator[None]:
    """Lightning's per-fit banners and two known deprecation warnings off, so stderr holds our progress."""
    loggers = [logging.getLogger(name) for name in ("lightning.pytorch", "lightning.fabric")]
    levels = [lg.level for lg in loggers]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*treespec, LeafSpec.*")
        # stock DDP's all_gather goes through a torch function deprecated upstream
        warnings.filterwarnings("ignore", message=r".*all_gather is deprecated.*")
        for lg in loggers:
            lg.setLevel(logging.WARNING)
        try:
            yield
        finally:
            for lg, level in zip(loggers, levels):
                lg.setLevel(level)
