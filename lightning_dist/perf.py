"""The performance checklist as code: process-wide torch settings, and warnings for what slows training.

Call :func:`run_preflight` once per process before building the ``Trainer``. It does two things:

1. :func:`apply_perf` sets the process-wide knobs that are cheap wins: the float32 matmul precision (TF32
   tensor cores on NVIDIA Ampere and newer), cuDNN autotuning, and the intra-/inter-op thread pools sized
   so that N ranks on one machine do not oversubscribe its cores.
2. :func:`preflight_warnings` reads the environment for debug and tuning variables that are known to slow
   distributed training (collective consistency checks, verbose NCCL logging, synchronous CUDA launches,
   thread oversubscription, a forced NCCL algorithm) and says what each costs and how to undo it.

Both are pure functions of their arguments (no process group needed), so they are unit-tested directly.
Some useful knobs cannot be checked from one process (``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME``
picking the wrong interface across nodes, for one) and are left out rather than guessed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Mapping, Optional

import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

_MATMUL_PRECISIONS = ("highest", "high", "medium")


@dataclass
class PerfConfig:
    """Process-wide performance settings applied by :func:`apply_perf`."""

    # float32 matmuls: "highest" = full fp32; "high" = TF32 tensor cores on Ampere+ GPUs (~10-bit mantissa,
    # several times faster, fine for training); "medium" = bf16 internally. No effect on CPU matmuls.
    float32_matmul_precision: str = "high"
    # let cuDNN time its convolution algorithms on the first batch of each input shape and keep the fastest;
    # a win for fixed shapes, a loss when shapes change every step. Lightning's Trainer(benchmark=...)
    # overrides it when passed explicitly.
    cudnn_benchmark: bool = True
    # intra-op threads per process (torch.set_num_threads). None = OMP_NUM_THREADS if set, else
    # cores // local ranks (at least 1), the rule Lightning's own launchers use.
    intra_op_threads: Optional[int] = None
    # inter-op threads per process (torch.set_num_interop_threads). None = leave torch's default. torch allows
    # this once per process, before any parallel work; a later attempt is reported as skipped.
    inter_op_threads: Optional[int] = None
    # log the preflight warnings from rank zero in run_preflight
    warn: bool = True

    def __post_init__(self) -> None:
        if self.float32_matmul_precision not in _MATMUL_PRECISIONS:
            raise ValueError(
                f"PerfConfig: float32_matmul_precision={self.float32_matmul_precision!r} is not one of"
                f" {_MATMUL_PRECISIONS}. Use 'high' for TF32 on Ampere+ GPUs or 'highest' for full fp32."
            )
        if not isinstance(self.cudnn_benchmark, bool):
            raise ValueError(
                f"PerfConfig: cudnn_benchmark must be True or False, got {self.cudnn_benchmark!r}."
            )
        for name in ("intra_op_threads", "inter_op_threads"):
            value = getattr(self, name)
            if value is not None and not _is_positive_int(value):
                raise ValueError(
                    f"PerfConfig: {name} must be an int >= 1 or None (automatic), got {value!r}."
                )


def _is_positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _check_local_world_size(local_world_size: object) -> None:
    if not _is_positive_int(local_world_size):
        raise ValueError(
            "local_world_size must be an int >= 1 (the number of ranks on this machine),"
            f" got {local_world_size!r}."
        )


def available_cores() -> int:
    """Cores this process may run on (its CPU affinity where the OS reports it, else ``os.cpu_count()``)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def apply_perf(cfg: PerfConfig, local_world_size: int = 1) -> dict[str, Any]:
    """Apply ``cfg`` to this process; return what was set.

    Args:
        cfg: the settings.
        local_world_size: ranks sharing this machine; the automatic thread count divides the cores among them.

    Returns:
        ``{"float32_matmul_precision": str, "cudnn_benchmark": bool, "intra_op_threads": int,
        "inter_op_threads": int | None, "skipped": {setting: reason}}``. ``inter_op_threads`` is the value
        in effect afterwards; a setting torch refused is listed under ``skipped`` instead of raising.
    """
    _check_local_world_size(local_world_size)
    skipped: dict[str, str] = {}

    torch.set_float32_matmul_precision(cfg.float32_matmul_precision)
    torch.backends.cudnn.benchmark = cfg.cudnn_benchmark

    intra = cfg.intra_op_threads
    if intra is None:
        from_env = os.environ.get("OMP_NUM_THREADS", "")
        # respect an explicit OMP_NUM_THREADS; an unparsable one is reported by preflight_warnings
        intra = int(from_env) if from_env.isdigit() and int(from_env) >= 1 else None
    if intra is None:
        intra = max(1, available_cores() // local_world_size)
    torch.set_num_threads(intra)

    inter: Optional[int] = None
    if cfg.inter_op_threads is not None:
        try:
            torch.set_num_interop_threads(cfg.inter_op_threads)
        except RuntimeError as err:  # already set, or parallel work already started in this process
            skipped["inter_op_threads"] = f"{cfg.inter_op_threads} refused by torch: {err}"
        inter = torch.get_num_interop_threads()

    return {
        "float32_matmul_precision": cfg.float32_matmul_precision,
        "cudnn_benchmark": cfg.cudnn_benchmark,
        "intra_op_threads": intra,
        "inter_op_threads": inter,
        "skipped": skipped,
    }


def preflight_warnings(
    env: Mapping[str, str] = os.environ, local_world_size: int = 1, cores: Optional[int] = None
) -> list[str]:
    """Human-readable warnings for environment settings that slow training; empty when none apply.

    Args:
        env: the environment to read (``os.environ`` by default; tests pass a dict).
        local_world_size: ranks sharing this machine, for the thread-oversubscription check.
        cores: cores on this machine; ``None`` asks the OS (:func:`available_cores`).
    """
    _check_local_world_size(local_world_size)
    cores = available_cores() if cores is None else cores
    warnings: list[str] = []

    debug = env.get("TORCH_DISTRIBUTED_DEBUG", "").upper()
    if debug in ("DETAIL", "INFO"):
        cost = (
            "wraps every collective in a consistency check (extra collectives per call) and logs DDP"
            " internals"
            if debug == "DETAIL"
            else "logs DDP internals and collects extra runtime statistics"
        )
        warnings.append(f"TORCH_DISTRIBUTED_DEBUG={debug} {cost}. Unset it (or set OFF) for speed runs.")

    nccl_debug = env.get("NCCL_DEBUG", "").upper()
    if nccl_debug in ("INFO", "TRACE"):
        warnings.append(
            f"NCCL_DEBUG={nccl_debug} logs from every rank on every NCCL call."
            " Unset it or use NCCL_DEBUG=WARN."
        )

    cpp_level = env.get("TORCH_CPP_LOG_LEVEL", "").upper()
    if cpp_level == "INFO":
        warnings.append(
            "TORCH_CPP_LOG_LEVEL=INFO logs c10d and DDP internals from every rank. Unset it or use WARNING."
        )

    if env.get("CUDA_LAUNCH_BLOCKING", "").strip() == "1":
        warnings.append(
            "CUDA_LAUNCH_BLOCKING=1 makes every CUDA kernel launch synchronous: no compute/communication"
            " overlap, often several times slower. Use it only to locate a CUDA error; unset it otherwise."
        )

    omp = env.get("OMP_NUM_THREADS")
    if omp is not None:
        if not omp.strip().isdigit() or int(omp) < 1:
            warnings.append(
                f"OMP_NUM_THREADS={omp!r} is not a positive integer. Set it to an int >= 1 or unset it."
            )
        elif int(omp) * local_world_size > cores:
            suggested = max(1, cores // local_world_size)
            warnings.append(
                f"OMP_NUM_THREADS={omp} x {local_world_size} local ranks = {int(omp) * local_world_size}"
                f" threads on {cores} cores: oversubscribed threads contend and slow every rank."
                f" Set OMP_NUM_THREADS={suggested} (cores // local ranks), or unset it and let apply_perf"
                " choose."
            )

    nccl_algo = env.get("NCCL_ALGO")
    if nccl_algo:
        warnings.append(
            f"NCCL_ALGO={nccl_algo} forces one algorithm for every message size. NCCL otherwise picks"
            " per size (tree for small, latency-bound all-reduces; ring for large, bandwidth-bound ones),"
            " so forcing ring can slow small all-reduces. Keep it only if a benchmark on this cluster"
            " shows a win."
        )

    return warnings


def run_preflight(cfg: PerfConfig, local_world_size: int = 1) -> tuple[dict[str, Any], list[str]]:
    """Apply ``cfg``, log what was applied and any warnings from rank zero; return both.

    Returns:
        ``(applied, warnings)``: the dict from :func:`apply_perf` and the list from
        :func:`preflight_warnings` (empty when ``cfg.warn`` is False).
    """
    applied = apply_perf(cfg, local_world_size)
    settings = ", ".join(f"{key}={value}" for key, value in applied.items() if key != "skipped")
    rank_zero_info(f"lightning_dist.perf applied: {settings}")
    for name, reason in applied["skipped"].items():
        rank_zero_info(f"lightning_dist.perf skipped {name}: {reason}")

    warnings = preflight_warnings(os.environ, local_world_size) if cfg.warn else []
    for message in warnings:
        rank_zero_warn(message)
    return applied, warnings
