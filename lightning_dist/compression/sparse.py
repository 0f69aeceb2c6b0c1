"""What top-k and threshold sparsification share: (index, value) payloads, gathered and summed in rank order.

A sparse payload cannot be summed on the wire (two ranks pick different indices), so every rank's
``(indices, values)`` pairs are all-gathered (one message: int32 indices and the values, packed as bytes)
and each rank adds them into a zeroed bucket in rank order. Every rank adds the same numbers in the same
order, so the result is bit-identical on every rank.

Bytes: an all-gather sends the local payload ``N - 1`` times, so at ``k`` of ``n`` elements each rank sends
``(N - 1) k (4 + v)`` bytes (``v`` bytes per value) against the dense ring's ``2 (N - 1) / N x 4 n``: the
saving is ``8 n / (N k (4 + v))``, and shrinks as ranks are added (the known limit of sparse all-gathers).

Non-finite values are always selected (top-k ranks NaN and Inf first; threshold keeps them explicitly), so
a NaN or Inf in any rank's bucket reaches every rank.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from lightning_dist.compression.base import BucketLayout, Compressor
from lightning_dist.compression.transport import Transport

VALUE_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


class SparseCompressor(Compressor):
    """Base of top-k and threshold: subclasses choose the indices (:meth:`select`)."""

    summable = False
    light = False
    lossy = True
    wants_error_feedback = True
    fixed_count = False  # True when every rank sends the same number of pairs (no count exchange needed)

    def __init__(self, value_dtype: str = "bf16", start_step: int = 0) -> None:
        super().__init__(start_step)
        if value_dtype not in VALUE_DTYPES:
            raise ValueError(f"{self.name} value_dtype={value_dtype!r}: use one of {sorted(VALUE_DTYPES)}")
        self.value_dtype = value_dtype
        self._dtype = VALUE_DTYPES[value_dtype]

    def select(self, flat: torch.Tensor, layout: BucketLayout) -> torch.Tensor:
        """The (int64) indices of ``flat`` to send."""
        raise NotImplementedError

    def sent_fraction(self) -> float:
        """The most of a bucket one rank sends in a step (for the memory estimate)."""
        return 1.0

    def workspace_bytes(self, numel: int, element_size: int, world_size: int) -> int:
        # |g| and the selection mask over the bucket, then the chosen pairs: int64 indices, values, and every
        # rank's (int32 index, value) payload gathered
        k = math.ceil(self.sent_fraction() * numel)
        pair = 4 + self._dtype.itemsize
        return numel * (element_size + 1) + k * (8 + self._dtype.itemsize) + world_size * k * pair

    def reduce(self, flat: torch.Tensor, layout: BucketLayout, transport: Transport,
               sent: Optional[torch.Tensor] = None) -> torch.Tensor:
        index = self.select(flat, layout)
        values = flat[index].to(self._dtype)
        if sent is not None:
            sent.zero_()
            sent[index] = values.to(sent.dtype)
        count = index.numel()
        if self.fixed_count:
            counts = [count] * transport.world_size
        else:
            counts = transport.all_gather(torch.tensor([count], dtype=torch.int64, device=flat.device)).view(-1)
            counts = counts.tolist()
        longest = max(counts)
        flat.zero_()
        if longest == 0:
            return flat
        # indices, then values; the values' part is padded to whole 4-byte words so that every rank's part of
        # the gathered tensor starts aligned for the int32 view
        value_bytes = -(-longest * values.element_size() // 4) * 4
        payload = torch.zeros(4 * longest + value_bytes, dtype=torch.uint8, device=flat.device)
        payload[: 4 * count] = index.to(torch.int32).view(torch.uint8)
        payload[4 * longest : 4 * longest + count * values.element_size()] = values.view(torch.uint8)
        gathered = transport.all_gather(payload)
        for rank, part in enumerate(gathered):  # in rank order: the same sum on every rank
            k = counts[rank]
            rank_index = part[: 4 * longest].view(torch.int32)[:k].long()
            rank_values = part[4 * longest : 4 * longest + k * values.element_size()].view(self._dtype)
            flat.index_add_(0, rank_index, rank_values.to(flat.dtype))
        return flat
