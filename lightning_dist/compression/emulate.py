"""Run a compressor for N ranks inside one process: the reference the multi-rank tests compare against, and
a way to try a compressor (or write a new one) without starting a process group.

Each emulated rank is a thread with its own compressor instance and a :class:`LocalTransport`, whose
collectives meet at a barrier and compute in plain torch: the all-reduce sums in rank order, the
all-gather stacks, the all-to-all hands part ``j`` of every rank to rank ``j``.

:class:`MirrorTransport` is one rank of a group whose other ranks hold the same bucket: it moves no bytes
and waits for nobody, so timing a codec through it measures the codec's own arithmetic at a given world
size (``python -m lightning_dist.benchmarks.codecs``).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Optional

import torch

from lightning_dist.comm import CommStats
from lightning_dist.compression.base import BucketLayout, Compressor, Feedback
from lightning_dist.compression.transport import Transport


class _Meeting:
    """Where the emulated ranks' collectives meet: each puts its tensor, all read everyone's."""

    def __init__(self, world_size: int, timeout_s: float) -> None:
        self.slots: list[Optional[torch.Tensor]] = [None] * world_size
        self.barrier = threading.Barrier(world_size, timeout=timeout_s)

    def exchange(self, rank: int, tensor: torch.Tensor) -> list[torch.Tensor]:
        self.slots[rank] = tensor.detach().clone()
        self.barrier.wait()
        everyone = [t for t in self.slots if t is not None]
        self.barrier.wait()  # nobody overwrites a slot before everyone has read it
        return everyone


class LocalTransport(Transport):
    """A :class:`Transport` for one emulated rank (no ``torch.distributed``)."""

    def __init__(self, meeting: _Meeting, rank: int, stats: Optional[CommStats] = None) -> None:
        self.algorithm, self.group, self.stats = "emulated", None, stats
        self.rank, self.world_size, self.seconds = rank, len(meeting.slots), 0.0
        self._meeting = meeting

    def allreduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        parts = self._meeting.exchange(self.rank, tensor)
        total = parts[0].clone()
        for part in parts[1:]:
            total += part
        return tensor.copy_(total)

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return torch.stack(self._meeting.exchange(self.rank, tensor))

    def all_to_all(self, tensor: torch.Tensor) -> torch.Tensor:
        parts = self._meeting.exchange(self.rank, tensor)
        return torch.stack([part.chunk(self.world_size)[self.rank] for part in parts]).view_as(tensor)


class MirrorTransport(Transport):
    """Rank 0 of ``world_size`` ranks that all hold this rank's tensors: the all-reduce multiplies by the world
    size, the all-gather and the all-to-all hand back copies of what this rank would have received, written
    as a real transport writes them (one contiguous copy per part)."""

    def __init__(self, world_size: int = 2) -> None:
        self.algorithm, self.group, self.stats = "mirror", None, None
        self.rank, self.world_size, self.seconds = 0, world_size, 0.0

    def allreduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.mul_(self.world_size)

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        out = torch.empty((self.world_size, *tensor.shape), dtype=tensor.dtype, device=tensor.device)
        for part in out:
            part.copy_(tensor)
        return out

    def all_to_all(self, tensor: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(tensor)
        mine = tensor.chunk(self.world_size)[self.rank]
        for part in out.chunk(self.world_size):
            part.copy_(mine)
        return out


def emulate_reduce(compressors: Sequence[Compressor], flats: Sequence[torch.Tensor], layout: BucketLayout,
                   owed: Optional[Sequence[Optional[torch.Tensor]]] = None, timeout_s: float = 60.0) -> list:
    """Reduce ``flats[r]`` (rank ``r``'s weighted bucket) with ``compressors[r]`` on N emulated ranks.

    Returns every rank's result (new tensors; ``flats`` is not modified). With ``owed`` (per rank, a bucket-
    shaped tensor of what that rank owes, or None), each plain codec is handed a
    :class:`~lightning_dist.compression.base.Feedback` and the result is a list of (result, keep) pairs:
    ``keep`` is what the rank owes afterwards. State is staged in each compressor as in training.
    """
    n = len(compressors)
    if len(flats) != n:
        raise ValueError(f"{n} compressors but {len(flats)} buckets")
    meeting = _Meeting(n, timeout_s)
    results: list = [None] * n
    errors: list[BaseException] = []

    def rank_main(rank: int) -> None:
        try:
            flat = flats[rank].clone()
            transport = LocalTransport(meeting, rank)
            if owed is None:
                results[rank] = compressors[rank].reduce(flat, layout, transport)
                return
            mine = owed[rank]
            per_param = [None] * len(layout.names) if mine is None else [v.reshape(-1) for v in layout.views(mine)]
            fed = Feedback(per_param, torch.empty_like(flat))
            results[rank] = (compressors[rank].reduce(flat, layout, transport, fed), fed.keep)
        except BaseException as exc:  # noqa: BLE001 - re-raised below, after the other ranks are released
            errors.append(exc)
            meeting.barrier.abort()

    threads = [threading.Thread(target=rank_main, args=(r,), name=f"emulated-rank{r}") for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        first = next((e for e in errors if not isinstance(e, threading.BrokenBarrierError)), errors[0])
        raise first
    return results
