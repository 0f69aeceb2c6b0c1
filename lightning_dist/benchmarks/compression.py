"""Gradient-compression benchmark: every compressor of :mod:`lightning_dist.compression` under ``RingDDPStrategy``,
beside PyTorch's own DDP comm hooks (fp16, PowerSGD) as the peer reference: accuracy, bytes and step time.

Workloads (:data:`WORKLOADS`; 2 CPU ranks, seeds 0-2): ``digits`` (its rows also write the accuracy table advise
quotes: :func:`write_accuracy_table`), ``digits30`` and ``mlp``; each run one fit on fresh ranks. Bytes are what rank 0
hands to the wire per step (torch's hooks counted by :func:`counting_hook` at the same ring rate). Targets (digits):
``topk1%`` within 1 point of dense at >= 50x, ``int8`` within 0.5 at >= 3.5x, ``powersgd-r2`` within 1 and no lower than
torch's, ``topk1%-noEF`` worse than ``topk1%`` by more than its seed spread. Method and results: docs/benchmarks.md.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import lightning as L
import numpy as np
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import Strategy
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_dist.benchmarks import _common as bench
from lightning_dist.benchmarks import workloads
from lightning_dist.benchmarks.workloads import DIGITS, MLP, Workload
from lightning_dist.comm import ring_bytes_sent
from lightning_dist.compression import accuracy, build_compressor
from lightning_dist.compression.accuracy import ACCURACY_COST
from lightning_dist.examples import WideMLP
from lightning_dist.strategy import features_of
from lightning_dist.testing import RanksFailed, launched_externally, quiet_trainer, run_ranks
from lightning_dist.upstream import DDPBase

TORCH_POWERSGD_START_ITER = 2  # torch's minimum with error feedback or warm start
LOSS_WINDOW = 10  # mlp: the loss at the fixed step is the mean over this many last steps
MLP_LR = 0.05  # WideMLP's default 0.01 barely moves the loss in 200 steps: no signal
QUICK_DIGITS_BATCHES, QUICK_MLP_STEPS, QUICK_WARMUP = 12, 12, 3


@dataclass(frozen=True)
class Config:
    """One configuration: a ring_ddp compressor (``compressor``: build_compressor's arguments) or, with
    ``torch_hook`` set, Lightning's stock DDPStrategy with one of torch's comm hooks."""

    label: str
    compressor: Optional[dict[str, Any]] = None  # None with torch_hook None: ring_ddp, no compression
    torch_hook: Optional[str] = None  # "fp16" or "powersgd"
    torch_rank: int = 0  # PowerSGD's matrix_approximation_rank

    @property
    def is_torch(self) -> bool:
        return self.torch_hook is not None

    def compressor_kwargs(self, seed: int) -> dict[str, Any]:
        """build_compressor's arguments for this run: the compressor's random seed follows the run's."""
        kwargs = dict(self.compressor or {"name": "none"})
        if kwargs["name"] in ("int8", "int4", "powersgd"):
            kwargs.setdefault("seed", seed)
        return kwargs

    def describe(self) -> str:
        if self.torch_hook == "fp16":
            return "torch fp16_compress_hook"
        if self.torch_hook == "powersgd":
            return f"torch powerSGD_hook(rank={self.torch_rank}, start_iter={TORCH_POWERSGD_START_ITER})+ef"
        kwargs = self.compressor_kwargs(0)
        start = kwargs.get("start_step", 0)
        return build_compressor(**kwargs).describe() + (f", start_step={start}" if start else "")


@dataclass(frozen=True)
class Job:
    """A workload, how long each run trains, how it is judged, and the configurations measured on it."""

    name: str
    workload: Workload
    epochs: Optional[int]  # train this many epochs (validating after each) ...
    steps: Optional[int]  # ... or this many optimizer steps
    seeds: int  # seeds 0 .. seeds - 1 (--seeds overrides)
    warmup: int  # leading steps dropped from the step time
    deadline_s: float  # one run's hard deadline
    quality: str  # "val_acc" (higher is better) or "loss" (lower is better)
    configs: tuple[Config, ...]
    quick_configs: tuple[str, ...]
    description: str


DENSE = "dense"
TOPK = {"name": "topk", "ratio": 0.01}
THRESHOLD = {"name": "threshold", "threshold": 0.1, "max_ratio": 0.05}

CONFIGS = {c.label: c for c in (
    Config(DENSE),
    Config("fp16", {"name": "fp16"}),
    Config("bf16", {"name": "bf16"}),
    Config("int8", {"name": "int8"}),
    Config("int4", {"name": "int4"}),
    Config("topk1%", TOPK),
    Config("topk1%-noEF", {**TOPK, "error_feedback": False}),
    Config("threshold", THRESHOLD),
    # 2 dense steps first, as torch's hook must (start_powerSGD_iter=2): the same protocol, the same bytes
    Config("powersgd-r1", {"name": "powersgd", "rank": 1, "start_step": TORCH_POWERSGD_START_ITER}),
    Config("powersgd-r2", {"name": "powersgd", "rank": 2, "start_step": TORCH_POWERSGD_START_ITER}),
    Config("sign", {"name": "sign", "chunk": 256}),
    Config("torch-fp16", torch_hook="fp16"),
    Config("torch-powersgd-r1", torch_hook="powersgd", torch_rank=1),
    Config("torch-powersgd-r2", torch_hook="powersgd", torch_rank=2),
)}


def _configs(*labels: str) -> tuple[Config, ...]:
    return tuple(CONFIGS[label] for label in labels)


WORKLOADS = {
    "digits": Job(
        "digits", DIGITS, epochs=8, steps=None, seeds=3, warmup=10, deadline_s=120.0, quality="val_acc",
        configs=tuple(CONFIGS.values()),  # every configuration
        quick_configs=(DENSE, "int8", "topk1%", "powersgd-r2", "torch-powersgd-r2"),
        description="DigitsCNN 22k params, Adam 3e-3, batch 32/rank, 8 epochs",
    ),
    "digits30": Job(
        "digits30", DIGITS, epochs=30, steps=None, seeds=3, warmup=10, deadline_s=300.0, quality="val_acc",
        configs=_configs(DENSE, "topk1%", "topk1%-noEF"),
        quick_configs=(),  # --quick leaves it out
        description="digits, 30 epochs instead of 8 (690 steps)",
    ),
    "mlp": Job(
        "mlp", dataclasses.replace(MLP, model=lambda: WideMLP(lr=MLP_LR)),
        epochs=None, steps=200, seeds=3, warmup=10, deadline_s=180.0, quality="loss",
        configs=_configs(DENSE, "fp16", "int8", "topk1%", "topk1%-noEF", "powersgd-r2", "torch-fp16",
                         "torch-powersgd-r2"),
        quick_configs=(DENSE, "topk1%", "torch-fp16"),
        description=f"WideMLP 4.3M params, SGD+momentum lr {MLP_LR}, batch 16/rank, 5 buckets, 200 steps",
    ),
}


# -- PyTorch's hooks, on CPU, with their bytes counted -----------------------------------------------------------------
@dataclass
class HookMeter:
    """The state of :func:`counting_hook`: torch's hook and its state, and the bytes its all-reduces carry."""

    hook: Callable[..., Any]
    state: Any  # the torch hook's own state (None: the default group; a PowerSGDState)
    kind: str  # "fp16" or "powersgd"
    totals: dict[str, float] = field(default_factory=lambda: {"bytes_sent": 0.0, "dense_bytes": 0.0})
    checked: int = 0  # compressed PowerSGD buckets whose count was checked against torch's own
    mismatches: int = 0  # ... and disagreed (must stay 0)


def powersgd_allreduce_numels(shapes: Sequence[torch.Size], rank: int, min_compression_rate: float
                              ) -> tuple[int, int, int]:
    """Elements of PowerSGD's three all-reduces for a bucket of gradients with these shapes, by torch's rule
    (``powerSGD_hook._should_compress``): (uncompressed gradients, all P, all Q)."""
    uncompressed = ps = qs = 0
    for shape in shapes:
        n = shape[0] if len(shape) else 1
        m = math.prod(shape) // n if n else 0
        r = min(n, m, rank)
        if (n + m) * r * min_compression_rate < n * m:
            ps, qs = ps + n * r, qs + m * r
        else:
            uncompressed += n * m
    return uncompressed, ps, qs


def counting_hook(meter, bucket):  # no annotations: DDP checks them, and they are strings here
    """Count what torch's hook will all-reduce for this bucket at the ring's rate
    (:func:`lightning_dist.comm.ring_bytes_sent`), then run it: fp16, one all-reduce at 2 bytes per element;
    PowerSGD, the dense bucket before ``start_powerSGD_iter``, then by torch's rule
    (:func:`powersgd_allreduce_numels`) three fp32 all-reduces, checked against its own count."""
    buffer = bucket.buffer()
    n, rank = dist.get_world_size(), dist.get_rank()
    meter.totals["dense_bytes"] += ring_bytes_sent(buffer.numel(), n, rank, 4)
    if meter.kind == "fp16":
        meter.totals["bytes_sent"] += ring_bytes_sent(buffer.numel(), n, rank, 2)
        return meter.hook(meter.state, bucket)
    state = meter.state
    if state.iter < state.start_powerSGD_iter:  # the hook's own test: a vanilla all-reduce of the bucket
        meter.totals["bytes_sent"] += ring_bytes_sent(buffer.numel(), n, rank, buffer.element_size())
        return meter.hook(state, bucket)
    parts = powersgd_allreduce_numels([g.shape for g in bucket.gradients()], state.matrix_approximation_rank,
                                      state.min_compression_rate)
    meter.totals["bytes_sent"] += sum(ring_bytes_sent(p, n, rank, buffer.element_size()) for p in parts)
    before = state.total_numel_after_compression
    future = meter.hook(state, bucket)
    meter.checked += 1
    meter.mismatches += int(state.total_numel_after_compression - before != sum(parts))
    # The hook issues its P and Q all-reduces from completion callbacks, on gloo's threads: with several buckets
    # in flight they reach the wire in a different order on each rank and gloo aborts (a collective mismatch).
    # Waiting here keeps one bucket in flight at a time.
    future.wait()
    return future


class TorchHookDDPStrategy(DDPBase):
    """Lightning's stock DDPStrategy with a torch comm hook that is registered on CPU too (Lightning registers hooks
    only on CUDA and drops them silently elsewhere).

    The peer reference, not a feature of ours: it wraps stock DDP and PyTorch's hooks, so RingFeatures has nothing to
    offer it. It overrides the hook registration RingDDPStrategy does, through the same adapter
    (:class:`lightning_dist.upstream.DDPBase`)."""

    def __init__(self, meter: HookMeter, **kwargs: Any) -> None:
        super().__init__(ddp_comm_state=meter, ddp_comm_hook=counting_hook, **kwargs)
        self.meter = meter

    @override
    def register_comm_hooks(self) -> None:
        assert isinstance(self.model, DistributedDataParallel)
        self.model.register_comm_hook(self._ddp_comm_state, self._ddp_comm_hook)


def make_strategy(config: Config, job: Job, seed: int) -> Strategy:
    # popen: inside launched_externally it launches nothing (the ranks exist already)
    bucket_cap_mb = job.workload.bucket_cap_mb
    if not config.is_torch:
        return workloads.make_strategy("auto", bucket_cap_mb, "popen",
                                       compressor=build_compressor(**config.compressor_kwargs(seed)))
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if config.torch_hook == "fp16":
        meter = HookMeter(default_hooks.fp16_compress_hook, None, "fp16")
    else:
        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=config.torch_rank,
            start_powerSGD_iter=TORCH_POWERSGD_START_ITER, use_error_feedback=True, warm_start=True,
            random_seed=seed)
        meter = HookMeter(powerSGD_hook.powerSGD_hook, state, "powersgd")
    return workloads.make_strategy(None, bucket_cap_mb, "popen", stock=TorchHookDDPStrategy, meter=meter)


# -- one run -----------------------------------------------------------------------------------------------------------
def _fit(rank: int, world_size: int, job_name: str, label: str, seed: int, quick: bool,
         steps: Optional[int], epochs: Optional[int]) -> dict[str, Any]:
    """Inside a run_ranks rank: one fit, Lightning training in this very process; returns what it measured."""
    job = WORKLOADS[job_name]
    with launched_externally(rank, world_size), bench.quiet_lightning():
        L.seed_everything(seed, verbose=False)
        model, data = job.workload.model(), job.workload.data()
        strategy = make_strategy(CONFIGS[label], job, seed)
        if job.epochs is not None:
            limits = {"max_epochs": 1 if quick else (epochs or job.epochs),
                      "limit_train_batches": QUICK_DIGITS_BATCHES if quick else None}
        else:
            limits = {"max_steps": QUICK_MLP_STEPS if quick else (steps or job.steps)}
        recorder = bench.StepRecorder()
        trainer = quiet_trainer(devices=world_size, strategy=strategy, callbacks=[recorder], **limits)
        started = time.perf_counter()
        trainer.fit(model, data)
        features = features_of(strategy)
        meter = None if features else strategy.meter
        totals = meter.totals if meter else features.totals  # the torch hooks': their own count
        return {"steps": trainer.global_step, "fit_s": time.perf_counter() - started, "ends": recorder.ends,
                "epochs": recorder.epochs, "losses": recorder.losses, "val_acc_curve": recorder.val_acc,
                "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
                "bytes_sent": totals["bytes_sent"], "dense_bytes": totals["dense_bytes"],
                "codec_s": totals.get("codec_s"), "comm_s": totals.get("comm_s"),
                "torch_count_checked": meter.checked if meter else None,
                "torch_count_mismatches": meter.mismatches if meter else None}


def run_once(job: Job, config: Config, seed: int, quick: bool, warmup: int,
             steps: Optional[int] = None, epochs: Optional[int] = None) -> dict[str, Any]:
    """One fit on a fresh pair of gloo ranks (hard deadline); the run's record (``error`` set if it failed)."""
    record: dict[str, Any] = {"workload": job.name, "config": config.label, "seed": seed,
                              "compressor": config.describe(), "torch_peer": config.is_torch, "error": None}
    started = time.perf_counter()
    try:
        ranks = run_ranks(_fit, bench.WORLD_SIZE, job.name, config.label, seed, quick, steps, epochs,
                          deadline_s=job.deadline_s)
    except RanksFailed as err:
        return {**record, "error": str(err)[-4000:], "wall_s": time.perf_counter() - started}
    # other processes' load at the end: above the core count, this run's step times include their share
    record.update(wall_s=time.perf_counter() - started, load_1m_at_end=os.getloadavg()[0])
    zero, steps_done = ranks[0], ranks[0]["steps"]
    times = bench.step_times(zero["ends"], zero["epochs"], warmup)
    stats = bench.summarize(times) if times else {}
    losses = np.mean([r["losses"] for r in ranks], axis=0)  # the two ranks' mean batch loss per step
    record.update({
        "steps": steps_done, "fit_s": zero["fit_s"], "timed_steps": len(times),
        "step_median_s": stats.get("median_s"), "step_p25_s": stats.get("p25_s"), "step_p75_s": stats.get("p75_s"),
        "bytes_per_step": zero["bytes_sent"] / steps_done, "dense_bytes_per_step": zero["dense_bytes"] / steps_done,
        "ratio": zero["dense_bytes"] / zero["bytes_sent"] if zero["bytes_sent"] > 0 else None,
        **{f"{key}_per_step": None if zero[key] is None else zero[key] / steps_done for key in ("codec_s", "comm_s")},
        "val_acc": zero["metrics"].get("val/acc"), "val_loss": zero["metrics"].get("val/loss"),
        "val_acc_curve": zero["val_acc_curve"], "loss_end": float(np.mean(losses[-LOSS_WINDOW:])),
        "loss_window": min(LOSS_WINDOW, len(losses)), "loss_curve": [float(x) for x in losses],
        "torch_count_checked": zero["torch_count_checked"], "torch_count_mismatches": zero["torch_count_mismatches"],
    })
    return record


# -- summaries and targets ---------------------------------------------------------------------------------------------
def quality_of(record: dict[str, Any], quality: str) -> Optional[float]:
    return record.get("val_acc") if quality == "val_acc" else record.get("loss_end")


def _stats(values: Sequence[float]) -> dict[str, Optional[float]]:
    """Quality over seeds: mean, standard deviation, minimum and maximum (None where no run succeeded)."""
    if not values:
        return {"mean": None, "std": None, "min": None, "max": None}
    arr = np.asarray(values, dtype=float)
    return {"mean": float(arr.mean()), "std": float(arr.std(ddof=1)) if len(arr) > 1 else 0.0,
            "min": float(arr.min()), "max": float(arr.max())}


def summarize_configs(runs: Sequence[dict[str, Any]], job: Job, labels: Sequence[str]) -> list[dict[str, Any]]:
    """Per configuration of one workload: quality over seeds (mean, std, min, max), mean bytes per step, the
    compression ratio, the median step time over seeds and its ratio to dense's, paired by seed."""
    ok = [r for r in runs if r["workload"] == job.name and r.get("error") is None]
    out = []
    for label in labels:
        mine = [r for r in ok if r["config"] == label]
        sent, dense = [r["bytes_per_step"] for r in mine], [r["dense_bytes_per_step"] for r in mine]
        vs_dense = bench.paired_runs(mine, [r for r in ok if r["config"] == DENSE], "step_median_s", by="seed")
        quality = _stats([q for r in mine if (q := quality_of(r, job.quality)) is not None])
        out.append({"workload": job.name, "config": label, "seeds": len(mine), "quality": job.quality,
                    "failed": sum(1 for r in runs if (r["workload"], r["config"]) == (job.name, label) and r["error"]),
                    "compressor": CONFIGS[label].describe(), "torch_peer": CONFIGS[label].is_torch,
                    **{f"quality_{k}": v for k, v in quality.items()},
                    **({"val_loss_mean": _stats([r["val_loss"] for r in mine if r["val_loss"] is not None])["mean"]}
                       if job.quality == "val_acc" else {}),
                    "bytes_per_step": float(np.mean(sent)) if sent else None,
                    "dense_bytes_per_step": float(np.mean(dense)) if dense else None,
                    "ratio": float(np.sum(dense) / np.sum(sent)) if sent and np.sum(sent) > 0 else None,
                    "step_median_s": bench.median([r["step_median_s"] for r in mine if r["step_median_s"]]),
                    "step_vs_dense": vs_dense["median"] if vs_dense else None,
                    "codec_s_per_step": bench.median([r["codec_s_per_step"] for r in mine
                                                      if r["codec_s_per_step"] is not None]),
                    "wall_s_mean": float(np.mean([r["wall_s"] for r in mine])) if mine else None})
    return out


def judge(summary: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's targets on the digits summary rows (accuracy in [0, 1]; a point is 0.01), and the
    error-feedback comparison repeated on digits30 and mlp. A target whose configurations are missing is
    left out; one whose runs all failed is MISSED."""
    out: list[dict[str, Any]] = []
    for workload in ("digits", "digits30", "mlp"):
        out += _judge_workload(workload, {s["config"]: s for s in summary if s["workload"] == workload})
    return out


def _judge_workload(workload: str, rows: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    def acc(label: str) -> Optional[float]:
        return rows[label]["quality_mean"] if label in rows else None

    def near_dense(label: str, points: float, min_ratio: float) -> tuple[bool, str]:
        gap = (acc(DENSE) - acc(label)) / 0.01  # points below dense (negative: above)
        ratio = rows[label]["ratio"] or 0.0
        return (gap <= points and ratio >= min_ratio,
                f"{100 * acc(label):.2f}% vs dense {100 * acc(DENSE):.2f}% ({-gap:+.2f} points), ratio {ratio:.1f}x")

    def powersgd() -> tuple[bool, str]:
        close, detail = near_dense("powersgd-r2", 1.0, 0.0)
        peer = acc("torch-powersgd-r2")
        return (close and acc("powersgd-r2") >= peer,
                f"{detail}; torch-powersgd-r2 {100 * peer:.2f}% ({100 * (acc('powersgd-r2') - peer):+.2f} points)")

    def error_feedback() -> tuple[bool, str]:
        ef, no_ef = rows["topk1%"], rows["topk1%-noEF"]
        spread, lead = ef["quality_max"] - ef["quality_min"], ef["quality_mean"] - no_ef["quality_mean"]
        if workload == "mlp":  # a loss: lower is better
            return (-lead > spread, f"loss EF {ef['quality_mean']:.4f} vs noEF {no_ef['quality_mean']:.4f} "
                                    f"(EF lower by {-lead:+.4f}; EF seed spread {spread:.4f})")
        return (lead > spread, f"EF {100 * ef['quality_mean']:.2f}% vs noEF {100 * no_ef['quality_mean']:.2f}% "
                               f"(EF ahead by {100 * lead:+.2f} points; EF seed spread {100 * spread:.2f})")

    checks = [] if workload == "mlp" else [
        ("topk1%", (DENSE, "topk1%"), f"{workload} topk1% (EF) within 1 point of dense at >= 50x fewer bytes",
         lambda: near_dense("topk1%", 1.0, 50.0))]
    if workload == "digits":
        checks += [("int8", (DENSE, "int8"), "digits int8 within 0.5 point of dense at a ratio >= 3.5",
                    lambda: near_dense("int8", 0.5, 3.5)),
                   ("powersgd-r2", (DENSE, "powersgd-r2", "torch-powersgd-r2"),
                    "digits powersgd-r2 within 1 point of dense and no lower than torch-powersgd-r2", powersgd)]
    checks.append(("topk1%-noEF", ("topk1%", "topk1%-noEF"),
                   f"{workload} topk1%-noEF worse than topk1% (EF) by more than the EF runs' seed spread",
                   error_feedback))
    out = []
    for name, needs, text, check in checks:
        if all(label in rows for label in needs):  # a target whose configurations are missing is left out
            met, detail = (False, "no successful run") if any(acc(label) is None for label in needs) else check()
            out.append({"workload": workload, "target": name, "text": text, "met": bool(met), "detail": detail})
    return out


# -- the accuracy table lightning-dist-advise quotes (lightning_dist/compression/accuracy.py) -------------------------
# Each digits configuration's row: the compressor, the settings it runs at, and how the note names them ("" none)
TABLE_ROWS = {
    DENSE: ("none", {}, ""),
    "fp16": ("fp16", {}, ""),
    "bf16": ("bf16", {}, ""),
    "int8": ("int8", {}, "EF"),
    "int4": ("int4", {}, "EF"),
    "topk1%": ("topk", {"ratio": 0.01, "error_feedback": True}, "1%, EF"),
    "topk1%-noEF": ("topk", {"ratio": 0.01, "error_feedback": False}, "1%, no EF"),
    "threshold": ("threshold", {"threshold": 0.1}, "0.1, EF"),
    # measured with torch's 2 dense warm-up steps (start_step=2), not the default start_step=0: a row says so
    "powersgd-r2": ("powersgd", {"rank": 2, "start_step": TORCH_POWERSGD_START_ITER},
                    f"r2, start_step={TORCH_POWERSGD_START_ITER}, EF"),
    "powersgd-r1": ("powersgd", {"rank": 1, "start_step": TORCH_POWERSGD_START_ITER},
                    f"r1, start_step={TORCH_POWERSGD_START_ITER}, EF"),
    "sign": ("sign", {"chunk": 256}, "chunk 256, EF on ranks and owners"),
}


def accuracy_rows(summary: Sequence[dict[str, Any]], kept: Sequence[tuple] = ACCURACY_COST) -> list[tuple]:
    """The accuracy table from a run's digits rows: per configuration of :data:`TABLE_ROWS` measured, its mean val
    acc against dense's, in points; a row the run did not measure is ``kept`` as it was."""
    acc = {s["config"]: round(100 * s["quality_mean"], 2) for s in summary
           if s["workload"] == "digits" and s["quality_mean"] is not None}
    if DENSE not in acc:
        raise ValueError("the accuracy table is measured against dense on digits: run --workloads digits with dense")
    old = {(row[0], json.dumps(row[1], sort_keys=True)): tuple(row) for row in kept}
    rows = []
    for label, (name, settings, what) in TABLE_ROWS.items():
        before = old.pop((name, json.dumps(settings, sort_keys=True)), None)
        if label in acc:
            note = f"dense {acc[DENSE]:.2f}%" if label == DENSE else f"{what}: {acc[label]:.2f}%".removeprefix(": ")
            rows.append((name, settings, round(acc[label] - acc[DENSE], 2), note))
        elif before is not None:
            rows.append(before)
    return rows + list(old.values())


def _literal(value: Any) -> str:
    """``value`` as Python source, strings double-quoted."""
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_literal(k)}: {_literal(v)}" for k, v in value.items()) + "}"
    return repr(value)


def render_accuracy_table(rows: Sequence[tuple], text: str) -> str:
    """``text`` (``lightning_dist/compression/accuracy.py``'s) with its ``ACCURACY_COST`` list holding ``rows``."""
    opening = "ACCURACY_COST: list[tuple[str, dict[str, Any], float, str]] = [\n"
    head, rest = text.split(opening, 1)
    body = "".join(f"    ({', '.join(map(_literal, row))}),\n" for row in rows)
    return head + opening + body + rest[rest.index("]\n"):]


def write_accuracy_table(summary: Sequence[dict[str, Any]], path: Path) -> list[tuple]:
    """Rewrite the accuracy table at ``path`` (the package's module, or a copy of it) from a run's digits rows."""
    path.write_text(render_accuracy_table(rows := accuracy_rows(summary), Path(accuracy.__file__).read_text()))
    bench.progress(f"[compression] wrote {path} (docs/advise.md shows it row for row):\n" + "\n".join(
        f"  {name} {_literal(settings)} {points:+.2f} pt ({what})" for name, settings, points, what in rows))
    return rows


# -- output ------------------------------------------------------------------------------------------------------------
def table(summary: Sequence[dict[str, Any]]) -> str:
    rows = []
    for s in summary:
        if s["quality_mean"] is None:
            quality = spread = "-"
        else:
            acc = s["quality"] == "val_acc"  # an accuracy in %, a loss as it is
            mean, std, low, high = ((100 if acc else 1) * s[f"quality_{k}"] for k in ("mean", "std", "min", "max"))
            quality = f"acc {mean:.2f}%" if acc else f"loss {mean:.4f}"
            spread = f"{std:.2f} [{low:.1f}, {high:.1f}]" if acc else f"{std:.4f} [{low:.4f}, {high:.4f}]"
        rows.append([
            s["workload"], s["config"], s["compressor"],
            f"{s['seeds']}" + (f" ({s['failed']} failed)" if s["failed"] else ""), quality, spread,
            bench.cell(s.get("val_loss_mean"), ".4f"), bench.cell(s["bytes_per_step"], ".1f", 1 / 1024),
            bench.cell(s["dense_bytes_per_step"], ".1f", 1 / 1024), bench.cell(s["ratio"], ".1f", unit="x"),
            bench.cell(s["step_median_s"], ".2f", 1e3), bench.cell(s["step_vs_dense"], ".2f", unit="x"),
            bench.cell(s["codec_s_per_step"], ".2f", 1e3), bench.cell(s["wall_s_mean"], ".1f"),
        ])
    headers = ["workload", "config", "compressor", "seeds", "quality (mean)", "std [min, max]", "val loss",
               "KiB/step", "dense KiB/step", "ratio", "step ms", "vs dense", "codec ms", "run s"]
    return bench.format_table(headers, rows)


MARKERS = {DENSE: {"marker": "*", "ms": 14, "color": "black", "label": "dense (ring_ddp)"},
           "torch": {"marker": "s", "ms": 8, "mfc": "none", "mew": 1.6, "color": "tab:red",
                     "label": "torch hook (peer)"},
           "ring": {"marker": "o", "ms": 7, "color": "tab:blue", "label": "ring_ddp compressor"}}


def plot(summary: Sequence[dict[str, Any]]) -> Any:
    """One panel per workload: quality (mean, min-max over seeds) against bytes per step, log x."""
    names = list(dict.fromkeys(s["workload"] for s in summary))
    fig, axes = bench.figure_row(len(names), 6.8 * len(names), 5.2)
    for ax, name in zip(axes, names):
        rows = [s for s in summary if s["workload"] == name and s["quality_mean"] is not None]
        scale = 100.0 if rows and rows[0]["quality"] == "val_acc" else 1.0
        labelled: dict[tuple[bool, float], int] = {}  # labels at the same bytes: stacked, torch's on the left
        for s in rows:
            x, y = s["bytes_per_step"] / 1024, scale * s["quality_mean"]
            err = [[y - scale * s["quality_min"]], [scale * s["quality_max"] - y]]
            style = MARKERS[DENSE if s["config"] == DENSE else "torch" if s["torch_peer"] else "ring"]
            ax.errorbar([x], [y], yerr=err, capsize=3, ls="none", **style)
            spot = (s["torch_peer"], round(math.log10(x), 2))
            stack = labelled[spot] = labelled.get(spot, -1) + 1
            ax.annotate(s["config"], (x, y), textcoords="offset points", fontsize="x-small",
                        xytext=(-6, -11 - 9 * stack) if s["torch_peer"] else (6, 4 + 9 * stack),
                        ha="right" if s["torch_peer"] else "left", color=style["color"])
        dense = next((s for s in rows if s["config"] == DENSE), None)
        if dense is not None and scale == 100.0:
            ax.axhline(100 * dense["quality_mean"], color="gray", lw=0.8)
            ax.axhline(100 * dense["quality_mean"] - 1, color="gray", lw=0.8, ls="--", label="dense - 1 point")
        unique = dict(zip(*ax.get_legend_handles_labels()[::-1]))  # one entry per label
        ax.legend(unique.values(), unique.keys(), fontsize="x-small")
        ax.set_title(f"{name}: {WORKLOADS[name].description}", fontsize="small")
        bench.style(ax, which="both", xscale="log", xlabel="gradient bytes sent per step by rank 0, KiB (log)",
                    ylabel="final val accuracy, % (mean, min-max over seeds)" if scale == 100.0
                    else f"train loss at the last step (mean of last {LOSS_WINDOW}; min-max over seeds)")
    fig.suptitle(f"{bench.WORLD_SIZE} CPU ranks, gloo: gradient compression, quality against bytes")
    return fig


# -- command line ------------------------------------------------------------------------------------------------------
def _parse_args(argv: Optional[Sequence[str]]) -> Any:
    cli = bench.parser("compression", __doc__, f"a few configurations, 1 seed, {QUICK_DIGITS_BATCHES} digits "
                                               f"batches and {QUICK_MLP_STEPS} mlp steps")
    cli.add_argument("--workloads", nargs="+", choices=sorted(WORKLOADS), default=list(WORKLOADS),
                     help="which workloads to run (default: all)")
    cli.add_argument("--configs", nargs="+", default=None, choices=list(CONFIGS),
                     help="only these configurations (dense is always added: ratios are taken against it)")
    cli.add_argument("--seeds", type=int, default=None,
                     help="seeds per configuration, 0..N-1 (default: the workload's, 1 with --quick)")
    cli.add_argument("--epochs", type=int, default=None, help="digits: epochs per run (default 8)")
    cli.add_argument("--steps", type=int, default=None, help="mlp: optimizer steps per run (default 200)")
    cli.add_argument("--write-accuracy-table", nargs="?", const=accuracy.__file__, default=None, metavar="PATH",
                     help="rewrite the accuracy table lightning-dist-advise quotes from this run's digits rows "
                          "(default PATH: lightning_dist/compression/accuracy.py; rows not measured are kept)")
    args = cli.parse_args(argv)
    bench.check_counts(cli, args.steps, WORKLOADS["mlp"].warmup, seeds=args.seeds, epochs=args.epochs)
    if args.write_accuracy_table and "digits" not in args.workloads:
        cli.error("--write-accuracy-table measures on digits: add digits to --workloads")
    if args.write_accuracy_table == accuracy.__file__ and args.quick:
        cli.error("--write-accuracy-table with --quick: a smoke run's accuracy is no measurement; give a PATH")
    if args.quick:
        args.seeds = args.seeds or 1
    return args


def _labels(job: Job, args: Any) -> list[str]:
    labels = list(job.quick_configs) if args.quick else [c.label for c in job.configs]
    if args.configs:
        labels = [label for label in labels if label in args.configs or label == DENSE]
    return labels


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    """Run the benchmark, print the table and the verdicts, write JSON/TXT/PNG; return the JSON payload."""
    args = _parse_args(argv)
    runs, summary, meta_workloads = [], [], {}
    start = time.perf_counter()
    with bench.quiet_lightning():
        for name in args.workloads:
            job = WORKLOADS[name]
            labels = _labels(job, args)
            if not labels:  # a workload --quick leaves out
                continue
            seeds = list(range(args.seeds or job.seeds))
            warmup = QUICK_WARMUP if args.quick else job.warmup
            length = (f"{QUICK_DIGITS_BATCHES} batches" if job.epochs else f"{QUICK_MLP_STEPS} steps") if args.quick \
                else f"{args.epochs or job.epochs} epochs" if job.epochs else f"{args.steps or job.steps} steps"
            meta_workloads[name] = {"description": job.description, "configs": labels, "seeds": seeds,
                                    "length": length, "batch_size": job.workload.batch_size,
                                    "bucket_cap_mb": job.workload.bucket_cap_mb, "warmup": warmup,
                                    "quality": job.quality,
                                    "compressors": {label: CONFIGS[label].describe() for label in labels}}
            bench.progress(f"[compression] {name}: {len(seeds)} seeds x {len(labels)} configs ({', '.join(labels)}), "
                           f"{length} per run")
            mine: list[dict[str, Any]] = []
            for seed in seeds:
                for label in labels:
                    mine.append(r := run_once(job, CONFIGS[label], seed, args.quick, warmup, args.steps, args.epochs))
                    if r["error"]:
                        bench.progress(f"  {name} seed {seed} {label:<18} FAILED after {r['wall_s']:.0f}s: "
                                       f"{r['error'].splitlines()[0]}")
                        continue
                    q = quality_of(r, job.quality)
                    shown = f"acc {100 * q:6.2f}%" if job.quality == "val_acc" else f"loss {q:.4f}"
                    bench.progress(f"  {name} seed {seed} {label:<18} {shown}  {r['bytes_per_step'] / 1024:9.1f} "
                                   f"KiB/step ({r['ratio']:.1f}x)  {bench.cell(r['step_median_s'], '.2f', 1e3)} "
                                   f"ms/step  (run {r['wall_s']:.1f}s)")
            runs += mine
            summary += summarize_configs(mine, job, labels)
    targets = judge(summary)
    if args.write_accuracy_table:
        write_accuracy_table(summary, Path(args.write_accuracy_table))
    lines = [bench.verdict(t["text"], t["met"], t["detail"]) for t in targets]
    return bench.finish("compression", args.out, start, [table(summary), lines],
                        {"runs": runs, "records": summary, "targets": targets}, lambda: plot(summary),
                        world_size=bench.WORLD_SIZE, quick=args.quick, workloads=meta_workloads,
                        torch_powersgd_start_iter=TORCH_POWERSGD_START_ITER, loss_window=LOSS_WINDOW,
                        loadavg_at_end=os.getloadavg())


if __name__ == "__main__":
    main()
