"""What the simulated-cluster benchmarks share: the workload, its training configurations, one job on fresh shaped
hosts, the summary of a training run and the table cells.

:mod:`lightning_dist.benchmarks.cluster` (flat, across hosts of one rank) and :mod:`lightning_dist.benchmarks.tiers`
(flat against two_tier, hosts of several ranks) both import this module and not each other's privates; every rank of
either runs as a worker of ``python -m lightning_dist.benchmarks.cluster`` (:data:`WORKER_MODULE`).
:mod:`lightning_dist.benchmarks.sync` launches its own module's workers through :func:`launch_job` too.
"""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from lightning_dist.benchmarks import _common as bench
from lightning_dist.simcluster import SimCluster

WORKER_MODULE = "lightning_dist.benchmarks.cluster"  # what every host runs under torchrun (its --worker* modes)
# The workload: WideMLP(width, depth), per-rank batch, DDP's bucket size; the all-reduce's buffer
MLP_WIDTH, MLP_DEPTH, BATCH_SIZE, BUCKET_CAP_MB = 1024, 5, 16, 4
ALLREDUCE_BYTES = 16 << 20
DEFAULT_RATES = (100, 1000)  # Mbit/s
QUICK_STEPS = 10
QUICK_ITERATIONS = 2


@dataclass(frozen=True)
class Config:
    """One training configuration: RingDDPStrategy's algorithm and build_compressor's arguments."""

    label: str
    algorithm: str = "auto"
    compressor: dict = field(default_factory=lambda: {"name": "none"})


CONFIGS = {c.label: c for c in (
    Config("dense", "native"),
    Config("dense/ring", "ring"),
    Config("fp16", compressor={"name": "fp16"}),
    Config("int8", compressor={"name": "int8"}),
    Config("topk1%", compressor={"name": "topk", "ratio": 0.01}),
    Config("powersgd-r2", compressor={"name": "powersgd", "rank": 2}),
)}
DENSE, TOPK = "dense", "topk1%"


def run_record(raw: dict[str, Any], warmup: int) -> dict[str, Any]:
    """A training run's numbers from rank 0's stamps: medians over the steps after ``warmup``."""
    times = bench.step_times(raw["ends"], raw["epochs"], warmup)
    if not times:
        raise ValueError(f"no step left after {warmup} warm-up steps (got {len(raw['ends'])} stamps)")
    timed = [s for s in raw["steps"][max(warmup, 1):] if s]

    def med(key: str) -> Optional[float]:
        return bench.median([s[key] for s in timed if key in s])

    first, last = raw.get("first", {}), raw["last"]
    link = None  # what left rank 0's host per step, from its second step to the end
    if "link_sent" in first and "link_sent" in last and len(raw["ends"]) > 1:
        link = (last["link_sent"] - first["link_sent"]) / (len(raw["ends"]) - 1)
    return {"params": last.get("params"), "timed_steps": len(times), **bench.summarize(times),
            "exposed_median_s": med("exposed_s"), "comm_median_s": med("comm_s"),
            "bytes_sent_per_step": med("bytes_sent"), "dense_bytes_per_step": med("dense_bytes"),
            "inter_host_bytes_per_step": med("bytes_inter_host"), "intra_host_bytes_per_step": med("bytes_intra_host"),
            "link_bytes_per_step": link}


def ms_cell(seconds: Optional[float]) -> str:
    """A table cell in milliseconds ("-" for none)."""
    return bench.cell(seconds, ",.1f", 1e3)


def mb_cell(nbytes: Optional[float]) -> str:
    """A table cell in megabytes ("-" for none)."""
    return bench.cell(nbytes, ".3f", 1e-6)


def launch_job(hosts: int, rate_mbit: float, worker_args: list[str], port: int, timeout_s: float,
               log_path: Path, per_host: int = 1, module: str = WORKER_MODULE) -> tuple[list[Optional[int]], float]:
    """One torchrun job over ``hosts`` fresh shaped hosts of ``per_host`` ranks each, every rank running
    ``python -m <module> <worker_args> --nodes <hosts>``; every rank's output appended to ``log_path``. Returns the exit
    codes (None: killed at the deadline) and the wall time."""
    start = time.perf_counter()
    with SimCluster(hosts, rate_mbit=rate_mbit) as cluster, open(log_path, "w") as log:
        cmd_args = ["-m", module, *worker_args, "--nodes", str(hosts)]
        env = {**cluster.env(), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
        procs = [cluster.popen(i, cluster.torchrun(i, cmd_args, port=port, nproc=per_host), env=env, stdout=log,
                               stderr=subprocess.STDOUT) for i in range(hosts)]
        codes = cluster.wait(procs, timeout_s)  # those past the deadline die with the cluster
    return codes, time.perf_counter() - start


def failure_message(codes: Sequence[Optional[int]], log_path: Path) -> str:
    """Why a job failed, for its record and the progress line: timed out or its exit codes, and its log's tail."""
    tail = [line for line in log_path.read_text(errors="replace").splitlines() if line.strip()][-3:]
    what = "timed out" if None in codes else f"exit codes {list(codes)}"
    return f"{what}; see {log_path}: " + " | ".join(tail)
