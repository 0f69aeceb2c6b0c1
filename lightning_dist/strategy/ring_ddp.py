"""``RingDDPStrategy``: Lightning's DDP with every gradient bucket routed through lightning_dist's hook.

Like Lightning's :class:`~lightning.pytorch.strategies.DDPStrategy`, the class is a set of overrides that
delegate; each mechanism lives in a module beside it:

- :mod:`.hook` (with :mod:`.comm_worker`): the DDP comm hook, registered on every device; with a two-tier
  topology (:mod:`lightning_dist.comm.topology`) it reduces each bucket through :mod:`.tiers`. Lightning's
  ``_register_ddp_hooks`` (private, hence the ``lightning>=2.6,<2.7`` pin and a test that fails if it goes)
  registers hooks only on CUDA and drops them silently on CPU. With ``overlap=True`` each bucket travels on
  a communication thread while backward computes the next, on a process group of the strategy's own;
- :mod:`.stepping`: the rank's share of the step applied in autograd, and step-or-skip on every rank together
  (:mod:`.skip` holds the finiteness mechanism, :class:`~lightning_dist.callbacks.NaNRecovery` the policy);
- :mod:`.schedule` (with :mod:`.exchange`): the one small per-step exchange of measurements and agreed values,
  on the steps features ask for, complete before the optimizer steps;
- :mod:`.step_meter` and :mod:`.dist_metrics`: each rank's per-step measurements, logged from rank zero by
  DistMetrics, which the strategy adds to the Trainer when the user has not;
- :mod:`.checkpoint`: every rank's compressor state in checkpoints, and its restore;
- :mod:`lightning_dist.hetero`: with ``hetero=``, the training loader rebuilt so each rank's share of the
  global batch follows its speed, rebalanced from the exchange; :mod:`.micro` runs a share above the rank's memory
  cap as several micro-batches inside the one training step;
- :mod:`lightning_dist.sync`: with ``sync=DiLoCo(...)``, the workers (ranks, or hosts under two_tier) train alone
  and meet every H steps in an outer step (:class:`~lightning_dist.sync.diloco.DiLoCoSync`); the comm hook then
  reduces inside a worker only;
- :mod:`lightning_dist.launch`: under torchrun, a view of the launcher's store private to the restart attempt.

Features (callbacks, experiments, benchmarks) use the strategy only through :attr:`RingDDPStrategy.features`
(:mod:`.features`).
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any, Callable, Optional, Union

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.distributed import _init_dist_connection
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.utilities.rank_zero import rank_zero_debug, rank_zero_info, rank_zero_warn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_dist.comm import check_algorithm, release_scratch
from lightning_dist.comm.topology import TOPOLOGIES, Topology, resolve_topology, state_layout
from lightning_dist.compression import Compressor, NoCompressor, as_compressor
from lightning_dist.elastic import complete_from_siblings
from lightning_dist.hetero import HeteroBatching, micro_batch_sizes
from lightning_dist.hetero.batching import as_hetero, describe_event
from lightning_dist.launch import LaunchEnv, attempt_store
from lightning_dist.strategy import stepping
from lightning_dist.strategy.checkpoint import (
    CHECKPOINT_KEY,
    compressor_entry,
    gather_states,
    restore_compressor,
    restore_sync,
    sync_entry,
    worker_state,
)
from lightning_dist.strategy.dist_metrics import DistMetrics
from lightning_dist.strategy.features import RingFeatures
from lightning_dist.strategy.hook import RingHookState, ring_comm_hook
from lightning_dist.strategy.micro import MicroBatches
from lightning_dist.strategy.schedule import ExchangeSchedule
from lightning_dist.strategy.skip import StepGuard, StepVerdict
from lightning_dist.strategy.step_meter import StepMeter
from lightning_dist.strategy.tiers import TwoTier
from lightning_dist.sync import DiLoCo, as_sync
from lightning_dist.sync.diloco import DiLoCoSync, SyncResult, inner_steps

if not callable(getattr(DDPStrategy, "_register_ddp_hooks", None)):  # pragma: no cover - guarded by a test too
    raise ImportError(
        "lightning_dist needs DDPStrategy._register_ddp_hooks, which this Lightning release does not have; "
        "install lightning>=2.6,<2.7 (the range in lightning_dist's pyproject.toml)."
    )

# How ranks are started on one machine (Lightning's launchers; "popen" re-runs the script per rank): the one list,
# read by the strategy's check, the Hydra schema (lightning_dist.config) and the errors
START_METHODS = ("popen", "spawn", "fork", "forkserver")
DEFAULT_TIMEOUT_S = default_pg_timeout.total_seconds()  # torch.distributed's: a hung collective fails then
WORKER_JOIN_TIMEOUT_S = 10.0  # teardown waits this long for the communication worker to end


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
        topology: ``"flat"`` (every rank alike), ``"two_tier"`` (dense inside each host, ``algorithm`` and
            ``compressor`` only between hosts: :mod:`lightning_dist.strategy.tiers`) or ``"auto"`` (default:
            two_tier on at least 2 hosts of at least 2 ranks each, the same count on every host; flat
            otherwise). Hosts are the launcher's nodes (Lightning's node rank: torchrun's ``GROUP_RANK``,
            SLURM's ``SLURM_NODEID``, ``NODE_RANK``).
        sync: how often the workers synchronise: None or ``"every_step"`` (default: the gradient all-reduce of every
            step), or a :class:`~lightning_dist.sync.DiLoCo` (``"diloco"``, or a dict of its arguments): each worker
            (a host under two_tier, a rank under flat) trains alone for ``every`` steps, then the workers average
            their progress through an outer Nesterov step (:mod:`lightning_dist.sync.diloco`).
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
        sync: Union[DiLoCo, dict, str, None] = None,
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
        algorithm = check_algorithm(getattr(algorithm, "value", algorithm))  # an enum from Hydra's structured config
        topology = getattr(topology, "value", topology)  # Hydra's structured config passes an enum
        if topology not in TOPOLOGIES:
            raise ValueError(f"topology={topology!r}; use one of {', '.join(TOPOLOGIES)} ('auto': two_tier on 2 or "
                             "more hosts of 2 or more ranks each).")
        start_method = getattr(start_method, "value", start_method)  # Hydra's structured config passes an enum
        if start_method not in START_METHODS:
            raise ValueError(f"start_method={start_method!r}; use one of {', '.join(START_METHODS)} ('popen' re-runs "
                             "the script per rank, the robust default; 'fork' starts fastest on CPU).")
        self._sync = as_sync(sync)
        compressor = as_compressor(compressor)
        if self._sync is not None and not isinstance(compressor, NoCompressor):
            raise ValueError(f"compressor={compressor.describe()} compresses the per-step gradient, which "
                             "sync=DiLoCo does not send between workers; compress the pseudo-gradient instead: "
                             f"sync=DiLoCo(every={self._sync.every}, compressor={compressor.name!r}) (on the command "
                             f"line sync.compressor={compressor.name}), and drop compressor=")
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
        self._topology_request = topology
        if self._sync is not None and self._sync.balance == "steps":
            _check_steps_balance(self._hetero, topology)
        self.topology: Optional[Topology] = None  # what topology resolved to at set-up (every rank alike)
        self._tier_groups: list[dist.ProcessGroup] = []  # two_tier: its host's two groups, its part's
        self._guard = StepGuard()  # step-or-skip, armed by NaNRecovery
        self._hook_state = RingHookState(algorithm=algorithm, compressor=compressor, guard=self._guard)
        self._comm_group: Optional[dist.ProcessGroup] = None  # the gradient buckets' own group
        self._schedule = ExchangeSchedule()  # the per-step exchange, on a gloo group of its own
        self._meter = StepMeter()  # this rank's per-step measurements; its step count is the strategy's
        self._micro = MicroBatches()  # a share run as several micro-batches (hetero accumulate)
        self._inner_counts: Optional[list[int]] = None  # DiLoCo(balance="steps"): each rank's inner steps per step
        self._diloco: Optional[DiLoCoSync] = None  # sync=DiLoCo: the outer loop, made at set-up
        self._sync_restore: Optional[dict[str, Any]] = None  # a checkpoint's DiLoCo entry, applied at set-up
        self._worker_optimizers: Optional[list[Any]] = None  # this worker's inner optimizer states from it
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
    def sync(self) -> Optional[DiLoCo]:
        """How often the workers synchronise: None (every step) or the DiLoCo settings (the running outer loop, its
        metrics and state, is ``features.sync`` during and after a fit)."""
        return self._sync

    # -- set-up ---------------------------------------------------------------------------------------------
    @override
    def setup_distributed(self) -> None:
        store = attempt_store(self._timeout)
        if store is None:
            super().setup_distributed()
        else:  # DDPStrategy.setup_distributed, with the store of this attempt
            reset_seed()
            self.set_world_ranks()
            self._process_group_backend = self._get_process_group_backend()
            assert self.cluster_environment is not None
            device_id = self.root_device if self.root_device.type != "cpu" else None
            _init_dist_connection(self.cluster_environment, self._process_group_backend, timeout=self._timeout,
                                  device_id=device_id, store=store)
        # The exchange's group (a CPU tensor on every backend, so gloo) and the topology, before anything is
        # restored from a checkpoint (whose compressor state applies only under the same topology)
        if self.world_size > 1:
            self._schedule.group = dist.new_group(backend="gloo", timeout=self._timeout)
            self.topology = self._resolve_topology()

    @override
    def _configure_launcher(self) -> None:
        # When torchrun, SLURM or another launcher created the processes, every rank already runs this script:
        # launch nothing, whatever start_method says. (Lightning's own DDPStrategy with "fork" or "spawn"
        # forks N more ranks inside each worker.) The subprocess launcher is the one that checks for this.
        assert self.cluster_environment is not None
        launch = LaunchEnv.current()
        if launch.launcher == "torchrun" and launch.num_nodes is not None and self.num_nodes != launch.num_nodes:
            # Lightning's own check would say only that the product does not match; say what to pass
            raise ValueError(
                f"Trainer(num_nodes={self.num_nodes}) but torchrun runs {launch.num_nodes} node(s) now (world size "
                f"{launch.world_size}, {launch.local_world_size} per node); under torchrun --nnodes MIN:MAX the count "
                "changes between restarts: pass Trainer(num_nodes=lightning_dist.launch.LaunchEnv.current().num_nodes, "
                "devices=LaunchEnv.current().local_world_size) (lightning-dist-train reads both from the launcher)")
        if self._hetero is not None and self.parallel_devices:  # list lengths, in the launching process
            self._hetero.check_world(self.num_nodes * len(self.parallel_devices))
        if self._topology_request == "two_tier" and self.num_nodes < 2:
            one_worker = " (with sync=DiLoCo a worker is a host: one host is one worker, with nothing to sync)" \
                if self._sync is not None else ""
            raise ValueError(f"topology='two_tier' needs at least 2 nodes, and Trainer(num_nodes={self.num_nodes})"
                             f"{one_worker}: run on 2 or more hosts (num_nodes=2, ...), or use topology='auto' or "
                             "'flat'.")
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
        # as stock DDP: barebones mode (it also sets log_every_n_steps=0) runs no logging callback
        wanted = not getattr(trainer, "barebones", False)
        if wanted and not any(isinstance(cb, DistMetrics) for cb in trainer.callbacks):
            trainer.callbacks.append(DistMetrics())
        super().setup(trainer)
        if self._hetero is not None and not trainer.lightning_module.automatic_optimization:
            change = self._hetero.without_micro_batches()  # the user's training_step runs its own backward
            if change is not None:
                rank_zero_info(f"RingDDPStrategy: {change}")
        if self._diloco is not None:
            _sigterm_broadcast_before_syncs(trainer, self._diloco)

    @override
    def _register_ddp_hooks(self) -> None:
        # Lightning registers hooks only when root_device is CUDA; ours must run on CPU as well.
        assert isinstance(self.model, DistributedDataParallel)
        self._stop_worker()  # a fit that failed before teardown may have left one
        # The gradient buckets' own group (the default backend, so NCCL for CUDA tensors), made by every rank here
        # in the same order, driven by the worker thread, never interleaving with what DDP and Lightning run on
        # the default group from the main thread. With a two-tier topology, this rank's host's groups and its
        # part's across hosts replace it.
        tiers, world, spans_hosts = None, self.world_size, self.topology is not None and len(self.topology.hosts) > 1
        if self._sync is not None:  # DiLoCo: the hook reduces inside a worker only; the outer loop syncs the workers
            world, spans_hosts = self._bind_sync()
        elif self.topology is not None and self.topology.kind == "two_tier":
            tiers = TwoTier.create(self.topology, self.global_rank, self._algorithm, self._hook_state.stats,
                                   self._timeout)
            self._tier_groups = tiers.groups
        elif self.world_size > 1:
            self._comm_group = dist.new_group(timeout=self._timeout)
        self._schedule.every_step = bool(self._hetero is not None and self._hetero.rebalance)
        state = self._hook_state
        state.bind(self.model.module, self._comm_group, world, on_last_bucket=self._start_exchange_early,
                   tiers=tiers, spans_hosts=spans_hosts)
        if self._overlap:
            state.start_worker(f"rank{self.global_rank}", self.root_device)
        self.model.register_comm_hook(state, ring_comm_hook)

    def _bind_sync(self) -> tuple[int, bool]:
        """DiLoCo's outer loop on groups of its own; DDP's synchronisation kept inside a worker: off for a worker of
        one rank (no byte leaves it between syncs), on the host's group for a host (dense, over its own links). DDP's
        buffer broadcast (from rank 0, across workers) is off: buffers are averaged at the sync instead, and a host's
        first rank broadcasts them inside the host before each forward. Returns the hook's world (the worker's
        ranks) and whether its traffic crosses hosts (never)."""
        assert isinstance(self.model, DistributedDataParallel) and self._sync is not None
        diloco = self._diloco = DiLoCoSync.create(self._sync, self.topology, self.global_rank, self.world_size,
                                                  self._algorithm, self._timeout)
        workers = diloco.workers
        if self._sync.balance == "steps" and workers.local_size > 1:
            _check_steps_balance(self._hetero, "two_tier")  # topology="auto" resolved to two_tier
        self.model.broadcast_buffers = False
        if workers.local_size == 1:
            self.model.require_backward_grad_sync = False  # what DDP's no_sync() sets, for the whole fit
        else:
            self._comm_group = dist.new_subgroups_by_enumeration([list(r) for r in workers.ranks],
                                                                 timeout=self._timeout)[0]
        diloco.bind(self.model.module)
        self._features.sync = diloco
        if self._sync_restore is not None:
            self._worker_optimizers = restore_sync(diloco, self.model.module, self._sync_restore, self.global_rank,
                                                   self.world_size, self._features.identities)
            self._sync_restore = None
            if diloco.lost_workers and self._hetero is not None:  # their samples since the last sync train again
                self._hetero.lost_workers = (diloco.unsynced_from, list(diloco.lost_workers))
                rank_zero_info(f"RingDDPStrategy: DiLoCo workers of old ranks {diloco.lost_workers} were lost with "
                               f"their progress since global batch {diloco.unsynced_from}: their samples since then "
                               "train again on the survivors")
        self._tier_groups = diloco.groups
        rank_zero_info(f"RingDDPStrategy: {self._sync.describe()} over {workers.count} workers "
                       f"({'hosts' if workers.local_size > 1 else 'ranks'}: {[list(r) for r in workers.ranks]})")
        return workers.local_size, False

    def _resolve_topology(self) -> Topology:
        """Every rank's node rank, gathered, and the topology they imply (the same decision on every rank)."""
        nodes: list[Any] = [None] * self.world_size
        dist.all_gather_object(nodes, self.node_rank, group=self._schedule.group)
        topology = resolve_topology(self._topology_request, nodes)
        rank_zero_info(f"RingDDPStrategy: topology {topology.kind} ({topology.reason}; hosts: "
                       f"{[list(ranks) for ranks in topology.hosts]})")
        return topology

    def _stop_worker(self) -> None:
        warning = self._hook_state.stop_worker(WORKER_JOIN_TIMEOUT_S)
        if warning is not None:
            rank_zero_warn(warning)

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        # a new fit starts counting afresh (the same strategy object may fit twice)
        self._meter.reset()
        self._schedule.step_finished()
        self._hook_state.reset_step()

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
        diloco, micro = self._diloco, None
        if self._hetero is not None and self._hetero.attached:  # the share, from the plan every rank holds
            batch_idx = args[1] if len(args) > 1 else kwargs["batch_idx"]
            epoch = self.lightning_module.trainer.current_epoch
            among = diloco.workers.mine if diloco is not None else None  # DiLoCo: averaged inside the worker only
            self._hook_state.share = self._hetero.start_batch(epoch, batch_idx, self.global_rank, among)
            if diloco is not None:  # each worker's samples weigh its pseudo-gradient
                diloco.count_samples(self._hetero.sizes_of(epoch, batch_idx))
            micro = self._hetero.micro_sizes(epoch, batch_idx, self.global_rank)
            if diloco is not None and diloco.settings.balance == "steps":  # the share as inner steps of its own
                micro = self._inner_step_sizes(self._hetero.sizes_of(epoch, batch_idx))
        if diloco is not None:
            diloco.broadcast_buffers()
        if micro is not None and len(micro) > 1:  # the share as several micro-batches (lightning_dist.strategy.micro)
            args = (*args, *kwargs.values())  # Lightning passes (batch, batch_idx) by position
            return self._micro.start(self, args[0], args[1:], micro, self._hook_state, super().training_step,
                                     accumulate=diloco is None or diloco.settings.balance != "steps")
        return super().training_step(*args, **kwargs)

    def _inner_step_sizes(self, shares: list[int]) -> list[int]:
        """``DiLoCo(balance="steps")``: this rank's share cut into its inner steps (:func:`inner_steps`, from every
        rank's share, so every rank agrees); a change of the counts is logged."""
        counts = inner_steps(shares)
        if counts != self._inner_counts:
            self._inner_counts = counts
            rank_zero_info(f"RingDDPStrategy: DiLoCo(balance='steps'): inner steps per training step {counts} "
                           f"(shares {shares})")
        return micro_batch_sizes(shares[self.global_rank], count=counts[self.global_rank])

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
            # Runs backward (and with it every bucket hook), then completes the step's exchange, so every
            # rank holds the same values before any parameter changes.
            nonlocal exchanged
            result = closure()
            if not exchanged:
                exchanged = True
                self._complete_exchange()
            return result

        if not self._guard.armed:
            output = super().optimizer_step(optimizer, closure_then_exchange, model, **kwargs)
            if exchanged:
                self._more_inner_steps(optimizer, model, **kwargs)
                self._sync_if_due()
                self._finish_step(skipped=False)
            return output
        # The step-or-skip point: backward first, then every rank decides alike whether the optimizer steps (under
        # DiLoCo every rank of a worker: the workers step alone between syncs).
        result = closure_then_exchange()
        scaler = self._features.loss_scaler
        group, rank, size = self._schedule.group, self.global_rank, self.world_size
        if self._diloco is not None:
            group, rank, size = self._diloco.worker_verdict_group(self._guard, self.model.module)
        verdict = stepping.decide_step(self._guard, optimizer, scaler, group, rank, size,
                                       step=self.lightning_module.trainer.global_step)
        if verdict.skipped:
            stepping.skip_step(optimizer, scaler)
        else:
            result = super().optimizer_step(optimizer, stepping.replay(result, closure_then_exchange), model,
                                            **kwargs)
        self._more_inner_steps(optimizer, model, **kwargs)
        self._sync_if_due()
        self._finish_step(skipped=verdict.skipped)
        return result

    def _more_inner_steps(self, optimizer: Any, model: Any, **kwargs: Any) -> None:
        """``DiLoCo(balance="steps")``: a faster worker's further inner steps of this training step, each stepped or
        skipped by its own verdict (lightning_dist.strategy.micro)."""
        if not self._micro.steps_pending:
            return
        scaler = self._features.loss_scaler

        def take_step(output: Any) -> None:
            if self._guard.armed:
                group, rank, size = self._diloco.worker_verdict_group(self._guard, self.model.module)
                verdict = stepping.decide_step(self._guard, optimizer, scaler, group, rank, size,
                                               step=self.lightning_module.trainer.global_step)
                if verdict.skipped:
                    stepping.skip_step(optimizer, scaler)
                    return
            super(RingDDPStrategy, self).optimizer_step(optimizer, lambda: output, model, **kwargs)

        started = time.perf_counter()
        self._micro.more_steps(self, optimizer, lambda loss: self.backward(loss, optimizer), take_step,
                               self._hook_state, super().training_step)
        self._meter.add_compute(time.perf_counter() - started)  # the measured speed covers every inner step

    def _start_exchange_early(self) -> None:
        """From the last bucket's hook: the exchange travels beside that bucket when nothing in it can change."""
        self._schedule.start_early(self._meter.step, self._meter.last_step,
                                   self.lightning_module.automatic_optimization)

    def _complete_exchange(self) -> None:
        """After backward: the exchange, if due, done; then the hetero plan may rebalance from it."""
        self._meter.backward_done()
        if not self._schedule.complete(self._meter.step, self._meter.last_step):
            return
        exchange = self._schedule.exchange
        self._meter.exchanged(exchange, self.world_size)
        hetero = self._hetero
        if hetero is None or not hetero.rebalance or not hetero.attached:
            return
        # every rank holds the same measurements now, so every rank decides alike
        event = hetero.after_exchange(exchange.per_rank("rank_compute_s"), exchange.per_rank("rank_samples"),
                                      self._meter.step, self.lightning_module.trainer.num_training_batches)
        for line in describe_event(event) if event is not None else ():
            rank_zero_info(f"RingDDPStrategy: {line}")
        if self._meter.step_metrics:  # empty on the first step: no previous step to describe
            self._meter.step_metrics["hetero/rebalances"] = float(len(hetero.events))

    def _sync_if_due(self) -> None:
        """DiLoCo: after every optimizer step (taken or skipped: Lightning counts both), the fragment syncs that land
        and start there, on every rank together (:meth:`DiLoCoSync.after_step`)."""
        diloco = self._diloco
        step = self.lightning_module.trainer.global_step + 1  # Lightning counts this step once it returns
        if diloco is None or not diloco.due(step):
            return
        self._report_syncs(diloco.after_step(step, self._hook_state.stats, self._sync_tier(),
                                             flags_group=self._schedule.group))

    def _sync_tier(self) -> str:
        return "inter_host" if self.topology is not None and len(self.topology.hosts) > 1 else "intra_host"

    def _report_syncs(self, results: list[SyncResult]) -> None:
        """A skipped outer step is warned of, and NaNRecovery hears of it as of a skipped step."""
        for result in results:
            if not result.skipped:
                continue
            step, fragment = result.step, f" (fragment {result.fragment})" if self._sync.fragments > 1 else ""
            workers = result.bad_workers or "none of them alone (the sum overflowed)"
            rank_zero_warn(f"RingDDPStrategy: DiLoCo skipped the outer step{fragment} after global step {step}: a "
                           f"non-finite pseudo-gradient (workers {workers}); every worker restarts from theta_global")
            if self._guard.armed:
                self._guard.record(StepVerdict(step=step, skipped=True, reason=(
                    f"non-finite pseudo-gradient on worker(s) {result.bad_workers} at the DiLoCo sync{fragment}: the "
                    "outer step skipped on every worker")))

    def _finish_step(self, skipped: bool) -> None:
        """The compressor's staged state kept (the optimizer stepped) or dropped (every rank skipped); this step's
        own measurements recorded (the next exchange carries them to every rank)."""
        state = self._hook_state
        if skipped:
            state.compressor.discard()
        else:
            state.compressor.commit()
        self._meter.step_finished(state.stats, state.exposed_s)
        state.reset_step()
        self._schedule.step_finished()
        if self._hetero is not None and self._hetero.attached:
            self._hetero.finish_step()

    # -- end of a fit -----------------------------------------------------------------------------------------
    @override
    def on_train_end(self) -> None:
        self._schedule.drain()  # every rank started it, so every rank can finish it
        if self._diloco is not None:  # exchanges still in flight land: the fit's model holds every sync it started
            self._report_syncs(self._diloco.finish(self._hook_state.stats, self._sync_tier(), self._schedule.group))
        super().on_train_end()

    @override
    def teardown(self) -> None:
        self._stop_worker()  # first: it may still use the comm group
        if self._diloco is not None:
            self._diloco.close()
        for group in (self._comm_group, self._schedule.group, *self._tier_groups):
            if group is not None and dist.is_initialized():
                try:
                    dist.destroy_process_group(group)
                except (RuntimeError, ValueError) as err:  # already gone with the default group after a fault
                    rank_zero_debug(f"RingDDPStrategy.teardown: {type(err).__name__}: {err}")
        self._comm_group = self._schedule.group = None
        self._tier_groups = []  # (a DiLoCo sync stays readable, its metrics and counts, until the next set-up)
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
        sync = None
        if self._diloco is not None:  # every worker's own state: mid-cycle, the workers differ
            leader = self.global_rank == self._diloco.workers.mine[0]  # a worker's ranks hold the same state
            sync = sync_entry(self._diloco, worker_state(self) if leader else None, self.global_rank,
                              self.world_size, self._schedule.group, identities=self._features.identities)
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
        restore_compressor(self._hook_state.compressor, checkpoint, self.global_rank, self.world_size,
                           self._features.identities, state_layout(self.topology))
        # DiLoCo's state applies once the sync is bound: after DDP's wrap, which copies rank zero's parameters
        self._sync_restore = (checkpoint.get(CHECKPOINT_KEY) or {}).get("sync") if self._sync is not None else None
        if self._sync is not None and self._sync_restore is None:
            rank_zero_warn("The checkpoint holds no DiLoCo state (written without sync=DiLoCo): theta_global starts "
                           "as the restored parameters, with no outer momentum.")

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        if self._worker_optimizers is not None:  # DiLoCo: this worker's own inner optimizer state
            checkpoint = {**checkpoint, "optimizer_states": self._worker_optimizers}
            self._worker_optimizers = None
        super().load_optimizer_state_dict(checkpoint)


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


def _check_steps_balance(hetero: Optional[HeteroBatching], topology: str) -> None:
    """``DiLoCo(balance="steps")`` needs heterogeneous batching (it measures each worker's speed and gives the shares
    the inner steps are cut from) and a worker of one rank (``flat``: the ranks of a host would have to run the same
    inner steps); caps per pass are the accumulation's, which this replaces."""
    if hetero is None:
        raise ValueError("sync=DiLoCo(balance='steps') runs more inner steps on a faster worker, from the speeds "
                         "heterogeneous batching measures: pass hetero=HeteroBatching() (on the command line "
                         "hetero=balanced), or use balance='batches'")
    if topology == "two_tier":
        raise ValueError("sync=DiLoCo(balance='steps') with topology='two_tier': a worker is then a host, whose ranks "
                         "would have to run the same inner steps; use topology='flat' (a worker per rank) or "
                         "balance='batches'")
    if hetero.memory_caps is not None or hetero.max_batch_size is not None or hetero.accumulate not in ("auto", "off"):
        raise ValueError("sync=DiLoCo(balance='steps') cuts each share into inner steps of about the smallest share; "
                         "HeteroBatching's memory_caps, max_batch_size and accumulate counts do not apply: drop them, "
                         "or use balance='batches'")


def _sigterm_broadcast_before_syncs(trainer: Any, diloco: DiLoCoSync) -> None:
    """Lightning broadcasts rank zero's SIGTERM flag to every rank before every training batch: a collective across
    every worker on every step, which syncing every H steps exists to avoid (on a slow link it costs a round trip per
    step, and every worker waits for the slowest at each). Under DiLoCo it runs only before the batches of a step
    where the workers meet anyway (:meth:`DiLoCoSync.meets`: a sync in the step), so a SIGTERM on rank zero stops
    every rank together within H steps. With a delay the workers never meet on the training loop's thread (the
    exchanges run beside it), and it runs once per H steps: before the first fragment's sync starts.
    (``FaultTolerance`` agrees on a stop through the strategy's exchange instead, on the steps it asks for.)"""
    loop = trainer.fit_loop.epoch_loop
    broadcast = type(loop)._broadcast_sigterm_tensor  # private, hence lightning<2.7 and a test that fails if it goes

    def before_syncs() -> None:
        if diloco.meets(trainer.global_step + 1):
            broadcast(loop)

    loop._broadcast_sigterm_tensor = before_syncs


def _as_timedelta(timeout: Union[float, int, timedelta, None]) -> timedelta:
    if timeout is None:  # as DDPStrategy: torch's default
        return default_pg_timeout
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
    if not isinstance(seconds, (int, float)) or isinstance(seconds, bool) or seconds <= 0:
        raise ValueError(f"timeout={timeout!r} must be a positive number of seconds (default {DEFAULT_TIMEOUT_S}).")
    return timedelta(seconds=float(seconds))
