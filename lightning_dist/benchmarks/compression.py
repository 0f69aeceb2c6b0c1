"""Gradient-compression benchmark: every compressor of :mod:`lightning_dist.compression` under
``RingDDPStrategy``, side by side with PyTorch's own DDP comm hooks (fp16 and PowerSGD) as the peer
reference: what each costs in accuracy, what it saves in bytes, and what it does to the step time.

Run ``python -m lightning_dist.benchmarks.compression`` (about nine minutes on a 2-core machine); ``--quick``
is a smoke run (a few configurations, one seed, a few steps); ``--workloads digits`` runs one workload,
``--configs dense topk1%`` some configurations.

Workloads (2 CPU ranks, gloo):

- ``digits``: the default training job: ``DigitsCNN`` (22 k parameters, Adam, lr 3e-3) on
  ``DigitsDataModule`` (batch 32 per rank, the job's train/validation split), 8 epochs (184 steps),
  validated after every epoch; seeds 0, 1, 2. Quality: the final ``val/acc`` over the 360 validation
  digits (one point of accuracy is ~4 of them), and ``val/loss``.
- ``digits30``: the same job trained 30 epochs (690 steps), ``dense``, ``topk1%`` and ``topk1%-noEF`` only:
  whether error feedback pays off once each coordinate has had several turns on the wire.
- ``mlp``: ``WideMLP`` (4.3 M parameters, SGD + momentum, ``lr=0.05``) on ``SyntheticDataModule`` (batch 16
  per rank), ``bucket_cap_mb=4`` for every strategy (5 buckets), 200 steps; seeds 0, 1, 2. It has no
  validation set: quality is the training loss at the fixed step, the mean over the last 10 steps of the
  two ranks' mean batch loss. At WideMLP's default ``lr=0.01`` 200 steps take the loss only from 2.303 to
  ~2.25 and every configuration but top-k ended within 0.001 of dense (no signal); at 0.05 it falls to
  ~1.2 (single-process check, global batch 32).

Configurations. ``dense`` is ring_ddp without compression (the reference every ratio is taken against);
``fp16``, ``bf16``, ``int8``, ``topk1%`` (``ratio=0.01``, bf16 values, error feedback), ``topk1%-noEF``
(the same without error feedback), ``threshold`` (``threshold=0.1``, ``max_ratio=0.05``, error feedback),
``powersgd-r1`` and ``powersgd-r2`` (error feedback, warm start, ``start_step=2``) are ``RingDDPStrategy(compressor=
build_compressor(...))`` with the library's defaults otherwise; the compressors' random seeds (int8's
rounding, PowerSGD's first factors) follow the run's seed. The threshold is on the rank's weighted gradient
(its half of the step's mean gradient); 0.1 was chosen on this model because it sends about as many bytes
as ``topk1%`` (~65x fewer than dense): from 1e-3 to 0.02 the ``max_ratio`` cap of 5% binds on most steps
(13-18x), 0.05 gives ~33x. The PyTorch peers, ``torch-fp16``, ``torch-powersgd-r1`` and
``torch-powersgd-r2``, are Lightning's stock ``DDPStrategy`` with ``default_hooks.fp16_compress_hook`` and
``powerSGD_hook.powerSGD_hook`` (``PowerSGDState(process_group=None, matrix_approximation_rank=r,
start_powerSGD_iter=2, use_error_feedback=True, warm_start=True, random_seed=seed)``; torch refuses
``start_powerSGD_iter <= 1`` with error feedback or warm start, so its first 2 steps are dense fp32).
Lightning registers comm hooks only on CUDA and drops them silently on CPU, so
:class:`TorchHookDDPStrategy` overrides ``_register_ddp_hooks`` to register them on CPU too. torch's
PowerSGD hook issues its second and third all-reduces from completion callbacks, on gloo's threads: with
more than one bucket in flight (mlp's 5) they reach the wire in a different order on each rank and gloo
aborts with a collective mismatch, so the wrapper waits for each PowerSGD bucket before handing the next
one over: on mlp the torch PowerSGD peer does not overlap communication with backward (digits has a single
bucket, which nothing could overlap anyway). The fp16 hook issues its one all-reduce from the hook itself
and runs unchanged.

Tuning, measured on digits (3 seeds each) while writing this benchmark, not re-run by it:

- ``powersgd-r1/r2`` run their first 2 steps dense (``start_step=2``), as torch's hook has to: the same
  protocol and the same bytes as the peer. With ``start_step=0`` (the library's default) they reached
  96.85% and 97.31% at 22.2x and 12.3x, against 97.59% and 97.50% for torch's (which had its 2 dense steps).
- ``topk1%`` with error feedback stays ~5 points under dense whatever was tried: ``clip_norm`` 1.0, 0.3,
  0.1, 0.03, 0.01 gave 92.5-94.9% at 64x; ``value_dtype="fp32"`` 95.7% at 48x; a dense warm-up
  (``start_step`` 23 or 46, one or two epochs) 95.3% and 93.8%, but at 7x and 4x, and no warm-up longer
  than one step leaves the 50x the target asks for in a 184-step run. Without error feedback 96.4%. A
  single-process simulation with independent code (per-layer top-1%, residuals per rank) gives the same
  order, under Adam (EF 91.7%, no EF 96.4%) and under SGD with momentum: on this short, Adam-trained job the
  residual's ~100-step delay (1% per step) costs more than what it recovers.

Method:

1. Each run is one ``Trainer.fit`` on a fresh pair of forked gloo ranks
   (:func:`lightning_dist.testing.run_ranks`, one intra-op thread per rank, a hard deadline per run) in which
   Lightning trains in-process (:func:`lightning_dist.testing.launched_externally`); no logger,
   checkpointing, progress bar or model summary. Every run starts from ``L.seed_everything(seed)``: the
   same initial weights and data order for every configuration of a seed. Runs go round-robin: for each
   seed, every configuration once, so that drift on the machine hits every configuration alike.
2. Bytes: what rank 0 hands to the wire for gradients per optimizer step, the mean over all steps of the
   run (warm-up steps included). Under ring_ddp this is the strategy's own count (``strategy.totals``:
   every collective a compressor issues, a ring all-reduce counted as ``2 (N - 1) / N`` of its payload,
   an all-gather as ``N - 1`` times it, an all-to-all as all parts but one's own). For the torch hooks a
   thin wrapper around the hook counts, per bucket, the all-reduces the hook issues at the same ring rate
   (:func:`lightning_dist.comm.ring_bytes_sent`): fp16, one all-reduce of the bucket at 2 bytes per element;
   PowerSGD, by torch's documented rule (``_should_compress``: a gradient seen as ``n x m`` is compressed
   when ``(n + m) r * min_compression_rate < n m``), three fp32 all-reduces: the uncompressed gradients,
   all ``P`` (``n r`` each), all ``Q`` (``m r`` each); before ``start_powerSGD_iter`` the dense bucket. The
   count is checked against PowerSGD's own ``total_numel_after_compression`` on every compressed bucket
   (``torch_count_mismatches`` in each run's record must be 0). ``dense bytes`` is what the dense fp32 ring
   would send for the same buckets, and ``ratio`` = dense / sent. Small collectives outside the gradient
   path (ring_ddp's per-step control exchange, the validation metrics' sync) are not counted.
3. Step time: rank 0 stamps ``time.perf_counter()`` at every ``on_train_batch_end``; a step is the gap
   between two stamps of one epoch (gaps across an epoch boundary, which hold validation, are dropped), the
   first 10 steps are dropped, a run's step time is the median of its steps, a configuration's the median
   over seeds; ``vs dense`` is the median over seeds of the run's step time over the same seed's dense run.
   ``codec ms`` is rank 0's time per step inside the compressor but outside the wire (ring_ddp only).
4. Summaries per configuration: mean, standard deviation, minimum and maximum over seeds of the quality,
   means of bytes.

Targets (from the issue, judged on digits at 2 ranks, mean accuracy over the seeds):

- ``topk1%`` (error feedback): within 1 point of dense, at >= 50x fewer bytes than dense;
- ``int8``: within 0.5 point of dense, at a ratio >= 3.5;
- ``powersgd-r2``: within 1 point of dense, and no lower than ``torch-powersgd-r2``;
- ``topk1%-noEF`` measurably worse than ``topk1%``: its mean accuracy lower by more than the spread
  (max - min over seeds) of the error-feedback runs.

The error-feedback comparison (and top-k's distance to dense) is also judged on ``digits30`` and, by loss,
on ``mlp``: at 1% per step a coordinate waits ~100 steps for its turn, a 184-step run gives each about two.

Reference figures measured before with torch's hooks on this job: dense 97.6%, fp16 97.6%, PowerSGD r1
96.1%, r2 97.1%.

Outputs in ``--out`` (default ``bench_results/compression/``): ``compression.json`` (``meta`` with the
environment and settings, one record per run in ``runs``, one per workload and configuration in
``records``, and the ``targets``), ``compression.txt`` (the printed table and target lines) and
``compression.png`` (digits: mean accuracy with its min-max range over seeds against bytes per step; mlp:
loss at the fixed step against bytes per step; log x; ring_ddp, dense and the torch peers marked apart).
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Optional, Sequence

import lightning as L
import numpy as np
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy, Strategy
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_dist.benchmarks._common import (
    environment,
    format_table,
    output_dir,
    progress,
    quiet_lightning,
    step_times,
    summarize,
    write_results,
)
from lightning_dist.comm import ring_bytes_sent
from lightning_dist.compression import build_compressor
from lightning_dist.examples import DigitsCNN, DigitsDataModule, SyntheticDataModule, WideMLP
from lightning_dist.strategy import RingDDPStrategy
from lightning_dist.testing import RanksFailed, launched_externally, run_ranks

WORLD_SIZE = 2
COLLECTIVE_TIMEOUT_S = 120.0  # a hung collective fails the run after this long instead of hanging it
TORCH_POWERSGD_START_ITER = 2  # torch's minimum with error feedback or warm start
LOSS_WINDOW = 10  # mlp: the loss at the fixed step is the mean over this many last steps
MLP_LR = 0.05  # WideMLP's default 0.01 barely moves the loss in 200 steps (2.303 -> 2.25): no signal
QUICK_DIGITS_BATCHES, QUICK_MLP_STEPS, QUICK_WARMUP = 12, 12, 3


@dataclass(frozen=True)
class Config:
    """One configuration: a ring_ddp compressor (``compressor``: build_compressor's arguments) or, with
    ``torch_hook`` set, Lightning's stock DDPStrategy with one of torch's comm hooks."""

    label: str
    compressor: Optional[dict[str, Any]] = None  # None with torch_hook None: ring_ddp, no compression
    torch_hook: Optional[str] = None  # "fp16" or "powersgd"
    torch_rank: int = 0  # PowerSGD's matrix_approximation_rank

    @property
    def is_torch(self) -> bool:
        return self.torch_hook is not None

    def compressor_kwargs(self, seed: int) -> dict[str, Any]:
        """build_compressor's arguments for this run: the compressor's random seed follows the run's."""
        kwargs = dict(self.compressor or {"name": "none"})
        if kwargs["name"] in ("int8", "powersgd"):
            kwargs.setdefault("seed", seed)
        return kwargs

    def describe(self) -> str:
        if self.torch_hook == "fp16":
            return "torch fp16_compress_hook"
        if self.torch_hook == "powersgd":
            return f"torch powerSGD_hook(rank={self.torch_rank}, start_iter={TORCH_POWERSGD_START_ITER})+ef"
        kwargs = self.compressor_kwargs(0)
        start = kwargs.get("start_step", 0)
        return build_compressor(**kwargs).describe() + (f", start_step={start}" if start else "")


@dataclass(frozen=True)
class Workload:
    """A model, its data, how long each run trains and the configurations measured on it."""

    name: str
    model: Callable[[], L.LightningModule]
    data: Callable[[], L.LightningDataModule]
    batch_size: int  # per rank
    bucket_cap_mb: Optional[float]  # every strategy alike; None: DDP's default (25)
    epochs: Optional[int]  # train this many epochs (validating after each) ...
    steps: Optional[int]  # ... or this many optimizer steps
    seeds: int  # seeds 0 .. seeds - 1 (--seeds overrides)
    warmup: int  # leading steps dropped from the step time
    deadline_s: float  # one run's hard deadline
    quality: str  # "val_acc" (higher is better) or "loss" (lower is better)
    configs: tuple[Config, ...]
    quick_configs: tuple[str, ...]
    description: str

    def config(self, label: str) -> Config:
        for config in self.configs:
            if config.label == label:
                return config
        raise KeyError(f"{self.name} has no configuration {label!r}; it has {[c.label for c in self.configs]}")


DENSE = "dense"
TOPK = {"name": "topk", "ratio": 0.01}
THRESHOLD = {"name": "threshold", "threshold": 0.1, "max_ratio": 0.05}

CONFIGS = {c.label: c for c in (
    Config(DENSE),
    Config("fp16", {"name": "fp16"}),
    Config("bf16", {"name": "bf16"}),
    Config("int8", {"name": "int8"}),
    Config("topk1%", TOPK),
    Config("topk1%-noEF", {**TOPK, "error_feedback": False}),
    Config("threshold", THRESHOLD),
    # 2 dense steps first, as torch's hook must (start_powerSGD_iter=2): the same protocol, the same bytes
    Config("powersgd-r1", {"name": "powersgd", "rank": 1, "start_step": TORCH_POWERSGD_START_ITER}),
    Config("powersgd-r2", {"name": "powersgd", "rank": 2, "start_step": TORCH_POWERSGD_START_ITER}),
    Config("torch-fp16", torch_hook="fp16"),
    Config("torch-powersgd-r1", torch_hook="powersgd", torch_rank=1),
    Config("torch-powersgd-r2", torch_hook="powersgd", torch_rank=2),
)}


def _configs(*labels: str) -> tuple[Config, ...]:
    return tuple(CONFIGS[label] for label in labels)


WORKLOADS = {
    "digits": Workload(
        "digits", DigitsCNN, lambda: DigitsDataModule(batch_size=32), batch_size=32, bucket_cap_mb=None,
        epochs=8, steps=None, seeds=3, warmup=10, deadline_s=120.0, quality="val_acc",
        configs=_configs(DENSE, "fp16", "bf16", "int8", "topk1%", "topk1%-noEF", "threshold", "powersgd-r1",
                         "powersgd-r2", "torch-fp16", "torch-powersgd-r1", "torch-powersgd-r2"),
        quick_configs=(DENSE, "int8", "topk1%", "powersgd-r2", "torch-powersgd-r2"),
        description="DigitsCNN 22k params, Adam 3e-3, batch 32/rank, 8 epochs",
    ),
    # the same job trained 30 epochs (690 steps): what error feedback needs to pay off at 1% per step
    "digits30": Workload(
        "digits30", DigitsCNN, lambda: DigitsDataModule(batch_size=32), batch_size=32, bucket_cap_mb=None,
        epochs=30, steps=None, seeds=3, warmup=10, deadline_s=300.0, quality="val_acc",
        configs=_configs(DENSE, "topk1%", "topk1%-noEF"),
        quick_configs=(),  # --quick leaves it out
        description="digits, 30 epochs instead of 8 (690 steps)",
    ),
    "mlp": Workload(
        "mlp", lambda: WideMLP(lr=MLP_LR), lambda: SyntheticDataModule(batch_size=16), batch_size=16, bucket_cap_mb=4,
        epochs=None, steps=200, seeds=3, warmup=10, deadline_s=180.0, quality="loss",
        configs=_configs(DENSE, "fp16", "int8", "topk1%", "topk1%-noEF", "powersgd-r2", "torch-fp16",
                         "torch-powersgd-r2"),
        quick_configs=(DENSE, "topk1%", "torch-fp16"),
        description=f"WideMLP 4.3M params, SGD+momentum lr {MLP_LR}, batch 16/rank, 5 buckets, 200 steps",
    ),
}


# ---- PyTorch's hooks, on CPU, with their bytes counted ---------------------------------------------------

@dataclass
class HookMeter:
    """The state of :func:`counting_hook`: torch's hook and its state, and the bytes its all-reduces carry."""

    hook: Callable[..., Any]
    state: Any  # the torch hook's own state (None: the default group; a PowerSGDState)
    kind: str  # "fp16" or "powersgd"
    totals: dict[str, float] = field(default_factory=lambda: {"bytes_sent": 0.0, "dense_bytes": 0.0})
    checked: int = 0  # compressed PowerSGD buckets whose count was checked against torch's own
    mismatches: int = 0  # ... and disagreed (must stay 0)


def powersgd_allreduce_numels(shapes: Sequence[torch.Size], rank: int, min_compression_rate: float
                              ) -> tuple[int, int, int]:
    """Elements of PowerSGD's three all-reduces for a bucket of gradients with these shapes, by torch's rule
    (``powerSGD_hook._should_compress``): (uncompressed gradients, all P, all Q)."""
    uncompressed = ps = qs = 0
    for shape in shapes:
        n = shape[0] if len(shape) else 1
        m = math.prod(shape) // n if n else 0
        r = min(n, m, rank)
        if (n + m) * r * min_compression_rate < n * m:
            ps, qs = ps + n * r, qs + m * r
        else:
            uncompressed += n * m
    return uncompressed, ps, qs


def counting_hook(meter, bucket):  # no annotations: DDP checks them, and they are strings here
    """Count what torch's hook will all-reduce for this bucket (at the ring's rate), then run it."""
    buffer = bucket.buffer()
    n, rank = dist.get_world_size(), dist.get_rank()
    meter.totals["dense_bytes"] += ring_bytes_sent(buffer.numel(), n, rank, 4)
    if meter.kind == "fp16":
        meter.totals["bytes_sent"] += ring_bytes_sent(buffer.numel(), n, rank, 2)
        return meter.hook(meter.state, bucket)
    state = meter.state
    if state.iter < state.start_powerSGD_iter:  # the hook's own test: a vanilla all-reduce of the bucket
        meter.totals["bytes_sent"] += ring_bytes_sent(buffer.numel(), n, rank, buffer.element_size())
        return meter.hook(state, bucket)
    parts = powersgd_allreduce_numels([g.shape for g in bucket.gradients()], state.matrix_approximation_rank,
                                      state.min_compression_rate)
    meter.totals["bytes_sent"] += sum(ring_bytes_sent(p, n, rank, buffer.element_size()) for p in parts)
    before = state.total_numel_after_compression
    future = meter.hook(state, bucket)
    meter.checked += 1
    meter.mismatches += int(state.total_numel_after_compression - before != sum(parts))
    # The hook issues its P and Q all-reduces from completion callbacks, on gloo's threads: with several buckets
    # in flight they reach the wire in a different order on each rank and gloo aborts (a collective mismatch).
    # Waiting here keeps one bucket in flight at a time.
    future.wait()
    return future


class TorchHookDDPStrategy(DDPStrategy):
    """Lightning's stock DDPStrategy with a torch comm hook that is registered on CPU too (Lightning's own
    ``_register_ddp_hooks`` registers hooks only on CUDA and drops them silently elsewhere)."""

    def __init__(self, meter: HookMeter, **kwargs: Any) -> None:
        super().__init__(ddp_comm_state=meter, ddp_comm_hook=counting_hook, **kwargs)
        self.meter = meter

    @property
    def totals(self) -> dict[str, float]:
        return self.meter.totals

    @override
    def _register_ddp_hooks(self) -> None:
        assert isinstance(self.model, DistributedDataParallel)
        self.model.register_comm_hook(self._ddp_comm_state, self._ddp_comm_hook)


def make_strategy(config: Config, workload: Workload, seed: int) -> Strategy:
    kwargs: dict[str, Any] = {"timeout": timedelta(seconds=COLLECTIVE_TIMEOUT_S)}
    if workload.bucket_cap_mb is not None:
        kwargs["bucket_cap_mb"] = workload.bucket_cap_mb
    if not config.is_torch:
        # popen: inside launched_externally it launches nothing (the ranks exist already)
        return RingDDPStrategy(start_method="popen", compressor=build_compressor(**config.compressor_kwargs(seed)),
                               **kwargs)
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if config.torch_hook == "fp16":
        meter = HookMeter(default_hooks.fp16_compress_hook, None, "fp16")
    else:
        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=config.torch_rank,
            start_powerSGD_iter=TORCH_POWERSGD_START_ITER, use_error_feedback=True, warm_start=True,
            random_seed=seed)
        meter = HookMeter(powerSGD_hook.powerSGD_hook, state, "powersgd")
    return TorchHookDDPStrategy(meter, start_method="popen", **kwargs)


# ---- one run ---------------------------------------------------------------------------------------------

class RunRecorder(Callback):
    """Per training batch: the time, the epoch and this rank's batch loss; after each validation, val/acc."""

    def __init__(self) -> None:
        self.ends: list[float] = []
        self.epochs: list[int] = []
        self.losses: list[float] = []
        self.val_acc: list[float] = []

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, *args: Any
                           ) -> None:
        self.ends.append(time.perf_counter())
        self.epochs.append(trainer.current_epoch)
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(float(loss))

    @override
    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking and "val/acc" in trainer.callback_metrics:
            self.val_acc.append(float(trainer.callback_metrics["val/acc"]))


def _fit_on_rank(rank: int, world_size: int, *args: Any) -> dict[str, Any]:
    """Inside a run_ranks rank: one fit (:func:`_fit`), then a garbage collection on this thread.

    The trainer, the DDP model and torch's hook callbacks form reference cycles that hold the process group.
    Collected later, after ``run_ranks`` destroyed the group, the collection may run on one of gloo's threads;
    the group's destructor then joins that very thread and aborts the rank (seen with the PowerSGD hook).
    """
    out = _fit(rank, world_size, *args)
    gc.collect()
    return out


def _fit(rank: int, world_size: int, workload_name: str, label: str, seed: int, quick: bool,
         steps: Optional[int], epochs: Optional[int]) -> dict[str, Any]:
    """One fit, Lightning training in this very process; returns what it measured (plain data)."""
    workload = WORKLOADS[workload_name]
    config = workload.config(label)
    with launched_externally(rank, world_size), quiet_lightning():
        L.seed_everything(seed, verbose=False)
        model, data = workload.model(), workload.data()
        strategy = make_strategy(config, workload, seed)
        recorder = RunRecorder()
        limits: dict[str, Any]
        if workload.epochs is not None:
            limits = {"max_epochs": 1 if quick else (epochs or workload.epochs),
                      "limit_train_batches": QUICK_DIGITS_BATCHES if quick else None}
        else:
            limits = {"max_steps": QUICK_MLP_STEPS if quick else (steps or workload.steps)}
        trainer = L.Trainer(
            accelerator="cpu", devices=world_size, strategy=strategy, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
            callbacks=[recorder], **limits,
        )
        started = time.perf_counter()
        trainer.fit(model, data)
        fit_s = time.perf_counter() - started
        totals = dict(strategy.totals)  # type: ignore[attr-defined]  # both strategies here keep them
        meter = getattr(strategy, "meter", None)
        return {
            "steps": trainer.global_step, "fit_s": fit_s, "ends": recorder.ends, "epochs": recorder.epochs,
            "losses": recorder.losses, "val_acc_curve": recorder.val_acc,
            "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
            "bytes_sent": totals["bytes_sent"], "dense_bytes": totals["dense_bytes"],
            "codec_s": totals.get("codec_s"), "comm_s": totals.get("comm_s"),
            "torch_count_checked": meter.checked if meter else None,
            "torch_count_mismatches": meter.mismatches if meter else None,
        }


def run_once(workload: Workload, config: Config, seed: int, quick: bool, warmup: int,
             steps: Optional[int] = None, epochs: Optional[int] = None) -> dict[str, Any]:
    """One fit on a fresh pair of gloo ranks (hard deadline); the run's record (``error`` set if it failed)."""
    record: dict[str, Any] = {"workload": workload.name, "config": config.label, "seed": seed,
                              "compressor": config.describe(), "torch_peer": config.is_torch, "error": None}
    started = time.perf_counter()
    try:
        ranks = run_ranks(_fit_on_rank, WORLD_SIZE, workload.name, config.label, seed, quick, steps, epochs,
                          deadline_s=workload.deadline_s)
    except RanksFailed as err:
        record.update(error=str(err)[-4000:], wall_s=time.perf_counter() - started)
        return record
    record["wall_s"] = time.perf_counter() - started
    # other processes' load: above the core count, this run's step times include their share
    record["load_1m_at_end"] = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    zero = ranks[0]
    times = step_times(zero["ends"], zero["epochs"], warmup)
    losses = np.mean([r["losses"] for r in ranks], axis=0)  # the two ranks' mean batch loss per step
    steps_done = zero["steps"]
    record.update({
        "steps": steps_done, "fit_s": zero["fit_s"], "timed_steps": len(times),
        "step_median_s": float(np.median(times)) if times else None,
        "step_p25_s": summarize(times)["p25_s"] if times else None,
        "step_p75_s": summarize(times)["p75_s"] if times else None,
        "bytes_per_step": zero["bytes_sent"] / steps_done,
        "dense_bytes_per_step": zero["dense_bytes"] / steps_done,
        "ratio": zero["dense_bytes"] / zero["bytes_sent"] if zero["bytes_sent"] > 0 else None,
        "codec_s_per_step": None if zero["codec_s"] is None else zero["codec_s"] / steps_done,
        "comm_s_per_step": None if zero["comm_s"] is None else zero["comm_s"] / steps_done,
        "val_acc": zero["metrics"].get("val/acc"), "val_loss": zero["metrics"].get("val/loss"),
        "val_acc_curve": zero["val_acc_curve"],
        "loss_end": float(np.mean(losses[-LOSS_WINDOW:])), "loss_window": min(LOSS_WINDOW, len(losses)),
        "loss_curve": [float(x) for x in losses],
        "torch_count_checked": zero["torch_count_checked"],
        "torch_count_mismatches": zero["torch_count_mismatches"],
    })
    return record


# ---- summaries and targets -------------------------------------------------------------------------------

def quality_of(record: dict[str, Any], quality: str) -> Optional[float]:
    return record.get("val_acc") if quality == "val_acc" else record.get("loss_end")


def _stats(values: Sequence[float]) -> dict[str, Optional[float]]:
    if not values:
        return {"mean": None, "std": None, "min": None, "max": None}
    arr = np.asarray(values, dtype=float)
    return {"mean": float(arr.mean()), "std": float(arr.std(ddof=1)) if len(arr) > 1 else 0.0,
            "min": float(arr.min()), "max": float(arr.max())}


def summarize_configs(runs: Sequence[dict[str, Any]], workload: Workload, labels: Sequence[str]
                      ) -> list[dict[str, Any]]:
    """Per configuration of one workload: quality over seeds (mean, std, min, max), mean bytes per step, the
    compression ratio, the median step time over seeds and its paired ratio to dense."""
    ok = [r for r in runs if r["workload"] == workload.name and r.get("error") is None]
    dense_time = {r["seed"]: r["step_median_s"] for r in ok if r["config"] == DENSE and r["step_median_s"]}
    out = []
    for label in labels:
        mine = [r for r in ok if r["config"] == label]
        failed = sum(1 for r in runs if r["workload"] == workload.name and r["config"] == label and r.get("error"))
        row: dict[str, Any] = {"workload": workload.name, "config": label, "seeds": len(mine), "failed": failed,
                               "compressor": CONFIGS[label].describe(), "torch_peer": CONFIGS[label].is_torch,
                               "quality": workload.quality}
        quality = _stats([q for r in mine if (q := quality_of(r, workload.quality)) is not None])
        row.update({f"quality_{k}": v for k, v in quality.items()})
        if workload.quality == "val_acc":
            row["val_loss_mean"] = _stats([r["val_loss"] for r in mine if r["val_loss"] is not None])["mean"]
        sent = [r["bytes_per_step"] for r in mine]
        dense = [r["dense_bytes_per_step"] for r in mine]
        times = [r["step_median_s"] for r in mine if r["step_median_s"]]
        paired = [r["step_median_s"] / dense_time[r["seed"]] for r in mine
                  if r["step_median_s"] and r["seed"] in dense_time]
        codec = [r["codec_s_per_step"] for r in mine if r["codec_s_per_step"] is not None]
        row.update({
            "bytes_per_step": float(np.mean(sent)) if sent else None,
            "dense_bytes_per_step": float(np.mean(dense)) if dense else None,
            "ratio": float(np.sum(dense) / np.sum(sent)) if sent and np.sum(sent) > 0 else None,
            "step_median_s": float(np.median(times)) if times else None,
            "step_vs_dense": float(np.median(paired)) if paired else None,
            "codec_s_per_step": float(np.median(codec)) if codec else None,
            "wall_s_mean": float(np.mean([r["wall_s"] for r in mine])) if mine else None,
        })
        out.append(row)
    return out


def judge(summary: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's targets on the digits summary rows (accuracy in [0, 1]; a point is 0.01), and the
    error-feedback comparison repeated on digits30 and mlp. A target whose configurations are missing is
    left out; one whose runs all failed is MISSED."""
    out: list[dict[str, Any]] = []
    for workload in ("digits", "digits30", "mlp"):
        out += _judge_workload(workload, {s["config"]: s for s in summary if s["workload"] == workload})
    return out


def _judge_workload(workload: str, rows: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    point = 0.01
    higher_is_better = workload != "mlp"

    def acc(label: str) -> Optional[float]:
        return rows[label]["quality_mean"] if label in rows else None

    out = []

    def add(name: str, needs: Sequence[str], text: str, check: Callable[[], tuple[bool, str]]) -> None:
        if not all(label in rows for label in needs):
            return
        if any(acc(label) is None for label in needs):
            out.append({"workload": workload, "target": name, "text": text, "met": False,
                        "detail": "no successful run"})
            return
        met, detail = check()
        out.append({"workload": workload, "target": name, "text": text, "met": bool(met), "detail": detail})

    def near_dense(label: str, points: float, min_ratio: float) -> tuple[bool, str]:
        gap = (acc(DENSE) - acc(label)) / point  # points below dense (negative: above)
        ratio = rows[label]["ratio"] or 0.0
        return (gap <= points and ratio >= min_ratio,
                f"{100 * acc(label):.2f}% vs dense {100 * acc(DENSE):.2f}% ({-gap:+.2f} points), ratio {ratio:.1f}x")

    def error_feedback() -> tuple[bool, str]:
        ef, no_ef = rows["topk1%"], rows["topk1%-noEF"]
        spread = ef["quality_max"] - ef["quality_min"]
        lead = ef["quality_mean"] - no_ef["quality_mean"]
        if not higher_is_better:  # a loss: lower is better
            lead = -lead
            return (lead > spread, f"loss EF {ef['quality_mean']:.4f} vs noEF {no_ef['quality_mean']:.4f} "
                                   f"(EF lower by {lead:+.4f}; EF seed spread {spread:.4f})")
        return (lead > spread, f"EF {100 * ef['quality_mean']:.2f}% vs noEF {100 * no_ef['quality_mean']:.2f}% "
                               f"(EF ahead by {100 * lead:+.2f} points; EF seed spread {100 * spread:.2f})")

    if higher_is_better:
        add("topk1%", (DENSE, "topk1%"), f"{workload} topk1% (EF) within 1 point of dense at >= 50x fewer bytes",
            lambda: near_dense("topk1%", 1.0, 50.0))
    if workload == "digits":
        add("int8", (DENSE, "int8"), "digits int8 within 0.5 point of dense at a ratio >= 3.5",
            lambda: near_dense("int8", 0.5, 3.5))

        def powersgd() -> tuple[bool, str]:
            close, detail = near_dense("powersgd-r2", 1.0, 0.0)
            peer = acc("torch-powersgd-r2")
            return (close and acc("powersgd-r2") >= peer,
                    f"{detail}; torch-powersgd-r2 {100 * peer:.2f}% ({100 * (acc('powersgd-r2') - peer):+.2f} points)")

        add("powersgd-r2", (DENSE, "powersgd-r2", "torch-powersgd-r2"),
            "digits powersgd-r2 within 1 point of dense and no lower than torch-powersgd-r2", powersgd)
    add("topk1%-noEF", ("topk1%", "topk1%-noEF"),
        f"{workload} topk1%-noEF worse than topk1% (EF) by more than the EF runs' seed spread", error_feedback)
    return out


# ---- output ----------------------------------------------------------------------------------------------

def _kib(nbytes: Optional[float]) -> str:
    return "-" if nbytes is None else f"{nbytes / 1024:.1f}"


def _ms(seconds: Optional[float]) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.2f}"


def table(summary: Sequence[dict[str, Any]]) -> str:
    rows = []
    for s in summary:
        if s["quality_mean"] is None:
            quality = spread = "-"
        elif s["quality"] == "val_acc":
            quality = f"acc {100 * s['quality_mean']:.2f}%"
            spread = f"{100 * s['quality_std']:.2f} [{100 * s['quality_min']:.1f}, {100 * s['quality_max']:.1f}]"
        else:
            quality = f"loss {s['quality_mean']:.4f}"
            spread = f"{s['quality_std']:.4f} [{s['quality_min']:.4f}, {s['quality_max']:.4f}]"
        val_loss = s.get("val_loss_mean")
        rows.append([
            s["workload"], s["config"], s["compressor"], f"{s['seeds']}" + (f" ({s['failed']} failed)" if s["failed"]
                                                                          else ""),
            quality, spread, "-" if val_loss is None else f"{val_loss:.4f}", _kib(s["bytes_per_step"]),
            _kib(s["dense_bytes_per_step"]), "-" if s["ratio"] is None else f"{s['ratio']:.1f}x",
            _ms(s["step_median_s"]), "-" if s["step_vs_dense"] is None else f"{s['step_vs_dense']:.2f}x",
            _ms(s["codec_s_per_step"]), "-" if s["wall_s_mean"] is None else f"{s['wall_s_mean']:.1f}",
        ])
    headers = ["workload", "config", "compressor", "seeds", "quality (mean)", "std [min, max]", "val loss",
               "KiB/step", "dense KiB/step", "ratio", "step ms", "vs dense", "codec ms", "run s"]
    return format_table(headers, rows)


def target_lines(targets: Sequence[dict[str, Any]]) -> list[str]:
    return [f"target {t['text']}: {'MET' if t['met'] else 'MISSED'} ({t['detail']})" for t in targets]


def plot(summary: Sequence[dict[str, Any]], path: os.PathLike) -> os.PathLike:
    """One panel per workload: quality (mean, min-max over seeds) against bytes per step, log x."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # Agg: no display, no pyplot global state
    from matplotlib.figure import Figure

    names = list(dict.fromkeys(s["workload"] for s in summary))
    fig = Figure(figsize=(6.8 * len(names), 5.2), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(names), squeeze=False)[0]
    for ax, name in zip(axes, names):
        rows = [s for s in summary if s["workload"] == name and s["quality_mean"] is not None]
        scale = 100.0 if rows and rows[0]["quality"] == "val_acc" else 1.0
        labelled: dict[tuple[bool, float], int] = {}  # labels at the same bytes: stacked, torch's on the left
        for s in rows:
            x = s["bytes_per_step"] / 1024
            y = scale * s["quality_mean"]
            err = [[y - scale * s["quality_min"]], [scale * s["quality_max"] - y]]
            if s["config"] == DENSE:
                style = {"marker": "*", "ms": 14, "color": "black", "label": "dense (ring_ddp)"}
            elif s["torch_peer"]:
                style = {"marker": "s", "ms": 8, "mfc": "none", "mew": 1.6, "color": "tab:red",
                         "label": "torch hook (peer)"}
            else:
                style = {"marker": "o", "ms": 7, "color": "tab:blue", "label": "ring_ddp compressor"}
            ax.errorbar([x], [y], yerr=err, capsize=3, ls="none", **style)
            spot = (s["torch_peer"], round(math.log10(x), 2))
            stack = labelled[spot] = labelled.get(spot, -1) + 1
            ax.annotate(s["config"], (x, y), textcoords="offset points", fontsize="x-small",
                        xytext=(-6, -11 - 9 * stack) if s["torch_peer"] else (6, 4 + 9 * stack),
                        ha="right" if s["torch_peer"] else "left", color=style["color"])
        dense = next((s for s in rows if s["config"] == DENSE), None)
        if dense is not None and scale == 100.0:
            ax.axhline(100 * dense["quality_mean"], color="gray", lw=0.8)
            ax.axhline(100 * dense["quality_mean"] - 1, color="gray", lw=0.8, ls="--", label="dense - 1 point")
        handles, labels = ax.get_legend_handles_labels()
        unique = dict(zip(labels, handles))
        ax.legend(unique.values(), unique.keys(), fontsize="x-small")
        ax.set_xscale("log")
        ax.set_xlabel("gradient bytes sent per step by rank 0, KiB (log)")
        ax.set_ylabel("final val accuracy, % (mean, min-max over seeds)" if scale == 100.0
                      else f"train loss at the last step (mean of last {LOSS_WINDOW}; min-max over seeds)")
        ax.set_title(f"{name}: {WORKLOADS[name].description}", fontsize="small")
        ax.grid(alpha=0.3, which="both")
    fig.suptitle(f"{WORLD_SIZE} CPU ranks, gloo: gradient compression, quality against bytes")
    fig.savefig(path, dpi=110)
    return path


# ---- command line ------------------------------------------------------------------------------------------

def _parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m lightning_dist.benchmarks.compression",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", nargs="+", choices=sorted(WORKLOADS), default=list(WORKLOADS),
                        help="which workloads to run (default: all)")
    parser.add_argument("--configs", nargs="+", default=None, choices=list(CONFIGS),
                        help="only these configurations (dense is always added: ratios are taken against it)")
    parser.add_argument("--seeds", type=int, default=None,
                        help="seeds per configuration, 0..N-1 (default: the workload's, 1 with --quick)")
    parser.add_argument("--epochs", type=int, default=None, help="digits: epochs per run (default 8)")
    parser.add_argument("--steps", type=int, default=None, help="mlp: optimizer steps per run (default 200)")
    parser.add_argument("--quick", action="store_true",
                        help=f"smoke run: a few configurations, 1 seed, {QUICK_DIGITS_BATCHES} digits batches and "
                             f"{QUICK_MLP_STEPS} mlp steps")
    parser.add_argument("--out", default=None, help="output directory (default bench_results/compression/)")
    args = parser.parse_args(argv)
    for name, value in (("--seeds", args.seeds), ("--epochs", args.epochs), ("--steps", args.steps)):
        if value is not None and value < 1:
            parser.error(f"{name} {value}: need at least 1.")
    if args.steps is not None and args.steps < WORKLOADS["mlp"].warmup + 3:
        parser.error(f"--steps {args.steps} leaves fewer than 3 timed steps; use --steps >= "
                     f"{WORKLOADS['mlp'].warmup + 3}.")
    if args.quick:
        args.seeds = args.seeds or 1
    return args


def _labels(workload: Workload, args: argparse.Namespace) -> list[str]:
    labels = list(workload.quick_configs) if args.quick else [c.label for c in workload.configs]
    if args.configs:
        labels = [label for label in labels if label in args.configs or label == DENSE]
    return labels


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    """Run the benchmark, print the table and the verdicts, write JSON/TXT/PNG; return the JSON payload."""
    args = _parse_args(argv)
    out = output_dir(args.out, "compression")
    runs: list[dict[str, Any]] = []
    summary: list[dict[str, Any]] = []
    meta_workloads: dict[str, Any] = {}
    start = time.perf_counter()
    with quiet_lightning():
        for name in args.workloads:
            workload = WORKLOADS[name]
            labels = _labels(workload, args)
            if not labels:  # a workload --quick leaves out
                continue
            seeds = list(range(args.seeds or workload.seeds))
            warmup = QUICK_WARMUP if args.quick else workload.warmup
            length = (f"{QUICK_DIGITS_BATCHES} batches" if args.quick and workload.epochs
                      else f"{QUICK_MLP_STEPS} steps" if args.quick
                      else f"{args.epochs or workload.epochs} epochs" if workload.epochs
                      else f"{args.steps or workload.steps} steps")
            meta_workloads[name] = {"description": workload.description, "configs": labels, "seeds": seeds,
                                    "length": length, "batch_size": workload.batch_size,
                                    "bucket_cap_mb": workload.bucket_cap_mb, "warmup": warmup,
                                    "quality": workload.quality,
                                    "compressors": {label: CONFIGS[label].describe() for label in labels}}
            progress(f"[compression] {name}: {len(seeds)} seeds x {len(labels)} configs ({', '.join(labels)}), "
                     f"{length} per run")
            mine: list[dict[str, Any]] = []
            for seed in seeds:
                for label in labels:
                    record = run_once(workload, CONFIGS[label], seed, args.quick, warmup, args.steps, args.epochs)
                    mine.append(record)
                    if record["error"]:
                        progress(f"  {name} seed {seed} {label:<18} FAILED after {record['wall_s']:.0f}s: "
                                 f"{record['error'].splitlines()[0]}")
                        continue
                    q = quality_of(record, workload.quality)
                    shown = f"acc {100 * q:6.2f}%" if workload.quality == "val_acc" else f"loss {q:.4f}"
                    progress(f"  {name} seed {seed} {label:<18} {shown}  {record['bytes_per_step'] / 1024:9.1f} "
                             f"KiB/step ({record['ratio']:.1f}x)  {_ms(record['step_median_s'])} ms/step  "
                             f"(run {record['wall_s']:.1f}s)")
            runs += mine
            summary += summarize_configs(mine, workload, labels)
    total_s = time.perf_counter() - start
    progress(f"[compression] {len(runs)} runs in {total_s:.0f}s")

    targets = judge(summary)
    text = table(summary) + "\n\n" + "\n".join(target_lines(targets))
    print(text)
    payload = {
        "meta": {**environment(), "benchmark": "compression", "world_size": WORLD_SIZE, "quick": args.quick,
                 "workloads": meta_workloads, "torch_powersgd_start_iter": TORCH_POWERSGD_START_ITER,
                 "loss_window": LOSS_WINDOW, "total_s": total_s,
                 "loadavg_at_end": os.getloadavg() if hasattr(os, "getloadavg") else None},
        "runs": runs,
        "records": summary,
        "targets": targets,
    }
    write_results(out, "compression", text, payload, lambda path: plot(summary, path))
    return payload


if __name__ == "__main__":
    main()
