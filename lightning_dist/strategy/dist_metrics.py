"""Logs RingDDPStrategy's per-step communication and straggler metrics from rank zero.

Every rank measures every step (:attr:`~lightning_dist.strategy.RingFeatures.last_step` holds its own values).
On the steps this callback logs, the strategy carries every rank's values to all ranks on its per-step exchange,
which travels alongside the last gradient bucket (no collective of this callback's own); the callback hands
them to Lightning's loggers from rank zero. The values describe the optimizer step before the logged one.
The strategy adds this callback to the Trainer by itself (not under ``Trainer(barebones=True)``); add it
yourself to change ``log_every_n_steps``. With ``log_every_n_steps=0`` (the Trainer's or this callback's)
nothing is gathered or logged. It is the strategy's own reporting, so it lives beside the strategy (which adds it, and
may not import from the callbacks above it); ``lightning_dist.callbacks`` exports it with the other callbacks.
``DistMetricsCallback``, its name before one naming rule for callbacks (no suffix, as Lightning's ``EarlyStopping``),
still imports, with a ``DeprecationWarning``.

Logged metrics (``r`` is a rank index):

- ``dist/step_time_ms``: the slowest rank's wall time per optimizer step, ms (includes data loading)
- ``dist/throughput``: samples per second over all ranks
- ``dist/comm_ms``: the longest time any rank spent inside gradient all-reduces this step, ms (with the
  overlapping hook most of it runs beside backward)
- ``dist/exposed_comm_ms``: the longest time any rank's backward waited for communication, ms: from the
  moment DDP handed over the last bucket until every bucket was reduced (the whole hook time with
  ``overlap=False``).
  The communication that was not hidden; the figure to tune bucket size and algorithm against
- ``dist/bytes_sent_per_rank``: gradient payload bytes each rank sent, mean over ranks
- ``dist/dense_bytes_per_rank``: what the dense ring would have sent for the same gradients,
  ``2 (N - 1) / N`` x the bucket's bytes (4 per fp32 element), mean over ranks
- ``dist/compression_ratio``: dense bytes over bytes sent (1.0 uncompressed; ~2 with fp16, ~4 with int8)
- ``dist/bytes_inter_host``: the bytes every rank together sent this step in collectives whose group spans hosts:
  under ``topology="two_tier"`` the parts' reductions between hosts; on the flat path, with ranks on 2 or more
  hosts, all of it (an upper bound on what crossed: a ring's edges inside a host are counted too)
- ``dist/bytes_intra_host``: the bytes every rank together sent this step in collectives inside one host
  (two_tier's reduce-scatter and all-gather; everything on the flat path on one host)
- ``dist/codec_ms``: the longest time any rank spent compressing and decompressing this step, ms
- ``dist/straggler_ratio``: slowest rank's compute time over the fastest's (1.0 is balanced)
- ``dist/rank{r}/compute_ms``: rank ``r``'s forward+backward time less its exposed communication, ms
- ``dist/rank{r}/comm_ms``: rank ``r``'s time in all-reduces (includes waiting for slower peers), ms
- ``dist/rank{r}/exposed_comm_ms``: rank ``r``'s communication not hidden behind its backward, ms
- ``dist/rank{r}/samples_per_s``: rank ``r``'s samples over its compute time: its speed
- ``dist/rank{r}/bytes_sent``: rank ``r``'s payload bytes this step
- ``dist/rank{r}/codec_ms``: rank ``r``'s compression and decompression time, ms
"""

from __future__ import annotations

from typing import Any, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_dist._deprecation import renamed
from lightning_dist.strategy.features import features_of


class DistMetrics(Callback):
    """Logs the strategy's ``step_metrics`` every ``log_every_n_steps`` optimizer steps (default: the Trainer's)."""

    def __init__(self, log_every_n_steps: Optional[int] = None) -> None:
        if log_every_n_steps is not None and log_every_n_steps < 0:
            raise ValueError(
                f"log_every_n_steps={log_every_n_steps} must be >= 1, 0 to log nothing, or None for the Trainer's."
            )
        self._every = log_every_n_steps
        self._interval = 0  # the interval in force this fit (the Trainer's when ours is None)
        self._logged = -1
        self._syncs_logged = 0  # DiLoCo: syncs whose sync/* metrics were logged

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._interval = trainer.log_every_n_steps if self._every is None else self._every
        self._logged = -1  # (a fit counts its steps from 0 again)
        features = features_of(trainer.strategy)
        if features is not None:  # ask the strategy to exchange on the steps we log
            features.request_exchange(self._interval, "metrics")
            self._syncs_logged = 0 if features.sync is None else features.sync.report().syncs

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        features = features_of(trainer.strategy)
        if features is None:
            return
        if self._interval > 0:
            self._log_sync(trainer, features)
        fresh = features.exchange_step
        if fresh == self._logged or not features.step_metrics:
            return  # nothing new since the last log
        if self._interval <= 0 or fresh % self._interval:
            return  # an exchange another feature asked for (MemoryMonitor's interval), not one of our steps
        self._logged = fresh
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(features.step_metrics, step=trainer.global_step)

    def _log_sync(self, trainer: pl.Trainer, features: Any) -> None:
        """The sync driver's ``sync/*`` metrics after every sync (DiLoCo's: every H steps), whatever the interval."""
        report = features.sync.report() if features.sync is not None else None
        if report is None or report.syncs == self._syncs_logged or not report.metrics:
            return
        self._syncs_logged = report.syncs
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(dict(report.metrics), step=trainer.global_step)

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """The sync driver's figures of every validation of a fit (DiLoCo's ``sync/validated_global``), in the
        callback metrics and logged, whatever the interval."""
        features = features_of(trainer.strategy)
        if features is None or features.sync is None or trainer.sanity_checking or trainer.state.fn != "fit":
            return
        validation = dict(features.sync.report().validation)
        trainer.callback_metrics.update({k: torch.tensor(v) for k, v in validation.items()})
        if validation and trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(validation, step=trainer.global_step)


__getattr__ = renamed(__name__, {"DistMetricsCallback": DistMetrics})
