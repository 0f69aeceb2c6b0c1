"""Syncing every H steps against syncing every step, on the LM workload: ``python -m lightning_dist.benchmarks.sync``.

``--workload digits`` trains the digits CNN under SGD instead (:data:`DIGITS`; the auto benchmark's second job): the
same methods, curves and timing jobs, the targets still judged as the LM's.

Curves on loopback ranks (:func:`run_curves`) times the step timed on a shaped SimCluster (:func:`run_cluster`) give
loss against wall time (:func:`combine`); ``--scenario streaming`` and ``hetero``: issue 32's (:mod:`._streaming`).
Methods, targets and results: docs/benchmarks.md (``sync``).
"""

from __future__ import annotations

import argparse
import copy
import functools
import itertools
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import lightning as L
import numpy as np
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_dist.benchmarks import _common as bench
from lightning_dist.benchmarks import _streaming as stream
from lightning_dist.benchmarks._cluster import launch_job
from lightning_dist.compression import COMPRESSORS
from lightning_dist.examples import ByteLM, DigitsCNN, DigitsDataModule, StdlibText
from lightning_dist.examples.schedules import SCHEDULES
from lightning_dist.hetero import HeteroBatching
from lightning_dist.simcluster import link_bytes_sent, unavailable
from lightning_dist.strategy import RingDDPStrategy, features_of
from lightning_dist.sync import DiLoCo, OneBitAdam, SyncSettings
from lightning_dist.sync.diloco_fragments import SyncedModel
from lightning_dist.testing import RanksFailed, free_port, launched_externally, quiet_trainer, run_ranks

WORKER_MODULE = "lightning_dist.benchmarks.sync"
# gloo's own all-reduce, what "auto" picks for the full model's 1.9 MB bucket (for --quick's, auto's tree: ~15x slower)
ALGORITHM = "native"
COLLECTIVE_TIMEOUT_S = 300.0  # a dense step at 10 Mbit/s takes seconds; a hang still fails the run
TIMED_STEPS = 6  # the LM's per-step method's timed steps after 2 of warm-up (dense at 10 Mbit/s: ~2.5 s each)
NOSYNC_WARMUP = 5  # steps left out of a no-sync fit's step times (and of the hetero scenario's own speeds)
NOSYNC_EVERY = 10**9  # H beyond any run: no step of it syncs
QUALITY_BOUNDS = {"diloco50": 0.02, "diloco50/int8": 0.025, "onebit-adam": 0.01}  # loss above dense's (issue 43)
ONEBIT_BYTES = 1 / 25  # OneBitAdam: bytes across workers per step after the warm-up, of dense's (issue 42)
ONEBIT_SHAPE, ONEBIT_RATE = "two_tier", 1000.0  # where its step speed-up is judged against top-k's
INT8_BYTES_FACTOR = 3.5  # int8 pseudo-gradients: bytes per inner step <= 1 / (3.5 H) of dense's
TIME_VS_DENSE, TIME_VS_COMPRESSOR = 10.0, 2.0  # at TARGET_RATE
NOSYNC_BOUND = 1.03
TARGET_SHAPE, TARGET_RATE = "flat", 10.0
VALIDATE_METHOD, VALIDATE_SHAPE, VALIDATE_RATE = "diloco10", "flat", 100.0
# what a timing fit's worker writes per rank (and the streaming scenario keeps per rank in its raw records)
TIMING_KEYS = ("ends", "trace", "link_sent", "link_samples", "sync_metrics")


@dataclass(frozen=True)
class Method:
    """One way to train: a per-step compressor, or DiLoCo every ``every`` steps with a pseudo-gradient compressor and,
    where not None, Streaming DiLoCo's settings (passed to :class:`~lightning_dist.sync.DiLoCo` as they are)."""

    label: str
    compressor: Optional[dict] = None  # the per-step gradient's (build_compressor's arguments); None: dense
    every: int = 1  # H; 1: a per-step method
    sync_compressor: Optional[dict] = None  # DiLoCo's pseudo-gradient's; None: dense
    fragments: Optional[int] = None  # DiLoCo(fragments=F): the model synced in F fragments at staggered steps
    delay: Optional[int] = None  # DiLoCo(delay=tau): inner steps a fragment's exchange overlaps before it lands
    mix: Optional[float] = None  # DiLoCo(mix=alpha) for a delayed fragment
    balance: Optional[str] = None  # DiLoCo(balance=...) for workers of different speeds
    warmup: Optional[int] = None  # DiLoCo(warmup=W): the first W steps average the workers after every step
    onebit: bool = False  # OneBitAdam() with its defaults: Adam's momentum compressed after a dense warm-up
    onebit_warmup: Optional[float] = None  # OneBitAdam(warmup=...) where not the default
    final_sync: bool = True  # DiLoCo's meeting after the last step; off in the timing fits (no step's time)
    inner_rate: Optional[str] = None  # DiLoCo(inner_rate=...): the outer step's answer to the inner learning rate
    outer_lr: Optional[float] = None  # DiLoCo(outer_lr=...) where not the default

    @property
    def diloco(self) -> bool:
        return self.every > 1

    @property
    def cycle(self) -> int:
        """Steps between two models every worker agrees on (H under DiLoCo, else 1): a curve is read at multiples of
        it, and a fit with cycles ends at its steps (its final sync), not at the horizon."""
        return self.every

    @property
    def steady(self) -> bool:
        """Every step alike, so one time and one byte count per step hold for the run: no warm-up, whose steps each
        sync (such a method is not timed, and DiLoCo's 1/H bytes bound is not judged on it)."""
        return not self.warmup

    def settings(self) -> Optional[SyncSettings]:
        """The sync settings (None: every step); raises DiLoCo's ValueError for a refused combination."""
        if not self.diloco:
            if not self.onebit:
                return None
            return OneBitAdam() if self.onebit_warmup is None else OneBitAdam(warmup=self.onebit_warmup)
        streaming = {k: v for k in ("fragments", "delay", "mix", "balance", "warmup", "inner_rate", "outer_lr")
                     if (v := getattr(self, k)) is not None}
        return DiLoCo(every=self.every, final_sync=self.final_sync,  # the outer optimizer's defaults
                      compressor=dict(self.sync_compressor) if self.sync_compressor else None, **streaming)

    def strategy(self, topology: str, hetero: Optional[HeteroBatching] = None) -> RingDDPStrategy:
        return RingDDPStrategy(algorithm=ALGORITHM, compressor=dict(self.compressor) if self.compressor else None,
                               sync=self.settings(), topology=topology, hetero=hetero,
                               timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))

    def config(self) -> dict[str, Any]:
        """What the streaming scenario's rows name it by."""
        return {"label": self.label, "every": self.every, "fragments": self.fragments or 1, "delay": self.delay or 0,
                "codec": self.sync_compressor["name"] if self.sync_compressor else None}


TOPK = {"name": "topk", "ratio": 0.01}
INT8 = {"name": "int8"}
METHODS = {m.label: m for m in (
    Method("dense"),
    Method("fp16", compressor={"name": "fp16"}),
    Method("int8", compressor=INT8),
    Method("topk1%", compressor=TOPK),
    Method("powersgd-r2", compressor={"name": "powersgd", "rank": 2}),
    Method("onebit-adam", onebit=True),
    Method("onebit-adam+warmup30", onebit=True, onebit_warmup=0.3),
    *(Method(f"diloco{h}{suffix}", every=h, sync_compressor=codec)
      for h in (10, 50) for suffix, codec in (("", None), ("/int8", INT8), ("/topk1%", TOPK))),
    *(Method(f"diloco50+warmup{w}", every=50, warmup=w) for w in (50, 100)),
    # under a decaying learning rate (issue 52, docs/sync.md): the outer step's answers to the inner rate other than
    # the default's ("rise": every diloco* method above runs it; "none", the default before it, for the table),
    # and a higher outer rate alone and after a warm-up (at outer_lr=1.0 "rise" is "none": the rate is at most 1)
    *(Method(f"diloco50+{rule}", every=50, inner_rate=rule) for rule in ("none", "normalised", "follow", "anneal")),
    Method("diloco50/int8+none", every=50, sync_compressor=INT8, inner_rate="none"),
    Method("diloco50+warmup100+none", every=50, warmup=100, inner_rate="none"),
    Method("diloco50+outer1", every=50, outer_lr=1.0),
    Method("diloco50+warmup100+outer1", every=50, warmup=100, outer_lr=1.0),
)}
DENSE = "dense"
PER_STEP_COMPRESSORS = ("topk1%", "powersgd-r2")
QUICK_METHODS = ("dense", "topk1%", "diloco10")


@dataclass(frozen=True)
class Shape:
    hosts: int
    per_host: int
    topology: str

    @property
    def world(self) -> int:
        return self.hosts * self.per_host


SHAPES = {"flat": Shape(4, 1, "flat"), "two_tier": Shape(2, 2, "two_tier")}
STREAM_SHAPE = "flat"  # the streaming and hetero scenarios': 4 hosts of 1 rank
SCENARIOS = ("methods", "streaming", "hetero")  # --scenario: one of them, or all
HETERO_DEADLINE_S = 600.0  # one heterogeneous fit's (a fit takes about a minute; --run-timeout lowers it)


@dataclass(frozen=True)
class Sizes:
    """The model, its data, the run lengths and the command line's defaults (:data:`FULL`'s and ``--quick``'s; the
    digits job's: :data:`DIGITS` and :data:`DIGITS_QUICK`, whose LM fields nothing reads)."""

    width: int  # ByteLM's d_model
    depth: int  # transformer blocks
    heads: int
    context: int  # bytes per window
    batch_size: int  # windows per rank and step (4 ranks: the global batch is 4x)
    train_bytes: int  # StdlibText's training stream (FULL's 1 MiB is read ~3.2 times in 1,600 steps; without
    # repeats DiLoCo's gap to dense grew: docs/sync.md)
    warmup_steps: int  # ByteLM's linear learning-rate warm-up
    steps: int  # optimizer steps at equal samples (dense DDP's whole curve); a multiple of every H and of eval_every
    horizon: int  # per-step compressors' curves go on to this many steps, to time where they reach dense's final loss
    eval_every: int  # steps between curve points (DiLoCo: the first multiple of H at or above it)
    val_windows: int  # held-out windows per evaluation, spread evenly over the held-out stream
    min_timed_steps: int  # a DiLoCo timing fit's timed cycles: at least 2, and at least this many steps
    shapes: tuple[str, ...]  # --shapes
    rates: tuple[float, ...]  # --rates, Mbit/s
    methods: tuple[str, ...]  # --methods
    nosync_rounds: int  # --nosync-rounds: the no-sync step cost's alternating rounds, each fit of nosync_steps steps
    nosync_steps: int
    run_timeout: float  # --run-timeout: one job's hard deadline, s
    # streaming: --every (H; the reference is part 1's DiLoCo at H), --fragments, --delays (every pair; F divides H)
    stream_every: int
    stream_fragments: tuple[int, ...]
    stream_delays: tuple[int, ...]
    stream_timed_cycles: int  # a streaming timing fit's, after one warm-up cycle
    hetero_sync: tuple[int, int, int]  # hetero: DiLoCo's H, F and tau (F = 5: the 4 does not divide 50)
    hetero_batch: int  # hetero: windows per host and step before balancing (16: finer shares than 8)
    hetero_epoch_steps: int  # hetero: steps per epoch at equal batches
    hetero_epochs: int  # hetero: per fit; every epoch after the first (warm-up, first rebalance) is timed
    own_speed_steps: int  # hetero: the fits that measure each host's own speed
    # --schedule: the learning rate after the warm-up (lightning_dist.examples.schedules), over ``steps`` for every fit
    # (a curve that goes on past them stays at the schedule's last rate): every method at equal samples sees the same
    schedule: str = "constant"
    seed: int = 0  # --seed: the model's initial weights, the samples' order and the held-out windows
    workload: str = "lm"  # --workload: "lm" (ByteLM under AdamW) or "digits" (DigitsCNN under SGD, :func:`workload`)
    timed_steps: int = TIMED_STEPS  # a per-step method's timed steps (after 2 of warm-up)

    def stream_steps(self, every: int) -> int:
        """A streaming timing fit's steps: one warm-up cycle of H = ``every``, then ``stream_timed_cycles``."""
        return every * (1 + self.stream_timed_cycles)

    def hetero(self) -> Sizes:
        """The hetero scenario's: its batch, and a training stream of ``hetero_epoch_steps`` equal batches."""
        return replace(self, batch_size=self.hetero_batch, train_bytes=self.hetero_epoch_steps * stream.STREAM_HOSTS
                       * self.hetero_batch * (self.context + 1))


# Chosen for this 2-core machine (docs/benchmarks.md, sync's workload): 0.47 M parameters, a dense step at 10 Mbit/s
# still spends ~2.3 s on the wire; 1,600 steps: 32 syncs at H = 50 (issue 43: fewer methods rather than fewer syncs).
FULL = Sizes(width=128, depth=2, heads=4, context=64, batch_size=8, train_bytes=1 << 20, warmup_steps=50, steps=1600,
             horizon=2400, eval_every=20, val_windows=256, min_timed_steps=40, shapes=tuple(SHAPES),
             rates=(10.0, 100.0), methods=("dense", "topk1%", "onebit-adam", "diloco10/int8", "diloco50",
                                           "diloco50/int8"), nosync_rounds=10, nosync_steps=200, run_timeout=3600.0,
             stream_every=50, stream_fragments=(1, 5, 10), stream_delays=(0, 1, 5), stream_timed_cycles=5,
             hetero_sync=(50, 5, 1), hetero_batch=16, hetero_epoch_steps=128, hetero_epochs=3, own_speed_steps=60)
QUICK = Sizes(width=32, depth=1, heads=2, context=32, batch_size=8, train_bytes=64 << 10, warmup_steps=5, steps=20,
              horizon=40, eval_every=10, val_windows=64, min_timed_steps=20, shapes=("flat",), rates=(100.0,),
              methods=QUICK_METHODS, nosync_rounds=2, nosync_steps=12, run_timeout=150.0, stream_every=10,
              stream_fragments=(2,), stream_delays=(1,), stream_timed_cycles=2, hetero_sync=(10, 2, 1),
              hetero_batch=8, hetero_epoch_steps=15, hetero_epochs=2, own_speed_steps=40)


# The digits job under SGD (the auto benchmark's second workload): DigitsCNN (22 k parameters, one bucket) at
# DIGITS_LR, SGD with momentum 0.9, 32 images per rank; its held-out loss still falls at step 800 (at 5e-3 it is flat
# from step ~550). A step is ~1/10 of the LM's: its per-step methods are timed over 30 steps, not 6, and its curves
# read every 10 steps (an evaluation of its 360 held-out images costs milliseconds).
DIGITS_LR = 2e-3
DIGITS_METHODS = ("dense", "fp16", "int8", "powersgd-r2", "topk1%", "diloco10/int8", "diloco50", "diloco50/int8")
DIGITS = replace(FULL, workload="digits", batch_size=32, warmup_steps=0, steps=800, horizon=1200, eval_every=10,
                 rates=(10.0, 100.0), methods=DIGITS_METHODS, timed_steps=30)
DIGITS_QUICK = replace(QUICK, workload="digits", batch_size=32, warmup_steps=0, methods=("dense", "int8", "diloco10"))
WORKLOADS = {"lm": (FULL, QUICK), "digits": (DIGITS, DIGITS_QUICK)}  # --workload: (its sizes, --quick's)


def timing_steps(method: Method, sizes: Sizes) -> tuple[int, int]:
    """``(steps, warm-up cycles)`` of a method's timing fit: per-step methods 2 warm-up and ``sizes.timed_steps`` timed
    steps; DiLoCo one warm-up cycle, then whole cycles, at least 2 and at least ``sizes.min_timed_steps`` steps."""
    if not method.diloco:
        return 2 + sizes.timed_steps, 2
    cycles = max(2, math.ceil(sizes.min_timed_steps / method.every))
    return method.every * (1 + cycles), 1


def eval_every(method: Method, sizes: Sizes) -> int:
    """Steps between curve points: ``sizes.eval_every``, under DiLoCo rounded up to a multiple of H (a synced model)."""
    return method.cycle * math.ceil(sizes.eval_every / method.cycle)


# -- one fit (every rank, in a loopback group or under torchrun) -------------------------------------------------------
@functools.cache
def val_batch(sizes: Sizes) -> tuple[torch.Tensor, torch.Tensor]:
    """``sizes.val_windows`` windows of the held-out stream (all of it, every held-out file), evenly spaced; the digits
    job's: its whole held-out split (360 images)."""
    if sizes.workload == "digits":
        digits = DigitsDataModule(batch_size=sizes.batch_size, seed=sizes.seed)
        digits.setup("fit")
        return digits.val_set.tensors
    data = StdlibText(context=sizes.context, batch_size=sizes.batch_size, max_train_bytes=sizes.context + 1,
                      max_val_bytes=None, seed=sizes.seed)
    data.setup("fit")
    windows = data.val_set.windows
    picked = windows[torch.linspace(0, len(windows) - 1, sizes.val_windows).long()].long()
    return picked[:, :-1].contiguous(), picked[:, 1:].contiguous()


def val_loss(module: ByteLM | DigitsCNN, batch: tuple[torch.Tensor, torch.Tensor], chunk: int = 32) -> float:
    """Mean cross-entropy of ``module`` over ``batch`` (the LM's: nats per byte), in chunks, in eval mode (32 windows a
    chunk: the LM's 256 in 0.29 s on one core here, 0.44 s in chunks of 128)."""
    inputs, targets = batch
    was_training = module.training
    module.eval()
    total = 0.0
    with torch.no_grad():
        for start in range(0, len(inputs), chunk):
            part = slice(start, start + chunk)
            total += float(module.loss((inputs[part], targets[part]))) * len(inputs[part])
    module.train(was_training)
    return total / len(inputs)


@dataclass(frozen=True)
class CurveStop:
    """Where a curve ends before its fit's last step: after its first point at or below ``below``, or (``out_of_reach``)
    at the second point in a row from which, going on at its mean slope over the last ``window`` steps, it would still
    be above ``below`` at the fit's last step. Under a constant learning rate after warm-up the loss flattens (a
    slope only falls), so that straight line is optimistic: such a curve would not reach ``below`` in its steps (the
    second point in a row: one point's noise does not end it). A decaying schedule steepens the end: leave it off."""

    below: float
    out_of_reach: bool = False
    window: int = 200

    def reached(self, loss: float) -> bool:
        return loss <= self.below

    def hopeless(self, curve: Sequence[tuple[int, float]], last_step: int) -> bool:
        """Whether ``curve``'s (step, loss) points, its last two each judged on the window before it, say it cannot
        reach ``below`` by ``last_step``."""
        if not self.out_of_reach or len(curve) < 2:
            return False
        return all(self._short(curve[:end], last_step) for end in (len(curve) - 1, len(curve)))

    def _short(self, curve: Sequence[tuple[int, float]], last_step: int) -> bool:
        step, loss = curve[-1]
        earlier = [(s, v) for s, v in curve if s <= step - self.window]
        if not earlier:
            return False
        since, then = earlier[-1]
        slope = (then - loss) / (step - since)  # loss per step, falling
        return loss - max(slope, 0.0) * (last_step - step) > self.below


class FitRecord(Callback):
    """Per step its start, end, epoch, samples and (``link``) the bytes out of the host's link (no more: unlike
    :class:`~._common.StepRecorder`, no per-step reads of the loss or the strategy in the timed steps). With
    ``every``, every rank evaluates its share of ``batch``'s loss (:func:`shared_val_loss`) after every
    ``k every + offset``-th step, timed; ``trace``: DiLoCo's ``sync/*`` metrics at each change;
    ``sample=(first, last)``: a :class:`~._streaming.LinkSampler` over those steps; ``stop``: every rank stops after
    the evaluation where it says so (rank 0's verdict, broadcast: set it, or leave it None, on every rank alike);
    ``agreed``: under DiLoCo also ``theta_global``'s loss at each point."""

    def __init__(self, every: Optional[int] = None, batch: Optional[tuple] = None, link: bool = False,
                 trace: bool = False, sample: Optional[tuple[int, int]] = None, offset: int = 0,
                 stop: Optional[CurveStop] = None, agreed: bool = True) -> None:
        self.every, self.batch, self.link, self.trace, self.sample = every, batch, link, trace, sample
        self.offset = offset  # a delayed sync lands ``offset`` steps after its step
        self.stop, self.agreed = stop, agreed
        self.starts: list[float] = []
        self.ends: list[float] = []
        self.epochs: list[int] = []
        self.samples: list[int] = []
        self.link_sent: list[int] = []
        # (step, loss, theta_global's loss (DiLoCo; else None), step end, evaluation seconds)
        self.curve: list[tuple[int, float, Optional[float], float, float]] = []
        self.sync_trace: list[tuple[int, dict[str, float]]] = []
        self.sampler = stream.LinkSampler(link_bytes_sent) if sample else None

    @override
    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self.starts.append(time.perf_counter())

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           *args: Any) -> None:
        self.ends.append(time.perf_counter())
        self.epochs.append(trainer.current_epoch)
        self.samples.append(len(batch[0]))  # (inputs, targets), a window each
        if self.link:
            self.link_sent.append(link_bytes_sent())
        step = trainer.global_step
        if self.sampler is not None and step in self.sample:
            (self.sampler.start if step == self.sample[0] else self.sampler.stop)()
        features = features_of(trainer.strategy)
        if self.trace and features is not None and features.sync is not None:
            metrics = dict(features.sync.report().metrics)
            if metrics and (not self.sync_trace or self.sync_trace[-1][1] != metrics):
                self.sync_trace.append((step, metrics))
        if self.every and step > self.offset and step % self.every == self.offset % self.every:
            started = time.perf_counter()
            group = features.exchange_group if features is not None else None
            losses = validated_losses(pl_module, features, self.batch, group, self.agreed)
            if trainer.is_global_zero:
                self.curve.append((step, *losses, self.ends[-1], time.perf_counter() - started))
            if self.stop is not None:  # rank 0's verdict, so that every rank stops after the same step
                ends = torch.tensor([float(trainer.is_global_zero and self._ends(trainer.max_steps))])
                if group is not None:
                    dist.broadcast(ends, src=0, group=group)
                trainer.should_stop = trainer.should_stop or bool(ends.item())

    def _ends(self, last_step: int) -> bool:
        assert self.stop is not None
        return (self.stop.reached(self.curve[-1][1])
                or self.stop.hopeless([(point[0], point[1]) for point in self.curve], last_step))

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.sampler is not None:
            self.sampler.stop()  # a fit shorter than the sampled steps


def workload(sizes: Sizes) -> tuple[L.LightningModule, L.LightningDataModule]:
    """The LM and its data at ``sizes`` (the digits job's: DigitsCNN under SGD at :data:`DIGITS_LR`), seeded: every fit
    of the benchmark starts from the same weights and samples."""
    L.seed_everything(sizes.seed, verbose=False)
    if sizes.workload == "digits":
        return (DigitsCNN(lr=DIGITS_LR, optimizer="sgd", schedule=sizes.schedule, warmup_steps=sizes.warmup_steps),
                DigitsDataModule(batch_size=sizes.batch_size, seed=sizes.seed))
    model = ByteLM(width=sizes.width, depth=sizes.depth, heads=sizes.heads, context=sizes.context,
                   warmup_steps=sizes.warmup_steps, schedule=sizes.schedule, schedule_steps=sizes.steps)
    data = StdlibText(context=sizes.context, batch_size=sizes.batch_size, max_train_bytes=sizes.train_bytes,
                      max_val_bytes=sizes.context + 1, seed=sizes.seed)
    return model, data


def fit(method: Method, shape: Shape, sizes: Sizes, steps: int, curve: bool, link: bool = False,
        record: Optional[FitRecord] = None, callbacks: Sequence[Callback] = (),
        hetero: Optional[HeteroBatching] = None, epochs: Optional[int] = None,
        stop: Optional[CurveStop] = None, agreed: bool = True) -> dict[str, Any]:
    """One fit of the workload under ``method`` on this rank (the launcher's process group); this rank's record.
    ``record``: the :class:`FitRecord` (default the curve's, with ``link``, ``stop`` and ``agreed``: then also
    ``theta_global``'s final loss); ``epochs``: that many (``steps`` then -1)."""
    model, data = workload(sizes)
    if record is None:
        record = FitRecord(eval_every(method, sizes) if curve else None, val_batch(sizes) if curve else None, link,
                           offset=method.delay or 0, stop=stop, agreed=agreed)
    trainer = quiet_trainer(devices=shape.per_host, num_nodes=shape.hosts, strategy=method.strategy(shape.topology,
                            hetero), max_steps=steps, max_epochs=epochs if epochs is not None else -1,
                            limit_val_batches=0, callbacks=[record, *callbacks])
    trainer.fit(model, data)
    if record.every and trainer.is_global_zero and (not record.curve or record.curve[-1][0] != trainer.global_step):
        # the model the fit leaves: a delayed sync still in flight after the last step has landed (DiLoCo settles it
        # as training ends), so the last point holds every sync the fit started, as a synchronous sync's does
        record.curve.append((trainer.global_step, val_loss(model, record.batch), None, time.perf_counter(), 0.0))
    features = features_of(trainer.strategy)
    global_loss = None
    if record.every and record.agreed and trainer.is_global_zero and method.diloco:
        global_loss = val_loss(global_model(model, features.sync.loop), record.batch)
    return {"method": method.label, "steps": trainer.global_step, "params": sum(p.numel() for p in model.parameters()),
            "start": record.starts[0] if record.starts else None, "starts": record.starts, "ends": record.ends,
            "epochs": record.epochs, "samples": record.samples, "link_sent": record.link_sent,
            "curve": [list(point) for point in record.curve], "totals": dict(features.totals),
            # DiLoCo's sync/* figures as of the last sync (its bytes per step: this rank's over the fit's steps)
            "sync_metrics": dict(features.sync.report().metrics) if features.sync is not None else {},
            "global_loss": global_loss, "trace": [[step, m] for step, m in record.sync_trace],
            "link_samples": [list(s) for s in record.sampler.samples] if record.sampler is not None else []}


def shared_val_loss(module: ByteLM | DigitsCNN, batch: tuple[torch.Tensor, torch.Tensor],
                    group: Optional[dist.ProcessGroup]) -> float:
    """:func:`val_loss` of a model every rank of ``group`` holds alike, each rank evaluating every world-th window on
    its one core (rank 0 raising its threads instead hung in a forked rank's first parallel product); rank 0's model
    alone, the others waiting, where the models differ (a fingerprint of the parameters and buffers, agreed first)."""
    world = dist.get_world_size(group) if group is not None else 1
    if world == 1:
        return val_loss(module, batch)
    with torch.no_grad():
        fingerprint = torch.stack([t.detach().double().sum() for t in (*module.parameters(), *module.buffers())]).sum()
    spread = torch.stack([fingerprint, -fingerprint])
    dist.all_reduce(spread, op=dist.ReduceOp.MAX, group=group)
    if spread[0] != -spread[1]:
        total = torch.tensor([val_loss(module, batch) if dist.get_rank(group) == 0 else 0.0], dtype=torch.float64)
        dist.broadcast(total, group_src=0, group=group)
        return float(total.item())
    inputs, targets = batch
    mine = slice(dist.get_rank(group), None, world)
    part = (inputs[mine], targets[mine])
    total = torch.tensor([val_loss(module, part) * len(part[0]) if len(part[0]) else 0.0], dtype=torch.float64)
    dist.all_reduce(total, group=group)
    return float(total.item()) / len(inputs)


def validated_losses(module: ByteLM, features: Any, batch: tuple[torch.Tensor, torch.Tensor],
                     group: Optional[dist.ProcessGroup] = None, agreed: bool = True) -> tuple[float, Optional[float]]:
    """``module``'s loss on ``batch`` as validation sees it (every rank of ``group`` evaluating its share:
    :func:`shared_val_loss`), and under DiLoCo (``agreed``) ``theta_global``'s beside it:
    DiLoCo swaps in the model its ``validate`` setting names (by default the workers' mean at the last sync) and puts
    the worker's own back afterwards; under ``sync="auto"`` the DiLoCo it chose does (before the fix of this, auto's
    curves after a switch to DiLoCo held rank 0's own worker mid-cycle: docs/benchmarks.md, the auto section)."""
    driver = features.sync if features is not None else None
    loop = getattr(getattr(driver, "inner", driver), "loop", None)  # (auto's inner: the driver it handed the fit to)
    if loop is None:
        return shared_val_loss(module, batch, group), None
    loop.swap_in_validated()
    try:
        validated = shared_val_loss(module, batch, group)
    finally:
        loop.swap_back()
    return validated, shared_val_loss(global_model(module, loop), batch, group) if agreed else None


def global_model(model: ByteLM, loop: Any) -> ByteLM:
    """A copy of ``model`` holding DiLoCo's ``theta_global`` and averaged buffers (``loop``: the driver's outer loop,
    a :class:`~lightning_dist.sync.diloco.DiLoCoSync`): the model every worker agrees on (a worker's own mixes in its
    progress since each fragment's last sync)."""
    agreed = copy.deepcopy(model)
    with torch.no_grad():
        for t, g in zip(SyncedModel.of(agreed).tensors(), loop.outer.tensors(), strict=True):
            t.copy_(g)
    return agreed


def _one_thread() -> None:
    """One intra-op thread per rank, Lightning's too (unset, its DDP set-up gives a rank 2: 4 ranks x 2 threads on 2
    cores, a step ~10x slower)."""
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


def _loopback_rank(rank: int, world_size: int, method: Method, shape_name: str, sizes: Sizes, steps: int,
                   keep: Optional[Sequence[str]] = None, **fit_args: Any) -> dict[str, Any]:
    """One loopback rank posing as a host of ``shape_name``: :func:`fit`'s record (only the ``keep`` keys)."""
    _one_thread()
    shape = SHAPES[shape_name]
    with bench.quiet_lightning(), launched_externally(rank, world_size, hosts=shape.hosts):
        raw = fit(method, shape, sizes, steps, **{"curve": True, **fit_args})
    return raw if keep is None else {key: raw[key] for key in keep}


def _single_fit(sizes: Sizes, steps: int, callbacks: Sequence[Callback] = ()) -> FitRecord:
    """The LM in this one process, no strategy (Lightning's single device): its record."""
    model, data = workload(sizes)
    record = FitRecord()
    with bench.quiet_lightning():
        quiet_trainer(devices=1, max_steps=steps, limit_val_batches=0, callbacks=[record, *callbacks]).fit(model, data)
    return record


def _nosync_rank(rank: int, world_size: int, sizes: Sizes, rounds: int, steps: int) -> dict[str, Any]:
    """Alternating rounds of a no-sync DiLoCo fit (flat, ``world_size`` ranks) and a single-process fit on every rank
    alike (the same load on the cores); each fit's median step after the warm-up."""
    _one_thread()
    medians: dict[str, list[float]] = {"diloco": [], "single": []}
    for r in range(rounds):
        for name in (("diloco", "single") if r % 2 == 0 else ("single", "diloco")):
            if name == "diloco":
                with bench.quiet_lightning(), launched_externally(rank, world_size):
                    ends = fit(Method("diloco-nosync", every=NOSYNC_EVERY), Shape(1, world_size, "flat"), sizes,
                               steps, curve=False)["ends"]
            else:
                ends = _single_fit(sizes, steps).ends
            medians[name].append(float(np.median(np.diff(ends)[NOSYNC_WARMUP:])))
    return medians


# -- a shaped cluster job's worker (every rank, under torchrun in a simulated host) ------------------------------------
def _worker(args: argparse.Namespace) -> None:
    """Every timing fit of the job in turn, each rank writing its record; then any ``--validate`` full run's."""
    torch.set_num_threads(1)  # hosts share the machine's cores
    sizes, out, rank = args.sizes, Path(args.out), int(os.environ.get("RANK", "0"))
    streaming = args.scenario == "streaming"
    if streaming:  # the no-sync fit last, in processes as warm as the timed fits' (a first fit starts slower)
        methods = {**stream_methods(args.codec, args.every, args.fragments, args.delays, args.mix)[0],
                   "nosync": Method("nosync", every=NOSYNC_EVERY)}
    else:
        methods = {label: METHODS[label] for label in args.methods}
    for label, method in methods.items():
        if not streaming:
            _rank_file(out, label, rank).write_text(json.dumps(timing_fit(method, SHAPES[args.shape], sizes)))
            continue
        steps = sizes.stream_steps(args.every)
        sample = (args.every, steps) if rank == 0 and label != "nosync" else None  # after the warm-up cycle
        record = FitRecord(link=rank == 0, trace=True, sample=sample)
        raw = fit(replace(method, final_sync=False), SHAPES[args.shape], sizes, steps, curve=False, record=record)
        _rank_file(out, label, rank).write_text(json.dumps({k: raw[k] for k in TIMING_KEYS}))
    if args.validate:
        raw = fit(METHODS[args.validate], SHAPES[args.shape], sizes, sizes.steps, curve=True, link=True)
        if rank == 0:
            (out / "validate.json").write_text(json.dumps(raw))


def timing_fit(method: Method, shape: Shape, sizes: Sizes) -> dict[str, Any]:
    """``method``'s timing fit on this rank (:func:`timing_steps`, no final sync): what :func:`timing_record` reads."""
    raw = fit(replace(method, final_sync=False), shape, sizes, timing_steps(method, sizes)[0], curve=False,
              record=FitRecord(link=True))
    return {k: raw[k] for k in TIMING_KEYS}


def file_label(label: str) -> str:
    """A method's label as part of a file name."""
    return label.replace("/", "_").replace("%", "pct")


def _rank_file(out: Path, label: str, rank: int) -> Path:
    return out / f"{file_label(label)}_r{rank}.json"


def cluster_job(args: argparse.Namespace, shape: Shape, rate: float, worker: list[str], log: Path,
                labels: Sequence[str], world: int = 1
                ) -> tuple[dict[str, Optional[list[dict[str, Any]]]], Optional[dict[str, Any]], Optional[str], float]:
    """One SimCluster job of :func:`_worker`: per label its ``world`` ranks' records, the ``--validate`` run's (None:
    not written), why the job failed, its wall time."""
    with bench.scratch("sync") as out:
        worker = ["--worker", "--out", str(out), "--steps", str(args.sizes.steps), *(["--quick"] * args.quick),
                  "--schedule", args.sizes.schedule, "--seed", str(args.sizes.seed), "--workload",
                  args.sizes.workload, *worker]
        error, wall = launch_job(shape.hosts, rate, worker, free_port(), args.run_timeout, log,
                                 per_host=shape.per_host, module=WORKER_MODULE)
        files = {label: [_rank_file(out, label, r) for r in range(world)] for label in labels}
        ranks = {label: [json.loads(p.read_text()) for p in paths] if all(p.exists() for p in paths) else None
                 for label, paths in files.items()}
        validation = out / "validate.json"
        return ranks, json.loads(validation.read_text()) if validation.exists() else None, error, wall


# -- pure summaries (tested without ranks) -----------------------------------------------------------------------------
def cycle_timing(ends: Sequence[float], every: int, warm_cycles: int, link_sent: Sequence[int] = (),
                 interval: Optional[int] = None) -> dict[str, Any]:
    """A timing fit's figures from its step ends: ``per_step_s`` = median cycle after ``warm_cycles`` / H, the median
    local and sync steps (every ``interval``-th, default H) and the link's bytes per timed step."""
    whole = len(ends) // every
    cycles = [ends[k * every - 1] - ends[(k - 1) * every - 1] for k in range(max(warm_cycles, 1) + 1, whole + 1)]
    if not cycles:
        raise ValueError(f"no timed cycle: {len(ends)} steps of H={every} after {warm_cycles} warm-up cycle(s)")
    first, last = max(warm_cycles, 1) * every, whole * every  # the timed steps are (first, last]
    interval = interval or every
    gaps = [(i + 1, ends[i] - ends[i - 1]) for i in range(first, last)]
    local = [gap for step, gap in gaps if every > 1 and step % interval]
    sync = [gap for step, gap in gaps if step % interval == 0]
    link = ((link_sent[last - 1] - link_sent[first - 1]) / (last - first)
            if len(link_sent) >= last and last > first else None)
    return {"every": every, "timed_cycles": len(cycles), "cycle_s": bench.median(cycles),
            "per_step_s": bench.median(cycles) / every, "local_step_s": bench.median(local),
            "sync_step_s": bench.median(sync), "link_bytes_per_step": link}


def curve_record(outs: Sequence[dict[str, Any]], shape: str, equal_steps: int) -> dict[str, Any]:
    """One loopback fit's record: rank 0's curve and loss at ``equal_steps`` and at its end; bytes across workers per
    inner step, every rank's summed (DiLoCo's ``sync/bytes_per_step``, else the ``bytes_inter_host`` counter)."""
    rank0, steps = outs[0], outs[0]["steps"]
    curve = rank0["curve"]
    at_equal = [point[1] for point in curve if point[0] == equal_steps]

    def per_step(key: str) -> Optional[float]:
        return sum(o["totals"].get(key, 0.0) for o in outs) / steps if steps else None

    synced = [o["sync_metrics"]["sync/bytes_per_step"] for o in outs if "sync/bytes_per_step" in o["sync_metrics"]]
    synced_sum = sum(synced) if synced and len(synced) == len(outs) else None
    return {"shape": shape, "method": rank0["method"], "params": rank0["params"], "steps": steps,
            "equal_steps": equal_steps, "curve_steps": [p[0] for p in curve], "curve_loss": [p[1] for p in curve],
            # DiLoCo: theta_global's loss at each point but the last (the final sync's, which averages)
            "curve_global": [p[2] if len(p) > 4 else None for p in curve],
            "final_loss": at_equal[0] if at_equal else None, "end_loss": curve[-1][1] if curve else None,
            "global_loss": rank0.get("global_loss"),
            "bytes_across_per_step": synced_sum if synced_sum is not None else per_step("bytes_inter_host"),
            "inter_host_bytes_per_step": per_step("bytes_inter_host"), "sync_bytes_per_step": synced_sum,
            "bytes_sent_per_step": per_step("bytes_sent"), "sync_metrics": rank0["sync_metrics"], "error": None}


def time_to_loss(curve_steps: Sequence[int], curve_loss: Sequence[float], target: float,
                 per_step_s: Optional[float]) -> Optional[float]:
    """Seconds until the first curve point at or below ``target`` (None: never, or no time per step)."""
    if per_step_s is None:
        return None
    return next((step * per_step_s for step, loss in zip(curve_steps, curve_loss) if loss <= target), None)


def combine(curves: Sequence[dict[str, Any]], timings: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (shape, rate, method): the wall time to the end, the time to dense DDP's final loss and its ratios to
    dense's and the best per-step compressor's, and ``vs_dense_at_own_loss`` (dense's time to this method's own final
    loss over this method's: a method may never reach dense's)."""
    curve = {(c["shape"], c["method"]): c for c in curves if not c.get("error")}
    rows = []
    for t in timings:
        c, dense = curve.get((t["shape"], t["method"])), curve.get((t["shape"], DENSE))
        row = {**{k: t.get(k) for k in ("shape", "rate_mbit", "method", "per_step_s", "local_step_s", "sync_step_s",
                                        "link_bytes_per_step")},
               "target_loss": dense["final_loss"] if dense else None, "wall_to_end_s": None, "horizon_s": None,
               "time_to_dense_s": None, "error": t.get("error")}
        if c is not None and (per_step := t.get("per_step_s")) is not None:
            # at equal samples, and the whole curve's
            row.update(wall_to_end_s=c["equal_steps"] * per_step, horizon_s=c["steps"] * per_step)
            if dense is not None:
                row["time_to_dense_s"] = time_to_loss(c["curve_steps"], c["curve_loss"], dense["final_loss"], per_step)
        rows.append(row)
    by = {(r["shape"], r["rate_mbit"], r["method"]): r for r in rows}
    for row in rows:
        dense_row = by.get((row["shape"], row["rate_mbit"], DENSE))
        mine, dense_t = row["time_to_dense_s"], dense_row and dense_row["time_to_dense_s"]
        best, exact = _best_compressor(rows, row)
        # vs_best_compressor: a lower bound where the best compressor never got there (its whole curve's time)
        row.update(best_compressor_s=best, best_compressor_exact=exact, vs_dense=dense_t / mine if mine and dense_t
                   else None, vs_best_compressor=best / mine if mine and best else None, vs_dense_at_own_loss=None)
        c, dense = curve.get((row["shape"], row["method"])), curve.get((row["shape"], DENSE))
        if c is not None and dense is not None and dense_row and row["per_step_s"] and dense_row["per_step_s"]:
            own = time_to_loss(c["curve_steps"], c["curve_loss"], c["final_loss"], row["per_step_s"])
            theirs = time_to_loss(dense["curve_steps"], dense["curve_loss"], c["final_loss"], dense_row["per_step_s"])
            row["vs_dense_at_own_loss"] = theirs / own if own and theirs else None
    return rows


def _best_compressor(rows: Sequence[dict[str, Any]], row: dict[str, Any]) -> tuple[Optional[float], bool]:
    """The best per-step compressor's time to dense's final loss in ``row``'s setting, and whether it is exact (one
    that never got there took longer than its whole curve, ``horizon_s``: a lower bound)."""
    times = [(r["time_to_dense_s"], True) if r["time_to_dense_s"] is not None else (r["horizon_s"], False)
             for r in rows if (r["shape"], r["rate_mbit"]) == (row["shape"], row["rate_mbit"])
             and r["method"] in PER_STEP_COMPRESSORS and (r["time_to_dense_s"], r.get("horizon_s")) != (None, None)]
    return min(times, key=lambda t: (t[0], not t[1])) if times else (None, False)


def quality_rows(curves: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per curve: its final loss and bytes per inner step relative to dense DDP's of the same shape."""
    dense = {c["shape"]: c for c in curves if c["method"] == DENSE and not c.get("error")}
    rows = []
    for c in curves:
        d = dense.get(c["shape"]) if not c.get("error") else None
        rows.append({**c, "loss_vs_dense": c["final_loss"] / d["final_loss"] - 1 if d else None,
                     "bytes_vs_dense": (c["bytes_across_per_step"] / d["bytes_across_per_step"]
                                        if d and d["bytes_across_per_step"] else None)})
    return rows


def _bytes_bound(method: Method) -> float:
    return 1 / (method.every * (INT8_BYTES_FACTOR if method.sync_compressor == INT8 else 1))


def check_targets(quality: Sequence[dict[str, Any]], combined: Sequence[dict[str, Any]],
                  nosync: Optional[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Issue 31's targets on ``flat`` (4 workers); a target whose measurement is missing is absent."""
    out: dict[str, dict[str, Any]] = {}
    q = {r["method"]: r for r in quality if r["shape"] == TARGET_SHAPE}
    for label, bound in QUALITY_BOUNDS.items():
        if q.get(label, {}).get("loss_vs_dense") is not None:
            out[f"quality/{label}"] = bench.target(q[label]["loss_vs_dense"], bound)
    for label, row in q.items():
        method = METHODS.get(label)
        if method and method.diloco and method.steady and method.sync_compressor != TOPK \
                and row["bytes_vs_dense"] is not None:
            # dense DiLoCo sends exactly one step's gradient bytes per sync: 1/H on the nose, up to float rounding
            out[f"bytes/{label}"] = {**bench.target(row["bytes_vs_dense"], _bytes_bound(method) * (1 + 1e-9)),
                                     "bound": _bytes_bound(method)}
    for row in combined:
        method = METHODS.get(row["method"])
        if (row["shape"], row["rate_mbit"]) == (TARGET_SHAPE, TARGET_RATE) and method is not None and method.diloco:
            value = {k: row[k] for k in ("vs_dense", "vs_best_compressor", "best_compressor_exact")}
            out[f"time/{row['method']}"] = {
                "value": value, "bound": {"vs_dense": TIME_VS_DENSE, "vs_best_compressor": TIME_VS_COMPRESSOR},
                "met": bool(row["vs_dense"] and row["vs_dense"] >= TIME_VS_DENSE and row["vs_best_compressor"]
                            and row["vs_best_compressor"] >= TIME_VS_COMPRESSOR)}
    if q.get("onebit-adam", {}).get("bytes_vs_dense") is not None:
        out["bytes/onebit-adam"] = bench.target(q["onebit-adam"]["bytes_vs_dense"], ONEBIT_BYTES)
    step = {r["method"]: r["per_step_s"] for r in combined
            if (r["shape"], r["rate_mbit"]) == (ONEBIT_SHAPE, ONEBIT_RATE)}
    if step.get(DENSE) and step.get("onebit-adam") and step.get("topk1%"):
        value = {m: step[DENSE] / step[m] for m in ("onebit-adam", "topk1%")}
        out["time/onebit-adam"] = {"value": value, "met": value["onebit-adam"] >= value["topk1%"]}
    if nosync and nosync.get("ratio"):
        out["nosync_step"] = bench.target(nosync["ratio"]["median"], NOSYNC_BOUND)
    return out


def target_lines(targets: dict[str, dict[str, Any]], methods: Sequence[str]) -> list[str]:
    where = f"{TARGET_SHAPE} ({SHAPES[TARGET_SHAPE].hosts} workers)"
    lines = [bench.judged(f"{where}: {label} final val loss within {bound:.1%} of dense's",
                          targets.get(f"quality/{label}"), "{value:+.2%}") for label, bound in QUALITY_BOUNDS.items()]
    for label in (m for m in methods if METHODS[m].diloco and METHODS[m].steady
                  and METHODS[m].sync_compressor != TOPK):
        t = targets.get(f"bytes/{label}")
        lines.append(bench.judged(f"{where}: {label} bytes across workers per inner step <= "
                                  f"{'1/(3.5 H)' if METHODS[label].sync_compressor == INT8 else '1/H'} of dense's",
                                  t if t and t["value"] else None,
                                  lambda t: f"1/{1 / t['value']:.1f} (bound 1/{1 / t['bound']:.0f})"))

    def time_detail(t: dict[str, Any]) -> str:
        v = t["value"]
        at_least = "" if v.get("best_compressor_exact", True) or v["vs_best_compressor"] is None else ">= "
        return (f"{bench.cell(v['vs_dense'], '.1f', unit='x')} vs dense, {at_least}"
                f"{bench.cell(v['vs_best_compressor'], '.2f', unit='x')} vs the best per-step compressor"
                + (" (no per-step compressor reached dense's loss in its curve: a lower bound)" if at_least else "")
                + ("" if v["vs_dense"] else "; dense's final loss not reached"))

    lines += [bench.judged(f"{where} @ {TARGET_RATE:g} Mbit/s: {label} to dense's final loss >= {TIME_VS_DENSE:g}x "
                           f"faster than dense, >= {TIME_VS_COMPRESSOR:g}x than the best per-step compressor",
                           targets.get(f"time/{label}"), time_detail) for label in methods
              if METHODS[label].diloco and METHODS[label].steady]
    lines.append(bench.judged(f"{where}: onebit-adam bytes across workers per step after the warm-up <= 1/25 of "
                              "dense's", targets.get("bytes/onebit-adam"), lambda t: f"1/{1 / t['value']:.1f}"))
    lines.append(bench.judged(f"{ONEBIT_SHAPE} @ {ONEBIT_RATE:g} Mbit/s: onebit-adam's step speed-up over dense >= "
                              "topk1%'s", targets.get("time/onebit-adam"),
                              lambda t: "{onebit-adam:.2f}x against {topk1%:.2f}x".format(**t["value"])))
    lines.append(bench.judged(f"flat, 2 ranks: a DiLoCo step with no sync <= {NOSYNC_BOUND:g}x a single process's "
                              "step", targets.get("nosync_step"), "{value:.3f}x"))
    return lines


# -- tables and plot ---------------------------------------------------------------------------------------------------
def quality_table(quality: Sequence[dict[str, Any]]) -> str:
    def cells(r: dict[str, Any]) -> list[Any]:
        return [METHODS[r["method"]].every if r["method"] in METHODS else "-", f"{r['final_loss']:.4f}",
                bench.cell(r["loss_vs_dense"], "+.2%"), bench.cell(r["bytes_across_per_step"], ",.0f", 1e-3),
                f"1/{1 / r['bytes_vs_dense']:.1f}" if r["bytes_vs_dense"] else "-"]

    headers = ["shape", "method", "H", "final val loss", "vs dense", "KB across workers/inner step", "bytes vs dense"]
    return ("quality (nats per byte) and bytes across workers (every rank's, summed)\n"
            + bench.table(quality, headers, lambda r: [r["shape"], r["method"]], cells, error_width=50))


def time_table(combined: Sequence[dict[str, Any]]) -> str:
    def cells(r: dict[str, Any]) -> list[str]:
        at_least = "" if r.get("best_compressor_exact", True) or r["vs_best_compressor"] is None else ">="
        return [*(bench.cell(r[k], ",.1f", 1e3) for k in ("per_step_s", "local_step_s", "sync_step_s")),
                bench.cell(r["link_bytes_per_step"], ",.1f", 1e-3), bench.cell(r["wall_to_end_s"], ",.1f"),
                bench.cell(r["time_to_dense_s"], ",.1f"), bench.cell(r["vs_dense"], ".1f", unit="x"),
                at_least + bench.cell(r["vs_best_compressor"], ".2f", unit="x"),
                bench.cell(r.get("vs_dense_at_own_loss"), ".1f", unit="x")]

    headers = ["shape", "Mbit/s", "method", "ms/step", "local step ms", "sync step ms", "link KB/step",
               "s to end", "s to dense's loss", "vs dense", "vs best compressor", "vs dense at own loss"]
    return ("time per step (shaped cluster) and time to dense DDP's final val loss (curve x time per step)\n"
            + bench.table(combined, headers, lambda r: [r["shape"], f"{r['rate_mbit']:g}", r["method"]], cells))


def validation_lines(validation: Optional[dict[str, Any]]) -> list[str]:
    if not validation:
        return ["validation (a full shaped run against the prediction): not run"]
    if validation.get("error"):
        return [f"validation: FAILED ({validation['error']})"]
    v = validation
    return [f"validation: {v['method']} on {v['shape']} @ {v['rate_mbit']:g} Mbit/s, {v['steps']} steps: wall time to "
            f"the end predicted {v['predicted_s']:.1f} s, measured {v['measured_s']:.1f} s "
            f"({v['predicted_s'] / v['measured_s']:.3f}x; measured with the evaluations "
            f"{v['measured_with_evals_s']:.1f} s); final val loss loopback {bench.cell(v['loopback_loss'], '.5f')}, "
            f"shaped {v['shaped_loss']:.5f}"]


def nosync_lines(nosync: Optional[dict[str, Any]]) -> list[str]:
    if not nosync or not nosync.get("ratio"):
        return ["no-sync step cost: not measured" + (f" ({nosync['error']})" if nosync and nosync.get("error") else "")]
    r = nosync["ratio"]
    diloco, single = bench.median(nosync["diloco_s"]), bench.median(nosync["single_s"])
    return [f"no-sync step cost (flat, 2 ranks, {nosync['rounds']} alternating rounds): DiLoCo {1e3 * diloco:.1f} ms, "
            f"single process {1e3 * single:.1f} ms; paired ratio {r['median']:.3f}x (p25 {r['p25']:.3f}, "
            f"p75 {r['p75']:.3f})"]


def plot(curves: Sequence[dict[str, Any]], combined: Sequence[dict[str, Any]], rates: Sequence[float],
         validation: Optional[dict[str, Any]]) -> Any:
    """Per shape (rows): validation loss against wall time at each rate (log x), against bytes across workers, and
    against steps (equal samples)."""
    shapes = list(dict.fromkeys(c["shape"] for c in curves))
    rows, cols = max(len(shapes), 1), len(rates) + 2
    fig, grid = bench.figure_grid(rows, cols, 4.6 * cols, 3.8 * rows)
    per_step = {(r["shape"], r["rate_mbit"], r["method"]): r["per_step_s"] for r in combined}
    colors = {label: f"C{i % 10}" for i, label in enumerate(dict.fromkeys(c["method"] for c in curves))}

    def lines(ax: Any, mine: Sequence[dict[str, Any]], scale: Callable[[dict[str, Any]], Optional[float]]) -> None:
        for c in mine:
            if scale(c):
                ax.plot(np.array(c["curve_steps"]) * scale(c), c["curve_loss"], "-" if METHODS[c["method"]].diloco
                        else "--", color=colors[c["method"]], label=c["method"], lw=1.2)

    for row, shape in zip(grid, shapes):
        mine = [c for c in curves if c["shape"] == shape and not c.get("error") and c["curve_steps"]]
        for ax, rate in zip(row, rates):
            lines(ax, mine, lambda c: per_step.get((shape, rate, c["method"])))
            target = next((c["final_loss"] for c in mine if c["method"] == DENSE), None)
            if target is not None:
                ax.axhline(target, color="grey", ls=":", lw=1, label="dense's final loss")
            v = validation
            if v and not v.get("error") and (shape, rate) == (v["shape"], v["rate_mbit"]):
                ax.plot(v["measured_times"], v["measured_loss"], "k.", ms=4, label=f"{v['method']}, measured run")
            bench.style(ax, xscale="log", xlabel="wall time, s (log)", ylabel="val loss, nats/byte",
                        title=f"{shape} ({SHAPES[shape].hosts}x{SHAPES[shape].per_host}), {rate:g} Mbit/s")
        lines(row[-2], mine, lambda c: c["bytes_across_per_step"] and c["bytes_across_per_step"] / 1e6)
        bench.style(row[-2], xscale="log", xlabel="MB across workers, all ranks (log)", ylabel="val loss, nats/byte",
                    title=f"{shape}: loss against bytes")
        lines(row[-1], mine, lambda c: 1)
        bench.style(row[-1], xlabel="optimizer steps (equal samples)", ylabel="val loss, nats/byte",
                    title=f"{shape}: loss against steps")
        row[0].legend(fontsize="x-small")
        row[-1].legend(fontsize="x-small")  # every curve's (a method without a timing has none in the first panels)
    return fig




# -- part 2 (issue 32): streaming fragments, workers of different speeds -----------------------------------------------
def stream_methods(codec: str, every: int, fragments: Sequence[int], delays: Sequence[int],
                   mix: Optional[float] = None) -> tuple[dict[str, Method], dict[str, str]]:
    """The reference (part 1's dense DiLoCo at H) and every (F, tau) with ``codec`` pseudo-gradients; the pairs
    DiLoCo refuses, with its reason, in the second dict."""
    reference = Method(f"diloco{every}", every=every)
    methods, refused = {reference.label: reference}, {}
    for count, delay in itertools.product(fragments, delays):
        method = Method(stream.stream_label(count, delay, codec), every=every, sync_compressor={"name": codec},
                        fragments=count, delay=delay, mix=mix if delay else None)
        try:
            method.settings()
            methods[method.label] = method
        except ValueError as err:
            refused[method.label] = str(err)
    return methods, refused


def stream_timings(raw: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The streaming job's figures from its raw records: every configuration's (or its error), and the no-sync step."""
    failed = raw.get("error") or "no result written"
    nosync: dict[str, Any] = {"step_s": None, "error": failed}
    if raw.get("nosync"):
        nosync = {**stream.nosync_step([r["ends"] for r in raw["nosync"]], NOSYNC_WARMUP), "error": None}
    timings = []
    for entry in raw["configs"].values():
        config, ranks = entry["config"], entry["ranks"]
        if ranks is None:
            timings.append({**config, "error": failed})
            continue
        cycles = [cycle_timing(r["ends"], config["every"], raw["warm_cycles"], r.get("link_sent") or (),
                               interval=config["every"] // config["fragments"]) for r in ranks]
        timings.append({**config, **stream.stream_timing(config, cycles, ranks, raw["warm_cycles"],
                                                         nosync["step_s"])})
    return timings, nosync


def run_streaming(args: argparse.Namespace, out: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """The streaming scenario: loopback curves, the shaped timing job; the meta and measurements."""
    every, fragments, delays = args.every, args.fragments, args.delays
    methods, refused = stream_methods(args.codec, every, fragments, delays, args.mix)
    for label, reason in refused.items():
        bench.progress(f"[sync] streaming: {label} left out, DiLoCo refuses it: {reason}")
    steps, shape = args.sizes.stream_steps(every), SHAPES[STREAM_SHAPE]
    meta = bench.environment("sync", scenario="streaming", sizes=asdict(args.sizes), every=every,
                             fragments=list(fragments), delays=list(delays), codec=args.codec,
                             mix=args.mix if args.mix is not None else DiLoCo().mix,
                             outer_lr=DiLoCo.outer_lr, outer_momentum=DiLoCo.outer_momentum, hosts=shape.hosts,
                             rate_mbit=stream.STREAM_RATE, timing_steps=steps, peak_window_s=stream.PEAK_WINDOW_S,
                             sample_every_s=stream.SAMPLE_EVERY_S)
    curves = run_curves(args, STREAM_SHAPE, methods, args.sizes.steps)
    for rec in curves:
        rec.update(methods[rec["method"]].config(), samples_per_step=shape.world * args.sizes.batch_size)
    reason = _skipped("streaming: shaped timing")
    raw: dict[str, Any] = {"configs": {}, "nosync": None, "error": reason}
    if reason is None:
        bench.progress(f"[sync] streaming timing, {shape.hosts} hosts @ {stream.STREAM_RATE:g} Mbit/s: "
                       f"{' '.join(methods)}, no sync ({steps} steps each)")
        worker = ["--scenario", "streaming", "--shape", STREAM_SHAPE, "--codec", args.codec, "--every", str(every),
                  "--fragments", *map(str, fragments), "--delays", *map(str, delays),
                  *(["--mix", str(args.mix)] if args.mix is not None else [])]
        ranks, _, error, wall = cluster_job(args, shape, stream.STREAM_RATE, worker, _logs(out) / "streaming.log",
                                            [*methods, "nosync"], shape.world)
        raw = {"warm_cycles": 1, "steps": steps, "error": error, "wall_s": wall, "nosync": ranks["nosync"],
               "configs": {label: {"config": m.config(), "ranks": ranks[label]} for label, m in methods.items()}}
        bench.progress(f"[sync] streaming timing job {wall:.0f}s" + (f": {error}" if error else ""))
    return meta, {"skipped": reason, "curves": curves, "raw": raw, "refused": refused}


def stream_report(out: Path, meta: dict[str, Any], measured: dict[str, Any]) -> dict[str, Any]:
    """The streaming table, verdicts, plot and JSON from the curves and the shaped job's raw records."""
    skipped, curves, raw, refused = (measured[k] for k in ("skipped", "curves", "raw", "refused"))
    reference = f"diloco{meta['every']}"
    timings, nosync = stream_timings(raw) if raw["configs"] else ([], {"step_s": None})
    for t in (t for t in timings if t.get("error") is None):
        bench.progress(f"[sync] streaming timing {t['label']:<14} {1e3 * t['per_step_s']:8,.1f} ms/step, waited "
                       f"{bench.cell(t['waited_per_step_s'], ',.1f', 1e3)} ms/step, peak "
                       f"{bench.cell(t['peak_bytes_per_s'], ',.1f', 1e-3)} KB/s")
    rows = stream.stream_rows(curves, timings, reference)
    targets = stream.stream_targets(rows)
    payload = {"meta": meta, "skipped": skipped, "curves": curves, "timings": timings, "nosync": nosync,
               "refused": refused, "rows": rows, "targets": targets, "raw": raw}
    notes = [f"{label}: left out, DiLoCo refuses it ({reason})" for label, reason in refused.items()]
    notes.append(f"mix (alpha) {meta['mix']}; the step with no sync (DiLoCo with H beyond the fit, the same cluster): "
                 f"{bench.cell(nosync.get('step_s'), ',.1f', 1e3)} ms (the slowest host's mean step)")
    notes += [f"shaped timing skipped: {skipped}"] * bool(skipped)
    blocks = [stream.stream_table(rows), notes, stream.stream_target_lines(targets, rows, reference)]
    return bench.write_results(out, "sync-streaming", blocks, payload,
                               lambda: stream.stream_plot(curves, rows, reference))


def hetero_method(mode: str, codec: str, sizes: Sizes) -> Method:
    """The hetero scenario's DiLoCo (``sizes.hetero_sync``, ``codec`` pseudo-gradients); mode ``steps`` balances."""
    every, fragments, delay = sizes.hetero_sync
    return Method(f"hetero/{mode}", every=every, sync_compressor={"name": codec}, fragments=fragments, delay=delay,
                  balance="steps" if mode == "steps" else None)


def _hetero_rank(rank: int, world_size: int, method: Method, mode: str, sizes: Sizes, steps: int,
                 epochs: Optional[int], speeds: Optional[list[float]] = None) -> dict[str, Any]:
    """One host of a hetero fit, paced by :func:`~._streaming.slowdowns`; modes ``batches`` and ``steps`` measure
    speeds, ``fixed`` sizes the batches from ``speeds`` once."""
    hetero = HeteroBatching(window=5, every_n_steps=5) if mode in ("batches", "steps") else None
    if mode == stream.FIXED_MODE:
        hetero = HeteroBatching(speeds=list(speeds))
    return _loopback_rank(rank, world_size, method, STREAM_SHAPE, sizes, steps, ("starts", "ends", "epochs",
                          "samples", "steps"), curve=False, record=FitRecord(), hetero=hetero, epochs=epochs,
                          callbacks=[stream.CpuSlowdown(stream.slowdowns(world_size))])


def _alone_rank(rank: int, world_size: int, sizes: Sizes, steps: int) -> dict[str, Any]:
    """A fast host's and the slow host's speed alone (paced as in the scenario): one process, nothing else training."""
    _one_thread()
    pace = stream.slowdowns(stream.SLOW_HOST + 1)
    records = {name: _single_fit(sizes, steps, [stream.CpuSlowdown({0: factor})])
               for name, factor in (("fast", pace[0]), ("slow", pace[stream.SLOW_HOST]))}
    return {name: {"ends": r.ends, "samples": r.samples} for name, r in records.items()}


def run_hetero(args: argparse.Namespace, out: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """The hetero scenario on 4 loopback ranks: the hosts' own speeds, then each mode's fit; the meta and records."""
    sizes = args.sizes.hetero()
    epochs, own_steps = sizes.hetero_epochs, sizes.own_speed_steps
    world, deadline = SHAPES[STREAM_SHAPE].world, min(args.run_timeout, HETERO_DEADLINE_S)
    meta = bench.environment("sync", scenario="hetero", sizes=asdict(sizes), epochs=epochs,
                             timed_epochs=list(range(1, epochs)), codec=args.codec,
                             method=asdict(hetero_method("batches", args.codec, sizes)),
                             slow_host=stream.SLOW_HOST, slow_factor=stream.SLOW_FACTOR, own_speed_steps=own_steps,
                             where="loopback: 4 local gloo ranks posing as 4 hosts")
    raw: dict[str, Any] = {}
    try:
        raw["own"] = run_ranks(_hetero_rank, world, Method("own speed", every=NOSYNC_EVERY), "own", sizes, own_steps,
                               None, deadline_s=deadline)
        raw["alone"] = run_ranks(_alone_rank, 1, sizes, own_steps, deadline_s=deadline)[0]
    except RanksFailed as exc:
        raw["error"] = _last_line(exc)
        bench.progress(f"[sync] hetero: measuring the hosts' own speeds FAILED: {raw['error']}")
    runs: dict[str, Any] = {}
    speeds = stream.own_speeds(raw["own"], NOSYNC_WARMUP) if "own" in raw else []
    for mode in (*stream.HETERO_MODES, stream.FIXED_MODE):
        method = hetero_method(mode, args.codec, sizes)
        begun = time.perf_counter()
        try:
            method.settings()
            if mode == stream.FIXED_MODE and not (speeds and all(speeds)):
                raise ValueError("no measured speeds to size the batches from")
            runs[mode] = run_ranks(_hetero_rank, world, method, mode, sizes, -1, epochs, speeds, deadline_s=deadline)
            bench.progress(f"[sync] hetero {mode:<8} ({time.perf_counter() - begun:.0f}s)")
        except ValueError as err:
            runs[mode] = {"error": f"not run: {err}", "skipped": True}
            bench.progress(f"[sync] hetero {mode:<8} not run: {err}")
        except RanksFailed as exc:
            runs[mode] = {"error": _last_line(exc)}
            bench.progress(f"[sync] hetero {mode:<8} FAILED: {runs[mode]['error']}")
    raw["runs"] = runs
    return meta, {"raw": raw}


def hetero_report(out: Path, meta: dict[str, Any], measured: dict[str, Any]) -> dict[str, Any]:
    """The heterogeneous table, verdicts, plot and JSON from the raw per-rank records."""
    raw = measured["raw"]
    speeds: list[Optional[float]] = [None] * SHAPES[STREAM_SHAPE].world
    alone: list[Optional[float]] = list(speeds)
    if "own" in raw:
        speeds = stream.own_speeds(raw["own"], NOSYNC_WARMUP)
    if "alone" in raw:
        fast, slow = (stream.own_speeds([raw["alone"][name]], NOSYNC_WARMUP)[0] for name in ("fast", "slow"))
        alone = [slow if host == stream.SLOW_HOST else fast for host in range(len(speeds))]
    rows = [{"mode": mode, **ranks} if isinstance(ranks, dict) else  # an error
            stream.hetero_row(mode, ranks, speeds, meta["timed_epochs"]) for mode, ranks in raw["runs"].items()]
    targets = stream.hetero_targets(rows)
    lines = [f"where: {meta['where']} (the shaped cluster would add the link's time to every mode alike: the "
             "exchange is the streaming scenario's subject; balance is about compute)"]
    if all(s is not None for s in alone) and all(r.get("samples") for r in rows if not r.get("error")):
        for r in (r for r in rows if not r.get("error")):
            ideal = r["samples"] / sum(alone)
            lines.append(f"{r['mode']}: against each host's speed measured alone, one process at a time with a "
                         f"core to itself ({' / '.join(f'{s:,.0f}' for s in alone)} windows/s), the ideal is "
                         f"{ideal:.2f} s ({r['wall_s'] / ideal:.2f}x): 4 hosts share 2 cores here")
    payload = {"meta": meta, "raw": raw, "speeds": speeds, "alone_speeds": alone, "rows": rows, "targets": targets}
    blocks = [stream.hetero_table(rows, speeds), lines, stream.hetero_target_lines(targets, rows)]
    return bench.write_results(out, "sync-hetero", blocks, payload, lambda: stream.hetero_plot(rows, speeds))


# -- the driver --------------------------------------------------------------------------------------------------------
def _parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    cli = bench.parser("sync", __doc__, f"flat (4 hosts of 1) at 100 Mbit/s, {' '.join(QUICK.methods)}, a tiny "
                                        f"ByteLM, {QUICK.steps} steps; --scenario streaming: H=10, F=2, tau=1; "
                                        "hetero: H=10, F=2, tau=1, 2 epochs of 15 steps")
    add = cli.add_argument
    add("--scenario", choices=[*SCENARIOS, "all"], default="methods",
        help="methods (issue 31's comparison, sync.*), streaming (sync-streaming.*: F x tau at 10 Mbit/s), hetero "
             "(sync-hetero.*: one host at half speed), or all of them (default methods)")
    add("--shapes", nargs="+", choices=list(SHAPES), help="default flat two_tier")
    add("--rates", type=float, nargs="+", help="link rates, Mbit/s (default 10 100)")
    add("--methods", nargs="+", choices=list(METHODS), help=f"default {' '.join(FULL.methods)}".replace("%", "%%"))
    add("--codec", default=stream.STREAM_CODEC,
        help=f"streaming and hetero: the pseudo-gradient's compressor (default {stream.STREAM_CODEC})")
    add("--every", type=int,
        help=f"streaming: H of the reference and every configuration (default {FULL.stream_every}, --quick "
             f"{QUICK.stream_every})")
    add("--fragments", type=int, nargs="+",
        help=f"streaming: F values (default {' '.join(map(str, FULL.stream_fragments))}, --quick 2)")
    add("--delays", type=int, nargs="+",
        help=f"streaming: tau values (default {' '.join(map(str, FULL.stream_delays))}, --quick 1)")
    add("--mix", type=float, help="streaming: DiLoCo(mix=alpha) of the delayed configurations (default DiLoCo's)")
    add("--run-timeout", type=float, help="one job's hard deadline, s (default 1800, --quick 150)")
    add("--no-validate", action="store_true", help="skip the full shaped run that checks the prediction")
    add("--no-timing", action="store_true", help="the curves on loopback ranks only (quality at equal samples): no "
                                                 "no-sync step cost, no shaped cluster")
    add("--from", dest="from_json", help="redo the tables, verdicts and plot from a saved run's sync.json, "
                                         "sync-streaming.json or sync-hetero.json (nothing is measured)")
    add("--nosync-rounds", type=int, help=f"default {FULL.nosync_rounds} (--quick {QUICK.nosync_rounds})")
    add("--schedule", choices=SCHEDULES, default="constant",
        help="the learning rate after the warm-up, over --steps: constant (default), cosine to a tenth, or wsd")
    add("--horizon", type=int, help=f"steps of a per-step compressor's fit, read at --steps (default {FULL.horizon}, "
                                    "twice --steps where given); = --steps: every fit ends at the compared steps, as "
                                    "a user's fit of that length (OneBitAdam's warm-up is a fraction of it)")
    add("--seed", type=int, default=0, help="the model's initial weights, the samples' order and the held-out windows "
                                            "(default 0, the tables' runs)")
    add("--workload", choices=list(WORKLOADS), default="lm",
        help="lm (ByteLM under AdamW, the default) or digits (DigitsCNN under SGD; its own sizes and methods)")
    add("--steps", type=int, help=f"steps of every curve, a multiple of {FULL.eval_every} and of every H (default "
                                  f"{FULL.steps}, --quick {QUICK.steps})")
    # worker mode (what each host runs under torchrun)
    add("--worker", action="store_true", help=argparse.SUPPRESS)
    add("--shape", choices=list(SHAPES), default="flat", help=argparse.SUPPRESS)
    add("--validate", help=argparse.SUPPRESS)
    add("--nodes", type=int, default=1, help=argparse.SUPPRESS)
    args = cli.parse_args(argv)
    args.sizes = WORKLOADS[args.workload][bool(args.quick)]
    for key, field in (("shapes",) * 2, ("rates",) * 2, ("methods",) * 2, ("nosync_rounds",) * 2, ("run_timeout",) * 2,
                       ("every", "stream_every"), ("fragments", "stream_fragments"), ("delays", "stream_delays")):
        value = getattr(args, key)  # what the command line leaves out comes from the sizes
        setattr(args, key, getattr(args.sizes, field) if value is None else tuple(value) if isinstance(value, list)
                else value)
    if args.steps is not None:
        args.sizes = replace(args.sizes, steps=args.steps, horizon=2 * args.steps)
    if args.horizon is not None:
        args.sizes = replace(args.sizes, horizon=args.horizon)
    args.sizes = replace(args.sizes, schedule=args.schedule, seed=args.seed)
    args.scenarios = SCENARIOS if args.scenario == "all" else (args.scenario,)
    if args.worker or args.from_json:
        return args
    bench.check_counts(cli, nosync_rounds=args.nosync_rounds, steps=args.steps)
    if args.sizes.horizon < args.sizes.steps:
        cli.error(f"--horizon {args.sizes.horizon} ends before --steps {args.sizes.steps}, where every method is read; "
                  f"use --horizon >= {args.sizes.steps}")
    if "methods" in args.scenarios:
        points = {m: eval_every(METHODS[m], args.sizes) for m in args.methods}
        if any(args.sizes.steps % point for point in points.values()):
            cli.error(f"--steps {args.sizes.steps} does not end on a curve point of "
                      f"{' '.join(m for m, p in points.items() if args.sizes.steps % p)}; use a multiple of "
                      f"{math.lcm(*points.values())}")
        if DENSE not in args.methods:
            cli.error(f"--methods {' '.join(args.methods)}: dense is every comparison's base; add it")
    if {"streaming", "hetero"} & set(args.scenarios) and args.codec not in COMPRESSORS:
        cli.error(f"--codec {args.codec}: no such compressor; pick one of {', '.join(COMPRESSORS)}")
    if "streaming" in args.scenarios:
        bad = [v for v in args.fragments if v < 1] + [v for v in args.delays if v < 0]
        if bad or args.every < 2:
            cli.error(f"--every {args.every} --fragments / --delays {bad}: H is >= 2, fragments >= 1, delays >= 0")
        if args.sizes.steps % (point := eval_every(Method("", every=args.every), args.sizes)):
            cli.error(f"--steps {args.sizes.steps}: the streaming curves end on a sync's curve point; use a "
                      f"multiple of {point}")
    return args


def _last_line(exc: Exception) -> str:
    return str(exc).splitlines()[-1][:200]


def _logs(out: Path) -> Path:
    (out / "logs").mkdir(exist_ok=True)
    return out / "logs"


def run_curves(args: argparse.Namespace, shape: str, methods: dict[str, Method], steps: int,
               horizon: Optional[int] = None, stop: Optional[CurveStop] = None, cap: Optional[int] = None,
               agreed: bool = True) -> list[dict[str, Any]]:
    """Every method's curve on ``shape``'s loopback ranks, to ``steps`` (dense, DiLoCo) or ``horizon`` (per-step
    compressors; default ``steps``), at most ``cap`` steps, ended where ``stop`` says (:class:`CurveStop`), under
    DiLoCo with ``theta_global``'s loss beside its own where ``agreed``; quality at ``args.sizes.steps``. A DiLoCo
    fit ends there: its last point is the model its final sync leaves (the workers' mean), where one going on holds
    the outer step's ``theta_global``. A failed fit is a record with its error."""
    val_batch(args.sizes)  # read the library once, before the ranks fork
    records = []
    rank_fn = functools.partial(_loopback_rank, stop=stop, agreed=agreed)
    for label, method in methods.items():
        started = time.perf_counter()
        length = steps if label == DENSE or method.cycle > 1 else horizon or steps
        try:
            outs = run_ranks(rank_fn, SHAPES[shape].world, method, shape, args.sizes,
                             length if cap is None else min(length, cap), deadline_s=args.run_timeout)
            rec = curve_record(outs, shape, args.sizes.steps)
            ended = "" if rec["steps"] == length else f" (stopped at step {rec['steps']} of {length})"
            bench.progress(f"[sync] curve {shape:<8} {label:<15} final val loss "
                           f"{bench.cell(rec['final_loss'], '.4f')}{ended}, "
                           f"{bench.cell(rec['bytes_across_per_step'], ',.1f', 1e-3)} KB across workers/step "
                           f"({time.perf_counter() - started:.0f}s)")
        except RanksFailed as exc:
            rec = {"shape": shape, "method": label, "error": _last_line(exc)}
            bench.progress(f"[sync] curve {shape:<8} {label:<15} FAILED: {rec['error']}")
        records.append({**rec, "wall_s": time.perf_counter() - started})
    return records


def run_nosync(args: argparse.Namespace) -> dict[str, Any]:
    started, steps = time.perf_counter(), args.sizes.nosync_steps
    try:
        outs = run_ranks(_nosync_rank, 2, args.sizes, args.nosync_rounds, steps, deadline_s=args.run_timeout)
    except RanksFailed as exc:
        bench.progress(f"[sync] no-sync step cost FAILED: {exc}")
        return {"error": _last_line(exc)}
    diloco, single = outs[0]["diloco"], outs[0]["single"]
    ratio = bench.paired(dict(enumerate(diloco)), dict(enumerate(single)))
    bench.progress(f"[sync] no-sync step cost: {ratio['median']:.3f}x ({time.perf_counter() - started:.0f}s)")
    return {"rounds": args.nosync_rounds, "steps": steps, "warmup": NOSYNC_WARMUP, "diloco_s": diloco,
            "single_s": single, "rank1": outs[1], "ratio": ratio, "error": None}


def run_cluster(args: argparse.Namespace, logs: Path) -> tuple[list[dict[str, Any]], Optional[dict[str, Any]]]:
    """One SimCluster job per (shape, rate): every method's timing fit, and in the validation setting's job the full
    run; returns the timing records and the validation's raw record."""
    timings: list[dict[str, Any]] = []
    validation_raw = None
    methods = [m for m in args.methods if METHODS[m].steady]  # (Method.steady)
    for rate, shape_name in itertools.product(args.rates, args.shapes):
        shape = SHAPES[shape_name]
        where = _cell(shape_name, rate)
        here = (not args.no_validate and VALIDATE_METHOD in methods
                and (shape_name, rate) == (VALIDATE_SHAPE, VALIDATE_RATE))
        bench.progress(f"[sync] timing {where}: {' '.join(methods)}"
                       + (f", then the full {VALIDATE_METHOD} run" if here else ""))
        worker = ["--shape", shape_name, "--methods", *methods, *(["--validate", VALIDATE_METHOD] * here)]
        ranks, validation, error, wall = cluster_job(args, shape, rate, worker, logs / f"{shape_name}_r{rate:g}.log",
                                                     methods)
        timings += [timing_record(label, mine[0] if mine else None, shape_name, rate, args.sizes, error)
                    for label, mine in ranks.items()]
        if here:
            validation_raw = validation or {"error": error or "no result written"}
        bench.progress(f"[sync] {where}: job {wall:.0f}s")
    return timings, validation_raw


def timing_record(label: str, raw: Optional[dict[str, Any]], shape: str, rate: float, sizes: Sizes,
                  error: Optional[str]) -> dict[str, Any]:
    """A method's time per step in a cell from its timing fit's rank 0 (``raw``, from :func:`timing_fit`; None: it
    wrote nothing, ``error`` says why), printed as it comes."""
    where = _cell(shape, rate)
    rec: dict[str, Any] = {"shape": shape, "rate_mbit": rate, "method": label}
    if raw is None:
        rec.update(per_step_s=None, error=error or "no result written")
        bench.progress(f"[sync] {where} {label:<15} FAILED: {rec['error']}")
        return rec
    method = METHODS[label]
    rec.update(cycle_timing(raw["ends"], method.every, timing_steps(method, sizes)[1], raw["link_sent"]),
               timed_steps=len(raw["ends"]), error=None)
    bench.progress(f"[sync] {where} {label:<15} {1e3 * rec['per_step_s']:9,.1f} ms/step "
                   f"(local {bench.cell(rec['local_step_s'], ',.1f', 1e3)} ms, sync "
                   f"{bench.cell(rec['sync_step_s'], ',.1f', 1e3)} ms)")
    return rec


def _cell(shape: str, rate: float) -> str:
    """A cell as the progress lines name it: ``flat (4x1) @ 10 Mbit/s``."""
    return f"{shape} ({SHAPES[shape].hosts}x{SHAPES[shape].per_host}) @ {rate:g} Mbit/s"


def validation_record(raw: Optional[dict[str, Any]], curves: Sequence[dict[str, Any]],
                      combined: Sequence[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """The full shaped run against its prediction: wall time to the end (less the evaluations) and final loss."""
    if raw is None or raw.get("error"):
        return raw and {"error": raw["error"]}
    row = next((r for r in combined if (r["shape"], r["rate_mbit"], r["method"])
                == (VALIDATE_SHAPE, VALIDATE_RATE, VALIDATE_METHOD)), None)
    loop = next((c for c in curves if (c["shape"], c["method"]) == (VALIDATE_SHAPE, VALIDATE_METHOD)
                 and not c.get("error")), None)
    evals = [p[4] for p in raw["curve"]]
    # each evaluation's step end since the fit's first step, less the evaluations before it
    measured_times = [point[3] - raw["start"] - sum(evals[:i]) for i, point in enumerate(raw["curve"])]
    with_evals = raw["ends"][-1] - raw["start"]
    per_step = row["per_step_s"] if row else None
    return {"method": VALIDATE_METHOD, "shape": VALIDATE_SHAPE, "rate_mbit": VALIDATE_RATE, "steps": raw["steps"],
            "predicted_s": raw["steps"] * per_step if per_step else float("nan"),
            "measured_s": with_evals - sum(evals), "measured_with_evals_s": with_evals,
            "measured_times": measured_times, "measured_loss": [p[1] for p in raw["curve"]],
            "shaped_loss": raw["curve"][-1][1], "loopback_loss": loop["final_loss"] if loop else None,
            "error": None}


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    """Run the benchmark (or, with --worker, one rank of a cluster job); returns the JSON payload (with
    ``--scenario all``: a dict of the scenarios' payloads)."""
    args = _parse_args(argv)
    if args.worker:
        _worker(args)
        return {}
    out = bench.output_dir(args.out, "sync")
    if args.from_json:  # the same measurements, this code's arithmetic, tables and plot
        saved = json.loads(Path(args.from_json).read_text())
        meta = {**saved["meta"], "from": str(args.from_json)}
        return SCENARIO_RUNS[meta.get("scenario", "methods")][1](out, meta, saved)
    payloads = {}
    for name in args.scenarios:
        started = time.perf_counter()
        run, report_of = SCENARIO_RUNS[name]
        meta, measured = run(args, out)
        bench.progress(f"[sync] {name} done in {time.perf_counter() - started:.0f}s")
        payloads[name] = report_of(out, {**meta, "wall_s": time.perf_counter() - started}, measured)
    return payloads[args.scenarios[0]] if len(args.scenarios) == 1 else payloads


def run_methods(args: argparse.Namespace, out: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """Issue 31's comparison: curves, the no-sync step cost, the shaped timing jobs; the meta and measurements."""
    sizes = args.sizes
    meta = bench.environment("sync", shapes={s: asdict(SHAPES[s]) for s in args.shapes}, rates_mbit=list(args.rates),
                             methods={m: asdict(METHODS[m]) for m in args.methods}, sizes=asdict(sizes),
                             outer_lr=DiLoCo.outer_lr, outer_momentum=DiLoCo.outer_momentum,
                             timing_steps={m: timing_steps(METHODS[m], sizes)[0] for m in args.methods})
    methods = {label: METHODS[label] for label in args.methods}
    curves = [rec for shape in args.shapes for rec in run_curves(args, shape, methods, sizes.steps, sizes.horizon)]
    if args.no_timing:
        nosync, reason = {"error": "not run: --no-timing"}, "--no-timing"
    else:
        nosync, reason = run_nosync(args), _skipped("shaped timing")
    timings, validation_raw = run_cluster(args, _logs(out)) if reason is None else ([], None)
    validation = validation_record(validation_raw, curves, combine(curves, timings))
    return meta, {"skipped": reason, "curves": curves, "timings": timings, "validation": validation, "nosync": nosync}


def report(out: Path, meta: dict[str, Any], measured: dict[str, Any]) -> dict[str, Any]:
    """The tables, verdicts, plot and JSON from a run's measurements (``--from`` redoes them from a saved run's)."""
    curves, timings, validation, nosync = (measured[k] for k in ("curves", "timings", "validation", "nosync"))
    quality = quality_rows(curves)
    combined = combine(curves, timings)
    targets = check_targets(quality, combined, nosync)
    payload = {"meta": meta, "skipped": measured["skipped"], "curves": curves, "quality": quality, "timings": timings,
               "combined": combined, "validation": validation, "nosync": nosync, "targets": targets}
    blocks = [quality_table(quality), time_table(combined), validation_lines(validation), nosync_lines(nosync),
              target_lines(targets, list(meta["methods"]))]
    return bench.write_results(out, "sync", blocks, payload,
                               lambda: plot(curves, combined, meta["rates_mbit"], validation))


def _skipped(what: str) -> Optional[str]:
    """Why the shaped cluster cannot run here (None: it can), said on stderr."""
    if (reason := unavailable()) is not None:
        bench.progress(f"[sync] {what} skipped: {reason}")
    return reason


SCENARIO_RUNS = {"methods": (run_methods, report), "streaming": (run_streaming, stream_report),
                 "hetero": (run_hetero, hetero_report)}


if __name__ == "__main__":
    main(sys.argv[1:])
