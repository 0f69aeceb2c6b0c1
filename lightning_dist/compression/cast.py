"""fp16 / bf16: send the gradient at half the bits and sum it at that precision (torch's fp16/bf16 hooks).

Summable: the cast payload goes through the strategy's own all-reduce (ring, tree, native), so ring and
overlap work unchanged, at half the bytes. Every rank's bucket is already multiplied by its share of the
step before the cast (the division comes before the sum), so the sum of N values near fp16's limit of 65504
cannot overflow where the average would not. fp16 keeps 11 significant bits in a range up to 65504 (a
finite gradient beyond it becomes Inf and is then flagged as non-finite, like any overflow); bf16 keeps
fp32's range with 8 significant bits. NaN and Inf pass through the cast. No error feedback by default: the
rounding is ~1e-3 relative and unbiased enough, as in torch's own hooks; ``error_feedback=True`` adds it.
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_dist.compression.base import BucketLayout, Compressor

_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


class CastCompressor(Compressor):
    """Casts the bucket to ``float16`` (``name="fp16"``) or ``bfloat16`` (``name="bf16"``) for the wire."""

    summable = True
    light = True
    lossy = True
    wants_error_feedback = False

    def __init__(self, name: str = "fp16", start_step: int = 0) -> None:
        super().__init__(start_step)
        if name not in _DTYPES:
            raise ValueError(f"CastCompressor(name={name!r}): use 'fp16' or 'bf16'")
        self.name = name
        self.can_overflow = name == "fp16"  # bf16 has float32's range
        self.dtype = _DTYPES[name]

    def compress(self, flat: torch.Tensor, layout: BucketLayout) -> tuple[torch.Tensor, Any]:
        return flat.to(self.dtype), None

    def decompress(self, payload: torch.Tensor, ctx: Any, out: torch.Tensor) -> torch.Tensor:
        out.copy_(payload)
        return out

    def workspace_bytes(self, numel: int, element_size: int, world_size: int) -> int:
        return numel * self.dtype.itemsize  # the cast payload
