"""What the simulated-cluster benchmarks share: the workload, its training configurations, one job on fresh shaped
hosts, the summary of a training run and the table cells.

Every rank of :mod:`~lightning_dist.benchmarks.cluster` and :mod:`~lightning_dist.benchmarks.tiers` runs as a worker of
``python -m lightning_dist.benchmarks.cluster`` (:data:`WORKER_MODULE`); :mod:`~lightning_dist.benchmarks.sync`
launches its own module's workers through :func:`launch_job` too.
"""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from lightning_dist.benchmarks import _common as bench
from lightning_dist.benchmarks.allreduce import time_rounds
from lightning_dist.simcluster import SimCluster, link_bytes_sent, unavailable

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


def allreduce_worker(args: argparse.Namespace, contenders: Callable[[], tuple[dict[str, Callable], dict]],
                     link: bool = False) -> None:
    """One rank of an all-reduce job: ``contenders()`` (once the group is up) names two calls and the fields rank 0
    writes beside their times; a round each per iteration (one untimed), the two taking turns first, the slowest
    rank's seconds; with ``link``, what one call of each puts on host 0's link, between barriers."""
    torch.set_num_threads(1)  # hosts share the machine's cores
    dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=args.collective_timeout))
    calls, fields = contenders()
    tensor, names = torch.empty(args.nbytes // 4, dtype=torch.float32), list(calls)
    orders = [names if k % 2 == 0 else names[::-1] for k in range(-1, args.iterations)]
    times = time_rounds(calls, tensor, orders, warmup=1, slowest=True)
    for name, call in calls.items() if link else ():
        tensor.fill_(1.0)
        dist.barrier()
        before = link_bytes_sent()
        call(tensor)
        dist.barrier()
        fields.setdefault("link_sent", {})[name] = link_bytes_sent() - before
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps({"world_size": dist.get_world_size(), "bytes": args.nbytes,
                                              "times": times, **fields}))
    dist.destroy_process_group()


def allreduce_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """Per contender of an all-reduce job: its median seconds and every timed iteration, in the order they ran."""
    return {key: value for name, times in raw["times"].items()
            for key, value in ((f"{name}_median_s", bench.median(times)), (f"{name}_times_s", list(times)))}


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

    def measure(self, hosts: int, rate: float, tag: str, worker_args: list[str], where: str, record: dict[str, Any],
                build: Callable[[dict], dict], report: Callable[[dict], str], per_host: int = 1) -> dict[str, Any]:
        """One job of workers that write rank 0's JSON (their ``--out``): ``build(json)`` (``record`` where the job
        failed) with the ``error`` and ``wall_s``; the progress line says ``where`` it ran and ``report(record)``."""
        log, result = self.logs / f"{tag}.log", Path(self._scratch.name) / f"{tag}.json"
        error, wall = launch_job(hosts, rate, [*worker_args, "--out", str(result)], next(self.ports), self.timeout_s,
                                 log, per_host)
        if error is None and result.exists():
            record = build(json.loads(result.read_text()))
            bench.progress(f"[{self.name}] {where}{report(record)} (run {wall:.0f}s)")
            return {**record, "error": None, "wall_s": wall}
        bench.progress(f"[{self.name}] {where} FAILED: {(error := error or f'no result written; see {log}')}")
        return {**record, "error": error, "wall_s": wall}

    def train(self, hosts: int, rate: float, tag: str, worker_args: list[str], warmup: int, record: dict[str, Any],
              where: str, per_host: int = 1) -> dict[str, Any]:
        """One training job: ``record`` with :func:`run_record`'s figures (or the error) and the wall time."""
        return self.measure(hosts, rate, tag, worker_args, where, {**record, "median_s": None},
                            lambda raw: {**record, **run_record(raw, warmup)},
                            lambda r: f" {ms_cell(r['median_s']):>9} ms/step, rank 0 sent "
                                      f"{mb_cell(r['bytes_sent_per_step'])} MB/step, host 0's link "
                                      f"{mb_cell(r['link_bytes_per_step'])} MB/step", per_host)


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
