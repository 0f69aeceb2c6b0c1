"""``RingDDPStrategy``: Lightning's DDP with every gradient bucket routed through lightning_dist's hook.

What it changes in :class:`~lightning.pytorch.strategies.DDPStrategy`:

- registers :func:`~lightning_dist.strategy.hook.ring_comm_hook` on every device. Lightning's
  ``_register_ddp_hooks`` (private, hence the ``lightning>=2.6,<2.7`` pin and a test that fails if it goes)
  registers hooks only on CUDA and drops them silently on CPU;
- exchanges the step's control values and per-rank measurements in one small collective
  (:class:`~lightning_dist.strategy.control.StepControl`), complete before the optimizer steps: every step
  when a feature registered a value all ranks must agree on (started after backward, when the values are
  final), otherwise only on logging steps, started alongside the last gradient bucket and hidden behind it;
- keeps per-step metrics (bytes sent, time in communication, each rank's compute time and throughput) that
  :class:`~lightning_dist.callbacks.DistMetricsCallback` logs from rank zero. The strategy adds that
  callback to the Trainer itself when the user has not.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any, Callable, Optional, Union

import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities.data import extract_batch_size
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_dist.comm import check_algorithm, release_scratch
from lightning_dist.compression import Compressor, NoCompressor
from lightning_dist.strategy.control import StepControl
from lightning_dist.strategy.hook import RingHookState, ring_comm_hook

if not callable(getattr(DDPStrategy, "_register_ddp_hooks", None)):  # pragma: no cover - guarded by a test too
    raise ImportError(
        "lightning_dist needs DDPStrategy._register_ddp_hooks, which this Lightning release does not have; "
        "install lightning>=2.6,<2.7 (the range in lightning_dist's pyproject.toml)."
    )

# Keywords of DDPStrategy that would install a second hook or average models behind ours.
_CONFLICTING_KWARGS = ("ddp_comm_hook", "ddp_comm_state", "ddp_comm_wrapper", "model_averaging_period")
DEFAULT_TIMEOUT_S = 1800.0  # torch.distributed's default; a hung collective fails after this long

# Per-rank slots of the exchange: what each rank measured in the previous step. (Agreed slots, summed over
# ranks, are registered by the features that act on them.)
_PER_RANK_SLOTS = ("samples", "compute_s", "comm_s", "bytes_sent", "step_s")


class RingDDPStrategy(DDPStrategy):
    """DDP whose gradient all-reduce is lightning_dist's ring, tree, native or size-chosen algorithm.

    Args:
        algorithm: ``"ring"``, ``"tree"``, ``"native"`` (the backend's all_reduce) or ``"auto"`` (the tree at
            2 ranks; at more, the tree below :data:`~lightning_dist.comm.AUTO_TREE_MAX_BYTES` and the ring
            above; native on NCCL).
        compressor: a :class:`~lightning_dist.compression.Compressor`, ``"none"`` or ``None`` (no compression).
        timeout: collective timeout in seconds (or a ``timedelta``): how long a rank waits for a peer
            that stalls before the job fails instead of hanging.
        start_method: ``"popen"`` (re-runs the script per rank, the robust default), ``"spawn"``, or
            ``"fork"`` (fastest start, works in notebooks, CPU or before CUDA is initialised).
        **kwargs: every other :class:`~lightning.pytorch.strategies.DDPStrategy` keyword
            (``find_unused_parameters``, ``static_graph``, ``process_group_backend``, ...).
    """

    def __init__(
        self,
        algorithm: str = "auto",
        compressor: Union[Compressor, str, None] = None,
        timeout: Union[float, timedelta] = DEFAULT_TIMEOUT_S,
        start_method: str = "popen",
        **kwargs: Any,
    ) -> None:
        conflicting = [k for k in _CONFLICTING_KWARGS if k in kwargs]
        if conflicting:
            raise ValueError(
                f"RingDDPStrategy installs its own DDP comm hook, so {conflicting} would collide with it. "
                "Remove them; to change how gradients travel use algorithm=... or compressor=..., or use "
                "Lightning's DDPStrategy if you need your own hook."
            )
        check_algorithm(algorithm)
        if start_method not in ("popen", "spawn", "fork", "forkserver"):
            raise ValueError(f"start_method={start_method!r}; use 'popen', 'spawn', 'fork' or 'forkserver'.")
        super().__init__(timeout=_as_timedelta(timeout), start_method=start_method, **kwargs)
        self._algorithm = algorithm
        self._hook_state = RingHookState(algorithm=algorithm, compressor=_as_compressor(compressor))
        self._control: Optional[StepControl] = None
        self._control_group: Optional[dist.ProcessGroup] = None
        self._step_started: Optional[float] = None  # perf_counter at the first training_step of a step
        self._backward_done: Optional[float] = None
        self._last_step_end: Optional[float] = None
        self._samples = 0  # samples this rank used in the current step
        self._steps_done = 0  # optimizer steps since fit started: the same count on every rank
        self._exchanged_this_step = False
        self._metrics_every: Optional[int] = None  # set by DistMetricsCallback.request
        # this rank's own measurements of the last step, always available, no collective involved
        self.last_step: dict[str, float] = {}
        # what DistMetricsCallback logs: every rank's measurements of the step before the last exchange,
        # identical on every rank; they ride on that exchange, so they arrive one step late
        self.step_metrics: dict[str, float] = {}
        self.step_metrics_step = -1  # the value of ``_steps_done`` when step_metrics was last refreshed
        # this rank's running totals over the run (for summary.json)
        self.totals: dict[str, float] = {"steps": 0, "bytes_sent": 0.0, "comm_s": 0.0, "samples": 0.0}

    @property
    def algorithm(self) -> str:
        return self._algorithm

    @property
    def hook_state(self) -> RingHookState:
        return self._hook_state

    def request_metrics(self, every_n_steps: int) -> None:
        """Gather every rank's measurements to all ranks on every ``every_n_steps``-th step (for logging)."""
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps={every_n_steps} must be >= 1")
        self._metrics_every = every_n_steps

    @property
    def control(self) -> StepControl:
        """The per-step exchange; features register their slots on it in a callback's ``setup`` or later."""
        if self._control is None:
            if not dist.is_initialized():
                raise RuntimeError("the step control exists once the processes have started (inside Trainer.fit)")
            self._control = StepControl(self.global_rank, self.world_size)
            for name in _PER_RANK_SLOTS:
                self._control.register(f"rank_{name}", per_rank=True)
        return self._control

    # -- set-up ---------------------------------------------------------------------------------------------
    @override
    def setup(self, trainer: Any) -> None:
        from lightning_dist.callbacks.dist_metrics import DistMetricsCallback

        if not any(isinstance(cb, DistMetricsCallback) for cb in trainer.callbacks):
            trainer.callbacks.append(DistMetricsCallback())
        super().setup(trainer)

    @override
    def _register_ddp_hooks(self) -> None:
        # Lightning registers hooks only when root_device is CUDA; ours must run on CPU as well.
        assert isinstance(self.model, DistributedDataParallel)
        state = self._hook_state
        state.world_size = self.world_size
        state.param_names = {id(p): name for name, p in self.model.module.named_parameters()}
        state.on_last_bucket = self._start_exchange_early
        self.model.register_comm_hook(state, ring_comm_hook)
        # The control vector is a CPU tensor on every backend, and on its own group it cannot interleave
        # with the gradients' point-to-point traffic. Every rank creates the group here, in the same order.
        self._control_group = dist.new_group(backend="gloo", timeout=self._timeout) if self.world_size > 1 else None

    # -- each step --------------------------------------------------------------------------------------------
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._step_started is None:
            self._step_started = time.perf_counter()
        batch = args[0] if args else kwargs.get("batch")
        self._samples += _batch_size(batch)
        return super().training_step(*args, **kwargs)

    @override
    def optimizer_step(
        self,
        optimizer: Any,
        closure: Callable[[], Any],
        model: Any = None,
        **kwargs: Any,
    ) -> Any:
        agreed = False

        def closure_then_agree() -> Any:
            # Runs backward (and with it every bucket hook), then completes the step's exchange, so every
            # rank holds the same control values before any parameter changes.
            nonlocal agreed
            result = closure()
            if not agreed:
                agreed = True
                self._complete_exchange()
            return result

        output = super().optimizer_step(optimizer, closure_then_agree, model, **kwargs)
        if agreed:
            self._finish_step()
        return output

    def _exchange_due(self) -> bool:
        """Every step when a feature needs agreed values, else on logging steps: the same answer on every rank."""
        if self.control.has_agreed:
            return True
        return self._metrics_every is not None and self._steps_done % self._metrics_every == 0

    def _start_exchange_early(self) -> None:
        """From the last bucket's hook: start now only if every value in the vector is already final.

        Per-rank measurements describe the previous step, so they are; agreed values may still be set
        after this point (in the last bucket's own checks, in ``on_after_backward``), so with any agreed slot
        registered, or under manual optimization (a backward need not be followed by a step), the exchange
        waits until backward is over.
        """
        if self.control.has_agreed or not self.lightning_module.automatic_optimization:
            return
        self._start_exchange()

    def _start_exchange(self) -> None:
        control = self.control
        if control.in_flight or self._exchanged_this_step or not self._exchange_due():
            return
        for name, value in self.last_step.items():  # this rank's complete measurements of the previous step
            control.set(f"rank_{name}", value)
        control.start(self._control_group)

    def _complete_exchange(self) -> None:
        """After backward: start the exchange if it is due and not started yet, and wait for it."""
        self._backward_done = time.perf_counter()
        if self._exchanged_this_step:  # a closure evaluated twice (LBFGS): one exchange per step
            return
        self._start_exchange()
        if self.control.in_flight:
            self.control.wait()
            self._exchanged_this_step = True
            self.step_metrics = _metrics_from(self.control, self.world_size)
            self.step_metrics_step = self._steps_done + 1

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        # a new fit starts counting afresh (the same strategy object may fit twice)
        self._steps_done = 0
        self._step_started = self._backward_done = self._last_step_end = None
        self._samples = 0
        self._exchanged_this_step = False
        self.last_step, self.step_metrics, self.step_metrics_step = {}, {}, -1
        self.totals = {"steps": 0, "bytes_sent": 0.0, "comm_s": 0.0, "samples": 0.0}

    @override
    def on_train_end(self) -> None:
        if self._control is not None and self._control.in_flight:
            self._control.wait()  # every rank started it, so every rank can finish it
        super().on_train_end()

    @override
    def teardown(self) -> None:
        if self._control_group is not None and dist.is_initialized():
            dist.destroy_process_group(self._control_group)
        self._control_group = None
        release_scratch()
        super().teardown()

    def _finish_step(self) -> None:
        """Record this step's own measurements; the next exchange carries them to every rank."""
        now = time.perf_counter()
        stats = self._hook_state.stats
        started = self._step_started or now
        step_s = now - (self._last_step_end or started)
        self.last_step = {
            "samples": float(self._samples),
            "compute_s": max((self._backward_done or now) - started - stats.seconds, 0.0),  # excludes comm
            "comm_s": stats.seconds,
            "bytes_sent": float(stats.bytes_sent),
            "step_s": step_s,
        }
        self.totals["steps"] += 1
        self.totals["bytes_sent"] += stats.bytes_sent
        self.totals["comm_s"] += stats.seconds
        self.totals["samples"] += self._samples
        stats.reset()
        self._samples = 0
        self._steps_done += 1
        self._exchanged_this_step = False
        self._last_step_end, self._step_started, self._backward_done = now, None, None

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        for name, start_method in (
            ("ring_ddp", "popen"),
            ("ring_ddp_spawn", "spawn"),
            ("ring_ddp_fork", "fork"),
            ("ring_ddp_notebook", "fork"),
        ):
            strategy_registry.register(
                name, cls, description=f"Ring all-reduce DDP, start_method={start_method!r}",
                override=True, start_method=start_method,
            )
            strategy_registry.register(
                f"{name}_find_unused_parameters_true", cls,
                description=f"Ring all-reduce DDP, find_unused_parameters=True, start_method={start_method!r}",
                override=True, start_method=start_method, find_unused_parameters=True,
            )


def _metrics_from(control: StepControl, world_size: int) -> dict[str, float]:
    """The logged metrics, from the per-rank rows of an exchange (they describe the previous step)."""
    step = control.per_rank("rank_step_s")
    if max(step) <= 0:
        return {}  # the first step's exchange carries no previous step
    samples = control.per_rank("rank_samples")
    compute = control.per_rank("rank_compute_s")
    comm = control.per_rank("rank_comm_s")
    sent = control.per_rank("rank_bytes_sent")
    metrics = {
        "dist/step_time_ms": 1e3 * max(step),
        "dist/throughput": sum(samples) / max(step),
        "dist/comm_ms": 1e3 * max(comm),
        "dist/bytes_sent_per_rank": sum(sent) / world_size,
        "dist/straggler_ratio": max(compute) / min(compute) if min(compute) > 0 else 1.0,
    }
    for r in range(world_size):
        metrics[f"dist/rank{r}/compute_ms"] = 1e3 * compute[r]
        metrics[f"dist/rank{r}/comm_ms"] = 1e3 * comm[r]
        metrics[f"dist/rank{r}/samples_per_s"] = samples[r] / compute[r] if compute[r] > 0 else 0.0
        metrics[f"dist/rank{r}/bytes_sent"] = sent[r]
    return metrics


def _as_timedelta(timeout: Union[float, int, timedelta]) -> timedelta:
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
    if not isinstance(seconds, (int, float)) or isinstance(seconds, bool) or seconds <= 0:
        raise ValueError(f"timeout={timeout!r} must be a positive number of seconds (default {DEFAULT_TIMEOUT_S}).")
    return timedelta(seconds=float(seconds))


def _as_compressor(compressor: Union[Compressor, str, None]) -> Compressor:
    if compressor is None or compressor == "none":
        return NoCompressor()
    if isinstance(compressor, Compressor):
        return compressor
    raise ValueError(
        f"compressor={compressor!r}: pass a lightning_dist.compression.Compressor instance or 'none'."
    )


def _batch_size(batch: Any) -> int:
    try:
        return int(extract_batch_size(batch))
    except Exception:  # noqa: BLE001 - batches without tensors count as zero samples, not as an error
        return 0
