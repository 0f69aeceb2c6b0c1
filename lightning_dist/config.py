"""Structured configs for ``lightning-dist-train``: the schema the YAML files in ``conf/`` are checked against.

Registered in Hydra's ConfigStore as ``train_schema``; ``conf/config.yaml`` lists it first in its defaults,
so a misspelt key (``trainer.max_epoch=3``) or a value of the wrong type (``trainer.devices=two``) fails in
Hydra before anything is built, and :func:`validate` catches bad values that types cannot (``devices=0``).
The groups whose options build different objects (``model``, ``data``, ``sync``) have one schema per option, stored
in the group (``model/cnn_schema``: :data:`OPTION_SCHEMAS`), which the option's YAML lists in its own defaults, as
Hydra's documentation recommends: ``model=lm model.channels=8`` fails in Hydra as ``model.chanels=8`` does.
Before Hydra composes, :func:`complete_overrides` gives a setting given without its group the group it needs
(``hetero.speeds=[3,1]``) or an error that names it (``compression.ratio=0.01``: ``compression=topk``).
All of it happens in the launching process, before any rank starts.
"""

from __future__ import annotations

import functools
import importlib.resources
import os
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Optional, Sequence, Union

from hydra.core.config_store import ConfigStore
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import OverrideType
from hydra.errors import HydraException
from omegaconf import MISSING, DictConfig, OmegaConf

from lightning_dist.comm.dispatch import ALGORITHMS
from lightning_dist.comm.topology import TOPOLOGIES
from lightning_dist.examples.cnn import OPTIMIZERS as DIGITS_OPTIMIZERS
from lightning_dist.examples.schedules import SCHEDULES
from lightning_dist.launch import LaunchEnv, connect_store
from lightning_dist.strategy.arguments import START_METHODS
from lightning_dist.sync import as_sync

RUN_DIR_TIMEOUT_S = 120.0  # how long the other ranks wait for rank 0 to name a static torchrun rendezvous's run
# groups whose options are plain dicts with settings of their own (one file per option in conf/<group>/), and the
# option a setting given without its group selects (a user who sets hetero.speeds wants heterogeneous batching;
# a compression or DiLoCo setting alone is refused, as choosing a compressor or to sync rarely is not a detail)
SETTING_GROUPS = {"compression": None, "hetero": "balanced", "sync": None}


def _choices(name: str, values: Sequence[str]) -> type[Enum]:
    """A string enum of ``values`` for the schema: Hydra then refuses any other value, naming the valid ones. The
    values are the list the owning module keeps (the strategy checks against the same one), never a copy here."""
    return Enum(name, [(value, value) for value in values], type=str, module=__name__)


Algorithm = _choices("Algorithm", ALGORITHMS)  # lightning_dist.comm.dispatch
TopologyKind = _choices("TopologyKind", TOPOLOGIES)  # lightning_dist.comm.topology
StartMethod = _choices("StartMethod", START_METHODS)  # lightning_dist.strategy.arguments
Schedule = _choices("Schedule", SCHEDULES)  # lightning_dist.examples.schedules: model.schedule
DigitsOptimizer = _choices("DigitsOptimizer", DIGITS_OPTIMIZERS)  # lightning_dist.examples.cnn: model.optimizer


@dataclass
class TrainerConf:
    accelerator: str = "cpu"  # "cpu", "gpu" or "auto"
    # processes (ranks) on this machine: a number, "auto" or -1 (under torchrun/SLURM: the processes the
    # launcher started per node; otherwise as Lightning reads them: all GPUs, or 1 for "auto" on CPU)
    devices: Union[int, str] = 2
    num_nodes: int = 1  # machines; launch each with torchrun or SLURM (num_nodes > 1 needs a launcher)
    max_epochs: int = 10
    max_steps: int = -1  # -1: no step limit
    precision: str = "32-true"  # any Lightning precision string, e.g. "bf16-mixed"
    accumulate_grad_batches: int = 1
    gradient_clip_val: Optional[float] = None
    log_every_n_steps: int = 10
    # a fraction (a float <= 1.0) or a number of batches (an int); Any, so that 1 stays the int 1
    limit_train_batches: Any = None
    limit_val_batches: Any = None
    # validate every N training batches (an int) or after this fraction of an epoch (a float); None: each epoch's end
    val_check_interval: Any = None
    check_val_every_n_epoch: Optional[int] = 1  # None: an int val_check_interval counts batches across epochs
    num_sanity_val_steps: int = 0
    enable_progress_bar: bool = True
    enable_model_summary: bool = True
    deterministic: bool = False
    profiler: Optional[str] = None  # "simple", "advanced" or "pytorch" (Chrome trace: docs/strategy.md)


@dataclass
class StrategyConf:
    _target_: str = "lightning_dist.RingDDPStrategy"
    algorithm: Optional[Algorithm] = Algorithm.auto  # None for strategies without one (stock ddp)
    overlap: Optional[bool] = True  # reduce buckets on a communication thread during backward; None for stock ddp
    # flat | two_tier (dense inside a host, compressed between hosts) | auto; None for stock ddp
    topology: Optional[TopologyKind] = TopologyKind.auto
    start_method: StartMethod = StartMethod.fork  # fork starts fastest on CPU; popen for CUDA / clusters
    timeout: float = 1800.0  # seconds a collective waits for a stalled peer before failing
    find_unused_parameters: bool = False
    static_graph: bool = False
    process_group_backend: Optional[str] = None  # None: gloo on CPU, nccl on CUDA


# The per-option schemas: types only. The values, each with its comment, are in the option's YAML (conf/<group>/), so
# that a default lives in one place; an option's YAML that lacks a key fails as a missing value.


@dataclass
class DigitsCNNConf:  # model=cnn
    _target_: str = "lightning_dist.examples.cnn.DigitsCNN"
    lr: float = MISSING
    channels: int = MISSING
    hidden: int = MISSING
    weight_decay: float = MISSING
    schedule: Schedule = MISSING  # type: ignore[valid-type]
    warmup_steps: int = MISSING
    optimizer: DigitsOptimizer = MISSING  # type: ignore[valid-type]


@dataclass
class ByteLMConf:  # model=lm
    _target_: str = "lightning_dist.examples.lm.ByteLM"
    lr: float = MISSING
    width: int = MISSING
    depth: int = MISSING
    heads: int = MISSING
    context: int = MISSING
    weight_decay: float = MISSING
    warmup_steps: int = MISSING
    schedule: Schedule = MISSING  # type: ignore[valid-type]


@dataclass
class DigitsDataConf:  # data=digits
    _target_: str = "lightning_dist.examples.digits.DigitsDataModule"
    batch_size: int = MISSING  # per rank
    val_fraction: float = MISSING
    num_workers: int = MISSING
    seed: int = MISSING


@dataclass
class StdlibTextConf:  # data=stdlib
    _target_: str = "lightning_dist.examples.lm.StdlibText"
    context: int = MISSING
    batch_size: int = MISSING  # per rank
    val_fraction: float = MISSING
    max_train_bytes: Optional[int] = MISSING
    max_val_bytes: Optional[int] = MISSING
    seed: int = MISSING
    num_workers: int = MISSING
    root: Optional[str] = MISSING


@dataclass
class EveryStepConf:  # sync=every_step
    name: str = "every_step"


@dataclass
class DiLoCoConf:  # sync=diloco: lightning_dist.sync.DiLoCo's arguments
    name: str = "diloco"
    every: int = MISSING
    outer_lr: float = MISSING
    outer_momentum: float = MISSING
    compressor: Any = MISSING  # null, a compressor's name or a dict of build_compressor's arguments
    fragments: int = MISSING  # Streaming DiLoCo: fragments synced at staggered steps (divides every)
    delay: int = MISSING  # inner steps a fragment's exchange overlaps (0: synced in its step)
    mix: float = MISSING  # how much of theta_global a delayed fragment takes on landing, in (0, 1]
    balance: str = MISSING  # batches | steps: how workers of different speeds meet at a sync
    final_sync: bool = MISSING  # every worker meets once more when the fit ends (every rank ends with theta_global)
    validate: str = MISSING  # mean | global | worker: the model validation runs on
    warmup: int = MISSING  # the first optimizer steps average the workers after every step (0: none)
    inner_rate: str = MISSING  # rise | none | normalised | follow | anneal: the outer step's answer to the inner rate


@dataclass
class OneBitAdamConf:  # sync=onebit_adam: lightning_dist.sync.OneBitAdam's arguments
    name: str = "onebit_adam"
    warmup: Any = MISSING  # dense Adam steps first: an int of steps, or a fraction in [0, 1) of the fit's steps
    compressor: Any = MISSING  # the momentum's: a compressor's name or a dict of build_compressor's arguments
    refresh: int = MISSING  # every refresh-th step after the warm-up, Adam updates v from a compressed gradient
    refresh_compressor: Any = MISSING  # how a refresh's gradient travels
    bound: Optional[float] = MISSING  # the largest update per coordinate, in units of lr (null: none)


@dataclass
class AutoConf:  # sync=auto: lightning_dist.sync.Auto's arguments
    name: str = "auto"
    warmup_steps: int = MISSING  # dense steps first, not timed
    steps: int = MISSING  # timed dense steps
    rounds: int = MISSING  # timed rounds of every candidate codec
    long_s: float = MISSING  # a candidate's first round, or the first timed step, taking longer is timed once
    compressors: list[str] = MISSING  # the per-step compressors measured
    max_bytes_per_step: Optional[float] = MISSING  # bytes a rank may send per step (null: any)
    exact: bool = MISSING  # no change to the optimisation
    methods: Optional[list[str]] = MISSING  # only these candidates (null: every one)
    drift: float = MISSING  # pick again at this many times the prediction (0: never)
    check_every: int = MISSING  # steps between the drift checks


# group -> option -> its schema, stored in the group as "<option>_schema" (the option's YAML lists it in its defaults)
OPTION_SCHEMAS: dict[str, dict[str, type]] = {
    "model": {"cnn": DigitsCNNConf, "lm": ByteLMConf},
    "data": {"digits": DigitsDataConf, "stdlib": StdlibTextConf},
    "sync": {"every_step": EveryStepConf, "diloco": DiLoCoConf, "onebit_adam": OneBitAdamConf, "auto": AutoConf},
}


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
    # one option of each group, typed by its own schema (OPTION_SCHEMAS); Any here, or the merge would check every
    # option against one schema
    model: Any = MISSING
    data: Any = MISSING
    perf: PerfConf = field(default_factory=PerfConf)
    # build_compressor's arguments, {_target_, name, ...}: one file per compressor in conf/compression/
    compression: dict[str, Any] = field(default_factory=lambda: {
        "_target_": "lightning_dist.compression.build_compressor", "name": "none"})
    # HeteroBatching's arguments plus `enabled` (conf/hetero/: none, balanced)
    hetero: dict[str, Any] = field(default_factory=lambda: {"enabled": False})
    # how often the workers sync: {name: every_step} or DiLoCo's arguments with name: diloco (conf/sync/)
    sync: Any = MISSING
    callbacks: dict[str, Any] = field(default_factory=dict)  # name -> {_target_: ..., ...}
    seed: int = 0
    ckpt_path: Optional[str] = None  # resume from this checkpoint (a path)
    resume: str = "never"  # never | auto: the newest valid checkpoint under <run dir>/checkpoints (ckpt_path wins)
    # lightning-dist-advise's settings (lightning_dist.advise.AdviseConf), which that command selects
    # (+advise=default); training leaves it null
    advise: Any = None


def stock_ddp_strategy(timeout: float, algorithm: Optional[str] = None, overlap: Optional[bool] = None,
                       compressor: Any = None, hetero: Any = None, topology: Optional[str] = None,
                       sync: Any = None, **kwargs: Any) -> Any:
    """Lightning's own DDPStrategy from the same keys, for side-by-side runs (``strategy=ddp``)."""
    from datetime import timedelta

    from lightning.pytorch.strategies import DDPStrategy

    if algorithm is not None:
        raise ValueError(f"strategy.algorithm={algorithm!r} has no meaning for stock ddp; use strategy=ring_ddp")
    if overlap is not None:
        raise ValueError(f"strategy.overlap={overlap!r} has no meaning for stock ddp (it always overlaps); "
                         "use strategy=ring_ddp")
    if topology is not None:
        raise ValueError(f"strategy.topology={topology!r} needs strategy=ring_ddp (stock ddp leaves the choice to "
                         "the backend); drop strategy.topology= or use strategy=ring_ddp")
    if compressor is not None and getattr(compressor, "name", "none") != "none":
        raise ValueError(f"compression={compressor.name} needs strategy=ring_ddp (stock ddp sends gradients as they "
                         "are on CPU); drop compression= or use strategy=ring_ddp")
    if hetero:
        raise ValueError("hetero=balanced needs strategy=ring_ddp; drop hetero= or use strategy=ring_ddp")
    if (driver := as_sync(sync)) is not None:
        raise ValueError(_needs_ring_ddp(driver.name))
    return DDPStrategy(timeout=timedelta(seconds=timeout), **kwargs)


def _needs_ring_ddp(sync: str) -> str:
    return (f"sync={sync} needs strategy=ring_ddp (stock ddp only all-reduces the gradient every step); drop sync= or "
            "use strategy=ring_ddp")


def register_configs() -> None:
    store = ConfigStore.instance()
    store.store(name="train_schema", node=TrainConf)
    for group, schemas in OPTION_SCHEMAS.items():
        for option, schema in schemas.items():
            store.store(group=group, name=f"{option}_schema", node=schema)


def complete_overrides(overrides: Sequence[str]) -> list[str]:
    """The command's overrides with the group option each setting needs, checked before Hydra composes them.

    Hydra refuses a setting the group's chosen option lacks with "Key 'speeds' is not in struct", which does not
    name the fix. Here, for the :data:`SETTING_GROUPS`: a ``hetero.*`` setting without ``hetero=...`` selects
    ``hetero=balanced`` (``hetero.speeds=[3,1]`` works as ``hetero=balanced hetero.speeds=[3,1]``); any other setting
    the chosen option lacks (``compression.ratio=0.01`` with the default ``compression=none``) raises ``ValueError``
    naming the options that have it (``use compression=topk compression.ratio=0.01``). Overrides Hydra cannot parse
    are returned as they are, for Hydra to report.
    """
    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except HydraException:
        return list(overrides)
    changes = [o for o in parsed if o.type == OverrideType.CHANGE and o.package is None]
    chosen: dict[str, Optional[list[str]]] = {  # group -> the options chosen (None: a sweep only Hydra can expand)
        o.key_or_group: _sweep_choices(o) for o in parsed
        if o.key_or_group in SETTING_GROUPS and o.type in (OverrideType.CHANGE, OverrideType.ADD,
                                                           OverrideType.FORCE_ADD)}
    completed, problems = list(overrides), []
    for o in changes:
        group, _, key = o.key_or_group.partition(".")
        if group not in SETTING_GROUPS or not key or (group in chosen and chosen[group] is None):
            continue
        key = key.split(".")[0]
        if group not in chosen and SETTING_GROUPS[group] is not None:
            chosen[group] = [SETTING_GROUPS[group]]
            completed.insert(completed.index(o.input_line), f"{group}={SETTING_GROUPS[group]}")
        for option in chosen.get(group) or [_default_option(group)]:
            if option in _options(group) and key not in _option_keys(group, option):  # (Hydra names a missing one)
                chose = f"{group}={option}" + ("" if group in chosen else " (the default)")
                fix = _fix(group, option, key, o.input_line)
                problems.append(f"{o.input_line}: {chose} has no setting {key!r}; {fix}")
    if problems:
        raise ValueError("invalid overrides:\n  " + "\n  ".join(problems))
    return completed


OWN_CLASS_GROUPS = ("model", "data")  # groups whose class may be the user's own: model._target_=my_pkg.MyModule


def own_class_overrides(overrides: Sequence[str]) -> list[str]:
    """``model._target_=my_pkg.MyModule`` (or ``data._target_=``) without a ``model=`` option: a class of the user's
    own, built from the ``model.*`` keys given with it alone, not the default option's (the digits CNN's ``lr``,
    ``channels``... mean nothing to it). Rewritten into what Hydra needs for that: ``~model``, then
    ``+model._target_=...`` and ``+model.<key>=...`` for each key given. With ``model=<option>`` given (or ``~model``,
    or an override Hydra cannot parse) the overrides are returned as they are."""
    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except HydraException:
        return list(overrides)
    own = [group for group in OWN_CLASS_GROUPS
           if any(o.key_or_group == f"{group}._target_" and o.type == OverrideType.CHANGE and o.package is None
                  for o in parsed)
           and not any(o.key_or_group == group for o in parsed)]
    if not own:
        return list(overrides)
    out = [f"~{group}" for group in own]
    for o in parsed:
        group = o.key_or_group.split(".")[0]
        mine = group in own and "." in o.key_or_group and o.type == OverrideType.CHANGE and o.package is None
        out.append(f"+{o.input_line}" if mine else o.input_line)
    return out


def _sweep_choices(override: Any) -> Optional[list[str]]:
    """The options a group override selects; None for a sweep Hydra expands itself (``glob(*)``)."""
    if not override.is_sweep_override():
        return [str(override.value())]
    try:
        return list(override.sweep_string_iterator())
    except HydraException:  # a glob needs Hydra's config loader: leave its checks to Hydra
        return None


def _fix(group: str, option: str, key: str, override: str) -> str:
    """What to write instead of ``override``, whose ``key`` the chosen ``option`` of ``group`` lacks."""
    having = [name for name in _options(group) if key in _option_keys(group, name)]
    if not having:
        settings = ", ".join(sorted(_option_keys(group, option) - {"_target_"}))
        return f"no {group} option has it; {group}={option}'s settings are {settings}"
    if len(having) == 1:
        return f"it is a setting of {group}={having[0]}: use {group}={having[0]} {override}"
    return f"it is a setting of {group}={', '.join(having)}: choose one, e.g. {group}={having[0]} {override}"


def _conf() -> Any:
    return importlib.resources.files("lightning_dist.conf")


@functools.cache
def _options(group: str) -> tuple[str, ...]:
    return tuple(sorted(path.name[:-len(".yaml")] for path in (_conf() / group).iterdir()
                        if path.name.endswith(".yaml")))


@functools.cache
def _option_keys(group: str, option: str) -> frozenset[str]:
    keys = OmegaConf.create((_conf() / group / f"{option}.yaml").read_text()).keys()
    return frozenset(keys) - {"defaults"}  # the option's schema, not a setting


@functools.cache
def _default_option(group: str) -> str:
    defaults = OmegaConf.create((_conf() / "config.yaml").read_text()).defaults
    return next(entry[group] for entry in defaults if not isinstance(entry, str) and group in entry)


def _numeric_devices(devices: Union[int, str]) -> Union[int, str]:
    """``"3"`` and ``"-1"`` as the ints they spell (a command-line value may arrive as a string)."""
    if isinstance(devices, str) and devices.strip().lstrip("-").isdigit():
        return int(devices)
    return devices


def resolve_devices(devices: Union[int, str]) -> Union[int, str]:
    """What the command passes to ``Trainer(devices=...)``: under a launcher, ``"auto"``/-1 mean the processes
    it started on this node (Lightning checks devices x num_nodes against the launcher's world size);
    otherwise Lightning's own reading."""
    devices = _numeric_devices(devices)
    if devices in ("auto", -1):
        launched = LaunchEnv.current().local_world_size
        if launched is not None:
            return launched
    return devices


def resolve_num_nodes(num_nodes: int) -> int:
    """What the command passes to ``Trainer(num_nodes=...)``: under torchrun or srun the nodes the launcher has now
    (under ``torchrun --nnodes MIN:MAX`` that changes between restarts, and Lightning refuses a count that does not
    match the launcher's world size), else the configured count."""
    launched = LaunchEnv.current().num_nodes
    if launched is None:
        return num_nodes
    if num_nodes not in (1, launched):
        print(f"[lightning_dist] trainer.num_nodes={num_nodes}: the launcher runs {launched} node(s) now; using "
              f"{launched}", flush=True)
    return launched


def local_world_size(devices: Union[int, str], accelerator: str) -> int:
    """Ranks on this node, for sizing each rank's thread pools."""
    resolved = resolve_devices(devices)
    if isinstance(resolved, int) and resolved > 0:
        return resolved
    if accelerator in ("gpu", "cuda", "auto"):
        import torch

        return max(torch.cuda.device_count(), 1)
    return 1  # "auto" on CPU: Lightning runs one process


def run_dir_name() -> str:
    """The name of this run's output directory, the same in every rank of one launch.

    Hydra computes its timestamped directory in each process, and two ranks can straddle a second. Under a
    launcher the name is the launch's run id (:class:`~lightning_dist.launch.LaunchEnv`: torchrun's ``--rdzv-id``,
    which ``--standalone`` makes afresh per launch; SLURM's job and step ids). A static torchrun rendezvous without
    ``--rdzv-id`` has none: rank 0 then writes its timestamp to torchrun's own store, and the others read it there.
    """
    launch = LaunchEnv.current()
    if launch.run_id is not None:
        return launch.run_id
    if launch.launcher == "torchrun" and launch.agent_store:
        store = connect_store(RUN_DIR_TIMEOUT_S, launch)
        # the first attempt's rank 0 names it; restarts (torchrun --max-restarts) find the same name, and with it
        # the checkpoints resume=auto looks for
        key = launch.key("run_dir")
        if launch.rank == 0:
            store.compare_set(key, "", time.strftime("%Y-%m-%d_%H-%M-%S"))
        return f"torchrun-{store.get(key).decode()}"
    return time.strftime("%Y-%m-%d/%H-%M-%S")  # Hydra's own layout


def validate(cfg: DictConfig) -> None:
    """Checks that types cannot express; raises ``ValueError`` naming the key, the value and the fix."""
    t = cfg.trainer
    problems = []
    devices = _numeric_devices(t.devices)
    launched = LaunchEnv.current().local_world_size is not None  # torchrun or srun started the processes
    if devices == -1 and t.accelerator == "cpu" and not launched:
        problems.append("trainer.devices=-1 on CPU: Lightning counts only accelerators for -1; give a number of "
                        "processes, e.g. trainer.devices=2 (under torchrun or srun, -1 and auto take theirs)")
    elif not (devices == "auto" or devices == -1 or (isinstance(devices, int) and devices >= 1)):
        problems.append(f"trainer.devices={t.devices!r}: use a number of processes >= 1, 'auto' or -1, "
                        "e.g. trainer.devices=2")
    if t.num_nodes < 1:
        problems.append(f"trainer.num_nodes={t.num_nodes}: use 1 or more")
    elif t.num_nodes > 1 and not launched:
        problems.append(f"trainer.num_nodes={t.num_nodes} needs a launcher on every node: start the command with "
                        "torchrun --nnodes ... or srun (see docs/launching.md)")
    if t.max_epochs < 1 and t.max_steps < 1:
        problems.append(f"trainer.max_epochs={t.max_epochs} and max_steps={t.max_steps}: set one of them >= 1")
    if t.accumulate_grad_batches < 1:
        problems.append(f"trainer.accumulate_grad_batches={t.accumulate_grad_batches}: use 1 or more")
    interval = t.get("val_check_interval")
    if not (interval is None or (isinstance(interval, int) and not isinstance(interval, bool) and interval >= 1) or (
            isinstance(interval, float) and 0.0 < interval <= 1.0)):
        problems.append(f"trainer.val_check_interval={interval!r}: use a number of training batches (int >= 1), a "
                        "fraction of an epoch in (0, 1], or null (each epoch's end)")
    every_n = t.get("check_val_every_n_epoch", 1)
    if every_n is not None and every_n < 1:
        problems.append(f"trainer.check_val_every_n_epoch={every_n}: use 1 or more, or null (with an int "
                        "val_check_interval: every that many batches across epochs)")
    for key in ("limit_train_batches", "limit_val_batches"):
        value = t[key]
        ok = value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 0) or (
            isinstance(value, float) and 0.0 <= value <= 1.0
        )
        if not ok:
            problems.append(f"trainer.{key}={value!r}: use a number of batches (int >= 0) or a fraction in [0, 1]")
    if t.accelerator in ("gpu", "cuda") and cfg.strategy.start_method == "fork" and not launched:
        problems.append(
            "strategy.start_method=fork with trainer.accelerator=gpu: CUDA cannot be used in forked processes; "
            "add strategy.start_method=popen"
        )
    if cfg.get("resume", "never") not in ("never", "auto"):
        problems.append(f"resume={cfg.resume!r}: use resume=auto (the newest valid checkpoint of this run directory) "
                        "or resume=never; ckpt_path=PATH resumes from one file")
    if cfg.strategy.timeout <= 0:
        problems.append(f"strategy.timeout={cfg.strategy.timeout}: seconds, > 0 (default 1800)")
    nodes = LaunchEnv.current().num_nodes or t.num_nodes  # the launcher's count wins (resolve_num_nodes)
    if _value(cfg.strategy.get("topology")) == "two_tier" and nodes < 2:
        one_worker = " (with sync=diloco a worker is a host: one worker, nothing to sync)" if _diloco(cfg) else ""
        problems.append(f"strategy.topology=two_tier on {nodes} node: it needs 2 or more hosts{one_worker}; use "
                        "strategy.topology=auto (two_tier where it applies) or flat")
    if t.accelerator == "cpu" and isinstance(devices, int) and devices > (os.cpu_count() or 1) * 4:
        problems.append(
            f"trainer.devices={t.devices} CPU processes on {os.cpu_count()} cores would crawl; "
            "use at most a few per core"
        )
    problems += _sync_problems(cfg)
    problems += _workload_problems(cfg)
    problems += _hetero_problems(cfg)
    problems += _nan_recovery_problems(cfg)
    problems += _memory_monitor_problems(cfg)
    problems += _fault_tolerance_problems(cfg)
    problems += _elastic_problems(cfg)
    if problems:
        raise ValueError("invalid configuration:\n  " + "\n  ".join(problems))


def _value(option: Any) -> Any:
    """An enum option's value (structured configs hold enums), anything else as it is."""
    return getattr(option, "value", option)


def _diloco(cfg: DictConfig) -> bool:
    return (cfg.get("sync") or {}).get("name") == "diloco"


def _sync_problems(cfg: DictConfig) -> list[str]:
    """sync.*: DiLoCo's own checks (``every >= 1``, the compressor's name and settings), and what it needs beside."""
    sync = cfg.get("sync")
    if sync is None:
        return []
    try:
        settings = as_sync(OmegaConf.to_container(sync, resolve=True, enum_to_str=True))
    except ValueError as err:
        return [f"sync: {err}"]
    if settings is None:
        return []
    problems, name = [], settings.name
    if cfg.strategy.get("_target_", "") != StrategyConf._target_:
        problems.append(_needs_ring_ddp(name))
    if getattr(settings, "balance", None) == "steps" and not (cfg.get("hetero") or {}).get("enabled", False):
        problems.append("sync.balance=steps runs more inner steps on a faster worker, from the speeds heterogeneous "
                        "batching measures: add hetero=balanced, or use sync.balance=batches")
    compression = (cfg.get("compression") or {}).get("name", "none")
    if compression != "none":
        why = ("between syncs nothing travels across workers, so there is no per-step gradient to compress; compress "
               "the pseudo-gradient instead" if name == "diloco" else
               "its warm-up's steps are plain Adam steps and after it the momentum travels; compress the momentum "
               "instead")
        problems.append(f"sync={name} with compression={compression}: {why}: sync.compressor={compression} (and drop "
                        "compression=)")
    warmup, max_steps = getattr(settings, "warmup", None), cfg.trainer.get("max_steps", -1)
    if isinstance(warmup, int) and max_steps is not None and 0 < max_steps <= warmup:
        fraction = ", or a fraction such as sync.warmup=0.2" if name == "onebit_adam" else ""
        problems.append(f"sync.warmup={warmup} with trainer.max_steps={max_steps}: the warm-up must end before the "
                        f"fit does; use sync.warmup < {max_steps}{fraction}")
    return problems


def _workload_problems(cfg: DictConfig) -> list[str]:
    """model and data that fit each other: byte windows for the byte-level LM, and no window longer than its
    positions."""
    model, data = cfg.get("model") or {}, cfg.get("data") or {}
    takes_bytes, gives_bytes = "context" in model, "context" in data
    if takes_bytes != gives_bytes:
        return [f"{_option_of('model', model)} with {_option_of('data', data)}: the byte-level LM reads byte windows "
                "and nothing else does; use model=lm data=stdlib, or model=cnn data=digits"]
    if takes_bytes and data.context > model.context:
        return [f"data.context={data.context} is longer than model.context={model.context} (the positions the model "
                f"learns); set model.context={data.context} or data.context={model.context}"]
    return []


def _option_of(group: str, node: Any) -> str:
    """``model=lm`` for a node built from that option (found by its ``_target_``), else ``model._target_=...``."""
    target = node.get("_target_")
    option = next((name for name, schema in OPTION_SCHEMAS[group].items() if schema._target_ == target), None)
    return f"{group}={option}" if option else f"{group}._target_={target}"


def _callback_problems(cfg: DictConfig, name: str, cls: type, check: Any) -> list[str]:
    """callbacks.<name>: its arguments checked by the callback's own ``check_settings``, its defaults taken from
    its constructor's signature."""
    import inspect

    node = (cfg.get("callbacks") or {}).get(name)
    if node is None:
        return []
    defaults = {key: p.default for key, p in inspect.signature(cls).parameters.items()}
    given = {k: v for k, v in node.items() if k != "_target_"}
    return [f"callbacks.{name}: {p}" for p in check(**{**defaults, **given})]


def _nan_recovery_problems(cfg: DictConfig) -> list[str]:
    """callbacks.nan_recovery: its arguments, and a strategy that can skip a step."""
    from lightning_dist.callbacks.nan_recovery import NaNRecovery, check_settings

    problems = _callback_problems(cfg, "nan_recovery", NaNRecovery, check_settings)
    if (cfg.get("callbacks") or {}).get("nan_recovery") is not None and \
            cfg.strategy.get("_target_", "") != StrategyConf._target_:
        problems.append("callbacks.nan_recovery needs strategy=ring_ddp (the strategy skips a step on every rank "
                        "together); use strategy=ring_ddp or drop nan_recovery from callbacks")
    return problems


def _memory_monitor_problems(cfg: DictConfig) -> list[str]:
    from lightning_dist.callbacks.memory_monitor import MemoryMonitor, check_settings

    return _callback_problems(cfg, "memory_monitor", MemoryMonitor, check_settings)


def _fault_tolerance_problems(cfg: DictConfig) -> list[str]:
    from lightning_dist.callbacks.fault_tolerance import FaultTolerance, check_settings

    return _callback_problems(cfg, "fault_tolerance", FaultTolerance, check_settings)


def _elastic_problems(cfg: DictConfig) -> list[str]:
    """callbacks.elastic: what an elastic run needs besides it (lightning_dist.callbacks.elastic)."""
    callbacks = cfg.get("callbacks") or {}
    if callbacks.get("elastic") is None:
        return []
    from lightning_dist.callbacks.elastic import launch_problems

    problems = [f"callbacks.elastic: {p}" for p in launch_problems()]
    hetero = cfg.get("hetero") or {}
    if cfg.strategy.get("_target_", "") != StrategyConf._target_:
        problems.append("callbacks.elastic needs strategy=ring_ddp (it splits the global batch over whoever is there)")
    if not (hetero.get("enabled", False) and hetero.get("elastic", False)):
        problems.append("callbacks.elastic needs hetero=elastic with a fixed hetero.global_batch_size (the global "
                        "batch must not change with the world size), e.g. hetero=elastic hetero.global_batch_size=96")
    if callbacks.get("fault_tolerance") is None:
        problems.append("callbacks.elastic needs fault_tolerance: callbacks=[checkpoint,fault_tolerance,elastic]")
    if cfg.get("resume", "never") != "auto" and cfg.get("ckpt_path") is None:
        problems.append("callbacks.elastic needs resume=auto (every restart resumes from the newest consistent state)")
    return problems


def _hetero_problems(cfg: DictConfig) -> list[str]:
    """hetero.* against the world size and the global batch, which only the whole config knows."""
    hetero = cfg.get("hetero") or {}
    if not hetero.get("enabled", False):
        return []
    from lightning_dist.hetero.batching import as_hetero

    accumulate = hetero.get("accumulate")
    if isinstance(accumulate, bool):  # the command line gives "off"; a YAML file reads an unquoted off as false
        return [f"hetero.accumulate={accumulate}: use auto, off or per-rank counts such as [1,3] (in a YAML file quote "
                "it, accumulate: 'off', which YAML 1.1 would read as false)"]
    try:
        settings = as_hetero(dict(hetero))
    except ValueError as err:
        return [str(err).replace("\n", " ")]
    devices = resolve_devices(cfg.trainer.devices)
    if not isinstance(devices, int):
        return []
    world = devices * (LaunchEnv.current().num_nodes or cfg.trainer.num_nodes)
    problems = []
    try:
        settings.check_world(world)
    except ValueError as err:
        problems.append(str(err))
    total = settings.global_batch_size or world * cfg.data.batch_size
    if settings.batch_sizes is not None and sum(settings.batch_sizes) != total:
        problems.append(f"hetero.batch_sizes={list(settings.batch_sizes)} add up to {sum(settings.batch_sizes)}, not "
                        f"the global batch {total} (= {world} ranks x data.batch_size={cfg.data.batch_size}); "
                        "make them add up or set hetero.global_batch_size")
    if total < world:
        problems.append(f"a global batch of {total} cannot give each of {world} ranks a sample")
    elif not problems:
        problems += _capacity_problems(settings, world, total)
    return problems


def _capacity_problems(settings: Any, world: int, total: int) -> list[str]:
    """Whether the ranks' shares can hold the global batch (the plan checks it only once every rank has started): a cap
    bounds a share with accumulate off, ``count x cap`` with per-rank counts; ``auto`` cuts any share."""
    bounds = settings.share_caps(world, total)
    if bounds is None or sum(bounds) >= total:
        return []
    caps = settings.micro_caps(world, total)
    needed = [-(-total // (world * c)) for c in caps]  # per rank, enough passes for an even split
    return [f"hetero.accumulate={settings.accumulate} with caps of {caps} samples a pass (hetero.memory_caps, "
            f"max_batch_size) holds {sum(bounds)} samples a step, fewer than the global batch {total}: use "
            "hetero.accumulate=auto (as many micro-batches as each share needs), per-rank counts such as "
            f"hetero.accumulate=[{','.join(map(str, needed))}], or larger caps"]
