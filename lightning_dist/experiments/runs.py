"""Run one small training job from a notebook and get everything it measured back as plain records.

Two ways in, one result (:class:`Run`):

- :func:`fit_digits`: the digits job of the examples with a :class:`~lightning_dist.RingDDPStrategy` built from
  keyword arguments (``compressor=``, ``hetero=``, ``algorithm=``...), on ranks forked from this process
  (the ``ring_ddp_notebook`` launcher), with :class:`~lightning_dist.experiments.records.JsonlLogger`,
  :class:`~lightning_dist.experiments.records.StepTimeline` and ``lightning-dist-train``'s own
  ``summary.json`` writer attached;
- :func:`fit_config`: the Hydra configs of ``lightning-dist-train``, composed with overrides
  (``["compression=topk", "compression.ratio=0.01"]``) and run by :func:`lightning_dist.train.run`, the
  command's own code path: the run writes the same ``summary.json`` and ``csv/metrics.csv`` the command does.

Each run's files live in its own directory (``save_dir``), which is emptied first; the result reads them back
once the ranks are gone, since nothing else a forked rank holds returns to the notebook.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
import warnings
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Optional, Sequence

import lightning.pytorch as pl
from hydra import compose, initialize_config_module
from lightning.pytorch.callbacks import Callback

from lightning_dist.config import complete_overrides, register_configs, validate
from lightning_dist.examples import DigitsCNN, DigitsDataModule
from lightning_dist.experiments.records import (
    JsonlLogger,
    Record,
    StepTimeline,
    epoch_times,
    last,
    read_csv_metrics,
    read_jsonl,
    read_timeline,
    series,
)
from lightning_dist.perf import PerfConfig
from lightning_dist.strategy import RingDDPStrategy
from lightning_dist.testing import Slowdown, quiet_trainer
from lightning_dist.train import ApplyPerfCallback, RunSummaryCallback, run

SMALL_ENV = "LIGHTNING_DIST_NB_SMALL"  # "1": the notebooks' small settings (what the test suite runs)
TIMEOUT_S = 120.0  # a collective waits this long for a stalled peer: a broken run fails instead of hanging


def quiet_logs() -> None:
    """Lightning's per-fit banners (devices found, tips, distributed set-up) and its warnings about this tiny
    job (few loader workers, few batches per logging interval) off for the session: a notebook's output then
    holds its results. Forked ranks inherit the setting. Errors and our own warnings still show."""
    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.WARNING)
    for message in (r".*treespec, LeafSpec.*", r".*does not have many workers.*",
                    r".*smaller than the logging interval.*", r".*which may be a bottleneck.*"):
        warnings.filterwarnings("ignore", message=message)


def small_settings() -> bool:
    """True when ``LIGHTNING_DIST_NB_SMALL=1``: notebooks then train on small settings (the test suite's)."""
    return os.environ.get(SMALL_ENV, "") not in ("", "0", "false", "False")


@dataclass
class Run:
    """One finished fit, read back from its files.

    Attributes:
        name: the label plots and tables use.
        save_dir: where its files are.
        metrics: rank zero's logged records, one dict per logging call: ``step``, ``train/loss``,
            ``val/acc``, ``dist/*`` (the strategy's per-step metrics, every rank's values included).
        timeline: every rank's training batches (:func:`~lightning_dist.experiments.records.read_timeline`);
            empty when the run had no :class:`StepTimeline`.
        summary: ``summary.json`` (``lightning-dist-train``'s): final metrics, ``wall_time_s``, ``global_step``,
            ``bytes_sent_rank0`` and ``dense_bytes_rank0`` over the whole run, ``compression_ratio``,
            ``compressor``, ``comm_time_s_rank0``, ``codec_time_s_rank0``, and the config.
        wall_s: the notebook's wall time for the fit, process start-up and teardown included.
    """

    name: str
    save_dir: str
    metrics: list[Record] = field(default_factory=list)
    timeline: list[Record] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    wall_s: float = 0.0

    def series(self, key: str) -> tuple[list[float], list[float]]:
        """``(steps, values)`` of one logged metric."""
        return series(self.metrics, key)

    def final(self, key: str, default: Optional[float] = None) -> Optional[float]:
        """The metric's value at the end of the fit (``summary.json``'s, else the last one logged)."""
        value = self.summary.get("metrics", {}).get(key)
        return value if value is not None else last(self.metrics, key, default)

    @property
    def steps(self) -> int:
        return int(self.summary.get("global_step", 0))

    @property
    def bytes_per_step(self) -> float:
        """Gradient bytes rank zero sent per optimizer step, over the whole run."""
        return self.summary.get("bytes_sent_rank0", 0.0) / max(self.steps, 1)

    @property
    def dense_bytes_per_step(self) -> float:
        """What the dense fp32 ring would have sent per step for the same gradients."""
        return self.summary.get("dense_bytes_rank0", 0.0) / max(self.steps, 1)

    def epoch_times(self, rank: int = 0) -> list[float]:
        """Seconds per training epoch on ``rank`` (validation excluded)."""
        return epoch_times(self.timeline, rank)

    def row(self) -> dict[str, Any]:
        """The run in one flat dict: what a comparison table shows."""
        return {
            "run": self.name, "val/acc": self.final("val/acc"), "val/loss": self.final("val/loss"),
            "steps": self.steps, "KiB/step": self.bytes_per_step / 1024,
            "ratio": self.summary.get("compression_ratio"), "compressor": self.summary.get("compressor"),
            "codec ms/step": 1e3 * self.summary.get("codec_time_s_rank0", 0.0) / max(self.steps, 1),
            "fit s": self.wall_s,
        }


def _fresh(save_dir: str | os.PathLike) -> str:
    path = os.fspath(save_dir)
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    return path


def _read(name: str, save_dir: str, metrics: list[Record], wall_s: float) -> Run:
    summary: dict[str, Any] = {}
    summary_path = os.path.join(save_dir, "summary.json")
    if os.path.exists(summary_path):
        with open(summary_path) as fh:
            summary = json.load(fh)
    return Run(name, save_dir, metrics, read_timeline(save_dir), summary, wall_s)


def summary_callback(save_dir: str | os.PathLike, config: Optional[dict[str, Any]] = None) -> Callback:
    """``lightning-dist-train``'s ``summary.json`` writer for ``save_dir``: at the end of fit rank zero writes the
    final metrics, wall time, steps, the gradient bytes it sent over the run (and the dense ring's), the
    compression ratio, comm and codec time, and ``config``. Make it right before ``fit`` (its clock starts)."""
    # the command's own writer
    return RunSummaryCallback(os.path.join(os.fspath(save_dir), "summary.json"), dict(config or {}), time.time())


def fit_digits(
    name: str,
    save_dir: str | os.PathLike,
    *,
    devices: int = 2,
    epochs: int = 2,
    batch_size: int = 32,
    limit_train_batches: Optional[int] = None,
    seed: int = 0,
    model: Optional[dict[str, Any]] = None,
    slowdown: Optional[dict[int, float]] = None,
    log_every_n_steps: int = 1,
    callbacks: Sequence[Callback] = (),
    start_method: str = "fork",
    **strategy_kwargs: Any,
) -> Run:
    """Train :class:`~lightning_dist.examples.DigitsCNN` on the digits with ``RingDDPStrategy(**strategy_kwargs)``.

    Args:
        name: the run's label.
        save_dir: its own directory (emptied first) for the metrics, the timeline and ``summary.json``.
        devices: CPU processes.
        epochs: training epochs; validation runs after each.
        batch_size: per rank (the global batch is ``devices x batch_size``; with ``hetero=`` it is split by speed).
        limit_train_batches: train on this many batches per epoch (None: all 23 at 2 x 32).
        seed: ``seed_everything``'s: the same initial weights and data order for every run of a comparison.
        model: ``DigitsCNN``'s arguments (``{"channels": 128, "hidden": 256}``: a step's compute grows with
            its samples, as it must for batch balancing to show).
        slowdown: ``{rank: factor}``: those ranks take ``factor`` times their compute time
            (:class:`~lightning_dist.testing.Slowdown`, for experiments only).
        log_every_n_steps: how often rank zero logs (1: every step's metrics).
        callbacks: more callbacks.
        start_method: ``"fork"`` (what ``ring_ddp_notebook`` uses) or another of RingDDPStrategy's.
        **strategy_kwargs: ``RingDDPStrategy``'s (``algorithm``, ``compressor``, ``hetero``, ``overlap``...).
    """
    save_dir = _fresh(save_dir)
    pl.seed_everything(seed, verbose=False)
    strategy_kwargs.setdefault("timeout", timedelta(seconds=TIMEOUT_S))
    strategy = RingDDPStrategy(start_method=start_method, **strategy_kwargs)
    logger = JsonlLogger(save_dir)
    # the command's own per-rank perf settings: above all one share of the cores per rank (forked ranks otherwise
    # keep the notebook's thread count each and contend, which a timeline or a speed measurement must not show)
    extra: list[Callback] = [ApplyPerfCallback(PerfConfig(warn=False), devices), StepTimeline(save_dir), *callbacks]
    if slowdown:
        extra.append(Slowdown(slowdown))
    config = {"name": name, "devices": devices, "epochs": epochs, "batch_size": batch_size,
              "limit_train_batches": limit_train_batches, "seed": seed, "model": model or {},
              "slowdown": slowdown or {}, "strategy": {k: repr(v) for k, v in strategy_kwargs.items()}}
    trainer = quiet_trainer(
        devices=devices, strategy=strategy, max_epochs=epochs, limit_train_batches=limit_train_batches,
        log_every_n_steps=log_every_n_steps, logger=logger, callbacks=[*extra, summary_callback(save_dir, config)],
        default_root_dir=save_dir,
    )
    started = time.perf_counter()
    trainer.fit(DigitsCNN(**(model or {})), DigitsDataModule(batch_size=batch_size, seed=seed))
    return _read(name, save_dir, logger.records(), time.perf_counter() - started)


def compose_config(overrides: Sequence[str] = ()) -> Any:
    """``lightning-dist-train``'s config with these overrides (Hydra's compose API), checked against its schema."""
    register_configs()
    with initialize_config_module("lightning_dist.conf", version_base="1.3"):
        cfg = compose("config", overrides=complete_overrides(list(overrides)))
    validate(cfg)
    return cfg


def fit_config(name: str, save_dir: str | os.PathLike, overrides: Sequence[str] = (), *,
               callbacks: Sequence[Callback] = (), timeline: bool = True) -> Run:
    """Train as ``lightning-dist-train <overrides>`` would, in this process's ranks, writing into ``save_dir``.

    The config is composed with Hydra's compose API and run by :func:`lightning_dist.train.run`: the same
    model, data, strategy, compressor, callbacks, checkpoint choice (``ckpt_path=``), ``csv/metrics.csv`` and
    ``summary.json`` as the command.
    Its default ``strategy.start_method=fork`` is the notebook launcher. ``callbacks`` are added to the
    command's, and a :class:`StepTimeline` unless ``timeline=False``.
    """
    cfg = compose_config(overrides)
    save_dir = _fresh(save_dir)
    started = time.perf_counter()
    run(cfg, save_dir, extra_callbacks=[*([StepTimeline(save_dir)] if timeline else []), *callbacks], verbose=False)
    wall_s = time.perf_counter() - started
    return _read(name, save_dir, read_csv_metrics(os.path.join(save_dir, "csv", "metrics.csv")), wall_s)


def load_run(name: str, save_dir: str | os.PathLike) -> Run:
    """A finished run read back from its directory (either kind), e.g. in a later session."""
    save_dir = os.fspath(save_dir)
    jsonl, csv_path = os.path.join(save_dir, "metrics.jsonl"), os.path.join(save_dir, "csv", "metrics.csv")
    metrics = read_jsonl(jsonl) if os.path.exists(jsonl) else read_csv_metrics(csv_path)
    return _read(name, save_dir, metrics, 0.0)
