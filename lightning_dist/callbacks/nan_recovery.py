"""``NaNRecovery``: skip non-finite steps on every rank together, back the loss scale off, roll back, stop cleanly.

What a NaN does to data-parallel training without it: one rank's NaN loss becomes a NaN gradient, the
all-reduce hands it to every rank, and every replica's weights are NaN after the next optimizer step. A rank
that notices on its own and skips while the others step is worse: the replicas silently diverge, or the next
collective deadlocks (pytorch#136009, fairscale#179).

With this callback (and :class:`~lightning_dist.strategy.RingDDPStrategy`, which holds the mechanism):

1. **Skip together.** A non-finite loss or gradient on any rank makes the reduced gradients non-finite on
   every rank, every rank sees it alike, and every rank skips the optimizer step
   (:mod:`lightning_dist.strategy.skip`: no collective on a good step). The compressor's staged state
   (error-feedback residuals, random generators) is discarded with it.
2. **Loss scale.** Under fp16 mixed precision the precision plugin's ``GradScaler`` is replaced by a
   :class:`~lightning_dist.loss_scaler.LossScaler` with these settings: backoff on a bad step after
   ``hysteresis`` bad steps, growth after ``growth_interval`` good ones, never below ``min_scale``.
3. **Rollback.** Every ``snapshot_every`` good steps the model, optimizer, LR-scheduler and compressor state
   are copied in memory (``snapshot_device``). After ``rollback_after`` consecutive skipped steps, every rank
   restores the snapshot and multiplies the learning rate by ``lr_factor``; training continues with the next
   batches (the ones that diverged are not replayed). The loss scale is kept, not rolled back: it already
   holds what the bad steps taught it.
4. **Stop.** After ``max_rollbacks`` rollbacks, or when a step is non-finite at the minimum loss scale, every
   rank raises :class:`NaNRecoveryError` at the same step, saying what happened, when, and which rank saw
   it first. No rank is left waiting in a collective.
5. **Replica drift** (off by default): every ``drift_check_every`` optimizer steps, one 64-bit hash per tensor
   is compared across ranks (:mod:`lightning_dist.strategy.replicas`); on a mismatch ``on_drift`` says
   ``"repair"`` (broadcast rank zero's parameters, buffers and optimizer state), ``"stop"`` or ``"warn"``.

**What a skipped step counts as.** It is an optimizer step for Lightning: ``trainer.global_step`` advances,
step-interval LR schedulers advance, and the batch is consumed, as with Lightning and torch's GradScaler
(DeepSpeed and Megatron hold the scheduler back on a skipped step instead). Every rank counts alike.

**Other strategies.** The skip has to happen inside the strategy's ``optimizer_step`` (in 32-bit precision
backward runs inside ``optimizer.step(closure)``, and no callback hook can veto the update), so with any
strategy but ``ring_ddp`` this callback raises a ``ValueError`` at setup instead of half-working.

Logged from rank zero on the Trainer's logging steps: ``nan/skipped_steps``, ``nan/loss_scale``,
``nan/rollbacks``, ``nan/drift_checks``, ``nan/drift_mismatches``. Every skip, rollback and drift finding is also
a log line. :meth:`state_dict` carries the counters through checkpoints (the snapshot itself is rebuilt
when training starts).
"""

from __future__ import annotations

import copy
import time
from typing import Any, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_dist.loss_scaler import LossScaler, check_scaler_settings
from lightning_dist.strategy import RingFeatures, features_of, replicas
from lightning_dist.strategy.skip import StepVerdict

DRIFT_ACTIONS = ("repair", "stop", "warn")


class NaNRecoveryError(RuntimeError):
    """Raised on every rank at the same step when NaNRecovery gives up."""


class NaNRecovery(Callback):
    """Non-finite steps skipped on every rank together, dynamic loss scaling, rollback, a clean stop.

    Args:
        rollback_after: consecutive skipped steps that trigger a rollback to the last snapshot (0: never).
        snapshot_every: good optimizer steps between in-memory snapshots (the first is taken at the start).
        max_rollbacks: rollbacks allowed before the run stops with :class:`NaNRecoveryError`.
        lr_factor: the learning rate (and step schedulers' base rates) is multiplied by this at each rollback.
        snapshot_device: ``"cpu"`` (host memory, the default) or ``"same"`` (next to the weights: faster, costs
            accelerator memory).
        drift_check_every: compare the replicas every this many optimizer steps (0: never).
        on_drift: ``"repair"``, ``"stop"`` or ``"warn"`` when replicas differ.
        init_scale: the fp16 loss scale to start from. This and the six settings below configure the
            :class:`~lightning_dist.loss_scaler.LossScaler` that replaces the precision plugin's GradScaler under
            fp16 mixed precision (ignored otherwise); each is that class's argument of the same name.
        growth_factor: the scale is multiplied by this after ``growth_interval`` good steps.
        backoff_factor: the scale is multiplied by this when a step overflows (after ``hysteresis``).
        growth_interval: consecutive good steps before the scale grows.
        hysteresis: bad steps tolerated before the scale is cut (1: every bad step cuts it).
        consecutive_hysteresis: restore the hysteresis after every good step (True) or only when the scale grows.
        min_scale: the scale never backs off below this floor.
    """

    def __init__(self, *, rollback_after: int = 10, snapshot_every: int = 100, max_rollbacks: int = 3,
                 lr_factor: float = 1.0, snapshot_device: str = "cpu", drift_check_every: int = 0,
                 on_drift: str = "repair", init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000, hysteresis: int = 2,
                 consecutive_hysteresis: bool = False, min_scale: float = 1.0) -> None:
        scaler = dict(init_scale=init_scale, growth_factor=growth_factor, backoff_factor=backoff_factor,
                      growth_interval=growth_interval, hysteresis=hysteresis, min_scale=min_scale,
                      consecutive_hysteresis=consecutive_hysteresis)
        problems = check_settings(rollback_after=rollback_after, snapshot_every=snapshot_every,
                                  max_rollbacks=max_rollbacks, lr_factor=lr_factor, snapshot_device=snapshot_device,
                                  drift_check_every=drift_check_every, on_drift=on_drift, **scaler)
        if problems:
            raise ValueError("NaNRecovery: " + "; ".join(problems))
        self.rollback_after, self.snapshot_every, self.max_rollbacks = rollback_after, snapshot_every, max_rollbacks
        self.lr_factor, self.snapshot_device = float(lr_factor), snapshot_device
        self.drift_check_every, self.on_drift = drift_check_every, on_drift
        self.scaler_settings = scaler
        # counters (state_dict)
        self.skipped = 0  # skipped steps over the run
        self.consecutive = 0  # skipped steps in a row, up to now
        self.rollbacks = 0
        self.drift_checks = 0
        self.drift_mismatches = 0
        self.first_bad: Optional[str] = None  # the first skipped step of the current run of them, described
        self.history: list[dict[str, Any]] = []  # skips, rollbacks and drift findings (the last 100)
        # in memory only
        self.seconds = 0.0  # CPU time in this callback's per-step work (time.thread_time)
        self._snapshot: Optional[dict[str, Any]] = None
        self._good_since_snapshot = 0
        self._steps_seen = 0

    # -- set-up ---------------------------------------------------------------------------------------------
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        features = features_of(trainer.strategy)
        if features is None:
            raise ValueError(
                f"NaNRecovery needs RingDDPStrategy (strategy='ring_ddp'), which can skip a step on every rank "
                f"together; the Trainer's strategy is {type(trainer.strategy).__name__}. In 32-bit precision backward "
                "runs inside optimizer.step and no callback can veto the update. Use strategy='ring_ddp' "
                "(a drop-in for DDP) or remove NaNRecovery."
            )
        plugin = trainer.precision_plugin
        scaler = getattr(plugin, "scaler", None)
        if isinstance(scaler, torch.amp.GradScaler) and not isinstance(scaler, LossScaler) and scaler.is_enabled():
            plugin.scaler = LossScaler.like(scaler, **self.scaler_settings)
        features.step_guard.arm()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        features = features_of(trainer.strategy)
        if features is not None:
            features.step_guard.disarm()

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        sync = features_of(trainer.strategy).sync  # bound by now (after the strategy's set-up)
        if self.drift_check_every and sync is not None and sync.gradient_ranks is not None:
            raise ValueError(f"NaNRecovery(drift_check_every={self.drift_check_every}) compares every rank's "
                             "parameters, which the workers of sync= (DiLoCo) hold apart between their syncs: drop "
                             "drift_check_every (nan_recovery.drift_check_every=0) under this way of syncing")

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        _ring(trainer).step_guard.pop_verdicts()  # nothing from an earlier fit counts
        self._take_snapshot(trainer, pl_module)

    # -- each step ----------------------------------------------------------------------------------------------
    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        started = time.thread_time()
        verdicts = _ring(trainer).step_guard.pop_verdicts()
        for verdict in verdicts:
            self._steps_seen += 1
            if verdict.skipped:
                self._on_skipped(trainer, pl_module, verdict)
            else:
                self._on_good(trainer, pl_module, verdict)
        if verdicts and self.drift_check_every and self._steps_seen % self.drift_check_every == 0 \
                and _replicas(trainer):
            self._check_drift(trainer, pl_module)
        if verdicts and trainer.log_every_n_steps and trainer.global_step % trainer.log_every_n_steps == 0:
            self._log(trainer)
        self.seconds += time.thread_time() - started

    def _on_good(self, trainer: pl.Trainer, pl_module: pl.LightningModule, verdict: StepVerdict) -> None:
        if self.consecutive:
            rank_zero_info(f"NaNRecovery: finite again at global step {verdict.step} after "
                           f"{self.consecutive} skipped step(s)")
        self.consecutive, self.first_bad = 0, None
        self._good_since_snapshot += 1
        if self._good_since_snapshot >= self.snapshot_every:
            self._take_snapshot(trainer, pl_module)

    def _on_skipped(self, trainer: pl.Trainer, pl_module: pl.LightningModule, verdict: StepVerdict) -> None:
        self.skipped += 1
        self.consecutive += 1
        if self.first_bad is None:
            self.first_bad = verdict.describe()
        self._remember("skip", verdict.step, detail=verdict.describe())
        rank_zero_warn(f"NaNRecovery: skipped the step on every rank: {verdict.describe()}")
        scaler = _ring(trainer).loss_scaler
        if isinstance(scaler, LossScaler) and scaler.exhausted:
            self._stop(trainer, f"a step was non-finite at the minimum loss scale (min_scale={scaler.min_scale:g})")
        if self.rollback_after and self.consecutive >= self.rollback_after:
            if self.rollbacks >= self.max_rollbacks:
                self._stop(trainer, f"{self.consecutive} consecutive non-finite steps after {self.rollbacks} "
                                    f"rollback(s) (max_rollbacks={self.max_rollbacks})")
            self._rollback(trainer, pl_module)

    def _stop(self, trainer: pl.Trainer, reason: str) -> None:
        self._remember("stop", trainer.global_step, detail=reason)
        snapshot_at = self._snapshot["global_step"] if self._snapshot else None
        raise NaNRecoveryError(
            f"NaNRecovery stopped training at global step {trainer.global_step} on every rank: {reason}. "
            f"This run of non-finite steps began at {self.first_bad}. {self.skipped} step(s) skipped in all, "
            f"{self.rollbacks} rollback(s); the last good snapshot is from global step {snapshot_at}. Try a lower "
            "learning rate (or lr_factor=0.5), gradient clipping, bf16 instead of fp16, or look at the data near "
            "these steps."
        )

    # -- snapshots and rollback ------------------------------------------------------------------------------
    def _take_snapshot(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        device = None if self.snapshot_device == "same" else torch.device("cpu")
        self._snapshot = {
            "global_step": trainer.global_step,
            "model": _copy(pl_module.state_dict(), device),
            "optimizers": [_copy(opt.state_dict(), device) for opt in trainer.optimizers],
            "schedulers": [_copy(cfg.scheduler.state_dict(), device) for cfg in trainer.lr_scheduler_configs],
            "compressor": _ring(trainer).compressor.state_dict(),
        }
        self._good_since_snapshot = 0

    def _rollback(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        snapshot = self._snapshot
        assert snapshot is not None, "a snapshot is taken when training starts"
        if self.lr_factor != 1.0:
            # in the snapshot itself, which is then loaded: a second rollback to the same snapshot (no good steps
            # enough for a new one in between) lowers the rates again, from the lowered ones
            for state in snapshot["optimizers"]:
                for group in state["param_groups"]:
                    group["lr"] *= self.lr_factor
            for state in snapshot["schedulers"]:
                if "base_lrs" in state:
                    state["base_lrs"] = [lr * self.lr_factor for lr in state["base_lrs"]]
        pl_module.load_state_dict(snapshot["model"])
        for optimizer, state in zip(trainer.optimizers, snapshot["optimizers"]):
            optimizer.load_state_dict(copy.deepcopy(state))  # loading may alias the tensors it is given
            optimizer.zero_grad(set_to_none=True)
        for cfg, state in zip(trainer.lr_scheduler_configs, snapshot["schedulers"]):
            cfg.scheduler.load_state_dict(copy.deepcopy(state))
        _ring(trainer).compressor.load_state_dict(snapshot["compressor"])
        self.rollbacks += 1
        lr = f", learning rate x{self.lr_factor:g}" if self.lr_factor != 1.0 else ""
        detail = (f"{self.consecutive} consecutive non-finite steps (from {self.first_bad}); restored the snapshot "
                  f"of global step {snapshot['global_step']}{lr}")
        self._remember("rollback", trainer.global_step, detail=detail)
        rank_zero_warn(f"NaNRecovery: rollback {self.rollbacks}/{self.max_rollbacks} at global step "
                       f"{trainer.global_step}: {detail}")
        self.consecutive, self.first_bad = 0, None
        self._good_since_snapshot = 0

    # -- replica drift ----------------------------------------------------------------------------------------
    def _check_drift(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        report = replicas.compare(pl_module, group=_ring(trainer).exchange_group)
        self.drift_checks += 1
        if report.agree:
            return
        self.drift_mismatches += 1
        detail = report.describe()
        self._remember("drift", trainer.global_step, detail=detail)
        if self.on_drift == "stop":
            raise NaNRecoveryError(f"NaNRecovery: replicas differ at global step {trainer.global_step}: {detail}. "
                                   "Set on_drift='repair' to broadcast rank zero's state instead of stopping.")
        if self.on_drift == "repair":
            sent = replicas.repair(pl_module, trainer.optimizers)
            rank_zero_warn(f"NaNRecovery: replicas differed at global step {trainer.global_step}: {detail}; "
                           f"repaired by broadcasting {sent} tensors from rank 0")
        else:
            rank_zero_warn(f"NaNRecovery: replicas differ at global step {trainer.global_step}: {detail}")

    # -- logging and state --------------------------------------------------------------------------------------
    def _remember(self, kind: str, global_step: int, detail: str) -> None:
        self.history.append({"kind": kind, "global_step": global_step, "detail": detail})
        del self.history[:-100]

    def metrics(self, trainer: pl.Trainer) -> dict[str, float]:
        features = features_of(trainer.strategy)
        scaler = features.loss_scaler if features is not None else None
        scale = scaler.scale_value if isinstance(scaler, LossScaler) else (scaler.get_scale() if scaler else 1.0)
        return {"nan/skipped_steps": float(self.skipped), "nan/loss_scale": float(scale),
                "nan/rollbacks": float(self.rollbacks), "nan/drift_checks": float(self.drift_checks),
                "nan/drift_mismatches": float(self.drift_mismatches)}

    def _log(self, trainer: pl.Trainer) -> None:
        if trainer.is_global_zero and trainer.loggers:
            metrics = self.metrics(trainer)
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)

    def memory_parts(self, parts: dict[str, int], on_accelerator: bool) -> dict[str, int]:
        """What the snapshot adds to MemoryMonitor's estimate of the device's memory: a copy of the weights and
        the optimizer state, where it lives (host memory with ``snapshot_device="cpu"`` on a GPU: not counted)."""
        if on_accelerator and self.snapshot_device == "cpu":
            return {}
        return {"nan_recovery_snapshot": parts.get("weights", 0) + parts.get("optimizer_state", 0)}

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"skipped": self.skipped, "consecutive": self.consecutive, "rollbacks": self.rollbacks,
                "drift_checks": self.drift_checks, "drift_mismatches": self.drift_mismatches,
                "first_bad": self.first_bad, "history": list(self.history)}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.skipped = int(state_dict.get("skipped", 0))
        self.consecutive = int(state_dict.get("consecutive", 0))
        self.rollbacks = int(state_dict.get("rollbacks", 0))
        self.drift_checks = int(state_dict.get("drift_checks", 0))
        self.drift_mismatches = int(state_dict.get("drift_mismatches", 0))
        self.first_bad = state_dict.get("first_bad")
        self.history = list(state_dict.get("history", []))


def _replicas(trainer: pl.Trainer) -> bool:
    """Whether every rank holds the same parameters between steps now: no sync driver with workers of its own (one
    that took over mid-fit, as ``sync="auto"`` may hand the fit to DiLoCo, pauses the drift check while it runs; the
    same answer on every rank)."""
    sync = features_of(trainer.strategy).sync
    return sync is None or sync.gradient_ranks is None


def _copy(tree: Any, device: Optional[torch.device]) -> Any:
    """A deep copy of a state dict whose tensors are cloned (onto ``device``, or where they are)."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().to(device, copy=True) if device is not None else tree.detach().clone()
    if isinstance(tree, dict):
        return {k: _copy(v, device) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_copy(v, device) for v in tree)
    return copy.deepcopy(tree)


def check_settings(**settings: Any) -> list[str]:
    """What is wrong with NaNRecovery's arguments (an empty list: nothing), each with its fix. Used by the
    constructor and by ``lightning-dist-train``'s validation, in the launching process."""
    problems = []
    for name, least in (("rollback_after", 0), ("snapshot_every", 1), ("max_rollbacks", 0), ("drift_check_every", 0)):
        value = settings.get(name)
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            problems.append(f"{name}={value!r} must be an integer >= {least}")
    lr = settings.get("lr_factor")
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not 0 < lr <= 1:
        problems.append(f"lr_factor={lr!r} must be in (0, 1] (1.0 keeps the learning rate at a rollback; 0.5 "
                        "halves it)")
    if settings.get("snapshot_device") not in ("cpu", "same"):
        problems.append(f"snapshot_device={settings.get('snapshot_device')!r} must be 'cpu' or 'same'")
    if settings.get("on_drift") not in DRIFT_ACTIONS:
        problems.append(f"on_drift={settings.get('on_drift')!r} must be one of {list(DRIFT_ACTIONS)}")
    scaler = {k: settings[k] for k in ("init_scale", "growth_factor", "backoff_factor", "growth_interval",
                                       "hysteresis", "min_scale") if k in settings}
    problems += check_scaler_settings(**scaler)
    if not isinstance(settings.get("consecutive_hysteresis", False), bool):
        problems.append(f"consecutive_hysteresis={settings.get('consecutive_hysteresis')!r} must be True or False")
    return problems


def _ring(trainer: pl.Trainer) -> RingFeatures:
    """The strategy's feature seam; setup refused any strategy without one."""
    features = features_of(trainer.strategy)
    assert features is not None, "NaNRecovery's setup accepts RingDDPStrategy only"
    return features
