"""What each rank measures per optimizer step, and the metrics rank zero logs from every rank's values.

:class:`StepMeter` is the strategy's stopwatch: it stamps the first ``training_step`` of a step, the end of
backward (all bucket Futures done) and the end of the step, and reads the hook's per-step counters
(bytes and seconds inside the transport, communication backward did not hide). Its ``last_step`` values
ride, one step late, on the strategy's per-step exchange (:data:`PER_RANK_SLOTS`), and
:func:`metrics_from` turns every rank's row into the ``dist/*`` metrics that
:class:`~lightning_dist.callbacks.DistMetrics` logs.

``compute_s`` is the step's forward and backward time minus the communication backward waited for
(``exposed_s``): with the overlapping hook the transport runs beside backward, so subtracting all of it
would undercount compute. It is the per-rank speed signal (samples / compute_s) stragglers show up in.

On a GPU the host's clock measures the wrong thing: kernels run asynchronously, so the time to the end of backward is
how long the CPU took to *queue* it (or wherever it happened to block). There ``compute_s`` is device time: a CUDA event
recorded on the current stream at the step's first ``training_step`` and another at the end of backward (after DDP
made the stream wait for every bucket's Future, so the communication backward waited for is inside it: on a GPU
``compute_s`` is forward and backward *including* exposed communication). The events are read one step later, when
they have long completed (reading them at once would wait for the device, a host sync per step): each step's row then
carries the previous step's ``samples`` and ``compute_s`` together, so the speed signal (samples / compute_s) stays
paired. ``comm_s`` and ``exposed_s`` stay host-side (NCCL's Futures complete when the operation is queued: about 0 on a
GPU); ``step_s`` is the host's wall time between steps, which a GPU run's own pace sets.
"""

from __future__ import annotations

import time
from typing import Any, Optional

import torch
from lightning.pytorch.utilities.data import extract_batch_size

from lightning_dist.comm import CommStats
from lightning_dist.comm.stats import TIERS
from lightning_dist.strategy.exchange import StepExchange

# Per-rank slots of the exchange: what each rank measured in the previous step.
PER_RANK_SLOTS = ("samples", "compute_s", "comm_s", "exposed_s", "bytes_sent", "dense_bytes", "codec_s", "step_s",
                  "bytes_intra_host", "bytes_inter_host")


class StepMeter:
    """One rank's per-step measurements and running totals (the strategy owns one)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """A new fit starts counting afresh (the same strategy object may fit twice)."""
        self._step_started: Optional[float] = None  # perf_counter at the first training_step of a step
        self._backward_done: Optional[float] = None
        self._last_step_end: Optional[float] = None
        self._samples = 0  # samples this rank used in the current step
        self._more_compute = 0.0  # compute after the step's exchange (DiLoCo(balance="steps")'s further inner steps)
        # CUDA: this step's (start, end) events, and the previous step's with its samples (read one step later)
        self._events: Optional[list[Any]] = None
        self._pending: Optional[tuple[Any, Any, int, float]] = None
        self.step = 0  # optimizer steps (taken or skipped) since fit started: the same count on every rank
        # this rank's own measurements of the last step, always available, no collective involved
        self.last_step: dict[str, float] = {}
        # every rank's measurements of the step before the last exchange, identical on every rank
        self.step_metrics: dict[str, float] = {}
        self.exchange_step = -1  # ``step`` during the step whose exchange refreshed step_metrics (-1: none)
        # this rank's running totals over the run (for summary.json)
        self.totals: dict[str, float] = {"steps": 0, "bytes_sent": 0.0, "dense_bytes": 0.0, "comm_s": 0.0,
                                         "codec_s": 0.0, "exposed_s": 0.0, "samples": 0.0,
                                         "bytes_intra_host": 0.0, "bytes_inter_host": 0.0}

    def batch_started(self, batch: Any) -> None:
        if self._step_started is None:
            self._step_started = time.perf_counter()
            if _on_cuda(batch):
                self._events = [_record_event()]
        self._samples += _batch_size(batch)

    def backward_done(self) -> None:
        self._backward_done = time.perf_counter()
        if self._events is not None:
            self._events[1:] = [_record_event()]

    def add_compute(self, seconds: float) -> None:
        """Compute this step did after its exchange (a faster worker's further inner steps under
        ``DiLoCo(balance="steps")``): it counts in ``compute_s``, so that the speed measured covers every sample of
        the step, while the wait inside the exchange does not."""
        self._more_compute += seconds

    def exchanged(self, exchange: StepExchange, world_size: int) -> None:
        """Every rank's values arrived on this step's exchange: refresh what the metrics callback logs."""
        self.step_metrics = metrics_from(exchange, world_size)
        self.exchange_step = self.step

    def step_finished(self, stats: CommStats, exposed_s: float) -> None:
        """Record this step's own measurements (the next exchange carries them to every rank)."""
        now = time.perf_counter()
        started = self._step_started or now
        samples = float(self._samples)
        compute_s = max((self._backward_done or now) - started - exposed_s, 0.0) + self._more_compute
        if self._events is not None or self._pending is not None:  # CUDA: the previous step's device time
            samples, compute_s = self._device_compute()
        self.last_step = {
            "samples": samples,
            "compute_s": compute_s,
            "comm_s": stats.seconds,
            "exposed_s": exposed_s,
            "bytes_sent": float(stats.bytes_sent),
            "dense_bytes": float(stats.dense_bytes),
            "codec_s": stats.codec_seconds,
            "step_s": now - (self._last_step_end or started),
            **{f"bytes_{tier}": float(stats.tier_bytes.get(tier, 0)) for tier in TIERS},
        }
        for key, value in (("steps", 1), ("bytes_sent", stats.bytes_sent), ("dense_bytes", stats.dense_bytes),
                           ("comm_s", stats.seconds), ("codec_s", stats.codec_seconds), ("exposed_s", exposed_s),
                           ("samples", self._samples),
                           *((f"bytes_{tier}", stats.tier_bytes.get(tier, 0)) for tier in TIERS)):
            self.totals[key] += value
        self._samples, self._more_compute = 0, 0.0
        self._events = None
        self.step += 1
        self._last_step_end, self._step_started, self._backward_done = now, None, None


    def _device_compute(self) -> tuple[float, float]:
        """CUDA: the previous step's samples and device seconds (0, 0 on the first step), and this step's events kept
        for the next one."""
        samples, seconds = 0.0, 0.0
        if self._pending is not None:
            start, end, count, more = self._pending
            end.synchronize()  # a step old: done already (no wait) unless the host runs more than a step ahead
            samples, seconds = float(count), start.elapsed_time(end) / 1e3 + more
        events = self._events
        self._pending = (events[0], events[1], self._samples, self._more_compute) \
            if events is not None and len(events) == 2 else None
        return samples, seconds


def _on_cuda(batch: Any) -> bool:
    """Whether the batch's first tensor is on a CUDA device (Lightning moved it there before the training step)."""
    if isinstance(batch, torch.Tensor):
        return batch.is_cuda
    if isinstance(batch, dict):
        return any(_on_cuda(v) for v in list(batch.values())[:1])
    if isinstance(batch, (list, tuple)) and batch:
        return _on_cuda(batch[0])
    return False


def _record_event() -> Any:
    event = torch.cuda.Event(enable_timing=True)
    event.record()  # on the current stream, behind every kernel queued so far
    return event


def metrics_from(exchange: StepExchange, world_size: int) -> dict[str, float]:
    """The logged metrics, from the per-rank rows of an exchange (they describe the previous step)."""
    step = exchange.per_rank("rank_step_s")
    if max(step) <= 0:
        return {}  # the first step's exchange carries no previous step
    samples = exchange.per_rank("rank_samples")
    compute = exchange.per_rank("rank_compute_s")
    comm = exchange.per_rank("rank_comm_s")
    exposed = exchange.per_rank("rank_exposed_s")
    sent = exchange.per_rank("rank_bytes_sent")
    dense = exchange.per_rank("rank_dense_bytes")
    codec = exchange.per_rank("rank_codec_s")
    metrics = {
        "dist/step_time_ms": 1e3 * max(step),
        "dist/throughput": sum(samples) / max(step),
        "dist/comm_ms": 1e3 * max(comm),
        "dist/exposed_comm_ms": 1e3 * max(exposed),
        "dist/bytes_sent_per_rank": sum(sent) / world_size,
        "dist/dense_bytes_per_rank": sum(dense) / world_size,
        "dist/compression_ratio": sum(dense) / sum(sent) if sum(sent) > 0 else 1.0,
        "dist/codec_ms": 1e3 * max(codec),
        # every rank's bytes in collectives between hosts / inside one host, summed: the step's traffic per tier
        **{f"dist/bytes_{tier}": sum(exchange.per_rank(f"rank_bytes_{tier}")) for tier in TIERS},
        "dist/straggler_ratio": max(compute) / min(compute) if min(compute) > 0 else 1.0,
    }
    for r in range(world_size):
        metrics[f"dist/rank{r}/compute_ms"] = 1e3 * compute[r]
        metrics[f"dist/rank{r}/comm_ms"] = 1e3 * comm[r]
        metrics[f"dist/rank{r}/exposed_comm_ms"] = 1e3 * exposed[r]
        metrics[f"dist/rank{r}/samples_per_s"] = samples[r] / compute[r] if compute[r] > 0 else 0.0
        metrics[f"dist/rank{r}/samples"] = samples[r]
        metrics[f"dist/rank{r}/bytes_sent"] = sent[r]
        metrics[f"dist/rank{r}/codec_ms"] = 1e3 * codec[r]
    return metrics


def _batch_size(batch: Any) -> int:
    try:
        return int(extract_batch_size(batch))
    except Exception:  # noqa: BLE001 - batches without tensors count as zero samples, not as an error
        return 0
