"""``lightning-dist-train``: the Hydra training command (also ``python -m lightning_dist.train``).

With no arguments it trains the digits CNN on 2 CPU processes with ``ring_ddp`` and writes, into Hydra's
output directory, ``summary.json`` (final metrics, wall time, bytes communicated, the resolved config),
``csv/metrics.csv`` (every logged metric, the per-step ``dist/*`` ones included) and ``checkpoints/``.

Everything is built in the launching process (the config is checked against ``lightning_dist.config``'s
schema first), so a bad key or value fails before any rank starts. Examples::

    lightning-dist-train trainer.devices=4 strategy.algorithm=ring data.batch_size=64
    lightning-dist-train callbacks=[dist_metrics] trainer.max_epochs=3
    lightning-dist-train compression=topk compression.ratio=0.01   # 1% of each layer, error feedback
    lightning-dist-train compression=powersgd compression.rank=4
    lightning-dist-train hetero.speeds=[3,1]               # per-rank batches 48 and 16 (hetero=balanced)
    lightning-dist-train model=lm data=stdlib sync=diloco sync.every=50 sync.compressor=int8   # DiLoCo
    lightning-dist-train strategy=ddp                      # Lightning's stock DDP, same everything else
    lightning-dist-train ckpt_path=outputs/.../checkpoints/last.ckpt trainer.max_epochs=20   # resume
    lightning-dist-train -m strategy.algorithm=ring,tree   # a sweep, one run after the other
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import deque
from typing import Any, Callable, Optional, Sequence

import hydra
import lightning.pytorch as pl
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger
from omegaconf import DictConfig, OmegaConf

import lightning_dist  # noqa: F401 - registers the strategies
from lightning_dist.config import (
    complete_overrides,
    local_world_size,
    own_class_overrides,
    register_configs,
    resolve_devices,
    resolve_num_nodes,
    run_dir_name,
    validate,
)
from lightning_dist.fault.resume import choose as choose_checkpoint
from lightning_dist.perf import PerfConfig, run_preflight
from lightning_dist.profiling import AllThreadsProfiler
from lightning_dist.strategy import features_of

register_configs()
# hydra.run.dir in conf/config.yaml: one directory for every rank of a torchrun or SLURM launch
OmegaConf.register_new_resolver("lightning_dist_run_dir", run_dir_name, use_cache=True, replace=True)


class ApplyPerfCallback(Callback):
    """Applies the perf settings once in every rank's process (spawned ranks inherit nothing) and prints,
    from rank zero, what it applied and the pre-flight warnings, before the first step."""

    def __init__(self, perf: PerfConfig, local_world_size: int) -> None:
        self.perf, self.local_world_size = perf, local_world_size

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        run_preflight(self.perf, self.local_world_size)


def _snake(name: str) -> str:
    """MemoryMonitor -> memory_monitor (the key a callback's run summary has in summary.json)."""
    return "".join(f"_{c.lower()}" if c.isupper() and i else c.lower() for i, c in enumerate(name))


TRAIN_LOSS_WINDOW = 50  # summary.json's train_loss: rank zero's logged train/loss averaged over the fit's last steps


class RunSummaryCallback(Callback):
    """Writes ``summary.json`` from rank zero when fitting ends (atomically: a temp file, then a rename).

    Its ``val/*`` metrics are of the model the fit ends with: when ``trainer.max_steps`` stops the fit between two
    validations (Lightning validates at an epoch's end and every ``val_check_interval``, not where ``max_steps`` stops
    mid-epoch), the callback asks Lightning to stop after the last step as early stopping does, and Lightning then
    validates before it stops (``validate_at_end=False`` leaves the last validation where it fell).
    ``validated_at_step`` records the optimizer step the last validation ran after, and ``train_loss`` the mean of
    rank zero's logged ``train/loss`` over the last :data:`TRAIN_LOSS_WINDOW` steps (one batch's loss is noisy)."""

    def __init__(self, path: str, config: dict[str, Any], started: float, validate_at_end: bool = True) -> None:
        self.path, self.config, self.started, self.validate_at_end = path, config, started, validate_at_end
        self._first_step: Optional[int] = None
        self._validated_step: Optional[int] = None
        self._train_losses: deque[float] = deque(maxlen=TRAIN_LOSS_WINDOW)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._first_step = trainer.global_step  # after a resume: the checkpoint's

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        loss = trainer.callback_metrics.get("train/loss")
        if trainer.is_global_zero and loss is not None:
            self._train_losses.append(float(loss))
        if self.validate_at_end and 0 < trainer.max_steps <= trainer.global_step:
            # the fit's last step (every rank agrees on global_step): Lightning validates a fit that is asked to stop
            # (as by EarlyStopping) before it stops, so the summary's val/* are the final model's
            trainer.should_stop = True

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking:
            self._validated_step = trainer.global_step

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        trained = self._first_step is not None and trainer.global_step > self._first_step
        if not trained and os.path.exists(self.path):
            # resumed from a finished run (an elastic restart as the job ended): nothing trained, nothing to add. A
            # checkpoint from the end of the last epoch never starts training at all (no on_train_start)
            print(f"[lightning_dist] no step trained in this fit: {self.path} is kept as the run left it", flush=True)
            return
        strategy, features = trainer.strategy, features_of(trainer.strategy)
        totals = dict(features.totals) if features is not None else {}
        summary = {
            "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
            "wall_time_s": time.time() - self.started,
            "global_step": trainer.global_step,
            "epochs": trainer.fit_loop.epoch_progress.current.completed,  # completed epochs
            # the step the metrics' val/* were measured after (global_step: the model the fit ends with)
            "validated_at_step": self._validated_step,
            "train_loss": ({"mean": sum(self._train_losses) / len(self._train_losses), "steps": len(self._train_losses)}
                           if self._train_losses else None),
            "world_size": trainer.world_size,
            "strategy": type(strategy).__name__,
            "algorithm": strategy.algorithm if features is not None else None,
            # gradient payload bytes rank zero sent over the run (every rank sends about the same)
            "bytes_sent_rank0": totals.get("bytes_sent", 0.0),
            "dense_bytes_rank0": totals.get("dense_bytes", 0.0),  # what the dense fp32 ring would have sent
            # None under sync=DiLoCo: no gradient bucket is exchanged, so there is no dense figure to compare with
            "compression_ratio": (totals["dense_bytes"] / totals["bytes_sent"]
                                  if totals.get("bytes_sent") and totals.get("dense_bytes") else
                                  None if features is not None and features.sync is not None else 1.0),
            "sync": strategy.sync.describe() if features is not None and strategy.sync is not None else None,
            "compressor": features.compressor.describe() if features is not None else "none",
            # how the gradients travelled (flat or two_tier, the ranks on each host) and rank zero's bytes per tier
            "topology": ({"kind": features.topology.kind, "hosts": [list(h) for h in features.topology.hosts]}
                         if features is not None and features.topology is not None else None),
            "bytes_intra_host_rank0": totals.get("bytes_intra_host", 0.0),
            "bytes_inter_host_rank0": totals.get("bytes_inter_host", 0.0),
            "comm_time_s_rank0": totals.get("comm_s", 0.0),
            "codec_time_s_rank0": totals.get("codec_s", 0.0),
            # callbacks that report on the run (MemoryMonitor: the estimate, the peaks, threshold events)
            **{_snake(type(cb).__name__): cb.run_summary() for cb in trainer.callbacks
               if callable(getattr(cb, "run_summary", None))},
            # a sync driver that reports on the run does the same, under its settings' name (sync="auto": "auto")
            **({strategy.sync.name: features.sync.run_summary()} if features is not None and features.sync is not None
               and callable(getattr(features.sync, "run_summary", None)) else {}),
            "config": self.config,
        }
        tmp = self.path + ".tmp"
        with open(tmp, "w") as fh:
            json.dump(summary, fh, indent=2)
        os.replace(tmp, self.path)


def build(
    cfg: DictConfig, output_dir: str, started: float, extra_callbacks: Sequence[Callback] = (),
    summary: bool = True, trainer_overrides: Optional[dict[str, Any]] = None,
) -> tuple[pl.Trainer, pl.LightningModule, Any]:
    """Instantiate trainer, model and data from a composed config (all in the launching process).

    ``extra_callbacks`` (Python callers such as :func:`lightning_dist.experiments.fit_config`) follow the
    config's callbacks and precede the run summary writer; ``summary=False`` leaves the writer out and
    ``trainer_overrides`` replace ``Trainer`` arguments (``lightning-dist-advise``: no logger, no checkpoints)."""
    validate(cfg)
    plain = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    perf = instantiate(plain["perf"])  # validated here, applied in each rank by ApplyPerfCallback
    model = instantiate(plain["model"])
    data = instantiate(plain["data"])
    compressor = instantiate(plain["compression"])  # checks its arguments here, before any rank starts
    hetero = plain["hetero"] if plain["hetero"].get("enabled") else None
    # sync as a plain dict ({name: every_step} or DiLoCo's arguments, checked by the strategy here): "partial" keeps
    # Hydra from handing the strategy its DictConfig
    strategy = instantiate(plain["strategy"], compressor=compressor, hetero=hetero, sync=plain.get("sync"),
                           _convert_="partial")
    callbacks: list[Callback] = []
    for name, node in (plain.get("callbacks") or {}).items():
        if not isinstance(node, dict) or "_target_" not in node:
            raise ValueError(f"callbacks.{name} must be a mapping with a _target_, got {node!r}")
        if "dirpath" in node and node["dirpath"] is None:
            node["dirpath"] = os.path.join(output_dir, "checkpoints")  # recorded in summary.json as used
        callbacks.append(instantiate(node))
    callbacks.append(ApplyPerfCallback(perf, local_world_size(cfg.trainer.devices, cfg.trainer.accelerator)))
    callbacks.extend(extra_callbacks)
    if summary:
        callbacks.append(RunSummaryCallback(os.path.join(output_dir, "summary.json"), plain, started))
    trainer_kwargs = dict(plain["trainer"])
    trainer_kwargs["devices"] = resolve_devices(trainer_kwargs["devices"])
    trainer_kwargs["num_nodes"] = resolve_num_nodes(trainer_kwargs["num_nodes"])
    if trainer_kwargs.get("profiler") == "pytorch":  # with the communication worker's thread in the trace
        trainer_kwargs["profiler"] = AllThreadsProfiler()
    trainer_kwargs.update(logger=CSVLogger(output_dir, name="csv", version=""), default_root_dir=output_dir)
    trainer_kwargs.update(trainer_overrides or {})
    trainer = pl.Trainer(**trainer_kwargs, strategy=strategy, callbacks=callbacks)
    return trainer, model, data


def run(cfg: DictConfig, output_dir: str, extra_callbacks: Sequence[Callback] = (),
        verbose: bool = True) -> dict[str, Any]:
    """Train as configured; returns the summary rank zero wrote (empty on other ranks). ``extra_callbacks``
    go to :func:`build`; ``verbose=False`` keeps the seed's message out of a notebook's output."""
    started = time.time()
    pl.seed_everything(cfg.seed, workers=True, verbose=verbose)
    trainer, model, data = build(cfg, output_dir, started, extra_callbacks)
    ckpt_path = cfg.ckpt_path
    if ckpt_path is None and cfg.resume == "auto":
        ckpt_path = choose_checkpoint(os.path.join(output_dir, "checkpoints"),
                                      may_host_store=features_of(trainer.strategy) is not None)
    trainer.fit(model, datamodule=data, ckpt_path=ckpt_path, weights_only=True)
    path = os.path.join(output_dir, "summary.json")
    if trainer.is_global_zero and os.path.exists(path):
        with open(path) as fh:
            return json.load(fh)
    return {}


def describe_result(summary: dict[str, Any]) -> str:
    """The printed summary's result: ``val/*`` and the step they were measured after, and the train loss's mean over
    the last steps, e.g. ``val/acc=0.4000  val/loss=1.9000 (validated after step 600 of 600)  train/loss=1.8500 (mean
    of the last 50 steps)``."""
    metrics = summary.get("metrics", {})
    parts = ["  ".join(f"{key}={value:.4f}" for key, value in sorted(metrics.items()) if key.startswith("val/"))]
    if summary.get("validated_at_step") is not None:
        parts[0] += f" (validated after step {summary['validated_at_step']} of {summary.get('global_step')})"
    train = summary.get("train_loss")
    if train:
        parts.append(f"train/loss={train['mean']:.4f} (mean of the last {train['steps']} steps)")
    return "  ".join(part for part in parts if part)


def hydra_main(task: Callable[[DictConfig], Any]) -> Callable[[], Any]:
    """``task`` as a Hydra entry point on ``conf/config.yaml`` (the training command's, and advise's)."""
    return hydra.main(config_path="pkg://lightning_dist.conf", config_name="config", version_base="1.3")(task)


@hydra_main
def _train(cfg: DictConfig) -> float:
    output_dir = HydraConfig.get().runtime.output_dir
    summary = run(cfg, output_dir)
    metrics = summary.get("metrics", {})
    if summary:
        print(f"summary: {os.path.join(output_dir, 'summary.json')}  {describe_result(summary)}")
    return float(metrics.get("val/acc", 0.0))  # what a Hydra sweeper would maximise


_CONFIG_FLAGS = ("-cn", "--config-name", "-cp", "--config-path", "-cd", "--config-dir")


def _importable_from_here() -> None:
    """The working directory on ``sys.path``, as ``python -m`` puts it there and a console script does not: a
    ``model._target_`` of the user's own resolves the same either way (a rank Lightning starts by re-running the
    command does this too)."""
    here = os.getcwd()
    if here not in sys.path and "" not in sys.path:
        sys.path.insert(0, here)


def hydra_command(entry: Callable[[], Any], prog: str,
                  added: Optional[Callable[[list[str]], list[str]]] = None) -> Any:
    """Run a :func:`hydra_main` ``entry`` with this package's override completion (``lightning-dist-train``,
    ``lightning-dist-advise``).

    The working directory goes on ``sys.path`` (a ``model._target_`` of the user's own resolves as under ``python -m``);
    a ``model._target_``/``data._target_`` given without its group option builds the user's class from the keys given
    with it alone (:func:`~lightning_dist.config.own_class_overrides`); then
    :func:`~lightning_dist.config.complete_overrides` (a setting given without its group:
    ``hetero.speeds=[3,1]`` selects ``hetero=balanced``, ``compression.ratio=0.01`` alone fails here, naming
    ``compression=topk``); ``added(overrides)`` returns overrides the command itself appends (advise's
    ``+advise=default``). The completed overrides replace ``sys.argv``'s, so that ranks Lightning starts by
    re-running the command see them too; ``prog`` names the command in an error."""
    _importable_from_here()
    args = sys.argv[1:]
    if any(arg.split("=")[0] in _CONFIG_FLAGS for arg in args):
        return entry()  # a config of the user's own: its groups and defaults are not ours to complete
    overrides = [arg for arg in args if "=" in arg and not arg.startswith("-")]  # key=value, not Hydra's flags
    try:
        completed = complete_overrides(own_class_overrides(overrides))
    except ValueError as err:
        sys.exit(f"{prog}: {err}")
    sys.argv[1:] = [arg for arg in args if arg not in overrides] + completed + (added(completed) if added else [])
    return entry()


def main() -> Any:
    """``lightning-dist-train``: trains as configured (:func:`hydra_command`)."""
    return hydra_command(_train, "lightning-dist-train")


if __name__ == "__main__":
    main()
