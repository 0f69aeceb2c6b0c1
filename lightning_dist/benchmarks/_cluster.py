"""What the simulated-cluster benchmarks share: the workload, its training configurations, one job on fresh shaped
hosts, the summary of a training run and the table cells.

Every rank of :mod:`~lightning_dist.benchmarks.cluster` and :mod:`~lightning_dist.benchmarks.tiers` runs as a worker of
``python -m lightning_dist.benchmarks.cluster`` (:data:`WORKER_MODULE`); :mod:`~lightning_dist.benchmarks.sync`
launches its own module's workers through :func:`launch_job` too.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from lightning_dist.benchmarks import _common as bench
from lightning_dist.simcluster import SimCluster, unavailable

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
    return bench.cell(seconds, ",.1f", 1e3)


def mb_cell(nbytes: Optional[float]) -> str:
    return bench.cell(nbytes, ".3f", 1e-6)


def launch_job(hosts: int, rate_mbit: float, worker_args: list[str], port: int, timeout_s: float, log_path: Path,
               per_host: int = 1, module: str = WORKER_MODULE) -> tuple[Optional[str], float]:
    """One torchrun job over ``hosts`` fresh shaped hosts of ``per_host`` ranks each, every rank running
    ``python -m <module> <worker_args> --nodes <hosts>``, every rank's output in ``log_path``. Returns why it failed
    (None: every host's torchrun exited 0; else timed out or the exit codes, and the log's tail) and the wall time."""
    start = time.perf_counter()
    with SimCluster(hosts, rate_mbit=rate_mbit) as cluster, open(log_path, "w") as log:
        cmd_args = ["-m", module, *worker_args, "--nodes", str(hosts)]
        env = {**cluster.env(), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
        procs = [cluster.popen(i, cluster.torchrun(i, cmd_args, port=port, nproc=per_host), env=env, stdout=log,
                               stderr=subprocess.STDOUT) for i in range(hosts)]
        codes = cluster.wait(procs, timeout_s)  # those past the deadline die with the cluster
    wall = time.perf_counter() - start
    if codes == [0] * hosts:
        return None, wall
    tail = [line for line in log_path.read_text(errors="replace").splitlines() if line.strip()][-3:]
    what = "timed out" if None in codes else f"exit codes {list(codes)}"
    return f"{what}; see {log_path}: " + " | ".join(tail), wall


class Jobs:
    """The jobs of one run of a cluster benchmark, each on fresh hosts and its own port: rank 0's JSON in a scratch
    directory, every rank's output in ``out/logs/<tag>.log``; a context manager (the scratch directory's life)."""

    def __init__(self, out: Path, name: str, timeout_s: float, base_port: int) -> None:
        self.logs, self.name, self.timeout_s, self.ports = out / "logs", name, timeout_s, itertools.count(base_port)
        self.logs.mkdir(exist_ok=True)
        self._scratch = tempfile.TemporaryDirectory(prefix=f"lightning_dist_{name}_")

    def __enter__(self) -> "Jobs":
        return self

    def __exit__(self, *exc: Any) -> None:
        self._scratch.cleanup()

    def json(self, hosts: int, rate: float, tag: str, worker_args: list[str], per_host: int = 1
             ) -> tuple[Optional[dict], Optional[str], float]:
        """One job of workers that write rank 0's JSON (their ``--out``): that JSON (None when the job failed), why it
        failed, and the wall time."""
        log, result = self.logs / f"{tag}.log", Path(self._scratch.name) / f"{tag}.json"
        error, wall = launch_job(hosts, rate, [*worker_args, "--out", str(result)], next(self.ports), self.timeout_s,
                                 log, per_host)
        if error is None and result.exists():
            return json.loads(result.read_text()), None, wall
        return None, error or f"no result written; see {log}", wall

    def train(self, hosts: int, rate: float, tag: str, worker_args: list[str], warmup: int, record: dict[str, Any],
              where: str, per_host: int = 1) -> dict[str, Any]:
        """One training job: ``record`` with :func:`run_record`'s figures (or the error) and the wall time."""
        raw, error, wall = self.json(hosts, rate, tag, worker_args, per_host)
        record = {**record, "wall_s": wall}
        if raw is None:
            bench.progress(f"[{self.name}] {where} FAILED: {error}")
            return {**record, "median_s": None, "error": error}
        record.update(run_record(raw, warmup), error=None)
        bench.progress(f"[{self.name}] {where} {ms_cell(record['median_s']):>9} ms/step, rank 0 sent "
                       f"{mb_cell(record['bytes_sent_per_step'])} MB/step, host 0's link "
                       f"{mb_cell(record['link_bytes_per_step'])} MB/step (run {wall:.0f}s)")
        return record


def skipped(name: str, benchmark: str, meta: dict[str, Any], *lists: str) -> Optional[dict[str, Any]]:
    """The payload of a run the cluster cannot host here (None: it can): ``benchmark``'s environment with ``meta``,
    why, and empty ``lists``."""
    reason = unavailable()
    if reason is None:
        return None
    bench.progress(f"[{name}] skipped: {reason}")
    print(f"{name} benchmark skipped: {reason}")
    return {"meta": bench.environment(benchmark, **meta), "skipped": reason, **{key: [] for key in lists},
            "targets": {}}
