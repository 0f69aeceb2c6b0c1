"""Structured configs for ``lightning-dist-train``: the schema the YAML files in ``conf/`` are checked against.

Registered in Hydra's ConfigStore as ``train_schema``; ``conf/config.yaml`` lists it first in its defaults,
so a misspelt key (``trainer.max_epoch=3``) or a value of the wrong type (``trainer.devices=two``) fails in
Hydra before anything is built, and :func:`validate` catches bad values that types cannot (``devices=0``).
All of it happens in the launching process, before any rank starts.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig


class Algorithm(str, Enum):
    ring = "ring"
    tree = "tree"
    native = "native"
    auto = "auto"


class StartMethod(str, Enum):
    popen = "popen"
    spawn = "spawn"
    fork = "fork"
    forkserver = "forkserver"


@dataclass
class TrainerConf:
    accelerator: str = "cpu"  # "cpu", "gpu" or "auto"
    devices: int = 2  # processes (ranks) on this machine
    num_nodes: int = 1  # machines; launch each with torchrun or SLURM
    max_epochs: int = 10
    max_steps: int = -1  # -1: no step limit
    precision: str = "32-true"  # any Lightning precision string, e.g. "bf16-mixed"
    accumulate_grad_batches: int = 1
    gradient_clip_val: Optional[float] = None
    log_every_n_steps: int = 10
    # a fraction (a float <= 1.0) or a number of batches (an int); Any, so that 1 stays the int 1
    limit_train_batches: Any = None
    limit_val_batches: Any = None
    num_sanity_val_steps: int = 0
    enable_progress_bar: bool = True
    enable_model_summary: bool = True
    deterministic: bool = False
    profiler: Optional[str] = None  # "simple", "advanced" or "pytorch" (Chrome trace: see README)


@dataclass
class StrategyConf:
    _target_: str = "lightning_dist.RingDDPStrategy"
    algorithm: Optional[Algorithm] = Algorithm.auto  # None for strategies without one (stock ddp)
    overlap: Optional[bool] = True  # reduce buckets on a communication thread during backward; None for stock ddp
    start_method: StartMethod = StartMethod.fork  # fork starts fastest on CPU; popen for CUDA / clusters
    timeout: float = 1800.0  # seconds a collective waits for a stalled peer before failing
    find_unused_parameters: bool = False
    static_graph: bool = False
    process_group_backend: Optional[str] = None  # None: gloo on CPU, nccl on CUDA


@dataclass
class ModelConf:
    _target_: str = "lightning_dist.examples.cnn.DigitsCNN"
    lr: float = 3e-3
    channels: int = 16
    hidden: int = 32
    weight_decay: float = 0.0


@dataclass
class DataConf:
    _target_: str = "lightning_dist.examples.digits.DigitsDataModule"
    batch_size: int = 32  # per rank
    val_fraction: float = 0.2
    num_workers: int = 0
    seed: int = 0


@dataclass
class PerfConf:
    _target_: str = "lightning_dist.perf.PerfConfig"
    float32_matmul_precision: str = "high"  # "highest", "high" (TF32 on Ampere+) or "medium"
    cudnn_benchmark: bool = True
    intra_op_threads: Optional[int] = None  # None: cores // local ranks
    inter_op_threads: Optional[int] = None
    warn: bool = True  # print the pre-flight warnings


@dataclass
class TrainConf:
    trainer: TrainerConf = field(default_factory=TrainerConf)
    strategy: StrategyConf = field(default_factory=StrategyConf)
    model: ModelConf = field(default_factory=ModelConf)
    data: DataConf = field(default_factory=DataConf)
    perf: PerfConf = field(default_factory=PerfConf)
    callbacks: dict[str, Any] = field(default_factory=dict)  # name -> {_target_: ..., ...}
    seed: int = 0
    ckpt_path: Optional[str] = None  # resume from this checkpoint (a path)


def stock_ddp_strategy(timeout: float, algorithm: Optional[str] = None, overlap: Optional[bool] = None,
                       **kwargs: Any) -> Any:
    """Lightning's own DDPStrategy from the same keys, for side-by-side runs (``strategy=ddp``)."""
    from datetime import timedelta

    from lightning.pytorch.strategies import DDPStrategy

    if algorithm is not None:
        raise ValueError(f"strategy.algorithm={algorithm!r} has no meaning for stock ddp; use strategy=ring_ddp")
    if overlap is not None:
        raise ValueError(f"strategy.overlap={overlap!r} has no meaning for stock ddp (it always overlaps); "
                         "use strategy=ring_ddp")
    return DDPStrategy(timeout=timedelta(seconds=timeout), **kwargs)


def register_configs() -> None:
    ConfigStore.instance().store(name="train_schema", node=TrainConf)


def validate(cfg: DictConfig) -> None:
    """Checks that types cannot express; raises ``ValueError`` naming the key, the value and the fix."""
    t = cfg.trainer
    problems = []
    if t.devices < 1:
        problems.append(f"trainer.devices={t.devices}: use 1 or more processes, e.g. trainer.devices=2")
    if t.num_nodes < 1:
        problems.append(f"trainer.num_nodes={t.num_nodes}: use 1 or more")
    if t.max_epochs < 1 and t.max_steps < 1:
        problems.append(f"trainer.max_epochs={t.max_epochs} and max_steps={t.max_steps}: set one of them >= 1")
    if t.accumulate_grad_batches < 1:
        problems.append(f"trainer.accumulate_grad_batches={t.accumulate_grad_batches}: use 1 or more")
    for key in ("limit_train_batches", "limit_val_batches"):
        value = t[key]
        ok = value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 0) or (
            isinstance(value, float) and 0.0 <= value <= 1.0
        )
        if not ok:
            problems.append(f"trainer.{key}={value!r}: use a number of batches (int >= 0) or a fraction in [0, 1]")
    if t.accelerator in ("gpu", "cuda") and cfg.strategy.start_method == "fork":
        problems.append(
            "strategy.start_method=fork with trainer.accelerator=gpu: CUDA cannot be used in forked processes; "
            "add strategy.start_method=popen"
        )
    if cfg.strategy.timeout <= 0:
        problems.append(f"strategy.timeout={cfg.strategy.timeout}: seconds, > 0 (default 1800)")
    if t.accelerator == "cpu" and t.devices > (os.cpu_count() or 1) * 4:
        problems.append(
            f"trainer.devices={t.devices} CPU processes on {os.cpu_count()} cores would crawl; "
            "use at most a few per core"
        )
    if problems:
        raise ValueError("invalid configuration:\n  " + "\n  ".join(problems))
