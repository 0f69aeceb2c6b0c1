"""Who trains together, the parameters DiLoCo syncs, their cut into fragments and the step schedule of their syncs.

The parts of :class:`~lightning_dist.sync.diloco.DiLoCoSync` that say *what* syncs *when*: docs/sync.md ("How it
works") has the algorithm.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from lightning_dist.comm.topology import Topology
from lightning_dist.compression import Compressor
from lightning_dist.compression.parts import PartPlan
from lightning_dist.sync.buckets import HOST, Bucket, cut_buckets, host_empty
from lightning_dist.sync.diloco_settings import DiLoCoSettings


@dataclass(frozen=True)
class Workers:
    """Who trains together between syncs: the ranks of every worker, and where this rank is among them."""

    ranks: tuple[tuple[int, ...], ...]  # worker index -> its ranks, ascending
    rank: int  # this rank (global)

    @classmethod
    def of(cls, topology: Optional[Topology], world_size: int, rank: int) -> Workers:
        """A worker per host under two_tier, a worker per rank otherwise (flat, or one rank)."""
        if topology is not None and topology.kind == "two_tier":
            return cls(tuple(tuple(host) for host in topology.hosts), rank)
        return cls(tuple((r,) for r in range(world_size)), rank)

    @property
    def count(self) -> int:
        return len(self.ranks)

    @property
    def index(self) -> int:
        """This rank's worker."""
        return next(i for i, ranks in enumerate(self.ranks) if self.rank in ranks)

    @property
    def local_ranks(self) -> tuple[int, ...]:
        """The ranks of this rank's worker."""
        return self.ranks[self.index]

    @property
    def leader(self) -> int:
        """The first rank of this rank's worker (its ranks hold the same state: the leader speaks for them)."""
        return self.local_ranks[0]

    @property
    def local_index(self) -> int:
        """This rank's place in its worker (the part of each bucket it carries across workers)."""
        return self.local_ranks.index(self.rank)

    @property
    def local_size(self) -> int:
        return len(self.local_ranks)


@dataclass
class SyncedModel:
    """The module's tensors DiLoCo syncs, in the module's order: its trainable parameters and its buffers."""

    names: list[str]  # the parameters'
    params: list[torch.Tensor]
    buffer_names: list[str]
    buffers: list[torch.Tensor]

    @classmethod
    def of(cls, module: torch.nn.Module) -> SyncedModel:
        named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        buffers = [(name, b) for name, b in module.named_buffers() if b is not None]
        return cls([name for name, _ in named], [p for _, p in named],
                   [name for name, _ in buffers], [b for _, b in buffers])

    @property
    def device(self) -> torch.device:
        return self.params[0].device if self.params else HOST

    def tensors(self) -> list[torch.Tensor]:
        """The parameters and buffers, in the order of ``theta_global`` and the averaged buffers."""
        return [*self.params, *self.buffers]

    def tensor_names(self) -> list[str]:
        return [*self.names, *self.buffer_names]


@dataclass
class Fragment:
    """A part of the parameters that syncs on its own schedule: its buckets, compressor and samples count."""

    index: int
    offset: int  # it syncs after the steps where global_step % H == offset
    params: list[int]  # its parameters' positions in the sync's list
    buckets: list[Bucket]
    compressor: Compressor  # its own copy: error feedback per fragment
    samples: list[float]  # per worker, since this fragment's last sync (heterogeneous batches)
    buffers: bool  # whether the model's buffers are averaged with it (the first fragment)
    started: int = -1  # the step after which its last sync started (-1: none in this fit yet)
    rate_sum: float = 0.0  # the inner learning rates of the optimizer steps since this fragment's last sync, summed
    rate_steps: int = 0  # and their count


class Schedule:
    """The fragments and when each syncs: after which optimizer steps a fragment's sync starts, the warm-up's steps,
    and each worker's weight at a fragment's sync (its samples since the fragment's last one)."""

    def __init__(self, settings: DiLoCoSettings, workers: Workers) -> None:
        self.settings = settings
        self.workers = workers
        self.fragments: list[Fragment] = []

    def cut(self, model: SyncedModel) -> None:
        """The model's parameters cut into the settings' fragments, each with its buckets (in host memory: docs/sync.md,
        "Where the state lives") and its own copy of the settings' compressor (which stays unused: a second fit starts
        anew)."""
        named = list(zip(model.names, model.params))
        self.fragments = []
        cuts = fragment_cut([(name, p.numel()) for name, p in named], self.settings.fragments)
        for f, index in enumerate(cuts):
            buckets = fragment_buckets([named[i] for i in index], self.workers.local_size, self.workers.local_index,
                                       index)
            self.fragments.append(Fragment(f, self.settings.offset(f), index, buckets,
                                           copy.deepcopy(self.settings.compressor), [0.0] * self.workers.count,
                                           buffers=f == 0))

    def warming(self, global_step: int) -> bool:
        """Whether the optimizer step that made ``global_step`` is one of the warm-up's (``DiLoCo(warmup=...)``):
        every fragment averages after it."""
        return 0 < global_step <= self.settings.warmup

    def starting(self, global_step: int) -> Optional[Fragment]:
        """The fragment whose sync starts after the optimizer step that made ``global_step`` (at most one: the
        offsets differ; none in the warm-up, whose steps sync every fragment)."""
        if global_step <= self.settings.warmup:
            return None
        phase = global_step % self.settings.every
        return next((f for f in self.fragments if f.offset == phase), None)

    def count_samples(self, sizes: Sequence[int]) -> None:
        """A batch of every rank's ``sizes`` (heterogeneous batching's plan) started: each worker's samples count
        towards its weight at every fragment's next sync."""
        for fragment in self.fragments:
            for w, ranks in enumerate(self.workers.ranks):
                fragment.samples[w] += float(sum(sizes[r] for r in ranks))

    def weight(self, fragment: int = 0) -> float:
        """This worker's share of the mean pseudo-gradient of ``fragment``: its samples since the fragment's last sync
        over everyone's, or ``1 / W`` when nobody counted (even batches)."""
        samples = self.fragments[fragment].samples
        total = sum(samples)
        if total <= 0:
            return 1.0 / self.workers.count
        return samples[self.workers.index] / total

    def count_rate(self, rate: float) -> None:
        """An optimizer step ran at the inner learning rate ``rate`` (0: unknown): it counts towards every fragment's
        mean rate at its next sync."""
        for fragment in self.fragments:
            fragment.rate_sum += rate
            fragment.rate_steps += 1

    def take_samples(self, fragment: Fragment, step: int) -> tuple[list[float], float, float]:
        """The fragment's sync starts after ``step``: its samples counted so far, this worker's weight from them and
        the mean inner learning rate of its steps since its last sync (0: none counted); its counts start again."""
        samples, weight = list(fragment.samples), self.weight(fragment.index)
        rate = fragment.rate_sum / fragment.rate_steps if fragment.rate_steps else 0.0
        fragment.started = step
        fragment.samples = [0.0] * self.workers.count
        fragment.rate_sum, fragment.rate_steps = 0.0, 0
        return samples, weight, rate


def fragment_buckets(named: list[tuple[str, torch.Tensor]], parts: int, local_index: int,
                     index: Optional[list[int]] = None) -> list[Bucket]:
    """A fragment's parameters in buckets in host memory (:func:`~lightning_dist.sync.buckets.cut_buckets`); with
    ``parts`` > 1 (two_tier: a host's ranks) each with this rank's part (``local_index``) of it."""
    buckets = cut_buckets(named, lambda numel, p: host_empty(numel, p.dtype), index)
    for bucket in buckets:
        bucket.plan = PartPlan.of(bucket.layout, parts, local_index) if parts > 1 else None
    return buckets


def fragment_cut(sizes: Sequence[tuple[str, int]], fragments: int) -> list[list[int]]:
    """The parameters (``(name, numel)`` in the module's order) cut into ``fragments`` runs of whole parameters of
    about equal numel: a run ends once its cumulative numel reaches the next ``k / F`` of the total, keeping at least
    one parameter for every later run. Every rank derives the same cut from the same model. Fewer parameters than
    fragments is refused (name the fix)."""
    if len(sizes) < fragments:
        raise ValueError(f"DiLoCo(fragments={fragments}) but the model has {len(sizes)} trainable parameter tensors: "
                         f"a fragment holds whole parameters; use fragments <= {len(sizes)}")
    total = sum(n for _, n in sizes)
    cut: list[list[int]] = [[] for _ in range(fragments)]
    done, f = 0, 0
    for i, (_, numel) in enumerate(sizes):
        left = len(sizes) - i  # parameters not yet placed, this one included
        # move on when this run is full, or when every later fragment needs one of the parameters left
        if cut[f] and f < fragments - 1 and (done >= total * (f + 1) / fragments or left <= fragments - 1 - f):
            f += 1
        elif cut[f] and f < fragments - 1 and done + numel / 2 > total * (f + 1) / fragments:
            f += 1  # this parameter lies mostly past the boundary: it starts the next run
        cut[f].append(i)
        done += numel
    return cut


def inner_steps(shares: Sequence[int]) -> list[int]:
    """``DiLoCo(balance="steps")``: how many inner steps each worker (a rank) runs per training step, from the shares
    of the global batch heterogeneous batching gave them (which follow each one's measured speed, and every rank
    holds alike): the share over the smallest share, rounded, at least 1. Each worker runs its share as that many
    inner steps of near-equal size, so every inner step holds about the smallest share whatever the worker's speed.
    ``[8, 8, 8, 4]`` (one worker at half speed) gives ``[2, 2, 2, 1]``."""
    smallest = min(shares)
    if smallest <= 0:
        raise ValueError(f"shares {list(shares)}: every worker needs at least one sample per step")
    return [max(1, int(math.floor(share / smallest + 0.5))) for share in shares]
