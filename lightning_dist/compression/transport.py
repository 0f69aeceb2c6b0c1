"""What a compressor's :meth:`~lightning_dist.compression.Compressor.reduce` sends its payloads with.

A :class:`Transport` is the hook's process group, algorithm and byte counter, seen from one rank:

- :meth:`Transport.allreduce_`: sum in place by the strategy's algorithm (ring, tree, native, auto);
- :meth:`Transport.all_gather`: every rank's equal-sized tensor, stacked in rank order (for payloads that
  cannot be summed on the way: summing them afterwards in rank order makes the result the same on every
  rank, bit for bit);
- :meth:`Transport.all_to_all`: rank ``j`` gets the ``j``-th of every rank's equal parts (the first phase
  of a compressed all-reduce: each chunk goes to the rank that owns it).

Every call is recorded into the step's :class:`~lightning_dist.comm.CommStats`: bytes this rank puts on
the wire (the backend's ring all-gather sends ``(N - 1)`` times the local payload; an all-to-all sends all
parts but one's own), and the call's wall time; :attr:`Transport.seconds` sums the time of this
transport's own calls so the hook can tell coding time from wire time.
"""

from __future__ import annotations

import time
from typing import Optional

import torch
import torch.distributed as dist

from lightning_dist.comm import CommStats, allreduce_
from lightning_dist.comm._common import all_gather_single, group_view
from lightning_dist.comm.stats import CallRecord


class Transport:
    """One rank's view of the group the compressor reduces over."""

    def __init__(self, algorithm: str = "auto", group: Optional[dist.ProcessGroup] = None,
                 stats: Optional[CommStats] = None) -> None:
        self.algorithm = algorithm
        self.group = group
        self.stats = stats
        view = group_view(group)
        self.rank, self.world_size = view.rank, view.size
        self.seconds = 0.0  # wall time inside this transport's calls, for telling coding time apart

    def allreduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` across ranks in place with the strategy's algorithm."""
        started = time.perf_counter()
        allreduce_(tensor, self.algorithm, group=self.group, op="sum", stats=self.stats)
        self.seconds += time.perf_counter() - started
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """``(world_size, *tensor.shape)``: every rank's ``tensor`` (same shape and dtype on every rank)."""
        n = self.world_size
        out = torch.empty((n, *tensor.shape), dtype=tensor.dtype, device=tensor.device)
        if n == 1:
            out[0].copy_(tensor)
            return out
        started = time.perf_counter()
        all_gather_single(out.view(-1), tensor.contiguous().view(-1), group=self.group)
        nbytes = tensor.numel() * tensor.element_size()
        self._record("all_gather", tensor.numel(), (n - 1) * nbytes, (n - 1) * nbytes, started)
        return out

    def all_to_all(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor``'s first dimension cut into ``world_size`` equal parts; part ``j`` goes to rank ``j``.
        Returns what arrived, part ``i`` from rank ``i``, in the same shape."""
        n = self.world_size
        if tensor.shape[0] % n:
            raise ValueError(f"all_to_all needs a first dimension divisible by {n}, got {tuple(tensor.shape)}")
        if n == 1:
            return tensor.clone()
        out = torch.empty_like(tensor)
        started = time.perf_counter()
        dist.all_to_all_single(out, tensor.contiguous(), group=self.group)
        nbytes = tensor.numel() * tensor.element_size() * (n - 1) // n
        self._record("all_to_all", tensor.numel(), nbytes, nbytes, started)
        return out

    def _record(self, algorithm: str, numel: int, sent: int, received: int, started: float) -> None:
        seconds = time.perf_counter() - started
        self.seconds += seconds
        if self.stats is not None:
            self.stats.record(CallRecord(algorithm, numel, sent, received, seconds, estimated=True))
