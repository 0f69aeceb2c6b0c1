"""``RingDDPStrategy``: Lightning's DDP with every gradient bucket routed through lightning_dist's hook.

What it changes in :class:`~lightning.pytorch.strategies.DDPStrategy`:

- registers :func:`~lightning_dist.strategy.hook.ring_comm_hook` on every device. Lightning's
  ``_register_ddp_hooks`` (private, hence the ``lightning>=2.6,<2.7`` pin and a test that fails if it goes)
  registers hooks only on CUDA and drops them silently on CPU;
- overlaps communication with backward: the hook returns a pending Future per bucket; work that would block
  (our ring's and tree's loops) runs on a :class:`~lightning_dist.strategy.comm_worker.CommWorker` thread,
  the backend's asynchronous all-reduce is issued right away; all of it on a process group of its own
  (``overlap=False`` reduces on the autograd thread instead);
- weights each rank's gradients by its share of the step in autograd (a hook on the loss's gradient, under
  automatic optimization), so the comm hook needs no pass of its own over the buckets;
- exchanges the step's control values and per-rank measurements in one small collective
  (:class:`~lightning_dist.strategy.exchange.StepExchange`), complete before the optimizer steps: every step
  when a feature registered a value all ranks must agree on (started after backward, when the values are
  final), otherwise only on the steps a feature requested (:meth:`RingDDPStrategy.request_exchange`), started
  alongside the last gradient bucket and hidden behind it;
- compresses the buckets with a :class:`~lightning_dist.compression.Compressor` (``compressor=``), commits its
  per-step state after the optimizer stepped, and saves every rank's state in checkpoints;
- with ``hetero=`` (:class:`~lightning_dist.hetero.HeteroBatching`), rebuilds the training loader so each
  rank's share of the global batch follows its speed, weights the gradients by sample count, and rebalances
  from the per-step exchange;
- skips a step on every rank together when any rank's loss or gradient is non-finite, once
  :class:`~lightning_dist.callbacks.NaNRecovery` arms :attr:`step_guard` (:mod:`lightning_dist.strategy.skip`):
  the closure runs first, then the optimizer steps or not, and the compressor commits or discards its state;
- keeps per-step metrics (bytes sent, time in communication, each rank's compute time and throughput) that
  :class:`~lightning_dist.callbacks.DistMetricsCallback` logs from rank zero. The strategy adds that
  callback to the Trainer itself when the user has not.
"""

from __future__ import annotations

import os
import warnings
from datetime import timedelta
from typing import Any, Callable, Literal, Optional, Union

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.distributed import _init_dist_connection
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.utilities.data import extract_batch_size
from lightning.pytorch.utilities.rank_zero import rank_zero_debug, rank_zero_info, rank_zero_warn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_dist.comm import check_algorithm, release_scratch
from lightning_dist.compression import Compressor, as_compressor
from lightning_dist.hetero import HeteroBatching, hetero_dataloader
from lightning_dist.hetero.batching import as_hetero
from lightning_dist.hetero.loader import prefetch_horizon
from lightning_dist.loss_scaler import LossScaler
from lightning_dist.strategy.comm_worker import CommWorker
from lightning_dist.strategy.exchange import StepExchange
from lightning_dist.strategy.features import RingFeatures
from lightning_dist.strategy.hook import RingHookState, ring_comm_hook
from lightning_dist.strategy.skip import StepGuard, StepVerdict
from lightning_dist.strategy.step_meter import PER_RANK_SLOTS, StepMeter

if not callable(getattr(DDPStrategy, "_register_ddp_hooks", None)):  # pragma: no cover - guarded by a test too
    raise ImportError(
        "lightning_dist needs DDPStrategy._register_ddp_hooks, which this Lightning release does not have; "
        "install lightning>=2.6,<2.7 (the range in lightning_dist's pyproject.toml)."
    )

DEFAULT_TIMEOUT_S = default_pg_timeout.total_seconds()  # torch.distributed's: a hung collective fails then
WORKER_JOIN_TIMEOUT_S = 10.0  # teardown waits this long for the communication worker to end
CHECKPOINT_KEY = "lightning_dist"  # the checkpoint's entry for every rank's compressor state


class RingDDPStrategy(DDPStrategy):
    """DDP whose gradient all-reduce is lightning_dist's ring, tree, native or size-chosen algorithm.

    The positional and keyword arguments are :class:`~lightning.pytorch.strategies.DDPStrategy`'s, in its
    order, so ring_ddp is a drop-in replacement; lightning_dist's own are keyword-only.

    Args:
        timeout: collective timeout in seconds or a ``timedelta`` (``None``: torch's default, 30 minutes):
            how long a rank waits for a peer that stalls before the job fails instead of hanging.
        start_method: ``"popen"`` (re-runs the script per rank, the robust default), ``"spawn"``,
            ``"forkserver"`` or ``"fork"`` (fastest start, works in notebooks, CPU or before CUDA is
            initialised).
        algorithm: ``"ring"``, ``"tree"``, ``"native"`` (the backend's all_reduce) or ``"auto"`` (at 3 or
            more ranks the tree below :data:`~lightning_dist.comm.AUTO_TREE_MAX_BYTES`, otherwise native;
            always native on NCCL).
        compressor: a :class:`~lightning_dist.compression.Compressor`, a name (``"topk"``, ``"powersgd"``, ...:
            :func:`~lightning_dist.compression.build_compressor` with its defaults), a dict of
            ``build_compressor``'s arguments, or ``None`` (no compression). Its state (residuals, factors,
            random generators) is saved in checkpoints for every rank, under ``"lightning_dist"``.
        hetero: a :class:`~lightning_dist.hetero.HeteroBatching` (or a dict of its arguments): per-rank batch
            sizes that follow each rank's speed, gradients weighted by sample count. None: even batches.
        overlap: ``True`` (default): a communication thread reduces each bucket while backward computes the
            next; ``False``: the hook blocks the autograd thread until its bucket has travelled.
        **kwargs: every other keyword of :class:`~torch.nn.parallel.DistributedDataParallel` that
            DDPStrategy passes through (``find_unused_parameters``, ``static_graph``, ``bucket_cap_mb``, ...).

    ``ddp_comm_state``, ``ddp_comm_hook``, ``ddp_comm_wrapper`` and ``model_averaging_period`` exist only
    to keep DDPStrategy's positions: anything but ``None`` is refused, since it would replace our hook.
    """

    def __init__(
        self,
        accelerator: Optional[Any] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
        ddp_comm_state: Optional[object] = None,
        ddp_comm_hook: Optional[Callable] = None,
        ddp_comm_wrapper: Optional[Callable] = None,
        model_averaging_period: Optional[int] = None,
        process_group_backend: Optional[str] = None,
        timeout: Union[float, timedelta, None] = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        *,
        algorithm: str = "auto",
        compressor: Union[Compressor, str, None] = None,
        overlap: bool = True,
        hetero: Union[HeteroBatching, dict, None] = None,
        **kwargs: Any,
    ) -> None:
        given = {"ddp_comm_state": ddp_comm_state, "ddp_comm_hook": ddp_comm_hook,
                 "ddp_comm_wrapper": ddp_comm_wrapper, "model_averaging_period": model_averaging_period}
        conflicting = sorted(name for name, value in given.items() if value is not None)
        if conflicting:
            raise ValueError(
                f"RingDDPStrategy installs its own DDP comm hook, so {conflicting} would collide with it. "
                "Remove them; to change how gradients travel use algorithm=... or compressor=..., or use "
                "Lightning's DDPStrategy if you need your own hook."
            )
        check_algorithm(algorithm)
        if start_method not in ("popen", "spawn", "fork", "forkserver"):
            raise ValueError(f"start_method={start_method!r}; use 'popen', 'spawn', 'fork' or 'forkserver'.")
        if not isinstance(overlap, bool):
            raise ValueError(f"overlap={overlap!r} must be True (reduce on a communication thread) or False.")
        super().__init__(
            accelerator=accelerator, parallel_devices=parallel_devices, cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io, precision_plugin=precision_plugin,
            process_group_backend=process_group_backend, timeout=_as_timedelta(timeout),
            start_method=start_method, **kwargs,
        )
        self._algorithm = algorithm
        self._overlap = overlap
        self._hetero = as_hetero(hetero)
        self._guard = StepGuard()
        self._hook_state = RingHookState(algorithm=algorithm, compressor=as_compressor(compressor), guard=self._guard)
        self._control: Optional[StepExchange] = None
        self._control_group: Optional[dist.ProcessGroup] = None  # the per-step control exchange's
        self._comm_group: Optional[dist.ProcessGroup] = None  # the gradient buckets'
        self._worker: Optional[CommWorker] = None
        self._meter = StepMeter()
        self._exchanged_this_step = False
        # feature -> every how many optimizer steps it needs every rank's measurements (request_exchange)
        self._exchange_every: dict[str, int] = {}
        self._features = RingFeatures(self)

    @property
    def features(self) -> RingFeatures:
        """The seam through which callbacks, experiments and benchmarks use this strategy."""
        return self._features

    @property
    def algorithm(self) -> str:
        return self._algorithm

    @property
    def overlap(self) -> bool:
        return self._overlap

    @property
    def last_step(self) -> dict[str, float]:
        """This rank's own measurements of its last optimizer step (no collective involved)."""
        return self._meter.last_step

    @property
    def step_metrics(self) -> dict[str, float]:
        """What DistMetricsCallback logs: every rank's measurements of the step before the last exchange,
        identical on every rank; they ride on that exchange, so they arrive one step late."""
        return self._meter.step_metrics

    @property
    def step_metrics_step(self) -> int:
        """The optimizer step at which :attr:`step_metrics` was last refreshed (-1: not yet)."""
        return self._meter.step_metrics_step

    @property
    def last_exchange_step(self) -> int:
        """The value of :attr:`steps_done` during the step whose exchange completed last (-1: none yet): a
        feature that filled per-rank slots on step ``s`` reads them while this equals ``s``."""
        step = self._meter.step_metrics_step
        return step - 1 if step >= 0 else -1

    @property
    def steps_done(self) -> int:
        """Optimizer steps (taken or skipped) since this fit started: the same count on every rank."""
        return self._meter.steps_done

    @property
    def totals(self) -> dict[str, float]:
        """This rank's running totals over the fit: steps, bytes sent, comm and exposed seconds, samples."""
        return self._meter.totals

    @property
    def compressor(self) -> Compressor:
        """The gradient compressor (its state is staged per step: ``commit`` after the optimizer stepped,
        ``discard`` when the ranks agreed to skip)."""
        return self._hook_state.compressor

    @property
    def hook_state(self) -> RingHookState:
        return self._hook_state

    @property
    def step_guard(self) -> StepGuard:
        """The step-or-skip mechanism; inactive until armed (:class:`~lightning_dist.callbacks.NaNRecovery`
        arms it). Its :meth:`~lightning_dist.strategy.skip.StepGuard.pop_verdicts` tells what each step did."""
        return self._guard

    @property
    def control_group(self) -> Optional[dist.ProcessGroup]:
        """The strategy's own gloo group (CPU tensors on every backend; None with one rank)."""
        return self._control_group

    @property
    def loss_scaler(self) -> Optional[torch.amp.GradScaler]:
        """The precision plugin's gradient scaler (fp16 mixed precision), or None."""
        scaler = getattr(self.precision_plugin, "scaler", None)
        return scaler if isinstance(scaler, torch.amp.GradScaler) and scaler.is_enabled() else None

    def request_exchange(self, every_n_steps: int, name: str = "metrics") -> None:
        """Carry every rank's per-rank slots to all ranks on every ``every_n_steps``-th optimizer step, for the
        feature ``name`` (DistMetricsCallback: ``"metrics"``; callbacks built on
        :class:`~lightning_dist.callbacks.rank_values.RankValues`: their feature name); 0 withdraws the
        request. The exchange happens on a step when any request's interval divides the step count (and on
        every step when an agreed slot is registered), the same steps on every rank."""
        if isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int) or every_n_steps < 0:
            raise ValueError(f"every_n_steps={every_n_steps!r} must be an int >= 1, or 0 to withdraw {name!r}")
        if every_n_steps:
            self._exchange_every[name] = every_n_steps
        else:
            self._exchange_every.pop(name, None)

    def request_metrics(self, every_n_steps: int) -> None:
        """:meth:`request_exchange` for DistMetricsCallback's logging steps (0: none, as with
        ``Trainer(log_every_n_steps=0)``)."""
        self.request_exchange(every_n_steps, "metrics")

    def exchange_due(self, every_n_steps: int) -> bool:
        """Whether the coming (or current) optimizer step is one of ``every_n_steps``'s: the test a feature that
        requested that interval uses to decide whether to fill its slots (the same answer on every rank)."""
        return every_n_steps > 0 and self._meter.steps_done % every_n_steps == 0

    @property
    def control(self) -> StepExchange:
        """The per-step exchange; features register their slots on it in a callback's ``setup`` or later."""
        if self._control is None:
            if not dist.is_initialized():
                raise RuntimeError("the step control exists once the processes have started (inside Trainer.fit)")
            self._control = StepExchange(self.global_rank, self.world_size)
            for name in PER_RANK_SLOTS:
                self._control.register(f"rank_{name}", per_rank=True)
        return self._control

    # -- set-up ---------------------------------------------------------------------------------------------
    @override
    def setup_distributed(self) -> None:
        store = _attempt_store(self._timeout)
        if store is None:
            super().setup_distributed()
            return
        # DDPStrategy.setup_distributed, with the store of this attempt
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = self._get_process_group_backend()
        assert self.cluster_environment is not None
        device_id = self.root_device if self.root_device.type != "cpu" else None
        _init_dist_connection(self.cluster_environment, self._process_group_backend, timeout=self._timeout,
                              device_id=device_id, store=store)

    @override
    def _configure_launcher(self) -> None:
        # When torchrun, SLURM or another launcher created the processes, every rank already runs this script:
        # launch nothing, whatever start_method says. (Lightning's own DDPStrategy with "fork" or "spawn"
        # forks N more ranks inside each worker.) The subprocess launcher is the one that checks for this.
        assert self.cluster_environment is not None
        if self._hetero is not None and self.parallel_devices:  # list lengths, in the launching process
            self._hetero.check_world(self.num_nodes * len(self.parallel_devices))
        if self._start_method != "popen" and self.cluster_environment.creates_processes_externally:
            rank_zero_info(
                f"RingDDPStrategy: {type(self.cluster_environment).__name__} created the processes; "
                f"start_method={self._start_method!r} launches none of its own."
            )
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
            return
        super()._configure_launcher()

    @override
    def setup(self, trainer: Any) -> None:
        from lightning_dist.callbacks.dist_metrics import DistMetricsCallback

        # as stock DDP: barebones mode (it also sets log_every_n_steps=0) runs no logging callback
        wanted = not getattr(trainer, "barebones", False)
        if wanted and not any(isinstance(cb, DistMetricsCallback) for cb in trainer.callbacks):
            trainer.callbacks.append(DistMetricsCallback())
        super().setup(trainer)

    @override
    def _register_ddp_hooks(self) -> None:
        # Lightning registers hooks only when root_device is CUDA; ours must run on CPU as well.
        assert isinstance(self.model, DistributedDataParallel)
        self._stop_worker()  # a fit that failed before teardown may have left one
        # Two groups of our own, made by every rank here in the same order: the gradient buckets' (the
        # default backend, so NCCL for CUDA tensors), driven by the worker thread, never interleaving with
        # what DDP and Lightning run on the default group from the main thread; and the control vector's,
        # a CPU tensor on every backend, so gloo.
        if self.world_size > 1:
            self._comm_group = dist.new_group(timeout=self._timeout)
            self._control_group = dist.new_group(backend="gloo", timeout=self._timeout)
        state = self._hook_state
        state.world_size = self.world_size
        state.process_group = self._comm_group
        state.rank = dist.get_rank(self._comm_group) if self._comm_group is not None else 0
        state.transport = None
        state._layouts.clear()
        state._dense_bytes.clear()
        state.param_names = {id(p): name for name, p in self.model.module.named_parameters()}
        state.on_last_bucket = self._start_exchange_early
        if self._overlap:
            device = self.root_device
            on_start = (lambda: torch.cuda.set_device(device)) if device.type == "cuda" else None
            self._worker = state.worker = CommWorker(name=f"rank{self.global_rank}", on_start=on_start).start()
        self.model.register_comm_hook(state, ring_comm_hook)

    def _stop_worker(self) -> None:
        worker, self._worker = self._worker, None
        self._hook_state.worker = None
        if worker is not None and not worker.stop(WORKER_JOIN_TIMEOUT_S):
            rank_zero_warn(
                f"{worker.name} is still blocked in a collective {WORKER_JOIN_TIMEOUT_S:.0f}s after teardown "
                "(a peer stopped answering); it is a daemon thread and ends with the process."
            )

    # -- each step --------------------------------------------------------------------------------------------
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        batch = args[0] if args else kwargs.get("batch")
        self._meter.batch_started(_batch_size(batch))
        if self._hetero is not None and self._hetero.sampler is not None:
            self._weigh_hetero_batch(args[1] if len(args) > 1 else kwargs["batch_idx"])
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

        if not self._guard.armed:
            output = super().optimizer_step(optimizer, closure_then_agree, model, **kwargs)
            if agreed:
                self._finish_step()
            return output
        # The step-or-skip point: backward first, then every rank decides alike whether the optimizer steps.
        result = closure_then_agree()
        verdict = self._decide(optimizer)
        if verdict.skipped:
            self._skip_step(optimizer)
            return result
        output = super().optimizer_step(optimizer, _replay(result, closure_then_agree), model, **kwargs)
        self._finish_step()
        return output

    def _decide(self, optimizer: Any) -> StepVerdict:
        scaler = self.loss_scaler
        if scaler is not None and not isinstance(scaler, LossScaler):
            raise RuntimeError(f"the step guard needs lightning_dist's LossScaler, the precision plugin holds a "
                               f"{type(scaler).__name__}; NaNRecovery swaps it in at setup")
        return self._guard.decide(optimizer, scaler, self._control_group, self.global_rank, self.world_size,
                                  step=self.lightning_module.trainer.global_step)

    def _skip_step(self, optimizer: Any) -> None:
        """Every rank together: no optimizer step, the compressor's staged state dropped, the scale backed off."""
        scaler = self.loss_scaler
        if isinstance(scaler, LossScaler):
            scaler.skip(optimizer)
            scaler.update()
        state = self._hook_state
        state.compressor.discard()
        self._meter.step_finished(state.stats, state.exposed_s)
        state.reset_step()
        self._exchanged_this_step = False

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        # Weight this rank's gradients in autograd: a hook on the loss multiplies the gradient flowing out of
        # it by the rank's share, so the buckets arrive weighted and the comm hook saves a pass over each.
        # The loss itself (what callbacks and loggers see) is untouched; the hook is removed right after.
        # Only under automatic optimization: there Lightning zeroes the gradients at the start of each
        # accumulation window and runs the window's other backward passes under no_sync, so a bucket never
        # holds already-reduced gradients, which would then be summed again unweighted. Manual optimization
        # may backward twice without zero_grad; the hook weights the whole bucket then, as stock DDP does.
        # With the step guard armed, the same hook also turns a non-finite loss into a NaN gradient, which
        # every rank then sees in the reduced buckets (lightning_dist.strategy.skip), under manual optimization
        # too. Under fp16 loss scaling the compressor learns the step's scale first.
        state = self._hook_state
        automatic = self.lightning_module.automatic_optimization
        scale = state.loss_gradient_scale() if automatic else 1.0
        handle = None
        self._follow_loss_scale()
        if self._guard.armed:
            if closure_loss.requires_grad:
                factor = self._guard.loss_factor(closure_loss, scale)
                handle = closure_loss.register_hook(lambda grad: grad * factor)
                state.weighted_in_autograd = automatic
        elif scale != 1.0 and closure_loss.requires_grad and automatic:
            handle = closure_loss.register_hook(lambda grad: grad * scale)
            state.weighted_in_autograd = True
        try:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        finally:
            if handle is not None:
                handle.remove()
            state.weighted_in_autograd = False

    def _follow_loss_scale(self) -> None:
        """Under fp16 loss scaling the buckets carry the scale: the compressor learns it (residuals in scaled
        units follow it, thresholds apply to unscaled values), and the scaler's own unscale_ is the agreed
        check, so the hook's reduced sums are not needed."""
        scaler, state = self.loss_scaler, self._hook_state
        state.check_reduced = scaler is None
        if scaler is not None and state.compressor.lossy:
            # LossScaler keeps its scale as a float; torch's GradScaler needs a device synchronisation to read it
            state.compressor.set_grad_scale(scaler.scale_value if isinstance(scaler, LossScaler)
                                            else scaler.get_scale())

    @override
    def post_backward(self, closure_loss: Any) -> None:
        # every bucket's Future is complete once backward returns (DDP waited for them)
        self._hook_state.close_backward()
        super().post_backward(closure_loss)

    def _exchange_due(self) -> bool:
        """Every step when a feature needs agreed values, else on logging steps: the same answer on every rank."""
        if self.control.has_agreed or (self._hetero is not None and self._hetero.rebalance):
            return True
        return any(self.exchange_due(every) for every in self._exchange_every.values())

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
        self._meter.backward_done()
        if self._exchanged_this_step:  # a closure evaluated twice (LBFGS): one exchange per step
            return
        self._start_exchange()
        if self.control.in_flight:
            self.control.wait()
            self._exchanged_this_step = True
            self._meter.exchanged(self.control, self.world_size)
            if self._hetero is not None and self._hetero.rebalance and self._hetero.sampler is not None:
                self._consider_rebalance()

    # -- heterogeneous batching ----------------------------------------------------------------------------------
    @override
    def process_dataloader(self, dataloader: object) -> object:
        dataloader = super().process_dataloader(dataloader)
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if self._hetero is None or trainer is None or not trainer.training or not isinstance(dataloader, DataLoader):
            return dataloader  # validation and test loaders keep their own settings
        loader = hetero_dataloader(dataloader, self._hetero, self.world_size, self.global_rank)
        self._hetero.sampler, self._hetero.horizon = loader.batch_sampler, prefetch_horizon(loader)
        return loader

    def _weigh_hetero_batch(self, batch_idx: int) -> None:
        """This rank's share of the step's samples, from the plan every rank shares (before any bucket travels)."""
        trainer, hetero = self.lightning_module.trainer, self._hetero
        assert hetero is not None
        epoch = trainer.current_epoch
        self._hook_state.weight = hetero.loss_scale(epoch, batch_idx, self.global_rank)
        hetero.sampler.consumed = (epoch, batch_idx + 1)

    def _consider_rebalance(self) -> None:
        """After the exchange: every rank holds the same measurements, so every rank decides alike."""
        hetero, control = self._hetero, self.control
        assert hetero is not None
        event = hetero.after_exchange(control.per_rank("rank_compute_s"), control.per_rank("rank_samples"),
                                      self._meter.steps_done, self.lightning_module.trainer.num_training_batches)
        if event is not None:
            rank_zero_info(f"RingDDPStrategy: compute-time spread {100 * event['spread']:.1f}% -> batch sizes "
                           f"{event['old']} -> {event['new']} from batch {event['from_step']}")
            if "capped" in event:
                rank_zero_info(f"RingDDPStrategy: a batch-size cap binds: {event['new']} instead of "
                               f"{event['capped']['without_caps']}, ~{100 * event['capped']['step_time_lost']:.0f}% "
                               "longer steps than without it")
        if self._meter.step_metrics:  # empty on the first step: no previous step to describe
            self._meter.step_metrics["hetero/rebalances"] = float(len(hetero.events))

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        self._reset_run()

    def _reset_run(self) -> None:
        """A new fit starts counting afresh (the same strategy object may fit twice)."""
        self._meter.reset()
        self._exchanged_this_step = False
        self._hook_state.reset_step()

    @override
    def on_train_end(self) -> None:
        if self._control is not None and self._control.in_flight:
            self._control.wait()  # every rank started it, so every rank can finish it
        super().on_train_end()

    @override
    def teardown(self) -> None:
        self._stop_worker()  # first: it may still use the comm group
        for group in (self._comm_group, self._control_group):
            if group is not None and dist.is_initialized():
                try:
                    dist.destroy_process_group(group)
                except (RuntimeError, ValueError) as err:  # already gone with the default group after a fault
                    rank_zero_debug(f"RingDDPStrategy.teardown: {type(err).__name__}: {err}")
        self._comm_group = self._control_group = None
        self._hook_state.process_group = self._hook_state.transport = None
        release_scratch()
        super().teardown()

    def _finish_step(self) -> None:
        """Record this step's own measurements; the next exchange carries them to every rank."""
        state = self._hook_state
        state.compressor.commit()  # the optimizer stepped: the compressor's staged state becomes its state
        self._meter.step_finished(state.stats, state.exposed_s)
        state.reset_step()
        self._exchanged_this_step = False

    # -- checkpoints ----------------------------------------------------------------------------------------
    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        # Every rank calls this (Lightning's trainer.save_checkpoint); rank zero writes. Each rank's compressor
        # state (residuals, random generator) is its own, so all of them travel to rank zero first.
        states = self._gather_compressor_states()
        if self.is_global_zero:
            checkpoint = {**checkpoint, **self._compressor_entry(states)}
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def local_checkpoint_state(self) -> dict[str, Any]:
        """What :meth:`save_checkpoint` adds, with this rank's compressor state only and no collective: for an
        emergency checkpoint written by one rank while the others may be gone. The other ranks' entries are
        None; a run resumed from it restarts their per-rank state (residuals, generators) at zero."""
        ranks: list[Any] = [None] * self.world_size
        ranks[self.global_rank] = self.compressor.state_dict()
        return self._compressor_entry(ranks)

    def _compressor_entry(self, ranks: list[Any]) -> dict[str, Any]:
        """The checkpoint's entry for the compressor: its description and every rank's state (None: not saved)."""
        return {CHECKPOINT_KEY: {"compressor": {"describe": self.compressor.describe(), "world_size": self.world_size,
                                                "ranks": ranks}}}

    def _gather_compressor_states(self) -> list[dict[str, Any]]:
        mine = self.compressor.state_dict()
        if self.world_size == 1 or not dist.is_initialized():
            return [mine]
        everyone: list[Any] = [None] * self.world_size
        dist.all_gather_object(everyone, mine, group=self._control_group)
        return everyone

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        super().load_model_state_dict(checkpoint, strict=strict)
        self._restore_compressor(checkpoint)

    def _restore_compressor(self, checkpoint: dict[str, Any]) -> None:
        """This rank's compressor state from a checkpoint; what cannot apply starts afresh, with a warning."""
        compressor = self.compressor
        saved = (checkpoint.get(CHECKPOINT_KEY) or {}).get("compressor")
        if saved is None:
            if compressor.lossy:
                rank_zero_warn(f"The checkpoint holds no compressor state (it was written by another strategy): "
                               f"{compressor.describe()} starts with zero residuals and fresh factors.")
            return
        if saved["describe"] != compressor.describe():
            rank_zero_warn(f"The checkpoint's compressor was {saved['describe']}, this run's is "
                           f"{compressor.describe()}: its state starts afresh.")
            return
        ranks = saved["ranks"]
        first = next(state for state in ranks if state is not None)  # shared state is the same on every rank
        if saved["world_size"] == self.world_size and ranks[self.global_rank] is not None:
            compressor.load_state_dict(ranks[self.global_rank])
        elif saved["world_size"] == self.world_size:  # an emergency checkpoint: another rank's state only
            if compressor.lossy:
                warnings.warn(f"rank {self.global_rank}: the checkpoint holds another rank's compressor state only "
                              "(an emergency checkpoint): this rank's error-feedback residuals and generators restart "
                              "at zero; shared state (step count, PowerSGD factors) is restored.", stacklevel=2)
            compressor.load_state_dict(first, shared_only=True)
        else:
            rank_zero_warn(f"The checkpoint was written by {saved['world_size']} ranks, this run has "
                           f"{self.world_size}: per-rank compressor state (error-feedback residuals, random "
                           "generators) starts afresh; shared state (step count, PowerSGD factors) is restored.")
            compressor.load_state_dict(first, shared_only=True)

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


def _replay(result: Any, closure: Callable[[], Any]) -> Callable[[], Any]:
    """A closure whose first call returns ``result`` (backward already ran) and whose later calls (LBFGS
    evaluates several times per step) run ``closure`` again."""
    calls = 0

    def replay() -> Any:
        nonlocal calls
        calls += 1
        return result if calls == 1 else closure()

    return replay


def _attempt_store(timeout: timedelta) -> Optional[dist.Store]:
    """Under torchrun's agent store, a view of it private to this restart attempt (None elsewhere).

    torch 2.13 initialises the default group on the agent's store without a per-attempt prefix (it assumes a new
    store per attempt), but torchrun's c10d rendezvous keeps one store for the agent's life: after a restart, a
    rank can read the previous attempt's peer addresses and fail with "Gloo connectFullMesh failed ... Connection
    refused" (seen in 3 of 5 restarts here). The prefix keeps every attempt's keys apart.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or "MASTER_ADDR" not in os.environ:
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timeout, wait_for_workers=False)
    return dist.PrefixStore(f"lightning_dist/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def _as_timedelta(timeout: Union[float, int, timedelta, None]) -> timedelta:
    if timeout is None:  # as DDPStrategy: torch's default
        return default_pg_timeout
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
    if not isinstance(seconds, (int, float)) or isinstance(seconds, bool) or seconds <= 0:
        raise ValueError(f"timeout={timeout!r} must be a positive number of seconds (default {DEFAULT_TIMEOUT_S}).")
    return timedelta(seconds=float(seconds))


def _batch_size(batch: Any) -> int:
    try:
        return int(extract_batch_size(batch))
    except Exception:  # noqa: BLE001 - batches without tensors count as zero samples, not as an error
        return 0
