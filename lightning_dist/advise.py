"""``lightning-dist-advise``: which gradient compressor pays on this cluster (also ``python -m lightning_dist.advise``).

Launched as training is, with the same Hydra overrides as ``lightning-dist-train``, it builds the configured model,
data and ``ring_ddp`` strategy and, on the real links::

    lightning-dist-advise                                                # 2 local ranks, the digits CNN
    lightning-dist-advise trainer.devices=4 advise.compressors=[int8,topk] advise.rounds=10
    lightning-dist-advise compression=topk compression.ratio=0.001       # this topk's settings, not the default's
    torchrun --nnodes 2 --node-rank 0 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint node0:29400 \\
             --rdzv-id advise-1 -m lightning_dist.advise trainer.devices=auto trainer.num_nodes=2
    srun .venv/bin/lightning-dist-advise trainer.devices=auto trainer.num_nodes=2 strategy.start_method=popen

What it measures, on every rank:

1. **The dense step.** ``advise.warmup_steps + advise.steps`` real training steps under ``RingDDPStrategy`` with no
   compressor. A bucket observer (:class:`~lightning_dist.strategy.BucketObserver`, registered through the strategy's
   feature seam) records each bucket's :class:`BucketLayout`, the moment DDP hands it over (its ready time, from the
   start of ``loss.backward()``) and the moment its reduction is done.
   Per measured step: the step time (end to end, as the benchmarks count it), the last hand-over (backward's own
   computation is then over) and the exposed communication (last done - last hand-over); the compute-only step is
   the step minus its exposed communication.
2. **Each compressor on the real buckets.** Copies of the last step's gradient buckets go through every candidate's
   ``reduce`` over a process group of its own (round-robin over the compressors, ``advise.rounds`` rounds after one
   untimed round, a barrier before each bucket, medians): wire seconds (inside the transport's collectives), coding
   seconds (the rest) and bytes this rank sent. Candidates are ``conf/compression/<name>.yaml`` with their defaults;
   the configured ``compression`` replaces its own name's.
3. **Every rank agrees.** Each figure is the maximum over ranks (one all-reduce), so all ranks hold the same numbers
   and run the same code; every collective has ``advise.timeout_s``.

The prediction (:func:`predict_step`) replays the communication worker's FIFO queue: buckets handed over at their
measured ready times, each taking coding + wire, one after the other; what runs past backward's end adds to the
compute-only step. The speed-up is the predicted dense step over the compressor's. What it leaves out: coding
competes with backward for the cores (on a loaded CPU the prediction is optimistic), and the accuracy cost is the
compression benchmark's digits measurement (:data:`lightning_dist.compression.accuracy.ACCURACY_COST`, which the
benchmark writes), not this model's. Rank zero prints the table and writes ``advise.json`` into the run's output
directory.

Below the compressors, DiLoCo's rows (:func:`sync_predictions`; syncing every H steps, :mod:`lightning_dist.sync`):
between syncs a worker exchanges nothing with the others, so a step is the compute-only step; every H-th step also
moves the whole model's pseudo-gradient between the workers, which costs what one step's gradient costs through the
same compressor (the buckets hold every trained parameter), now once per H steps. Per step: the compute-only step plus
the sync's coding and wire over H, and the sync's bytes over H, dense and with each pseudo-gradient codec
(:data:`SYNC_CODECS`, and ``sync.compressor`` when configured). H is ``sync.every`` under ``sync=diloco``, else
DiLoCo's default (the row's label says which). A worker is a rank under ``flat``; under ``two_tier`` it is a host:
each rank's part of the buckets (:meth:`BucketLayout.split`) goes through the codec across hosts, as DiLoCo sends
it, and the bytes are the host's (its ranks' parts together). DiLoCo changes the optimisation itself, so its rows
quote no accuracy cost: its quality is what the ``sync`` benchmark measures (docs/sync.md). Left out: the outer
step (a few elementwise passes over the parameters), and under ``two_tier`` the host's own all-reduce on the fast
links every step and its all-gather after a sync.

When the model's optimizer is Adam (or AdamW), one more row (:func:`onebit_prediction`): OneBitAdam after its warm-up
(:class:`~lightning_dist.sync.OneBitAdam`, its defaults), whose momentum goes through ``sign`` after backward (nothing
to overlap with) and a refresh's gradient through ``int4`` every ``refresh`` steps; and where a compressor pays (a
speed-up of :data:`PAYS` or more) and OneBitAdam does too, a line recommending it, with its measured quality
(:data:`ONEBIT_QUALITY`).

:class:`Advisor` is the callback that measures, and it measures a fit of one's own as well: ``Advisor()`` among a
Trainer's callbacks under ``RingDDPStrategy`` times the fit's first steps and prints the table when the fit ends
(``AdviseCallback``, its name before one naming rule for callbacks, still imports for one release, with a
``DeprecationWarning``). On the command line a class of one's own is ``model._target_=my_pkg.MyModule`` (then built
from the ``model.*`` keys given with it alone), importable from the working directory as under ``python -m``.
"""

from __future__ import annotations

import copy
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Any, Optional, Sequence, Union

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from omegaconf import DictConfig, OmegaConf, open_dict
from typing_extensions import override

from lightning_dist._deprecation import renamed
from lightning_dist.compression import COMPRESSORS, BucketLayout, build_compressor
from lightning_dist.compression.accuracy import ACCURACY_COST
from lightning_dist.compression.registry import error_feedback_default
from lightning_dist.config import StrategyConf, resolve_devices
from lightning_dist.strategy import RingDDPStrategy, features_of
from lightning_dist.sync import DiLoCo, OneBitAdam
from lightning_dist.sync.auto_measure import BucketRecorder, across_hosts, agree, dense_step, measure_codecs
from lightning_dist.sync.auto_measure import conf_compressor as default_candidate
from lightning_dist.sync.auto_rule import Decision, Row, candidate_rows, decide, family, predict_step
from lightning_dist.sync.auto_rule import table as auto_table
from lightning_dist.train import build, hydra_command, hydra_main


def accuracy_cost(kwargs: dict[str, Any]) -> tuple[Optional[float], str]:
    """The measured accuracy cost (:data:`~lightning_dist.compression.accuracy.ACCURACY_COST`) for these
    ``build_compressor`` arguments: the row measured at the same settings, else the compressor's first row marked as
    measured at other settings, else none."""
    name = kwargs.get("name")
    # every setting the compressor runs at, the given ones over its conf defaults (a row measured at start_step=2
    # is no row for the default start_step=0)
    given = {**(default_candidate(name) if name in COMPRESSORS else {}), **kwargs}
    given["error_feedback"] = given.get("error_feedback")
    if given["error_feedback"] is None:
        given["error_feedback"] = name in COMPRESSORS and error_feedback_default(name)
    rows = [row for row in ACCURACY_COST if row[0] == name]
    for _, settings, cost, what in rows:
        if all(given.get(k) == v for k, v in settings.items()):
            return cost, what
    if rows:
        return rows[0][2], f"measured at {rows[0][3]}, not these settings"
    return None, "not measured"


DENSE = "none"


@dataclass
class AdviseConf:
    """``advise.*``: what ``lightning-dist-advise`` measures (the training settings are the command's own)."""

    # candidates, names from conf/compression/ (the configured compression= replaces its own name's defaults)
    compressors: list[str] = field(default_factory=lambda: list(COMPRESSORS))
    warmup_steps: int = 2  # training steps not timed (DDP rebuilds its buckets after the first)
    steps: int = 6  # timed dense training steps
    rounds: int = 5  # timed rounds of every compressor over the real buckets (after one untimed round)
    timeout_s: float = 300.0  # each collective of the measurement fails after this long instead of hanging


def register_configs() -> None:
    ConfigStore.instance().store(group="advise", name="default", node=AdviseConf)


register_configs()


# -- the prediction (pure) -------------------------------------------------------------------------------------
def predictions(measured: dict[str, Any], codecs: dict[str, dict[str, list[float]]]) -> dict[str, dict[str, Any]]:
    """Per compressor: bytes, coding, wire and predicted step time, and the speed-up over dense's prediction.

    ``measured``: ``compute_s`` and ``ready_s`` (per bucket) of the dense step; ``codecs``: per compressor, per
    bucket ``coding_s``, ``wire_s`` and ``bytes``."""
    out: dict[str, dict[str, Any]] = {}
    for name, c in codecs.items():
        cost = [a + b for a, b in zip(c["coding_s"], c["wire_s"])]
        out[name] = {"bytes_per_step": sum(c["bytes"]), "coding_s": sum(c["coding_s"]), "wire_s": sum(c["wire_s"]),
                     "predicted_step_s": predict_step(measured["compute_s"], measured["ready_s"], cost)}
    base = out.get(DENSE, {}).get("predicted_step_s")
    for name, row in out.items():
        row["speedup_vs_dense"] = base / row["predicted_step_s"] if base and row["predicted_step_s"] else None
        row["accuracy_cost_pt"], row["accuracy_measured_at"] = accuracy_cost(codecs[name].get("kwargs", {"name": name}))
    return out


# -- DiLoCo's rows (pure) --------------------------------------------------------------------------------------
# the pseudo-gradient codecs shown beside dense (the sync benchmark's: int8 as INTELLECT-1 sends it, top-k as
# SparseLoCo), when advise measured them; a configured sync.compressor is shown too
SYNC_CODECS = ("int8", "topk")
# DiLoCo changes the optimisation (workers drift apart for H steps), so a per-step compressor's accuracy cost does not
# apply; what is known is measured on the LM workload by the sync benchmark
SYNC_QUALITY = "quality: benchmarks.sync, see docs/sync.md"


@dataclass
class SyncAdvice:
    """What DiLoCo's rows predict for: H, whether ``sync=diloco`` chose it, and the pseudo-gradient codecs."""

    every: int = DiLoCo.every  # H: inner steps between syncs
    configured: bool = False  # True: sync=diloco's sync.every; False: DiLoCo's default, shown for comparison
    codecs: list[str] = field(default_factory=lambda: [DENSE, *SYNC_CODECS])  # advise candidates' labels

    def label(self, codec: str) -> str:
        return f"diloco H={self.every}" + ("" if codec == DENSE else f" {codec}")

    def origin(self) -> str:
        return ("sync.every" if self.configured else
                "DiLoCo's default; lightning-dist-advise sync=diloco sync.every=H for yours")


def sync_predictions(measured: dict[str, Any], codecs: dict[str, dict[str, list[float]]], sync: SyncAdvice,
                     dense_step_s: Optional[float], bytes_scale: float = 1.0) -> dict[str, dict[str, Any]]:
    """DiLoCo's rows: per pseudo-gradient codec, the sync's figures and their share of each of H steps.

    A step without a sync is the compute-only step (no exchange between workers); the sync moves the whole model's
    pseudo-gradient, i.e. every bucket, through the codec, after the optimizer step (nothing to overlap with). So per
    step: ``compute_s + (coding + wire) / H`` seconds and ``bytes / H``.

    Args:
        measured: the dense step (``compute_s``).
        codecs: per label, per bucket ``coding_s``, ``wire_s`` and ``bytes`` of the reduction between workers.
        sync: H and the codecs' labels (those ``codecs`` lacks are left out).
        dense_step_s: the predicted dense every-step step, the speed-ups' base (None: no speed-up).
        bytes_scale: a worker's bytes per byte measured (under two_tier the host's ranks each send a part: the
            ranks per host).
    """
    out: dict[str, dict[str, Any]] = {}
    every = sync.every
    for codec in sync.codecs:
        if codec not in codecs:
            continue
        c = codecs[codec]
        coding_s, wire_s = sum(c["coding_s"]), sum(c["wire_s"])
        sync_bytes = bytes_scale * sum(c["bytes"])
        step_s = measured["compute_s"] + (coding_s + wire_s) / every
        out[sync.label(codec)] = {
            "every": every, "every_from": sync.origin(), "compressor": codec, "sync_bytes": sync_bytes,
            "sync_s": coding_s + wire_s, "bytes_per_step": sync_bytes / every, "coding_s": coding_s / every,
            "wire_s": wire_s / every, "predicted_step_s": step_s,
            "speedup_vs_dense": dense_step_s / step_s if dense_step_s and step_s else None, "quality": SYNC_QUALITY}
    return out


PAYS = 1.05  # a compressor's predicted speed-up from which OneBitAdam is recommended under Adam
# OneBitAdam's measured quality at equal samples (docs/onebit-adam.md has the tables)
ONEBIT_QUALITY = "digits +0.37 pt (98.52% vs 98.15%); LM +0.64% val loss at 400 steps: docs/onebit-adam.md"


def onebit_prediction(measured: dict[str, Any], codecs: dict[str, dict[str, list[float]]],
                      dense_step_s: Optional[float], refresh: int = OneBitAdam.refresh) -> Optional[dict[str, Any]]:
    """OneBitAdam's row after its warm-up: the compute-only step, then every bucket through ``sign`` (the momentum,
    after backward), and every ``refresh`` steps every bucket through ``int4`` (a refresh's gradient); None unless
    advise measured both codecs."""
    if "sign" not in codecs or "int4" not in codecs:
        return None
    sign, int4 = codecs["sign"], codecs["int4"]
    coding_s = sum(sign["coding_s"]) + sum(int4["coding_s"]) / refresh
    wire_s = sum(sign["wire_s"]) + sum(int4["wire_s"]) / refresh
    step_s = measured["compute_s"] + coding_s + wire_s
    return {"bytes_per_step": sum(sign["bytes"]) + sum(int4["bytes"]) / refresh, "coding_s": coding_s,
            "wire_s": wire_s, "predicted_step_s": step_s, "quality": ONEBIT_QUALITY,
            "speedup_vs_dense": dense_step_s / step_s if dense_step_s and step_s else None}


def table(report: dict[str, Any]) -> str:
    """The rows rank zero prints: one per compressor, dense's measured step above them, DiLoCo's rows below."""
    m = report["measured"]
    sync = report.get("sync", {})
    width = max([12, *(len(label) + 2 for label in sync.get("rows", {}))])
    lines = [f"measured dense step {1e3 * m['step_s']:.1f} ms (compute {1e3 * m['compute_s']:.1f} ms, exposed "
             f"comm {1e3 * m['exposed_s']:.1f} ms), {len(m['ready_s'])} bucket(s), {report['world_size']} ranks",
             f"{'compressor':<{width}}{'MB/step':>10}{'coding ms':>11}{'wire ms':>9}{'step ms':>9}{'speed-up':>10}"
             "  digits val acc vs dense (docs)"]

    def row(label: str, r: dict[str, Any], quality: str, megabytes: str) -> str:
        return (f"{label:<{width}}{megabytes:>10}{1e3 * r['coding_s']:>11.1f}"
                f"{1e3 * r['wire_s']:>9.1f}{1e3 * r['predicted_step_s']:>9.1f}"
                f"{r['speedup_vs_dense'] or float('nan'):>9.2f}x  {quality}")

    for name, r in report["compressors"].items():
        cost = r["accuracy_cost_pt"]
        lines.append(row(name, r, "-" if cost is None else f"{cost:+.2f} pt ({r['accuracy_measured_at']})",
                         f"{r['bytes_per_step'] / 1e6:.3f}"))
    onebit = report.get("onebit")
    if onebit is not None:
        lines.append(row("onebit_adam", onebit, onebit["quality"], f"{onebit['bytes_per_step'] / 1e6:.3f}"))
        pays = [n for n, r in report["compressors"].items() if n != DENSE and (r["speedup_vs_dense"] or 0) >= PAYS]
        if pays and (onebit["speedup_vs_dense"] or 0) >= PAYS:  # never a method predicted slower than dense
            lines.append(f"The optimizer is Adam and compression pays here ({', '.join(pays)}): sync=onebit_adam "
                         f"(predicted {1e3 * onebit['predicted_step_s']:.1f} ms, "
                         f"{onebit['speedup_vs_dense'] or float('nan'):.2f}x) sends Adam's momentum at 1 bit and keeps "
                         "Adam's quality, where per-step compressors lose it under Adam")
    if sync.get("rows"):
        first = next(iter(sync["rows"].values()))
        lines.append(f"DiLoCo: a sync every H={first['every']} steps ({first['every_from']}), {sync['workers']} "
                     f"workers ({sync['worker']}s); per step: the sync's / H. It changes the optimisation, so no "
                     "accuracy cost:")
        for label, r in sync["rows"].items():
            # a sync's bytes over H can be far below 1 kB: significant figures, not three decimals
            mb = r["bytes_per_step"] / 1e6
            per_sync = f"sync {r['sync_bytes'] / 1e6:.3f} MB in {1e3 * r['sync_s']:.1f} ms"
            lines.append(row(label, r, f"{per_sync}; {r['quality']}", f"{mb:.3f}" if mb >= 0.01 else f"{mb:.1e}"))
    if report.get("auto"):  # what sync="auto" would decide on these figures (docs/auto.md)
        auto = report["auto"]
        lines.append("sync='auto' would decide (DiLoCo at the settings whose quality is measured; docs/auto.md):")
        lines.append(auto_table(Decision(auto["choice"], auto["why"], [Row(**r) for r in auto["rows"]])))
    return "\n".join(lines)


# -- candidates and checks -----------------------------------------------------------------------------------
def default_candidates(names: Sequence[str]) -> dict[str, dict[str, Any]]:
    """``{name: its conf/compression defaults}`` for ``names``, dense first (the base of every speed-up); raises
    ``ValueError`` naming an unknown one."""
    if isinstance(names, str):
        names = [names]
    unknown = [n for n in names if n not in COMPRESSORS]
    if unknown:
        raise ValueError(f"unknown compressor(s) {unknown}; choose from {list(COMPRESSORS)}")
    return {n: default_candidate(n) for n in [DENSE, *(n for n in names if n != DENSE)]}


def settings_problems(settings: Any) -> list[str]:
    """What is wrong with ``advise.*`` (an :class:`AdviseConf` or its config node), each naming the value and fix."""
    problems = []
    unknown = [n for n in settings.compressors if n not in COMPRESSORS]
    if unknown:
        problems.append(f"advise.compressors: unknown {unknown}; choose from {list(COMPRESSORS)}, "
                        "e.g. advise.compressors=[int8,topk]")
    for key, low in (("warmup_steps", 1), ("steps", 1), ("rounds", 1)):
        if getattr(settings, key) < low:
            problems.append(f"advise.{key}={getattr(settings, key)}: use {low} or more")
    if settings.timeout_s <= 0:
        problems.append(f"advise.timeout_s={settings.timeout_s}: seconds, > 0")
    return problems


def configured_sync(cfg: DictConfig) -> tuple[SyncAdvice, Optional[dict[str, Any]]]:
    """DiLoCo's H for the rows and the configured pseudo-gradient compressor (``build_compressor`` arguments, None when
    dense or not configured), from the ``sync`` group when ``sync=diloco`` is chosen, else DiLoCo's defaults."""
    node = cfg.get("sync")  # .get: a config composed without the sync group has none
    plain = OmegaConf.to_container(node, resolve=True, enum_to_str=True) if isinstance(node, DictConfig) else node
    if isinstance(plain, str):
        plain = {"name": plain}
    # as DiLoCo's own as_sync reads it: a dict without a name is DiLoCo's settings
    if not isinstance(plain, dict) or plain.get("name", "diloco") != "diloco":
        return SyncAdvice(), None
    every = plain.get("every", DiLoCo.every)
    compressor = plain.get("compressor")
    if isinstance(compressor, str):
        compressor = default_candidate(compressor)
    elif isinstance(compressor, dict):
        compressor = {k: v for k, v in compressor.items() if k != "_target_"}
    if compressor is not None and compressor.get("name", DENSE) == DENSE:
        compressor = None
    codecs = [DENSE, *SYNC_CODECS]
    if compressor is not None and compressor["name"] not in codecs:
        codecs.append(compressor["name"])
    return SyncAdvice(every=every, configured=True, codecs=codecs), compressor


def candidates(cfg: DictConfig) -> dict[str, dict[str, Any]]:
    """``advise.compressors`` as ``{label: build_compressor arguments}``; dense first (the speed-ups' base). A
    configured ``compression`` or ``sync.compressor`` replaces its own name's defaults; the latter is measured even
    when ``advise.compressors`` leaves it out (DiLoCo's row with it is what the user asked about)."""
    configured = OmegaConf.to_container(cfg.compression, resolve=True)
    configured.pop("_target_", None)
    _, pseudo = configured_sync(cfg)
    names = list(cfg.advise.compressors)
    if pseudo is not None and pseudo["name"] not in names:
        names.append(pseudo["name"])
    chosen = default_candidates(names)
    if configured.get("name") in chosen:
        chosen[configured["name"]] = dict(configured)
    if pseudo is not None:
        chosen[pseudo["name"]] = pseudo
    return chosen


def check(cfg: DictConfig) -> None:
    """``advise.*`` and what the measurement needs; raises ``ValueError`` naming the value and the fix."""
    problems = settings_problems(cfg.advise)
    if cfg.strategy.get("_target_") != StrategyConf._target_:
        problems.append("advise measures under strategy=ring_ddp (its comm hook shows the buckets); drop strategy=")
    devices = resolve_devices(cfg.trainer.devices)
    if isinstance(devices, int) and devices * cfg.trainer.num_nodes < 2:
        problems.append(f"trainer.devices={cfg.trainer.devices} x num_nodes={cfg.trainer.num_nodes}: one rank has "
                        "no links to measure; use 2 or more ranks, e.g. trainer.devices=2")
    if problems:
        raise ValueError("invalid advise configuration:\n  " + "\n  ".join(problems))
    for label, kwargs in candidates(cfg).items():  # each compressor checks its own arguments
        try:
            build_compressor(**kwargs)
        except (TypeError, ValueError) as err:
            raise ValueError(f"advise: compressor {label} ({kwargs}): {err}") from err


# -- measuring: the bucket observer and the callback -----------------------------------------------------------
class Advisor(Callback):
    """Times a fit's first dense steps, then, when the fit ends, reduces the real buckets with every candidate; rank
    zero prints the table (and writes the report where ``path`` says). Every rank holds the report in :attr:`report`.

    In a Trainer of one's own, with one's own LightningModule and data::

        advisor = Advisor()  # every compressor at its defaults, 2 untimed + 6 timed steps
        trainer = pl.Trainer(strategy=RingDDPStrategy(), devices=2, max_steps=8, callbacks=[advisor])
        trainer.fit(model, datamodule=data)
        advisor.report["compressors"]["int8"]["speedup_vs_dense"]

    Only the fit's first ``warmup_steps + steps`` training batches are timed; a longer fit goes on as it would
    without the callback, and the measurement runs when it ends. The launching process holds the report when it is
    rank zero (``start_method="popen"``, the strategy's default, torchrun, srun); under ``fork`` or ``spawn`` it
    runs no rank: read the file at ``path``.

    Needs :class:`~lightning_dist.strategy.RingDDPStrategy`: it watches the buckets through the strategy's feature seam
    (:meth:`~lightning_dist.strategy.RingFeatures.add_bucket_observer`).

    Args:
        candidates: the compressors measured: None for every compressor, names (``["int8", "topk"]``) at the
            defaults of ``conf/compression/<name>.yaml``, or ``{label: build_compressor arguments}``. Dense
            (``none``) is always measured, first: it is the speed-ups' base.
        settings: warm-up and timed steps, rounds, timeout (:class:`AdviseConf`; None: its defaults).
        path: where rank zero writes the report (JSON); None: nowhere.
        sync: H and the pseudo-gradient codecs of DiLoCo's rows (None: DiLoCo's default H, dense, int8 and top-k
            where they are candidates).
    """

    def __init__(self, candidates: Union[None, Sequence[str], dict[str, dict[str, Any]]] = None,
                 settings: Optional[AdviseConf] = None, path: Optional[str] = None,
                 sync: Optional[SyncAdvice] = None) -> None:
        self.settings = settings if settings is not None else AdviseConf()
        problems = settings_problems(self.settings)
        if problems:
            raise ValueError("Advisor: " + "; ".join(problems))
        if candidates is None or not isinstance(candidates, dict):
            candidates = default_candidates(self.settings.compressors if candidates is None else candidates)
        elif DENSE not in candidates:
            candidates = {DENSE: default_candidate(DENSE), **candidates}
        self.candidates, self.path = dict(candidates), path
        for label, kwargs in self.candidates.items():  # each compressor checks its own arguments, before any fit
            try:
                build_compressor(**kwargs)
            except (TypeError, ValueError) as err:
                raise ValueError(f"Advisor: compressor {label} ({kwargs}): {err}") from err
        self.sync = sync or SyncAdvice()
        self._ends: list[float] = []
        self._steps: list[dict[str, Any]] = []  # per timed step: step_s, ready_s, exposed_s
        self._buckets: list[tuple[BucketLayout, torch.Tensor]] = []  # the last timed step's gradient buckets
        self._backward_at = 0.0
        self._recorder = BucketRecorder()
        self.report: dict[str, Any] = {}

    def _window(self) -> int:
        """Training batches recorded: the untimed ones, then the timed ones."""
        return self.settings.warmup_steps + self.settings.steps

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        features = features_of(trainer.strategy)
        if features is None:
            raise RuntimeError(f"Advisor needs RingDDPStrategy (it records the buckets through its comm hook), not "
                               f"{type(trainer.strategy).__name__}: use strategy=ring_ddp")
        features.add_bucket_observer(self._recorder)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        features = features_of(trainer.strategy)
        if features is not None:
            features.remove_bucket_observer(self._recorder)

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        rec = self._recorder
        rec.clear()
        rec.active = len(self._ends) < self._window()
        rec.keep = rec.active and len(self._ends) >= self.settings.warmup_steps
        if rec.keep:
            self._buckets = []  # one copy of the gradient at a time

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        self._backward_at = time.perf_counter()

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if not self._recorder.active:
            return  # the measured steps are over (on_train_batch_start): the fit goes on
        self._ends.append(time.perf_counter())
        rec = self._recorder
        if len(self._ends) > self.settings.warmup_steps and rec.handed:
            self._steps.append({"step_s": self._ends[-1] - self._ends[-2],
                                "ready_s": [t - self._backward_at for t in rec.handed],
                                "exposed_s": max(0.0, max(rec.done) - rec.handed[-1])})
            self._buckets = list(rec.buckets)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        measured = self._dense_step()  # before any collective: every rank trained the same steps, so all raise alike
        buckets = self._buckets
        features = features_of(trainer.strategy)
        topology = features.topology if features is not None else None
        two_tier = topology is not None and topology.kind == "two_tier"
        group = dist.new_group(timeout=timedelta(seconds=self.settings.timeout_s))
        try:
            codecs = measure_codecs(self.candidates, buckets, trainer.strategy.algorithm, group, self.settings.rounds)
            measured, codecs = agree(measured, codecs, group)
            # DiLoCo's workers are hosts: its sync runs across hosts, each rank carrying its part
            across = None
            if two_tier:
                chosen = {label: self.candidates[label] for label in self.sync.codecs if label in self.candidates}
                across = across_hosts(chosen, buckets, topology, trainer.global_rank, trainer.strategy.algorithm,
                                      self.settings.rounds, timedelta(seconds=self.settings.timeout_s))
            if across is not None:
                _, across = agree(measured, across, group)
        finally:
            dist.destroy_process_group(group)
        for label, kwargs in self.candidates.items():
            codecs[label]["kwargs"] = kwargs
        compressors = predictions(measured, codecs)
        dense_s = compressors.get(DENSE, {}).get("predicted_step_s")
        if across is not None:
            rows = sync_predictions(measured, across, self.sync, dense_s, bytes_scale=topology.ranks_per_host)
            workers, worker = len(topology.hosts), "host"
        else:
            rows = sync_predictions(measured, codecs, self.sync, dense_s)
            workers, worker = trainer.world_size, "rank"
        adam = any(isinstance(optimizer, torch.optim.Adam) for optimizer in trainer.optimizers)
        self.report = {"world_size": trainer.world_size, "algorithm": trainer.strategy.algorithm,
                       "onebit": onebit_prediction(measured, codecs, dense_s) if adam else None,
                       "settings": asdict(self.settings),
                       "candidates": self.candidates, "measured": measured, "per_bucket": codecs,
                       "compressors": compressors,
                       "sync": {**asdict(self.sync), "workers": workers, "worker": worker, "rows": rows}}
        # what sync="auto" would decide on these measurements (the same rule, the same figures)
        auto = decide(candidate_rows(measured, codecs, family(trainer.optimizers), "two_tier" if across else "flat",
                                     across, bytes_scale=topology.ranks_per_host if across is not None else 1.0,
                                     compressors=[n for n in codecs if n != DENSE]))
        self.report["auto"] = auto.as_dict()
        if trainer.is_global_zero:
            print(table(self.report), flush=True)
            if self.path is not None:
                tmp = self.path + ".tmp"
                with open(tmp, "w") as fh:
                    json.dump(self.report, fh, indent=2)
                os.replace(tmp, self.path)
                print(f"advise: {self.path}", flush=True)

    def _dense_step(self) -> dict[str, Any]:
        """Medians over the timed steps (per bucket for the ready times)."""
        if not self._steps:
            raise RuntimeError(
                f"advise: no timed step had a gradient bucket: the fit trained {len(self._ends)} batch(es), of which "
                f"the first warmup_steps={self.settings.warmup_steps} are not timed; train at least "
                f"{self._window()} (Trainer max_steps, the data's length), without gradient accumulation")
        return dense_step(self._steps)


# -- the command -------------------------------------------------------------------------------------------------
def run(cfg: DictConfig, output_dir: str) -> dict[str, Any]:
    """Measure as configured; returns rank zero's report (read back from ``advise.json`` in the launching process)."""
    cfg = copy.deepcopy(cfg)
    with open_dict(cfg):
        if cfg.get("advise") is None:  # a primary config of one's own (--config-dir) without the advise group
            cfg.advise = OmegaConf.structured(AdviseConf)
        if OmegaConf.is_missing(cfg, "data"):  # '~data': a LightningModule with its own dataloaders
            cfg.data = None
    check(cfg)
    settings = AdviseConf(**OmegaConf.to_container(cfg.advise, resolve=True))
    a = settings
    chosen = candidates(cfg)
    sync, _ = configured_sync(cfg)
    with open_dict(cfg):
        cfg.compression = {"_target_": "lightning_dist.compression.build_compressor", "name": "none"}
        if cfg.get("sync") is not None:  # the dense step is measured syncing every step; DiLoCo's rows are predicted
            cfg.sync = {"name": "every_step"}
        cfg.callbacks = {}  # no checkpoints, no per-step metrics: nothing but the measurement
        cfg.trainer.max_steps = a.warmup_steps + a.steps
        cfg.trainer.max_epochs = -1
    path = os.path.join(output_dir, "advise.json")
    callback = Advisor(chosen, settings, path, sync)
    pl.seed_everything(cfg.seed, workers=True, verbose=False)
    trainer, model, data = build(cfg, output_dir, time.time(), [callback], summary=False, trainer_overrides={
        "logger": False, "enable_checkpointing": False, "limit_val_batches": 0, "num_sanity_val_steps": 0,
        "enable_progress_bar": False, "enable_model_summary": False})
    rank_zero_info(f"advise: {a.warmup_steps} + {a.steps} dense steps, then {a.rounds} rounds of {list(chosen)}")
    trainer.fit(model, datamodule=data)
    if trainer.is_global_zero and os.path.exists(path):
        with open(path) as fh:
            return json.load(fh)
    return {}


@hydra_main
def _advise(cfg: DictConfig) -> None:
    run(cfg, HydraConfig.get().runtime.output_dir)


def _add_advise_group(overrides: list[str]) -> list[str]:
    """``+advise=default`` unless given (a rank that Lightning re-runs sees it already)."""
    return [] if any(o.lstrip("+~").startswith("advise=") for o in overrides) else ["+advise=default"]


def main() -> Any:
    """``lightning-dist-advise``: the Hydra command (``lightning_dist.train.hydra_command``: a class of the user's own
    too) with the advise group."""
    return hydra_command(_advise, "lightning-dist-advise", added=_add_advise_group)


# the names before one naming rule for callbacks, and the strategy subclass the bucket observer replaced
__getattr__ = renamed(__name__, {"AdviseCallback": Advisor, "RecordingRingDDPStrategy": RingDDPStrategy}, hints={
    "RecordingRingDDPStrategy": "lightning_dist.RingDDPStrategy: Advisor records the buckets itself, through "
                                "RingFeatures.add_bucket_observer (a .recorded attribute is no more)"})


if __name__ == "__main__":
    main()
    sys.exit(0)
