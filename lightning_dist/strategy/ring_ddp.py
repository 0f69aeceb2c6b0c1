"""``RingDDPStrategy``: Lightning's DDP with every gradient bucket routed through lightning_dist's hook; like
Lightning's :class:`~lightning.pytorch.strategies.DDPStrategy`, overrides that delegate to mechanisms beside it:

- :mod:`.hook` (with :mod:`.comm_worker`): the DDP comm hook, registered on every device (Lightning registers hooks
  only on CUDA: :class:`lightning_dist.upstream.DDPBase`'s ``register_comm_hooks``), two-tier through :mod:`.tiers`;
  with ``overlap=True`` each bucket travels on a communication thread while backward computes the next;
- :mod:`.stepping`: the rank's share of the step in autograd, step-or-skip on every rank together (:mod:`.skip` the
  mechanism, :class:`~lightning_dist.callbacks.NaNRecovery` the policy);
- :mod:`.schedule` (with :mod:`.exchange`, stepped by :mod:`.cycle`): the one small per-step exchange, complete before
  the optimizer steps; :mod:`.step_meter` and :mod:`.dist_metrics`: each rank's measurements, logged by DistMetrics;
- :mod:`.checkpoint`: every rank's compressor state in checkpoints, and its restore;
- :mod:`lightning_dist.hetero`: ``hetero=``'s loader, each rank's share following its speed; :mod:`.micro` runs a
  share above the rank's memory cap as micro-batches inside the one training step;
- :mod:`lightning_dist.sync` (with :mod:`.sync_seam`): ``sync=``'s settings bound at set-up to a
  :class:`~lightning_dist.sync.SyncDriver`, whose hooks the strategy calls around Lightning's step without knowing
  which way of syncing it drives; the comm hook then reduces inside the driver's workers only;
- :mod:`lightning_dist.launch`: under torchrun, a view of the launcher's store private to the restart attempt.

Features (callbacks, experiments, benchmarks) use the strategy only through :attr:`RingDDPStrategy.features`.
"""

from __future__ import annotations

import copy
import time
import warnings
from datetime import timedelta
from typing import Any, Callable, Optional, Sequence, Union

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities.rank_zero import rank_zero_debug, rank_zero_info
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_dist.comm import destroy_at_exit, destroy_groups, release_scratch
from lightning_dist.comm.topology import Topology, agree_topology, state_layout
from lightning_dist.compression import Compressor, as_compressor
from lightning_dist.elastic import complete_from_siblings
from lightning_dist.hetero import HeteroBatching
from lightning_dist.hetero.batching import as_hetero
from lightning_dist.launch import LaunchEnv, attempt_store
from lightning_dist.strategy import stepping
from lightning_dist.strategy.arguments import as_timedelta, check_arguments, register_names
from lightning_dist.strategy.checkpoint import CHECKPOINT_KEY, compressor_entry, gather_states, restore_compressor
from lightning_dist.strategy.cycle import StepCycle
from lightning_dist.strategy.dist_metrics import DistMetrics
from lightning_dist.strategy.features import RingFeatures
from lightning_dist.strategy.hook import RingHookState, ring_comm_hook
from lightning_dist.strategy.micro import MicroBatches
from lightning_dist.strategy.schedule import ExchangeSchedule
from lightning_dist.strategy.skip import StepGuard, StepVerdict
from lightning_dist.strategy.step_meter import StepMeter
from lightning_dist.strategy.sync_seam import SyncSeam, agreeing_scaler
from lightning_dist.strategy.tiers import gradient_groups
from lightning_dist.sync import SyncContext, SyncSettings, as_sync
from lightning_dist.upstream import DDPBase

WORKER_JOIN_TIMEOUT_S = 10.0  # teardown waits this long for the communication worker to end


class RingDDPStrategy(DDPBase):
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
        topology: ``"flat"`` (every rank alike), ``"two_tier"`` (dense inside each host, ``algorithm`` and
            ``compressor`` only between hosts: :mod:`lightning_dist.strategy.tiers`) or ``"auto"`` (default:
            two_tier on at least 2 hosts of at least 2 ranks each, the same count on every host; flat
            otherwise). Hosts are the launcher's nodes (Lightning's node rank: torchrun's ``GROUP_RANK``,
            SLURM's ``SLURM_NODEID``, ``NODE_RANK``).
        sync: how the workers synchronise: None or ``"every_step"`` (default: the gradient all-reduce of every
            step), a :class:`~lightning_dist.sync.DiLoCo` (``"diloco"``, or a dict of its arguments: each worker, a
            host under two_tier or a rank under flat, trains alone for ``every`` steps, then the workers average
            their progress through an outer Nesterov step), or any :class:`~lightning_dist.sync.SyncSettings`.
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
        start_method: str = "popen",
        *,
        algorithm: str = "auto",
        compressor: Union[Compressor, str, None] = None,
        overlap: bool = True,
        hetero: Union[HeteroBatching, dict, None] = None,
        topology: str = "auto",
        sync: Union[SyncSettings, dict, str, None] = None,
        **kwargs: Any,
    ) -> None:
        algorithm, topology, start_method = check_arguments(
            algorithm, topology, start_method, overlap, ddp_comm_state=ddp_comm_state, ddp_comm_hook=ddp_comm_hook,
            ddp_comm_wrapper=ddp_comm_wrapper, model_averaging_period=model_averaging_period)
        self._sync = as_sync(sync)  # the settings; the driver of each fit is bound at set-up (SyncSeam)
        compressor = as_compressor(compressor)
        self._compressor = compressor  # the settings: each fit reduces through a fresh copy (setup_distributed)
        super().__init__(
            accelerator=accelerator, parallel_devices=parallel_devices, cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io, precision_plugin=precision_plugin,
            process_group_backend=process_group_backend, timeout=as_timedelta(timeout),
            start_method=start_method, **kwargs,
        )
        self._algorithm = algorithm
        self._overlap = overlap
        self._hetero = as_hetero(hetero)
        self._topology_request = topology
        if self._sync is not None:
            self._sync.check(compressor=compressor, hetero=self._hetero, topology=topology)
        self.topology: Optional[Topology] = None  # what topology resolved to at set-up (every rank alike)
        self._hook_groups: list[dist.ProcessGroup] = []  # the comm hook's (flat: one; two_tier: three)
        self._guard = StepGuard()  # step-or-skip, armed by NaNRecovery
        self._hook_state = RingHookState(algorithm=algorithm, compressor=compressor, guard=self._guard)
        self._schedule = ExchangeSchedule()  # the per-step exchange, on a gloo group of its own
        self._meter = StepMeter()  # this rank's per-step measurements; its step count is the strategy's
        self._micro = MicroBatches()  # a share run as several micro-batches (hetero accumulate), or as inner steps
        self._seam = SyncSeam(self._sync, self._guard)  # the sync driver of this fit and what follows from its answers
        self._cycle = StepCycle(self._meter, self._schedule, self._hook_state, self._hetero)  # one step's bookkeeping
        self._features = RingFeatures(self, self._meter, self._schedule, self._guard, self._hook_state,
                                       self._hetero)

    @property
    def features(self) -> RingFeatures:
        """The seam through which callbacks, experiments and benchmarks use this strategy (:func:`features_of`)."""
        return self._features

    @property
    def algorithm(self) -> str:
        return self._algorithm

    @property
    def overlap(self) -> bool:
        return self._overlap

    @property
    def sync(self) -> Optional[SyncSettings]:
        """How the workers synchronise: None (every step) or the sync settings given as ``sync=`` (the driver bound to
        a fit, its report and state, is ``features.sync`` during and after the fit)."""
        return self._sync

    # -- set-up ---------------------------------------------------------------------------------------------
    @override
    def setup_distributed(self) -> None:
        # a fit starts from the compressor's settings, not from another fit's residuals (before a checkpoint's restore)
        self._hook_state.compressor = copy.deepcopy(self._compressor)
        store = attempt_store(self.collective_timeout)
        if store is None:
            super().setup_distributed()
        else:  # DDPStrategy.setup_distributed, with the store of this attempt
            reset_seed()
            self.set_world_ranks()
            assert self.cluster_environment is not None
            self.init_process_group(store, device_id=self.root_device if self.root_device.type != "cpu" else None)
        destroy_at_exit()  # gloo's threads must be joined before the interpreter finalizes (comm.destroy_at_exit)
        # The exchange's group (a CPU tensor on every backend, so gloo) and the topology, before anything is
        # restored from a checkpoint (whose compressor state applies only under the same topology)
        if self.world_size > 1:
            self._schedule.group = group = dist.new_group(backend="gloo", timeout=self.collective_timeout)
            self.topology = topology = agree_topology(self._topology_request, self.node_rank, self.world_size, group)
            rank_zero_info(f"RingDDPStrategy: topology {topology.kind} ({topology.reason}; hosts: "
                           f"{[list(ranks) for ranks in topology.hosts]})")

    @override
    def configure_launcher(self) -> None:
        # When torchrun, SLURM or another launcher created the processes, every rank already runs this script:
        # launch nothing, whatever start_method says. (Lightning's own DDPStrategy with "fork" or "spawn"
        # forks N more ranks inside each worker.) The subprocess launcher is the one that checks for this.
        assert self.cluster_environment is not None
        LaunchEnv.current().check_num_nodes(self.num_nodes)
        if self._hetero is not None and self.parallel_devices:  # list lengths, in the launching process
            self._hetero.check_world(self.num_nodes * len(self.parallel_devices))
        if self._topology_request == "two_tier" and self.num_nodes < 2:
            raise ValueError(f"topology='two_tier' needs at least 2 nodes, and Trainer(num_nodes={self.num_nodes}): "
                             "run on 2 or more hosts (num_nodes=2, ...), or use topology='auto' or 'flat'.")
        if self.start_method != "popen" and self.cluster_environment.creates_processes_externally:
            rank_zero_info(
                f"RingDDPStrategy: {type(self.cluster_environment).__name__} created the processes; "
                f"start_method={self.start_method!r} launches none of its own."
            )
            self.launch_nothing()
            return
        super().configure_launcher()

    @override
    def setup(self, trainer: Any) -> None:
        # as stock DDP: barebones mode (it also sets log_every_n_steps=0) runs no logging callback
        wanted = not getattr(trainer, "barebones", False)
        if wanted and not any(isinstance(cb, DistMetrics) for cb in trainer.callbacks):
            trainer.callbacks.append(DistMetrics())
        if trainer.state.fn == "fit":  # what the sync settings declare they cannot do, before DDP wraps the model
            self._seam.refuse(trainer, self._hetero, self.topology, self.world_size)
        super().setup(trainer)
        if self._hetero is not None and not trainer.lightning_module.automatic_optimization:
            change = self._hetero.without_micro_batches()  # the user's training_step runs its own backward
            if change is not None:
                rank_zero_info(f"RingDDPStrategy: {change}")
        if trainer.state.fn == "fit":  # once Lightning's set-up is done (DDP's wrap, optimizers): the driver binds
            self._register_hook(trainer)

    @override
    def register_comm_hooks(self) -> None:
        # Lightning calls this from its DDP wrap (and registers hooks only on CUDA); ours is registered on every device
        # at the end of setup, once the sync driver is bound (its workers decide where the hook reduces)
        self._stop_worker()  # a fit that failed before teardown may have left one

    def _register_hook(self, trainer: Any) -> None:
        assert isinstance(self.model, DistributedDataParallel)
        self._bind_hook_groups(self._bind_driver(trainer))
        self._schedule.every_step = bool(self._hetero is not None and self._hetero.rebalance)
        state = self._hook_state
        if self._overlap:
            state.start_worker(f"rank{self.global_rank}", self.root_device)
        self.model.register_comm_hook(state, ring_comm_hook)

    def _bind_driver(self, trainer: Any) -> Optional[Sequence[Sequence[int]]]:
        """The sync driver of this fit, bound to the wrapped model; returns its workers' ranks (None: every rank)."""
        features, state = self._features, self._hook_state
        context = SyncContext(
            rank=self.global_rank, world_size=self.world_size, module=self.model.module, topology=self.topology,
            algorithm=self._algorithm, timeout=self.collective_timeout, stats=state.stats, hetero=self._hetero,
            find_unused=bool(self.model.find_unused_parameters), share=state.step_share,
            reduction=lambda: gradient_groups(self.topology, self.global_rank, self.world_size, self._algorithm,
                                              state.stats, self.collective_timeout),
            record_skip=self._seam.record_skip, long_collective=features.long_collective,
            exchange_group=lambda: self._schedule.group, identities=lambda: features.identities,
            optimizer_states=lambda: [self.optimizer_state(optimizer) for optimizer in self.optimizers],
            agreeing_scaler=lambda: agreeing_scaler(self.precision_plugin),
            observe=lambda o, on: (features.add_bucket_observer if on else features.remove_bucket_observer)(o),
            compressor=lambda: state.compressor,
            set_compressor=lambda c: self._cycle.set_compressor(as_compressor(c)),
            regroup=lambda: self._bind_hook_groups(self._seam.derive(self.global_rank, self.model,
                                                                     self.collective_timeout)))
        # the share among the worker's ranks, the DDP flags, the verdict's group: lightning_dist.strategy.sync_seam
        workers = self._seam.bind(context, self.model, trainer, self.collective_timeout)
        features.sync = self._seam.driver if self._sync is not None else None
        return workers

    def _bind_hook_groups(self, workers: Optional[Sequence[Sequence[int]]]) -> None:
        """The comm hook on the groups of the sync driver's ``workers`` (every rank, in order): at set-up, and again
        when a driver hands the fit to another between steps (``SyncContext.regroup``), the old groups destroyed."""
        state, old = self._hook_state, self._hook_groups
        reduction = gradient_groups(self.topology, self.global_rank, self.world_size, self._algorithm, state.stats,
                                    self.collective_timeout, workers=workers)
        self._hook_groups = reduction.owned
        automatic = self.lightning_module.automatic_optimization
        state.bind(self.model.module, reduction.group, reduction.world, tiers=reduction.tiers,
                   spans_hosts=reduction.spans_hosts,
                   on_last_bucket=lambda: self._cycle.start_exchange_early(automatic))
        destroy_groups(old)

    def _stop_worker(self) -> None:
        warning = self._hook_state.stop_worker(WORKER_JOIN_TIMEOUT_S)
        if warning is not None:  # on every rank: the rank whose worker is stuck is the one to name
            warnings.warn(f"rank {self.global_rank}: {warning}", stacklevel=2)

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        self._cycle.restart()

    # -- each step --------------------------------------------------------------------------------------------
    @override
    def process_dataloader(self, dataloader: object) -> object:
        dataloader = super().process_dataloader(dataloader)
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if self._hetero is None or trainer is None or not trainer.training or not isinstance(dataloader, DataLoader):
            return dataloader  # validation and test loaders keep their own settings
        return self._hetero.training_loader(dataloader, self.world_size, self.global_rank)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        batch = args[0] if args else kwargs.get("batch")
        self._meter.batch_started(batch)
        micro, accumulate, driver = None, True, self._seam.driver
        if self._hetero is not None and self._hetero.attached:  # the share, from the plan every rank holds
            batch_idx = args[1] if len(args) > 1 else kwargs["batch_idx"]
            epoch = self.lightning_module.trainer.current_epoch
            self._hook_state.share = self._hetero.start_batch(epoch, batch_idx, self.global_rank, self._seam.worker)
            micro, accumulate = driver.before_batch(self._hetero.sizes_of(epoch, batch_idx),
                                                    self._hetero.micro_sizes(epoch, batch_idx, self.global_rank))
        self._seam.before_forward(self.model)
        if micro is not None and len(micro) > 1:  # several passes in this step (lightning_dist.strategy.micro)
            args = (*args, *kwargs.values())  # Lightning passes (batch, batch_idx) by position
            return self._micro.start(self, args[0], args[1:], micro, self._hook_state, super().training_step,
                                     accumulate=accumulate)
        return super().training_step(*args, **kwargs)

    # -- collectives from inside a micro-batch (lightning_dist.strategy.micro) -----------------------------------
    @override
    def reduce(self, tensor: Any, group: Optional[Any] = None, reduce_op: Optional[Any] = "mean") -> Any:
        if self._micro.inner:  # self.log(sync_dist=True) of a micro-batch the step's last one overwrites
            return tensor
        return super().reduce(tensor, group=group, reduce_op=reduce_op)

    @override
    def all_gather(self, tensor: torch.Tensor, group: Optional[Any] = None, sync_grads: bool = False) -> torch.Tensor:
        self._micro.check_collective("all_gather")
        return super().all_gather(tensor, group=group, sync_grads=sync_grads)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        self._micro.check_collective("broadcast")
        return super().broadcast(obj, src=src)

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        self._micro.check_collective("barrier")
        super().barrier(*args, **kwargs)

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        def one_pass(loss: torch.Tensor) -> torch.Tensor:
            if not self._seam.reduces:  # Lightning's manual optimization turns DDP's synchronisation back on after
                self.model.require_backward_grad_sync = False  # every forward
            # the loss gradient carries this rank's share (and NaN for a non-finite loss with the guard armed)
            stepping.follow_loss_scale(self._features.loss_scaler, self._hook_state)
            with stepping.shared_backward(loss, self._hook_state, self._guard,
                                          automatic=self.lightning_module.automatic_optimization):
                return super(RingDDPStrategy, self).backward(loss, optimizer, *args, **kwargs)

        if self._micro.pending:  # the step's other micro-batches, forward and backward (lightning_dist.strategy.micro)
            return self._micro.backward(self, closure_loss, one_pass, self._hook_state,
                                        super().training_step)
        return one_pass(closure_loss)

    @override
    def post_backward(self, closure_loss: Any) -> None:
        # every bucket's Future is complete once backward returns (DDP waited for them)
        self._hook_state.close_backward()
        super().post_backward(closure_loss)

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        exchanged = False

        def closure_then_exchange() -> Any:
            # backward (every bucket's hook), then the step's exchange: every rank's values before any parameter changes
            nonlocal exchanged
            result = closure()
            if not exchanged:
                exchanged = True
                self._cycle.complete_exchange(self.world_size, self.lightning_module.trainer.num_training_batches)
                self._seam.agree_scaler(optimizer, self._features.loss_scaler, self._schedule.group, self.global_rank,
                                        self.world_size)  # a step DDP did not reduce: fp16's verdict made the worker's
            return result

        def step(run: Callable[[], Any], update: Optional[Callable[[], None]] = None) -> Any:  # Lightning's step,
            with stepping.updating_with(optimizer, update):  # the driver's update in place of the optimizer's own
                return super(RingDDPStrategy, self).optimizer_step(optimizer, run, model, **kwargs)

        driver = self._seam.driver
        if not self._guard.armed:
            output = driver.optimizer_step(optimizer, closure_then_exchange, step)
            if exchanged:
                self._after_step(optimizer, model, skipped=False, **kwargs)
            return output
        # The step-or-skip point: backward first, then every rank decides alike whether the optimizer steps (every
        # rank of the sync driver's worker: under DiLoCo a worker's, since the workers step alone between syncs).
        result = closure_then_exchange()
        verdict = self._decide(optimizer)
        if not verdict.skipped:
            result = driver.optimizer_step(optimizer, stepping.replay(result, closure_then_exchange), step)
        self._after_step(optimizer, model, skipped=verdict.skipped, **kwargs)
        return result

    def _decide(self, optimizer: Any) -> StepVerdict:
        """Step or skip (NaNRecovery armed the guard), agreed among the worker's ranks; a skip is taken here."""
        scaler = self._features.loss_scaler
        group, rank, size = self._seam.verdict_group(self.model.module, scaler, self._schedule.group, self.global_rank,
                                                     self.world_size)
        verdict = stepping.decide_step(self._guard, optimizer, scaler, group, rank, size,
                                       step=self.lightning_module.trainer.global_step)
        if verdict.skipped:
            stepping.skip_step(optimizer, scaler)
        return verdict

    def _after_step(self, optimizer: Any, model: Any, skipped: bool, **kwargs: Any) -> None:
        """After the optimizer stepped or skipped: the training step's further inner steps, the sync driver's hook
        (Lightning counts this step once optimizer_step returns, hence + 1), the step's bookkeeping."""
        if self._micro.steps_pending:  # each inner step stepped or skipped by its own verdict
            def take_step(output: Any) -> None:
                if not self._guard.armed or not self._decide(optimizer).skipped:
                    super(RingDDPStrategy, self).optimizer_step(optimizer, lambda: output, model, **kwargs)

            started = time.perf_counter()
            self._micro.more_steps(self, optimizer, lambda loss: self.backward(loss, optimizer), take_step,
                                   self._hook_state, super().training_step)
            self._meter.add_compute(time.perf_counter() - started)  # the measured speed covers every inner step
        self._seam.driver.after_step(self.lightning_module.trainer.global_step + 1)
        self._cycle.finish(skipped)

    # -- validation (the sync driver's: e.g. DiLoCo validates theta_global) and the end of a fit --------------
    @override
    def on_validation_start(self) -> None:
        self._seam.driver.validation(starting=True)

    @override
    def on_validation_end(self) -> None:
        self._seam.driver.validation(starting=False)

    @override
    def on_train_end(self) -> None:
        self._schedule.drain()  # every rank started it, so every rank can finish it
        self._seam.driver.end_of_fit()
        super().on_train_end()

    @override
    def teardown(self) -> None:
        self._stop_worker()  # first: it may still use the comm group
        self._seam.driver.close()  # (it stays readable, its report and state, until the next set-up)
        for failure in destroy_groups((*self._hook_groups, self._schedule.group, self._seam.worker_group)):
            rank_zero_debug(f"RingDDPStrategy.teardown: {failure}")
        self._schedule.group, self._hook_groups, self._seam.worker_group = None, [], None
        self._hook_state.unbind()
        release_scratch()
        super().teardown()

    # -- checkpoints: every rank's compressor state (lightning_dist.strategy.checkpoint) -----------------------
    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        # Every rank calls this (Lightning's trainer.save_checkpoint); rank zero writes. Each rank's compressor
        # state (residuals, random generator) is its own, so all of them travel to rank zero first.
        compressor = self._hook_state.compressor
        states = gather_states(compressor, self.world_size, self._schedule.group)
        sync = self._seam.driver.state_dict()  # a collective too (DiLoCo: every worker's own state)
        if self.is_global_zero:
            entry = compressor_entry(compressor, self.world_size, states, self._features.identities,
                                     state_layout(self.topology))
            if sync is not None:
                entry[CHECKPOINT_KEY]["sync"] = sync
            checkpoint = {**checkpoint, **entry}
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        if self._features.identities is not None:  # elastic: survivors' own state from their emergency checkpoints
            complete_from_siblings(checkpoint, str(checkpoint_path))
        return checkpoint

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        super().load_model_state_dict(checkpoint, strict=strict)
        if not (self._sync is not None and self._sync.chooses_compressor):  # (else: once the driver chose it, below)
            self._restore_compressor(checkpoint)

    def _restore_compressor(self, checkpoint: Any) -> None:
        restore_compressor(self._hook_state.compressor, checkpoint, self.global_rank, self.world_size,
                           self._features.identities, state_layout(self.topology))

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        # the bound sync driver's state, in one call that hands back this rank's optimizer states where workers own them
        states = self._seam.driver.load_state_dict((checkpoint.get(CHECKPOINT_KEY) or {}).get("sync"))
        if self._sync is not None and self._sync.chooses_compressor:  # the driver set the hook's compressor: its state
            self._restore_compressor(checkpoint)
        super().load_optimizer_state_dict(checkpoint if states is None else {**checkpoint, "optimizer_states": states})

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        register_names(cls, strategy_registry)
