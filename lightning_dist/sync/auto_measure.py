"""What a fit measures of its own links and buckets, for ``lightning-dist-advise`` (:class:`~lightning_dist.advise.
Advisor`) and ``sync="auto"`` (:mod:`lightning_dist.sync.auto`) alike: one home for the measurement, two users.

- :class:`BucketRecorder`: a bucket observer (the comm hook's :class:`~lightning_dist.strategy.hook.BucketObserver`
  protocol: ``bucket_handed``, ``bucket_done``) that records each bucket's hand-over and completion, and copies of
  the gradient buckets of the steps it keeps.
- :func:`dense_step`: the medians of the timed dense steps (step, exposed communication, compute-only, ready times).
- :func:`measure_codecs`: every candidate codec's ``reduce`` on copies of the real buckets over a group of its own:
  coding seconds, wire seconds and bytes, per bucket.
- :func:`measure_across` (over a :func:`host_group`; :func:`across_hosts` makes its own): the same for this rank's part
  of every bucket across hosts (a sync between hosts' workers).
- :func:`unit_measurer`: one codec at a time, either way, for ``sync="auto"``'s bounded measurement.
- :func:`agree` (:func:`agree_step`, :func:`agree_codecs`): every figure as its maximum over the ranks, so every rank
  predicts, and decides, the same.
"""

from __future__ import annotations

import contextlib
import importlib.resources
import statistics
import time
from datetime import timedelta
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from lightning_dist.comm import CommStats
from lightning_dist.compression import BucketLayout, Transport, build_compressor
from lightning_dist.sync.auto_bound import Figures, Unit


def conf_compressor(name: str) -> dict[str, Any]:
    """``conf/compression/<name>.yaml`` as plain ``build_compressor`` arguments (without ``_target_``): a candidate at
    the defaults users get from the command line."""
    from omegaconf import OmegaConf

    text = (importlib.resources.files("lightning_dist.conf") / "compression" / f"{name}.yaml").read_text()
    node = OmegaConf.to_container(OmegaConf.create(text))
    node.pop("_target_", None)
    return node


class BucketRecorder:
    """Records each backward pass through the strategy's comm hook (register it with ``add_bucket_observer``)."""

    def __init__(self) -> None:
        self.handed: list[float] = []  # perf_counter per bucket, in hand-over order
        self.done: list[float] = []
        self.buckets: list[tuple[BucketLayout, torch.Tensor]] = []
        self.keep = False  # copy the buckets' gradients (a timed step)
        self.active = True  # False: the measured steps are over, record nothing

    def clear(self) -> None:
        self.handed.clear()
        self.done.clear()
        self.buckets.clear()

    def bucket_handed(self, index: int, layout: BucketLayout, buffer: torch.Tensor) -> None:
        if not self.active:
            return
        self.handed.append(time.perf_counter())
        if self.keep:
            self.buckets.append((layout, buffer.detach().clone()))

    def bucket_done(self, index: int) -> None:
        if self.active:
            self.done.append(time.perf_counter())

    def step(self, started: float, ended: float) -> Optional[dict[str, Any]]:
        """The step that ran from ``started`` to ``ended`` (``perf_counter``), as :func:`dense_step` takes it: its
        time, each bucket's ready time from ``started``, the exposed communication (the last completion past the last
        hand-over). None when no bucket was handed over."""
        if not self.handed:
            return None
        return {"step_s": ended - started, "ready_s": [t - started for t in self.handed],
                "exposed_s": max(0.0, max(self.done, default=self.handed[-1]) - self.handed[-1])}


def dense_step(steps: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Medians over the timed steps (:meth:`BucketRecorder.step`'s), per bucket for the ready times; the compute-only
    step is the step less its exposed communication."""
    if not steps:
        raise ValueError("no timed step had a gradient bucket")
    n = min(len(s["ready_s"]) for s in steps)
    step_s = statistics.median(s["step_s"] for s in steps)
    exposed_s = statistics.median(s["exposed_s"] for s in steps)
    return {"step_s": step_s, "exposed_s": exposed_s, "compute_s": max(0.0, step_s - exposed_s),
            "ready_s": [statistics.median(s["ready_s"][i] for s in steps) for i in range(n)],
            "timed_steps": len(steps)}


def measure_codecs(candidates: dict[str, dict[str, Any]], buckets: Sequence[tuple[BucketLayout, torch.Tensor]],
                   algorithm: str, group: Any, rounds: int, long_s: Optional[float] = None
                   ) -> dict[str, dict[str, list[float]]]:
    """Per candidate, per bucket: median coding and wire seconds and bytes of ``reduce`` on copies of the buckets,
    round-robin over the candidates (the order rotated each round), after one untimed round. ``long_s``: a candidate
    whose untimed round took longer than this (every rank's longest: a slow link's wire, which no warm-up changes)
    counts that round as its one timed sample and is not reduced again."""
    compressors = {label: build_compressor(**kwargs) for label, kwargs in candidates.items()}
    labels = list(compressors)
    samples: dict[str, list[list[tuple[float, float, int]]]] = {label: [[] for _ in buckets] for label in labels}
    first: dict[str, list[tuple[float, float, int]]] = {label: [] for label in labels}  # the untimed round's
    done: set[str] = set()
    for r in range(rounds + 1):
        if r == 1 and long_s is not None:  # every rank the same verdict: the longest round of any rank decides
            took = torch.tensor([sum(c + w for c, w, _ in first[label]) for label in labels], dtype=torch.float64)
            dist.all_reduce(took, op=dist.ReduceOp.MAX, group=group)
            for label, seconds in zip(labels, took.tolist(), strict=True):
                if seconds > long_s:
                    done.add(label)
                    for i, sample in enumerate(first[label]):
                        samples[label][i].append(sample)
        for label in labels[r % len(labels):] + labels[:r % len(labels)]:
            if label in done:
                continue
            codec = compressors[label]
            for i, (layout, grad) in enumerate(buckets):
                flat = grad.clone()
                stats = CommStats(keep_records=False)
                transport = Transport(algorithm, group, stats)
                dist.barrier(group)  # each bucket timed from a common start: no skew of the previous one
                _sync(flat)
                started = time.perf_counter()
                codec.reduce(flat, layout, transport)
                _sync(flat)
                wall = time.perf_counter() - started
                sample = (max(0.0, wall - transport.seconds), transport.seconds, stats.bytes_sent)
                (samples[label][i] if r > 0 else first[label]).append(sample)
            codec.commit()
    return {label: {key: [statistics.median(s[k] for s in per) for per in samples[label]]
                    for k, key in enumerate(("coding_s", "wire_s", "bytes"))} for label in labels}


def host_parts(buckets: Sequence[tuple[BucketLayout, torch.Tensor]], parts: int, index: int
               ) -> list[tuple[BucketLayout, torch.Tensor]]:
    """Part ``index`` of ``parts`` of every bucket (:meth:`BucketLayout.split`: what the ``index``-th rank of a host
    carries across hosts), as a contiguous tensor with its layout; empty parts left out."""
    out = []
    for layout, flat in buckets:
        part, spans = layout.split(parts)[index]
        if spans:
            out.append((part, torch.cat([flat[a:b] for a, b in spans])))
    return out


@contextlib.contextmanager
def host_group(topology: Any, rank: int, timeout: Optional[timedelta]) -> Iterator[Any]:
    """The group of this rank's local index across hosts (one rank per host: the ranks that carry a part between
    hosts), destroyed on leaving. A collective call: every rank makes every group, in order."""
    group = dist.new_subgroups_by_enumeration(topology.inter_groups(), timeout=timeout)[0]
    try:
        yield group
    finally:
        dist.destroy_process_group(group)


def measure_across(candidates: dict[str, dict[str, Any]], buckets: Sequence[tuple[BucketLayout, torch.Tensor]],
                   topology: Any, rank: int, algorithm: str, group: Any, rounds: int, long_s: Optional[float] = None
                   ) -> dict[str, dict[str, list[float]]]:
    """A sync between hosts' workers: this rank's part of every bucket through each candidate over ``group``
    (:func:`host_group`), as the parts cross at a sync. Totals per codec, one entry each (ranks of different local
    indices may hold different numbers of non-empty parts)."""
    per_part = measure_codecs(candidates, host_parts(buckets, topology.ranks_per_host, topology.local_index(rank)),
                              algorithm, group, rounds, long_s)
    return {label: {key: [sum(values)] for key, values in figures.items()} for label, figures in per_part.items()}


def across_hosts(candidates: dict[str, dict[str, Any]], buckets: Sequence[tuple[BucketLayout, torch.Tensor]],
                 topology: Any, rank: int, algorithm: str, rounds: int, timeout: Optional[timedelta],
                 long_s: Optional[float] = None) -> dict[str, dict[str, list[float]]]:
    """:func:`measure_across` over a :func:`host_group` of its own. A collective of every rank."""
    with host_group(topology, rank, timeout) as group:
        return measure_across(candidates, buckets, topology, rank, algorithm, group, rounds, long_s)


@contextlib.contextmanager
def unit_measurer(candidates: dict[str, dict[str, Any]], buckets: Sequence[tuple[BucketLayout, torch.Tensor]],
                  algorithm: str, group: Any, topology: Any, rank: int, timeout: Optional[timedelta], rounds: int,
                  long_s: Optional[float]) -> Iterator[Callable[[Unit], Figures]]:
    """The ``measure`` of :func:`~lightning_dist.sync.auto_bound.measure_what_can_win`: one codec's figures, agreed
    over ``group``, on every bucket (``flat``) or this rank's part across hosts (``across``: over a :func:`host_group`
    made at the first such measurement and destroyed on leaving). A collective of every rank."""
    with contextlib.ExitStack() as stack:
        hosts: list[Any] = []

        def measure(unit: Unit) -> Figures:
            where, codec = unit
            if where == "flat":
                figures = measure_codecs({codec: candidates[codec]}, buckets, algorithm, group, rounds, long_s)
            else:
                if not hosts:
                    hosts.append(stack.enter_context(host_group(topology, rank, timeout)))
                figures = measure_across({codec: candidates[codec]}, buckets, topology, rank, algorithm, hosts[0],
                                         rounds, long_s)
            return agree_codecs(figures, group)[codec]

        yield measure


def agree_step(measured: dict[str, Any], group: Any) -> dict[str, Any]:
    """The dense step's figures as their maximum over the ranks (every rank the same number of buckets, or an
    error)."""
    counts = torch.tensor([len(measured["ready_s"]), -len(measured["ready_s"])], dtype=torch.float64)
    dist.all_reduce(counts, op=dist.ReduceOp.MAX, group=group)  # every rank the same number of buckets
    if counts[0] != -counts[1]:
        raise RuntimeError(f"ranks saw different numbers of buckets ({-counts[1]:.0f} to {counts[0]:.0f})")
    values = torch.tensor([measured["step_s"], measured["exposed_s"], *measured["ready_s"]], dtype=torch.float64)
    dist.all_reduce(values, op=dist.ReduceOp.MAX, group=group)
    step_s, exposed_s, *ready = values.tolist()
    return {**measured, "step_s": step_s, "exposed_s": exposed_s, "ready_s": ready,
            "compute_s": max(0.0, step_s - exposed_s)}


def agree_codecs(codecs: dict[str, dict[str, list[float]]], group: Any) -> dict[str, dict[str, list[float]]]:
    """Every codec's figures as their maximum over the ranks (one all-reduce; every rank measured the same codecs on
    the same number of entries)."""
    keys = ("coding_s", "wire_s", "bytes")
    values = torch.tensor([v for label in codecs for key in keys for v in codecs[label][key]], dtype=torch.float64)
    dist.all_reduce(values, op=dist.ReduceOp.MAX, group=group)
    it = iter(values.tolist())
    return {label: {key: [next(it) for _ in codecs[label][key]] for key in keys} for label in codecs}


def agree(measured: dict[str, Any], codecs: dict[str, dict[str, list[float]]], group: Any
          ) -> tuple[dict[str, Any], dict[str, dict[str, list[float]]]]:
    """Every figure as its maximum over the ranks, so every rank predicts the same."""
    return agree_step(measured, group), agree_codecs(codecs, group)


def _sync(tensor: torch.Tensor) -> None:
    if tensor.is_cuda:
        torch.cuda.synchronize(tensor.device)
