"""int8: stochastic rounding with one scale per chunk, through a two-phase compressed all-reduce.

Quantizing (per chunk of ``chunk`` elements, scale ``s = max|x| / 127``): ``q = floor(x / s + u)`` with
``u ~ U[0, 1)``, so ``E[q s] = x``: unbiased, and within one step ``s`` of ``x``. int8 codes cannot be summed
on the wire (the sum overflows and the scales differ), so the bucket travels in two phases, as a ring
all-reduce does, but compressed in both:

1. the bucket is cut into N equal regions, one owned by each rank; every rank quantizes its bucket and sends
   region ``j``'s codes and scales to rank ``j`` (an all-to-all);
2. each owner decodes the N contributions, sums them in rank order, quantizes the sum afresh and sends it to
   every rank (an all-gather); every rank decodes the same bytes, so the result is bit-identical everywhere.

Each rank sends ``2 (N - 1) / N`` of the bucket at ``1 + 4 / chunk`` bytes per element, against the dense
ring's ``2 (N - 1) / N x 4``: about 4x fewer bytes at any world size (a compressed payload summed along a
ring would have to be re-quantized at every hop, and an all-gather of every rank's codes would send
``(N - 1)`` times the local payload: both lose the saving as ranks are added).

Both roundings are unbiased, so the result is an unbiased estimate of the dense sum. A chunk holding a NaN
or Inf gets a non-finite scale, and decodes as non-finite on every rank.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from lightning_dist.compression.base import BucketLayout, Compressor
from lightning_dist.compression.state import StagedGenerator
from lightning_dist.compression.transport import Transport

_LEVELS = 127  # codes in [-127, 127]: symmetric, so zero is exact and -x decodes as -(x)


class Int8Compressor(Compressor):
    """int8 codes with a float32 scale per ``chunk`` elements, stochastic rounding (seeded per rank)."""

    name = "int8"
    summable = False
    light = False
    lossy = True
    wants_error_feedback = True

    def __init__(self, chunk: int = 512, seed: int = 0, start_step: int = 0) -> None:
        super().__init__(start_step)
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
            raise ValueError(f"int8 chunk={chunk!r} must be an int >= 1 (elements per scale; 512 is typical)")
        self.chunk = chunk
        self.rng = StagedGenerator(seed)

    def describe(self) -> str:
        return f"int8(chunk={self.chunk})"

    def reduce(self, flat: torch.Tensor, layout: BucketLayout, transport: Transport,
               sent: Optional[torch.Tensor] = None) -> torch.Tensor:
        n, numel, chunk = transport.world_size, flat.numel(), self.chunk
        region = math.ceil(numel / (n * chunk)) * chunk  # elements each rank owns, whole chunks
        # The parameters in name order, not DDP's: DDP's first step in every process lays a bucket out in a
        # different order than its rebuilt buckets do, and chunks, regions and noise would follow the order
        # (a resumed run would then round its first step differently from an uninterrupted one).
        spans = sorted(layout.spans())
        x = torch.zeros(n * region, dtype=torch.float32, device=flat.device)
        torch.cat([flat[start:end] for _, start, end, _ in spans], out=x[:numel])
        gen = self.rng.get(transport.rank, flat.device)
        codes, steps = quantize(x, chunk, gen)
        if sent is not None:
            _scatter(dequantize(codes, steps, chunk), spans, sent)
        # phase 1: region j of every rank's codes goes to rank j, which sums the N of them in rank order
        arrived = transport.all_to_all(pack(codes.view(n, region), steps.view(n, region // chunk)))
        mine = torch.zeros(region, dtype=torch.float32, device=flat.device)
        for part in arrived:
            mine += dequantize(*unpack(part, region, chunk), chunk)
        # phase 2: each owner's re-quantized sum goes to every rank
        everyone = transport.all_gather(pack(*quantize(mine, chunk, gen)))
        total = torch.cat([dequantize(*unpack(part, region, chunk), chunk) for part in everyone])
        return _scatter(total, spans, flat)

    def workspace_bytes(self, numel: int, element_size: int, world_size: int) -> int:
        # at the peak of quantize: the padded float32 copy, the random codes and the scaled blocks (4 bytes
        # each per element), then the int8 codes, the packed message and the decoded sum
        return numel * (3 * 4 + 2 * 1 + 4)

    def commit(self) -> None:
        super().commit()
        self.rng.commit()

    def discard(self) -> None:
        self.rng.discard()

    def state_dict(self) -> dict:
        return {**super().state_dict(), **self.rng.state_dict()}

    def load_state_dict(self, state: dict, shared_only: bool = False) -> None:
        super().load_state_dict(state, shared_only)
        self.rng.load_state_dict({} if shared_only else state)


def _scatter(ordered: torch.Tensor, spans: list, out: torch.Tensor) -> torch.Tensor:
    """The inverse of the name-ordered concatenation: each parameter's part back to its place in ``out``."""
    offset = 0
    for _, start, end, _ in spans:
        out[start:end].copy_(ordered[offset : offset + end - start])
        offset += end - start
    return out


def quantize(x: torch.Tensor, chunk: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (float32, a multiple of ``chunk`` long) -> (int8 codes, float32 step per chunk).

    A chunk with a NaN or Inf gets a non-finite step (``amax`` propagates NaN), so it decodes as non-finite.
    """
    blocks = x.view(-1, chunk)
    step = blocks.abs().amax(dim=1) / _LEVELS
    safe = torch.where(step > 0, step, torch.ones_like(step))  # an all-zero chunk: codes 0, step 0
    codes = torch.rand(blocks.shape, generator=gen, device=x.device, dtype=torch.float32)
    codes.add_(blocks / safe.unsqueeze(1)).floor_().clamp_(-_LEVELS, _LEVELS)
    codes.nan_to_num_(nan=0.0)  # the step carries the non-finite value
    return codes.to(torch.int8).view(-1), step


def dequantize(codes: torch.Tensor, step: torch.Tensor, chunk: int) -> torch.Tensor:
    return (codes.view(-1, chunk).to(torch.float32) * step.unsqueeze(1)).view(-1)


def pack(codes: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """Codes and steps as one byte tensor (leading dimensions kept): one message per destination."""
    lead = codes.shape[:-1]
    return torch.cat([codes.view(torch.uint8), step.contiguous().view(torch.uint8).view(*lead, -1)], dim=-1)


def unpack(part: torch.Tensor, region: int, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    codes = part[:region].view(torch.int8)
    step = part[region:]
    if step.storage_offset() % 4:  # a chunk size that is not a multiple of 4 leaves the steps unaligned
        step = step.clone()
    step = step.view(torch.float32)
    return codes, step
