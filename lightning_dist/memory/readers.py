"""Reading one rank's memory from inside the job: host (psutil, /proc), CUDA (torch's allocator), GPU (NVML).

Every reader is cheap (tens of microseconds) and never raises for a missing source: a value that cannot be
read is ``-1`` (the per-rank exchange carries numbers only), and :data:`UNAVAILABLE` says which.
"""

from __future__ import annotations

import gc
import os
from typing import Optional

import psutil
import torch

UNAVAILABLE = -1.0
_process: Optional[tuple[int, psutil.Process]] = None


def _me() -> psutil.Process:
    global _process
    pid = os.getpid()
    if _process is None or _process[0] != pid:  # a forked rank is another process
        _process = (pid, psutil.Process(pid))
    return _process[1]


# -- host ---------------------------------------------------------------------------------------------------
def host_rss() -> int:
    """This process's resident set size, bytes."""
    return int(_me().memory_info().rss)


def host_rss_peak() -> int:
    """The highest resident set size since the process started or :func:`reset_host_peak` (Linux's VmHWM);
    the current RSS where the kernel does not say."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return host_rss()


def reset_host_peak() -> bool:
    """Restart the peak RSS from the current RSS (Linux >= 4.0: ``5 > /proc/self/clear_refs``)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _read_limit(path: str) -> Optional[int]:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    if not text.isdigit():
        return None  # "max": no limit at this level
    value = int(text)
    return value if value < 2**60 else None  # v1 writes "no limit" as a page-rounded 2**63


def cgroup_limit(root: str = "/sys/fs/cgroup", proc: str = "/proc/self/cgroup") -> Optional[int]:
    """The lowest memory limit on the way from this process's cgroup up to the root (cgroup v2's ``memory.max``
    or v1's ``memory.limit_in_bytes``): a container's, a SLURM job's (``.../job_N``), a systemd slice's. None
    when nothing limits it."""
    try:
        with open(proc) as f:
            lines = f.read().splitlines()
    except OSError:
        lines = []
    candidates = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        controllers, rel = parts[1], parts[2].strip("/")
        if controllers == "":  # v2, the unified hierarchy
            base, name = root, "memory.max"
        elif "memory" in controllers.split(","):
            base, name = os.path.join(root, "memory"), "memory.limit_in_bytes"
        else:
            continue
        while True:  # the process's own group, its parents, and the mount's root (a container's own group)
            candidates.append(os.path.join(base, rel, name))
            if not rel:
                break
            rel = os.path.dirname(rel)
    limits = [limit for limit in map(_read_limit, dict.fromkeys(candidates)) if limit is not None]
    return min(limits) if limits else None


def host_capacity(ranks_here: int) -> tuple[int, str]:
    """This rank's share of the machine's memory: physical memory or the cgroup limit, whichever is lower,
    divided among the ``ranks_here`` on the machine (the launcher's count:
    :attr:`lightning_dist.launch.LaunchEnv.local_world_size`)."""
    total, source = int(psutil.virtual_memory().total), "host memory"
    limit = cgroup_limit()
    if limit is not None and limit < total:
        total, source = limit, "cgroup limit"
    ranks_here = max(1, ranks_here)
    if ranks_here > 1:
        source += f" / {ranks_here} ranks on this machine"
    return total // ranks_here, source


def release_host_memory() -> None:
    """Collect garbage and hand freed heap pages back to the system (glibc's ``malloc_trim``)."""
    gc.collect()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


# -- CUDA ---------------------------------------------------------------------------------------------------
def cuda_device(device: torch.device) -> Optional[torch.device]:
    """``device`` when it is a usable CUDA device, else None (every CUDA reader is skipped then)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())


def cuda_stats(device: Optional[torch.device]) -> dict[str, float]:
    """Allocated and reserved bytes (current and peak), allocation retries and OOMs, as torch's caching
    allocator counts them; every value ``-1`` without a CUDA device."""
    keys = ("cuda_allocated", "cuda_allocated_peak", "cuda_reserved", "cuda_reserved_peak", "cuda_alloc_retries",
            "cuda_ooms", "cuda_nontorch")
    if device is None:
        return dict.fromkeys(keys, UNAVAILABLE)
    stats = torch.cuda.memory_stats(device)
    free, total = torch.cuda.mem_get_info(device)
    reserved = float(stats.get("reserved_bytes.all.current", 0))
    return {
        "cuda_allocated": float(stats.get("allocated_bytes.all.current", 0)),
        "cuda_allocated_peak": float(stats.get("allocated_bytes.all.peak", 0)),
        "cuda_reserved": reserved,
        "cuda_reserved_peak": float(stats.get("reserved_bytes.all.peak", 0)),
        "cuda_alloc_retries": float(stats.get("num_alloc_retries", 0)),
        "cuda_ooms": float(stats.get("num_ooms", 0)),
        # what the device holds outside this process's allocator: the CUDA context, other processes
        "cuda_nontorch": max(float(total - free) - reserved, 0.0),
    }


def cuda_capacity(device: torch.device) -> tuple[int, str]:
    """What this process's allocator can reach on ``device``: free memory plus what it already reserved."""
    free, total = torch.cuda.mem_get_info(device)
    reserved = torch.cuda.memory_reserved(device)
    name = torch.cuda.get_device_name(device)
    return int(free + reserved), f"{name}: {total / 2**30:.1f} GiB, less the CUDA context and other processes"


class GpuUtilization:
    """GPU utilisation in percent through NVML (``pip install lightning-dist[gpu]``, i.e. nvidia-ml-py), via
    ``torch.cuda.utilization``, which maps ``CUDA_VISIBLE_DEVICES`` to NVML's numbering; ``-1`` without it.
    A first failure (no library, no driver) turns it off for the run."""

    def __init__(self) -> None:
        self.error: Optional[str] = None

    def read(self, device: Optional[torch.device]) -> float:
        if device is None or self.error is not None:
            return UNAVAILABLE
        try:
            return float(torch.cuda.utilization(device))
        except Exception as err:  # noqa: BLE001 - ModuleNotFoundError, pynvml.NVMLError, ...: off for the run
            self.error = f"{type(err).__name__}: {err}"
            return UNAVAILABLE
