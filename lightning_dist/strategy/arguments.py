"""``RingDDPStrategy``'s own arguments, checked when the strategy is built (before any process starts), each error
naming the value, the allowed values and the fix; and the lists the Hydra schema (:mod:`lightning_dist.config`)
reads."""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Optional, Union

from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout

from lightning_dist.comm import check_algorithm
from lightning_dist.comm.topology import TOPOLOGIES

# How ranks are started on one machine (Lightning's launchers; "popen" re-runs the script per rank): the one list,
# read by the strategy's check, the Hydra schema (lightning_dist.config) and the errors
START_METHODS = ("popen", "spawn", "fork", "forkserver")
DEFAULT_TIMEOUT_S = default_pg_timeout.total_seconds()  # torch.distributed's: a hung collective fails then


def check_arguments(algorithm: Any, topology: Any, start_method: Any, overlap: Any,
                    **ddp_positions: Optional[object]) -> tuple[str, str, str]:
    """``(algorithm, topology, start_method)`` as plain strings (Hydra's structured config passes enums), or a
    ``ValueError``. ``ddp_positions``: DDPStrategy's ``ddp_comm_state``, ``ddp_comm_hook``, ``ddp_comm_wrapper`` and
    ``model_averaging_period``, kept in its positions only: anything but None would replace the strategy's hook."""
    conflicting = sorted(name for name, value in ddp_positions.items() if value is not None)
    if conflicting:
        raise ValueError(
            f"RingDDPStrategy installs its own DDP comm hook, so {conflicting} would collide with it. "
            "Remove them; to change how gradients travel use algorithm=... or compressor=..., or use "
            "Lightning's DDPStrategy if you need your own hook."
        )
    algorithm = check_algorithm(getattr(algorithm, "value", algorithm))
    topology = getattr(topology, "value", topology)
    if topology not in TOPOLOGIES:
        raise ValueError(f"topology={topology!r}; use one of {', '.join(TOPOLOGIES)} ('auto': two_tier on 2 or "
                         "more hosts of 2 or more ranks each).")
    start_method = getattr(start_method, "value", start_method)
    if start_method not in START_METHODS:
        raise ValueError(f"start_method={start_method!r}; use one of {', '.join(START_METHODS)} ('popen' re-runs "
                         "the script per rank, the robust default; 'fork' starts fastest on CPU).")
    if not isinstance(overlap, bool):
        raise ValueError(f"overlap={overlap!r} must be True (reduce on a communication thread) or False.")
    return algorithm, topology, start_method


def as_timedelta(timeout: Union[float, int, timedelta, None]) -> timedelta:
    """The collective timeout as a ``timedelta`` (None: torch's default, as DDPStrategy)."""
    if timeout is None:
        return default_pg_timeout
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
    if not isinstance(seconds, (int, float)) or isinstance(seconds, bool) or seconds <= 0:
        raise ValueError(f"timeout={timeout!r} must be a positive number of seconds (default {DEFAULT_TIMEOUT_S}).")
    return timedelta(seconds=float(seconds))


def register_names(cls: Any, strategy_registry: Any) -> None:
    """``cls`` in Lightning's strategy registry under ``ring_ddp`` and its start-method variants, each also with
    ``find_unused_parameters=True`` (``Trainer(strategy="ring_ddp_fork")``)."""
    for name, start_method in (("ring_ddp", "popen"), ("ring_ddp_spawn", "spawn"), ("ring_ddp_fork", "fork"),
                               ("ring_ddp_notebook", "fork")):
        strategy_registry.register(name, cls, description=f"Ring all-reduce DDP, start_method={start_method!r}",
                                   override=True, start_method=start_method)
        strategy_registry.register(
            f"{name}_find_unused_parameters_true", cls, override=True, start_method=start_method,
            description=f"Ring all-reduce DDP, find_unused_parameters=True, start_method={start_method!r}",
            find_unused_parameters=True)
