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
   checkpoint restored it), ``"off"`` skips it. Rank zero logs the estimate as a table.

2. **Watching.** Every ``every_n_steps`` optimizer steps (default: the Trainer's ``log_every_n_steps``) each
   rank reads its host RSS (current, and peak since the last reading), and on CUDA the caching allocator's
   allocated and reserved bytes (current and peak), allocation retries and OOMs, and the GPU's utilisation
   through NVML (``pip install lightning-dist[gpu]``). Under ``ring_ddp`` the values ride the strategy's
   per-rank control slots (no collective of their own); under any other strategy one small all-gather every
   ``every_n_steps`` steps carries them. Rank zero logs, for each quantity, the max and min over ranks and the
   rank that holds the max (``memory/rss_mib_max``, ``memory/rss_mib_min``, ``memory/rss_mib_max_rank``, ...).

3. **Thresholds.** ``usage`` is a rank's peak since the last reading over its capacity (host RSS on CPU, reserved
   CUDA memory on a GPU). At ``warn_at`` rank zero warns, naming the rank; at ``empty_cache_at`` every rank empties
   the CUDA cache (on CPU: collects garbage and trims the heap); at ``stop_at`` every rank saves a checkpoint
   (``memory-stop-step=N.ckpt`` next to the ModelCheckpoint's, else under ``default_root_dir``) and training stops
   after that step (Lightning's ``min_steps`` / ``min_epochs`` still hold). Every rank decides from the same
   gathered values, so every rank acts at the same step. Each fires once per crossing (again after usage fell back
   below it).

4. **OOM snapshots** (``oom_snapshot=True``, CUDA only): torch's allocator history is recorded from the start
   of fit and dumped (``torch.cuda.memory._dump_snapshot``) to
   ``<log_dir>/memory_snapshots/oom-rank{r}-step{N}.pickle``, for https://pytorch.org/memory_viz: by torch's
   out-of-memory observer at the failed allocation, before anything is freed (where the build has one; an
   OOM torch recovers from, such as a convolution retrying with less workspace, fires it too: at most 8 per
   fit), else when the out-of-memory error reaches Lightning.

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
import weakref
from typing import Any, Optional

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_dist.callbacks.rank_values import RankValues, gather
from lightning_dist.memory import readers
from lightning_dist.memory.estimate import ActivationProbe, MemoryEstimate, MiB, comm_setup_of, estimate_memory

PREFLIGHT = ("warn", "error", "off")
# what every rank sends at each reading, in this order (bytes unless named otherwise; -1: not available here)
SLOTS = ("rss", "rss_peak", "usage", "capacity", "estimate", "measured", "cuda_allocated", "cuda_allocated_peak",
         "cuda_reserved", "cuda_reserved_peak", "cuda_alloc_retries", "cuda_ooms", "gpu_util")
_BYTES = ("rss", "rss_peak", "cuda_allocated", "cuda_allocated_peak", "cuda_reserved", "cuda_reserved_peak")
_COUNTS = ("cuda_alloc_retries", "cuda_ooms")
_HISTORY = 100
_MAX_SNAPSHOTS = 8  # snapshots the OOM observer writes per fit (recoverable OOMs fire it too)
# torch's OOM observer cannot be detached: one per process, calling the monitor whose fit records allocations
_OOM_TARGET: Optional[weakref.ref] = None
_OOM_ATTACHED = False


def _oom_observer(device: int, alloc: int, device_alloc: int, device_free: int) -> None:
    monitor = _OOM_TARGET() if _OOM_TARGET is not None else None
    if monitor is not None:
        monitor._dump("oom", observed=True)


class InsufficientMemoryError(RuntimeError):
    """Raised on every rank together when the pre-flight estimate does not fit and ``preflight="error"``."""


class MemoryMonitor(Callback):
    """Pre-flight memory estimate, per-rank memory gathered across ranks, thresholds, OOM snapshots.

    Args:
        every_n_steps: optimizer steps between readings (None: the Trainer's ``log_every_n_steps``, 50 when
            that is 0).
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
        self.snapshots: list[str] = []
        self.seconds = 0.0  # CPU time in this callback's per-step work (time.thread_time)
        self.last: dict[str, float] = {}  # the last reading's metrics, identical on every rank
        self._every = 0
        self._cuda: Optional[torch.device] = None
        self._capacity = 0
        self._rss_at_setup = self._bytes_at_setup = 0
        self._measured = 0.0
        self._probe: Optional[ActivationProbe] = None
        self._preflight_pending = False
        self._values = RankValues("mem", SLOTS)  # every rank's readings, every N steps
        self._armed = {action: True for action in self.thresholds}
        self._gpu = readers.GpuUtilization()
        self._recording = False
        self._snapshot_dir = ""
        self._trainer_ref: Optional[weakref.ref] = None  # weak: the OOM observer outlives the fit
        self._compared = False  # the estimate-against-measurement line was logged

    # -- set-up -----------------------------------------------------------------------------------------------
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        strategy = trainer.strategy
        self._every = self.every_n_steps or trainer.log_every_n_steps or 50
        self._cuda = readers.cuda_device(strategy.root_device)
        self._values.setup(trainer, self._every)
        if self.reset_peaks:
            readers.reset_host_peak()
            if self._cuda is not None:
                torch.cuda.reset_peak_memory_stats(self._cuda)
        # the CPU footprint is measured as growth from here, plus the weights that already exist
        self._rss_at_setup = readers.host_rss()
        self._bytes_at_setup = sum(t.numel() * t.element_size() for t in (*pl_module.parameters(),
                                                                          *pl_module.buffers()) if not t.is_cuda)
        self._measured = 0.0
        self._armed = dict.fromkeys(self.thresholds, True)
        self._compared = False
        self.snapshots, self.seconds = [], 0.0
        self._preflight_pending = self.preflight != "off"
        if self.oom_snapshot:
            self._start_recording(trainer)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        started = time.thread_time()
        self._capacity, source = self._detect_capacity(trainer)
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
        if self._cuda is not None:
            return readers.cuda_capacity(self._cuda)
        return readers.host_capacity(readers.local_world_size(getattr(trainer, "num_devices", 1)))

    def _estimate(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                  activations: Optional[int], largest: int = 0) -> MemoryEstimate:
        strategy = trainer.strategy
        from lightning_dist.strategy import RingDDPStrategy

        ring = isinstance(strategy, RingDDPStrategy)  # its compressor and its transport's buffers count
        comm = comm_setup_of(getattr(strategy, "model", None) or pl_module,
                             compressor=getattr(strategy, "compressor", None) if ring else None,
                             world_size=trainer.world_size, transport_buffers=ring)
        est = estimate_memory(pl_module, trainer.optimizers, comm, activation_bytes=activations,
                              largest_activation=largest)
        for callback in trainer.callbacks:  # callbacks that hold copies (NaNRecovery's snapshot) say how much
            parts = getattr(callback, "memory_parts", None)
            if callable(parts) and callback is not self:
                for name, value in parts(dict(est.parts), self._cuda is not None).items():
                    est.parts[name] = int(value)
                    est.notes[name] = f"held by {type(callback).__name__}"
        est.capacity = self._capacity
        if self.estimate is not None:
            est.capacity_source = self.estimate.capacity_source
        # on CPU the process already holds libraries and the interpreter besides the training state
        est.baseline = 0 if self._cuda is not None else max(self._rss_at_setup - self._bytes_at_setup, 0)
        return est

    # -- the first forward pass: activations, then the pre-flight check ----------------------------------------
    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        started = time.thread_time()
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
        rows = gather(trainer, [float(est.needed), float(est.capacity), float(est.total)])
        rank_zero_info(f"MemoryMonitor: estimated peak memory of rank 0\n{est.table()}")
        short = [(r, row) for r, row in enumerate(rows) if row[1] > 0 and row[0] > row[1]]
        if not short:
            return
        worst, (needed, capacity, total) = max(short, key=lambda item: item[1][0] / item[1][1])
        message = (
            f"MemoryMonitor: rank {worst} will need about {needed / 2**30:.2f} GiB at its peak (training state "
            f"{total / 2**30:.2f} GiB + what the process already holds) but has {capacity / 2**30:.2f} GiB "
            f"({est.capacity_source}); {len(short)} of {len(rows)} ranks are short. This rank's estimate:\n"
            f"{est.table()}\n{_advice(est)}"
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
        """This rank's values, in :data:`SLOTS` order; peaks restart afterwards when ``reset_peaks``."""
        cuda = readers.cuda_stats(self._cuda)
        rss, rss_peak = readers.host_rss(), readers.host_rss_peak()
        if self._cuda is not None:
            held, measured = cuda["cuda_reserved_peak"], cuda["cuda_allocated_peak"]
        else:
            held, measured = rss_peak, rss_peak - self._rss_at_setup + self._bytes_at_setup
        self._measured = max(self._measured, float(measured))
        values = {
            "rss": float(rss), "rss_peak": float(rss_peak),
            "usage": held / self._capacity if self._capacity > 0 else readers.UNAVAILABLE,
            "capacity": float(self._capacity),
            "estimate": float(self.estimate.total) if self.estimate is not None else readers.UNAVAILABLE,
            "measured": self._measured,
            **{k: v for k, v in cuda.items() if k in SLOTS},
            "gpu_util": self._gpu.read(self._cuda),
        }
        if self.reset_peaks:
            readers.reset_host_peak()
            if self._cuda is not None:
                torch.cuda.reset_peak_memory_stats(self._cuda)
        return [values[name] for name in SLOTS]

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
            self._act(trainer, action, worst, rows[worst], limit)

    def _act(self, trainer: pl.Trainer, action: str, rank: int, row: dict[str, float], limit: float) -> None:
        what = "reserved CUDA memory" if self._cuda is not None else "host RSS"
        event = {"step": trainer.global_step, "action": action, "rank": rank, "usage": row["usage"], "limit": limit}
        self.events = (self.events + [event])[-_HISTORY:]
        said = (f"MemoryMonitor: at step {trainer.global_step}, rank {rank}'s peak {what} reached "
                f"{100 * row['usage']:.1f}% of its capacity ({row['usage'] * row['capacity'] / 2**30:.2f} of "
                f"{row['capacity'] / 2**30:.2f} GiB; {action} threshold {100 * limit:.0f}%)")
        if action == "warn":
            rank_zero_warn(said + ". Reduce the per-rank batch, use bf16 mixed precision, or set "
                           "gradient_as_bucket_view=True; MemoryMonitor(stop_at=...) stops cleanly before an OOM.")
        elif action == "empty_cache":
            rank_zero_info(said + ": every rank empties its cache")
            readers.release_host_memory()
            if self._cuda is not None:
                torch.cuda.empty_cache()
        else:
            path = os.path.join(_checkpoint_dir(trainer), f"memory-stop-step={trainer.global_step}.ckpt")
            rank_zero_warn(said + f": every rank saves {path} and training stops")
            trainer.save_checkpoint(path)  # every rank calls it; rank zero writes
            trainer.should_stop = True

    # -- OOM snapshots --------------------------------------------------------------------------------------
    def _start_recording(self, trainer: pl.Trainer) -> None:
        global _OOM_ATTACHED, _OOM_TARGET
        if self._cuda is None:
            rank_zero_info("MemoryMonitor: oom_snapshot needs a CUDA device; this run has none, so no snapshot")
            return
        self._snapshot_dir = self.snapshot_dir or os.path.join(trainer.log_dir or trainer.default_root_dir,
                                                               "memory_snapshots")
        self._trainer_ref = weakref.ref(trainer)
        torch.cuda.memory._record_memory_history(max_entries=self.snapshot_entries)
        self._recording = True
        _OOM_TARGET = weakref.ref(self)
        attach = getattr(torch._C, "_cuda_attach_out_of_memory_observer", None)
        if attach is not None and not _OOM_ATTACHED:  # one observer per process; it cannot be detached
            attach(_oom_observer)
            _OOM_ATTACHED = True

    def _dump(self, why: str, observed: bool = False) -> Optional[str]:
        """Write the allocator's history; from the observer (the moment of a failed allocation, which torch may
        still recover from, e.g. a convolution retrying with less workspace) at most ``_MAX_SNAPSHOTS`` times."""
        if not self._recording or (observed and len(self.snapshots) >= _MAX_SNAPSHOTS):
            return None
        os.makedirs(self._snapshot_dir, exist_ok=True)
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        path = os.path.join(self._snapshot_dir, f"{why}-rank{rank}-step{self._trainer_step()}.pickle")
        torch.cuda.memory._dump_snapshot(path)  # a later OOM at the same step overwrites it: the latest wins
        if path not in self.snapshots:
            self.snapshots.append(path)
        return path

    def _stop_recording(self) -> None:
        global _OOM_TARGET
        if self._recording:
            self._recording = False
            torch.cuda.memory._record_memory_history(enabled=None)
        if _OOM_TARGET is not None and _OOM_TARGET() is self:
            _OOM_TARGET = None
        self._trainer_ref = None

    def _trainer_step(self) -> int:
        trainer = self._trainer_ref() if self._trainer_ref is not None else None
        return trainer.global_step if trainer is not None else -1

    def _release(self, trainer: pl.Trainer) -> None:
        """What a fit leaves behind, whether it ended or failed: the probe, the recording, the exchange request."""
        if self._probe is not None:
            self._probe.stop()
            self._probe = None
        self._stop_recording()
        self._values.teardown(trainer)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if isinstance(exception, torch.cuda.OutOfMemoryError) and self._recording:
            step = self._trainer_step()
            if not any(path.endswith(f"-step{step}.pickle") for path in self.snapshots):
                self._dump("oom")  # no observer in this torch build, or it did not fire at this step
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


# -- pure helpers (tested without ranks) ------------------------------------------------------------------------
def summarize(rows: list[dict[str, float]], per_rank: bool = False) -> dict[str, float]:
    """The logged metrics from every rank's values (``rows[r]`` is rank ``r``'s): max, min and which rank."""
    metrics: dict[str, float] = {}

    def spread(key: str, values: list[float], scale: float, low_rank: bool = False) -> None:
        have = [(v, r) for r, v in enumerate(values) if v >= 0]
        if not have:
            return  # not available on any rank (CUDA values on CPU, NVML without the library)
        top, low = max(have), min(have)
        metrics[f"{key}_max"], metrics[f"{key}_min"] = top[0] * scale, low[0] * scale
        metrics[f"{key}_{'min' if low_rank else 'max'}_rank"] = float((low if low_rank else top)[1])

    column = {name: [row[name] for row in rows] for name in SLOTS}
    for name in _BYTES:
        spread(f"memory/{name}_mib", column[name], 1 / MiB)
    spread("memory/usage_pct", column["usage"], 100.0)
    for name in _COUNTS:
        spread(f"memory/{name}", column[name], 1.0)
    spread("memory/gpu_util_pct", column["gpu_util"], 1.0, low_rank=True)
    spread("memory/measured_mib", column["measured"], 1 / MiB)
    estimates = [v for v in column["estimate"] if v >= 0]
    if estimates:
        metrics["memory/estimate_mib_max"] = max(estimates) / MiB
        worst = max(range(len(rows)), key=lambda r: column["measured"][r])
        measured, estimate = column["measured"][worst], column["estimate"][worst]
        if measured > 0 and estimate >= 0:
            metrics["memory/estimate_error_pct"] = 100.0 * (estimate - measured) / measured
    if per_rank:
        for r, row in enumerate(rows):
            for name in ("rss", *_BYTES[2:], "measured"):
                if row[name] >= 0:
                    metrics[f"memory/rank{r}/{name}_mib"] = row[name] / MiB
            if row["usage"] >= 0:
                metrics[f"memory/rank{r}/usage_pct"] = 100.0 * row["usage"]
    return metrics


def _advice(est: MemoryEstimate) -> str:
    """What would shrink the largest parts, with the figures."""
    parts = est.parts
    tips = []
    if parts.get("activations", 0):
        tips.append(f"a smaller per-rank batch or bf16 mixed precision (activations: "
                    f"{parts['activations'] / 2**30:.2f} GiB)")
    if parts.get("ddp_buckets", 0):
        tips.append(f"strategy gradient_as_bucket_view=True (saves {parts['ddp_buckets'] / 2**30:.2f} GiB)")
    if parts.get("optimizer_state", 0) > parts.get("weights", 0):
        tips.append(f"an optimizer with less state (this one: {parts['optimizer_state'] / 2**30:.2f} GiB)")
    if parts.get("compressor_state", 0):
        tips.append(f"no error feedback or a compressor without it ({parts['compressor_state'] / 2**30:.2f} GiB)")
    if parts.get("optimizer_step", 0):
        tips.append("foreach=False or fused=True in the optimizer (its multi-tensor step holds "
                    f"{parts['optimizer_step'] / 2**30:.2f} GiB of temporaries)")
    tips.append("more ranks, or MemoryMonitor(preflight='off') to try anyway")
    return "To fit: " + "; ".join(tips) + "."


def _checkpoint_dir(trainer: pl.Trainer) -> str:
    callback = trainer.checkpoint_callback
    dirpath = getattr(callback, "dirpath", None) if callback is not None else None
    return dirpath or os.path.join(trainer.default_root_dir, "checkpoints")


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
