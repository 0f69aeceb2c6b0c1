"""``MemoryMonitor``: a pre-flight memory estimate, every rank's memory gathered and logged, thresholds that
every rank acts on together, and CUDA memory snapshots on an out-of-memory error.

What it does, with its defaults (``MemoryMonitor()``; any strategy, ``ring_ddp`` or stock ``ddp``):

1. **Pre-flight estimate.** Weights, gradients, DDP's gradient buckets, optimizer state (SGD, SGD with momentum,
   Adam/AdamW from torch's documented state; any other optimizer probed on dummy parameters), the optimizer's
   temporaries, the compressor's residuals and the transport's buffers (:mod:`lightning_dist.memory.estimate`), what
   other callbacks keep (NaNRecovery's snapshot: any callback with a ``memory_parts(parts, on_accelerator)`` method
   adds its own), plus the activations the first forward pass saves for backward, counted as it runs (no extra step,
   nothing changed). Before the first backward, every rank's total is held against its capacity: CUDA memory the
   process can reach, or on CPU the machine's memory (or its cgroup limit) shared among the ranks on it.
   ``preflight="warn"`` warns when a rank will not fit, ``"error"`` stops every rank with
   :class:`InsufficientMemoryError` before the first backward (no gradients yet, nor optimizer state unless a
   checkpoint restored it), ``"off"`` skips it. Rank zero logs the estimate as a table. When the strategy runs a
   rank's share as several micro-batches (``hetero.accumulate``), the first forward pass is the first micro-batch's,
   whose backward frees its activations before the next: the table says so, and the advice names the per-rank cap
   that fits (``hetero.memory_caps=[...]``) instead of a smaller per-rank batch.

2. **Watching.** Every ``every_n_steps`` optimizer steps (default: the Trainer's ``log_every_n_steps``) each rank
   reads its host RSS (current, and peak since the last reading), and on CUDA the caching allocator's allocated and
   reserved bytes (current and peak), allocation retries and OOMs, and the GPU's utilisation through NVML
   (``pip install lightning-dist[gpu]``). Under ``ring_ddp`` the values ride the strategy's per-rank exchange slots (no
   collective of their own); under any other strategy one small all-gather every ``every_n_steps`` steps carries
   them. At the default interval, under a sync driver that syncs every H steps (``sync=DiLoCo(every=H)``) each
   reading waits for the interval's first sync step, so that no exchange holds the workers together between syncs;
   an ``every_n_steps`` given is kept exactly. Rank zero logs, for each quantity, the max and min over ranks and the
   rank that holds the max (``memory/rss_mib_max``, ``memory/rss_mib_min``, ``memory/rss_mib_max_rank``, ...).

3. **Thresholds.** ``usage`` is a rank's peak since the last reading over its capacity (host RSS on CPU, reserved
   CUDA memory on a GPU). At ``warn_at`` rank zero warns, naming the rank; at ``empty_cache_at`` every rank empties
   the CUDA cache (on CPU: collects garbage and trims the heap); at ``stop_at`` every rank saves a checkpoint
   (``memory-stop-step=N.ckpt`` next to the ModelCheckpoint's, else under ``default_root_dir``) and training stops
   after that step (Lightning's ``min_steps`` / ``min_epochs`` still hold). Every rank decides from the same
   gathered values, so every rank acts at the same step. Each fires once per crossing (again after usage fell back
   below it). Under heterogeneous batching the warning names the cap that brings the rank back under the threshold
   (``hetero.memory_caps=[...]``; with accumulate on the same share runs as more micro-batches).

4. **OOM snapshots** (``oom_snapshot=True``, CUDA only): torch's allocator history is recorded from the start
   of fit and dumped to ``<log_dir>/memory_snapshots/oom-rank{r}-step{N}.pickle``, for
   https://pytorch.org/memory_viz, at the failed allocation or when the error reaches Lightning
   (:mod:`lightning_dist.memory.oom`).

The readings and the logged metrics are :mod:`lightning_dist.memory.report`'s; this callback decides when to read
and what every rank does.

Logged metrics (rank zero, through Lightning's loggers; ``_mib`` values in MiB, ``_pct`` in percent):

- ``memory/rss_mib_{max,min,max_rank}``: host resident memory; ``memory/rss_peak_mib_*``: its peak
- ``memory/usage_pct_{max,min,max_rank}``: the threshold figure
- ``memory/cuda_{allocated,allocated_peak,reserved,reserved_peak}_mib_*``, ``memory/cuda_alloc_retries_*``,
  ``memory/cuda_ooms_*``: CUDA only
- ``memory/gpu_util_pct_{max,min,min_rank}``: with NVML only
- ``memory/estimate_mib_max`` and ``memory/measured_mib_{max,max_rank}``: the estimate and the largest training
  footprint measured so far (CUDA: the allocator's peak; CPU: the growth in peak RSS since set-up plus the
  weights that already existed), and ``memory/estimate_error_pct``: (estimate - measured) / measured on the rank
  with the largest footprint
- ``memory/rank{r}/...``: each rank's own values, with ``log_per_rank=True``

``reset_peaks=True`` restarts the peaks at each reading (``torch.cuda.reset_peak_memory_stats``, and Linux's
peak RSS), so each reading's peak covers its own interval; the run's peaks are kept in :attr:`peaks` and in
``state_dict``. Turn it off if your own code reads ``torch.cuda.max_memory_allocated``.
"""

from __future__ import annotations

import os
import time
from typing import Any, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_dist.callbacks.rank_values import RankValues, gather
from lightning_dist.fault.checkpoint import checkpoint_dir
from lightning_dist.launch import LaunchEnv
from lightning_dist.memory import readers
from lightning_dist.memory.estimate import ActivationProbe, MemoryEstimate, MiB, comm_setup_of, estimate_memory
from lightning_dist.memory.oom import OomSnapshots
from lightning_dist.memory.report import (
    SLOTS,
    Passes,
    RankMemory,
    activation_note,
    advice,
    cap_that_fits,
    caps_advice,
    summarize,
)
from lightning_dist.strategy import features_of

PREFLIGHT = ("warn", "error", "off")
_HISTORY = 100
_CAP_TARGET = 0.9  # the cap a threshold warning names aims at this fraction of the threshold that fired

class InsufficientMemoryError(RuntimeError):
    """Raised on every rank together when the pre-flight estimate does not fit and ``preflight="error"``."""


class MemoryMonitor(Callback):
    """Pre-flight memory estimate, per-rank memory gathered across ranks, thresholds, OOM snapshots.

    Args:
        every_n_steps: optimizer steps between readings (None: the Trainer's ``log_every_n_steps``, 50 when
            that is 0, each reading under a sync driver on the interval's first step where the workers meet).
        warn_at: usage (a fraction of capacity) at which rank zero warns; None: never.
        empty_cache_at: usage at which every rank empties the CUDA cache (CPU: garbage collection and
            ``malloc_trim``); None: never.
        stop_at: usage at which every rank saves a checkpoint and training stops; None: never.
        preflight: ``"warn"``, ``"error"`` or ``"off"``: what to do when the estimate exceeds a rank's capacity.
        probe_activations: count the first forward pass's activations into the estimate (the check then runs
            before the first backward; without it, at the start of fit).
        capacity_gib: each rank's capacity in GiB instead of the detected one (to keep headroom, or where the
            limit is not visible to the process).
        reset_peaks: restart the allocator's and the kernel's peak counters at each reading.
        log_per_rank: also log every rank's own values.
        oom_snapshot: record CUDA allocations and dump a snapshot on an out-of-memory error (CUDA only).
        snapshot_entries: allocation events the snapshot keeps.
        snapshot_dir: where snapshots go (None: ``<log_dir>/memory_snapshots``).
    """

    def __init__(self, every_n_steps: Optional[int] = None, warn_at: Optional[float] = 0.9,
                 empty_cache_at: Optional[float] = None, stop_at: Optional[float] = None, preflight: str = "warn",
                 probe_activations: bool = True, capacity_gib: Optional[float] = None, reset_peaks: bool = True,
                 log_per_rank: bool = False, oom_snapshot: bool = False, snapshot_entries: int = 100_000,
                 snapshot_dir: Optional[str] = None) -> None:
        problems = check_settings(every_n_steps=every_n_steps, warn_at=warn_at, empty_cache_at=empty_cache_at,
                                  stop_at=stop_at, preflight=preflight, capacity_gib=capacity_gib,
                                  snapshot_entries=snapshot_entries)
        if problems:
            raise ValueError("MemoryMonitor: " + "; ".join(problems))
        self.every_n_steps, self.preflight, self.probe_activations = every_n_steps, preflight, probe_activations
        self.thresholds = {"warn": warn_at, "empty_cache": empty_cache_at, "stop": stop_at}
        self.capacity_gib, self.reset_peaks, self.log_per_rank = capacity_gib, reset_peaks, log_per_rank
        self.oom_snapshot, self.snapshot_entries, self.snapshot_dir = oom_snapshot, snapshot_entries, snapshot_dir
        # kept across checkpoints
        self.events: list[dict[str, Any]] = []  # thresholds crossed and what every rank did (the last 100)
        self.peaks: dict[str, float] = {}  # the run's highest value of each logged max (MiB, percent, counts)
        self.readings = 0
        # this fit only
        self.estimate: Optional[MemoryEstimate] = None  # this rank's
        self.seconds = 0.0  # CPU time in this callback's per-step work (time.thread_time)
        self.last: dict[str, float] = {}  # the last reading's metrics, identical on every rank
        self._every = 0
        self._memory = RankMemory()  # this rank's readings (its CUDA device, capacity, footprint)
        self._probe: Optional[ActivationProbe] = None
        self._batch: Optional[tuple[int, int]] = None  # (epoch, batch_idx) of the batch in progress
        self._probed_samples = 0  # samples of the forward pass the probe measured (heterogeneous batching only)
        self._preflight_pending = False
        self._values = RankValues("mem", SLOTS)  # every rank's readings, every N steps
        self._armed = {action: True for action in self.thresholds}
        self._oom = OomSnapshots(snapshot_entries)
        self._compared = False  # the estimate-against-measurement line was logged

    @property
    def snapshots(self) -> list[str]:
        """This fit's OOM snapshots."""
        return self._oom.paths

    @property
    def interval(self) -> int:
        """Optimizer steps between readings in this fit: ``every_n_steps``, or the Trainer's ``log_every_n_steps``
        (0 before the fit's setup)."""
        return self._every

    @property
    def measured(self) -> float:
        """This rank's largest training footprint measured so far in this fit, bytes (see ``memory/measured_mib``)."""
        return self._memory.measured

    # -- set-up -----------------------------------------------------------------------------------------------
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._every = self.every_n_steps or trainer.log_every_n_steps or 50
        self._values.setup(trainer, self._every, when_workers_meet=self.every_n_steps is None)
        self._memory.start(readers.cuda_device(trainer.strategy.root_device),
                           [*pl_module.parameters(), *pl_module.buffers()], self.reset_peaks)
        self._armed = dict.fromkeys(self.thresholds, True)
        self._compared = False
        self._batch, self._probed_samples = None, 0
        self.seconds = 0.0
        self._preflight_pending = self.preflight != "off"
        if self.oom_snapshot:
            self._start_recording(trainer)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        started = time.thread_time()
        self._memory.capacity, source = self._detect_capacity(trainer)
        self.estimate = self._estimate(trainer, pl_module, activations=None)
        self.estimate.capacity_source = source
        if self.probe_activations:
            self._probe = ActivationProbe(exclude=[*pl_module.parameters(), *pl_module.buffers()])
        elif self._preflight_pending:
            self._check_preflight(trainer)
        self.seconds += time.thread_time() - started

    def _detect_capacity(self, trainer: pl.Trainer) -> tuple[int, str]:
        if self.capacity_gib is not None:
            return int(self.capacity_gib * 2**30), "capacity_gib"
        if self._memory.cuda is not None:
            return readers.cuda_capacity(self._memory.cuda)
        return readers.host_capacity(LaunchEnv.current().local_world_size or trainer.num_devices)

    def _estimate(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                  activations: Optional[int], largest: int = 0) -> MemoryEstimate:
        features = features_of(trainer.strategy)  # ring_ddp: its compressor and its transport's buffers count
        topology = features.topology if features is not None else None
        comm = comm_setup_of(trainer.strategy.model or pl_module,
                             compressor=features.compressor if features is not None else None,
                             world_size=trainer.world_size, transport_buffers=features is not None,
                             two_tier_ranks_per_host=topology.ranks_per_host
                             if topology is not None and topology.kind == "two_tier" else 0,
                             sync_bytes=_sync_bytes(features.sync, self._memory.cuda is not None)
                             if features is not None and features.sync is not None else 0)
        est = estimate_memory(pl_module, trainer.optimizers, comm, activation_bytes=activations,
                              largest_activation=largest)
        passes = self._passes(trainer)
        if activations is not None and passes is not None and features is not None and features.hetero.accumulates:
            # the probe ran from on_train_batch_start to the first on_before_backward: the first micro-batch
            est.notes["activations"] = activation_note(passes.sizes[trainer.global_rank])
        for callback in trainer.callbacks:  # callbacks that hold copies (NaNRecovery's snapshot) say how much
            parts = getattr(callback, "memory_parts", None)
            if callable(parts) and callback is not self:
                for name, value in parts(dict(est.parts), self._memory.cuda is not None).items():
                    est.parts[name] = int(value)
                    est.notes[name] = f"held by {type(callback).__name__}"
        est.capacity, est.baseline = self._memory.capacity, self._memory.baseline
        if self.estimate is not None:
            est.capacity_source = self.estimate.capacity_source
        return est

    # -- the first forward pass: activations, then the pre-flight check ----------------------------------------
    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        started = time.thread_time()
        self._batch = (trainer.current_epoch, batch_idx)
        if self._probe is not None and not self._probe.active:  # the fit's first forward pass
            self._probe.start()
        self._values.fill(trainer, self._read)
        self.seconds += time.thread_time() - started

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        if self._probe is not None and self._probe.active:
            self._finish_probe(trainer, pl_module)

    def _finish_probe(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        started = time.thread_time()
        assert self._probe is not None
        activations, largest = self._probe.stop(), self._probe.largest
        self._probe = None
        passes = self._passes(trainer)  # under micro-batching the probed pass is the first micro-batch
        self._probed_samples = passes.sizes[trainer.global_rank][0] if passes is not None else 0
        self.estimate = self._estimate(trainer, pl_module, activations=activations, largest=largest)
        if self._preflight_pending:
            self._check_preflight(trainer)
        else:
            rank_zero_info(f"MemoryMonitor: estimated peak memory of rank 0\n{self.estimate.table()}")
        self.seconds += time.thread_time() - started

    def _check_preflight(self, trainer: pl.Trainer) -> None:
        """Every rank's estimate against its capacity (one collective, once): every rank decides alike."""
        self._preflight_pending = False
        est = self.estimate
        assert est is not None
        rows = gather(trainer, [float(est.needed), float(est.capacity), float(est.total), float(_activations(est))])
        rank_zero_info(f"MemoryMonitor: estimated peak memory of rank 0\n{est.table()}")
        short = [(r, row) for r, row in enumerate(rows) if row[1] > 0 and row[0] > row[1]]
        if not short:
            return
        worst, (needed, capacity, total, _) = max(short, key=lambda item: item[1][0] / item[1][1])
        caps, passes = None, self._passes(trainer)
        if passes is not None:  # every rank's probed pass (its first micro-batch) from the plan every rank holds
            fitting = [cap_that_fits(row[0], row[1], row[3], sizes[0]) for row, sizes in zip(rows, passes.sizes)]
            caps = caps_advice(passes, fitting, [r for r, _ in short])
        message = (
            f"MemoryMonitor: rank {worst} will need about {needed / 2**30:.2f} GiB at its peak (training state "
            f"{total / 2**30:.2f} GiB + what the process already holds) but has {capacity / 2**30:.2f} GiB "
            f"({est.capacity_source}); {len(short)} of {len(rows)} ranks are short. This rank's estimate:\n"
            f"{est.table()}\n{advice(est, caps)}"
        )
        if self.preflight == "error":
            raise InsufficientMemoryError(message)
        rank_zero_warn(message)

    # -- every N steps: read, gather, log, act --------------------------------------------------------------
    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._probe is not None and self._probe.active:  # manual optimization without a backward
            self._finish_probe(trainer, pl_module)
        started = time.thread_time()
        rows = self._values.collect(trainer, self._read)
        if rows is not None:
            self._handle(trainer, [dict(zip(SLOTS, row)) for row in rows])
        self.seconds += time.thread_time() - started

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                                 optimizer: torch.optim.Optimizer) -> None:
        self._values.capture(trainer)

    def _read(self) -> list[float]:
        """This rank's values, in :data:`~lightning_dist.memory.report.SLOTS` order."""
        return self._memory.read(self.estimate.total if self.estimate is not None else None)

    def _handle(self, trainer: pl.Trainer, rows: list[dict[str, float]]) -> None:
        self.readings += 1
        metrics = summarize(rows, per_rank=self.log_per_rank)
        self.last = metrics
        for key, value in metrics.items():
            if key.endswith("_max"):
                self.peaks[key] = max(self.peaks.get(key, value), value)
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)
        if not self._compared and trainer.global_step >= 3 and "memory/estimate_error_pct" in metrics:
            # a few steps in (optimizer state allocated, a whole step's peak seen): say how the estimate did
            self._compared = True
            rank_zero_info(f"MemoryMonitor: estimated {metrics['memory/estimate_mib_max']:.1f} MiB, measured "
                           f"{metrics['memory/measured_mib_max']:.1f} MiB on rank "
                           f"{int(metrics['memory/measured_mib_max_rank'])} so far "
                           f"({metrics['memory/estimate_error_pct']:+.0f}%)")
        usage = [row["usage"] for row in rows]
        if max(usage) < 0:
            return
        worst = max(range(len(rows)), key=lambda r: usage[r])
        for action in ("warn", "empty_cache", "stop"):
            limit = self.thresholds[action]
            if limit is None:
                continue
            if usage[worst] < limit:
                self._armed[action] = True  # fell back below: the next crossing fires again
                continue
            if not self._armed[action]:
                continue
            self._armed[action] = False
            self._act(trainer, action, worst, rows, limit)

    def _act(self, trainer: pl.Trainer, action: str, rank: int, rows: list[dict[str, float]], limit: float) -> None:
        row = rows[rank]
        what = "reserved CUDA memory" if self._memory.cuda is not None else "host RSS"
        event = {"step": trainer.global_step, "action": action, "rank": rank, "usage": row["usage"], "limit": limit}
        self.events = (self.events + [event])[-_HISTORY:]
        said = (f"MemoryMonitor: at step {trainer.global_step}, rank {rank}'s peak {what} reached "
                f"{100 * row['usage']:.1f}% of its capacity ({row['usage'] * row['capacity'] / 2**30:.2f} of "
                f"{row['capacity'] / 2**30:.2f} GiB; {action} threshold {100 * limit:.0f}%)")
        if action == "warn":
            caps = self._caps_for(trainer, rows, rank, limit)
            fix = f"Set {caps}" if caps is not None else "Reduce the per-rank batch"
            rank_zero_warn(said + f". {fix}, use bf16 mixed precision, or set gradient_as_bucket_view=True; "
                           "MemoryMonitor(stop_at=...) stops cleanly before an OOM.")
        elif action == "empty_cache":
            rank_zero_info(said + ": every rank empties its cache")
            readers.release_host_memory()
            if self._memory.cuda is not None:
                torch.cuda.empty_cache()
        else:
            path = os.path.join(checkpoint_dir(trainer), f"memory-stop-step={trainer.global_step}.ckpt")
            rank_zero_warn(said + f": every rank saves {path} and training stops")
            trainer.save_checkpoint(path)  # every rank calls it; rank zero writes
            trainer.should_stop = True

    # -- heterogeneous batching: the cap to name -------------------------------------------------------------
    def _passes(self, trainer: pl.Trainer) -> Optional[Passes]:
        """Every rank's passes of the batch in progress, when the strategy runs heterogeneous batching (read through
        its feature seam, handed to the advice as plain values); None otherwise."""
        if self._batch is None:  # no batch started in this fit yet
            return None
        features = features_of(trainer.strategy)
        hetero = features.hetero if features is not None else None
        if hetero is None or not hetero.attached or hetero.plan is None:
            return None
        world, (epoch, batch_idx) = hetero.plan.world_size, self._batch
        return Passes(accumulate=hetero.accumulate, caps=hetero.micro_caps(world, hetero.global_batch),
                      sizes=[hetero.micro_sizes(epoch, batch_idx, r) for r in range(world)], elastic=hetero.elastic)

    def _caps_for(self, trainer: pl.Trainer, rows: list[dict[str, float]], rank: int, limit: float) -> Optional[str]:
        """The cap that brings ``rank``'s peak to :data:`_CAP_TARGET` of the threshold ``limit`` that fired, from the
        last reading's peaks and this rank's activations per sample (the first pass's; every rank runs the same
        model); None without heterogeneous batching."""
        passes = self._passes(trainer)
        if passes is None:
            return None
        per_sample = _activations(self.estimate) / self._probed_samples if self.estimate and self._probed_samples \
            else 0.0
        fitting = []
        for r, sizes in enumerate(passes.sizes):
            row, samples = rows[r], max(sizes)
            fitting.append(cap_that_fits(row["usage"] * row["capacity"], _CAP_TARGET * limit * row["capacity"],
                                         per_sample * samples, samples))
        return caps_advice(passes, fitting, [rank])

    # -- OOM snapshots --------------------------------------------------------------------------------------
    def _start_recording(self, trainer: pl.Trainer) -> None:
        if self._memory.cuda is None:
            rank_zero_info("MemoryMonitor: oom_snapshot needs a CUDA device; this run has none, so no snapshot")
            return
        self._oom.start(trainer, self.snapshot_dir or os.path.join(trainer.log_dir or trainer.default_root_dir,
                                                                   "memory_snapshots"))

    def _release(self, trainer: pl.Trainer) -> None:
        """What a fit leaves behind, whether it ended or failed: the probe, the recording, the exchange request."""
        if self._probe is not None:
            self._probe.stop()
            self._probe = None
        self._oom.stop()
        self._values.teardown(trainer)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._oom.on_exception(exception)
        self._release(trainer)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._release(trainer)

    # -- state ------------------------------------------------------------------------------------------------
    @override
    def state_dict(self) -> dict[str, Any]:
        return {"events": list(self.events), "peaks": dict(self.peaks), "readings": self.readings}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.events = list(state_dict.get("events", []))
        self.peaks = dict(state_dict.get("peaks", {}))
        self.readings = int(state_dict.get("readings", 0))

    def run_summary(self) -> dict[str, Any]:
        """For ``summary.json``: the estimate, the run's peaks and the threshold events."""
        est = self.estimate
        return {
            "estimate_mib": {k: v / MiB for k, v in est.parts.items()} if est is not None else {},
            "estimate_total_mib": est.total / MiB if est is not None else None,
            "capacity_mib": est.capacity / MiB if est is not None else None,
            "peaks": dict(self.peaks),
            "events": list(self.events),
            "snapshots": list(self.snapshots),
        }


def _activations(est: Optional[MemoryEstimate]) -> int:
    """The estimate's activation-sized parts (saved for backward, and backward's temporaries), bytes."""
    return est.parts.get("activations", 0) + est.parts.get("activation_grads", 0) if est is not None else 0


def check_settings(**settings: Any) -> list[str]:
    """What is wrong with MemoryMonitor's arguments (empty: nothing), each with its fix; used by the
    constructor and by ``lightning-dist-train``'s validation before any rank starts."""
    problems = []
    every = settings.get("every_n_steps")
    if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
        problems.append(f"every_n_steps={every!r} must be an integer >= 1, or None for the Trainer's "
                        "log_every_n_steps")
    for name in ("warn_at", "empty_cache_at", "stop_at"):
        value = settings.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not 0 < value <= 1.5):
            problems.append(f"{name}={value!r} must be a fraction of capacity in (0, 1.5] (0.9 is 90%), or None "
                            "for no action")
    if settings.get("preflight", "warn") not in PREFLIGHT:
        problems.append(f"preflight={settings.get('preflight')!r} must be one of {list(PREFLIGHT)}")
    capacity = settings.get("capacity_gib")
    if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, (int, float))
                                 or not capacity > 0):
        problems.append(f"capacity_gib={capacity!r} must be > 0 (GiB per rank), or None to detect it")
    entries = settings.get("snapshot_entries", 1)
    if isinstance(entries, bool) or not isinstance(entries, int) or entries < 1:
        problems.append(f"snapshot_entries={entries!r} must be an integer >= 1")
    return problems


def _sync_bytes(sync: Any, on_gpu: bool) -> int:
    """What a sync driver keeps on the device this monitor watches: its report's bytes by device type (DiLoCo keeps all
    of it in host memory, OneBitAdam beside the model)."""
    return int(sync.report().memory.get("cuda" if on_gpu else "cpu", 0))
