"""int8: stochastic rounding with one scale per chunk, through a two-phase compressed all-reduce.

Quantizing (per chunk of ``chunk`` elements, step ``s = max|x| / 126.999``): ``q = floor(x / s + u)`` with ``u``
uniform in [0, 1), so ``E[q s] = x``: unbiased, and within one step ``s`` of ``x``; ``|x / s| <= 126.999``, so
``q`` stays in [-127, 127] without a clamp. int8 codes cannot be summed
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

The noise does not come from a fresh 32-bit draw per element (``torch.rand`` of a bucket costs many
passes over it on the CPU's Mersenne twister): each rank holds a table of ``P`` (32768) stratified points
``(j + 1/2) / P`` in an order shuffled from ``(seed, rank)``, and each rounding reads it from an offset drawn
from the rank's staged generator, element ``i`` taking point ``(offset + i) mod P``. Over the offset every
element's ``u`` is uniform over the ``P`` points, so the rounding is unbiased to ``1 / (2P)`` of a step; the
generator is checkpointed and rolled back with a skipped step as before. Elements ``P`` apart share a
point in one rounding: their errors are correlated, not biased. Codes are found from ``floor`` of one fused
multiply-add per element; with error feedback the residual is ``x - q s`` from the same ``q``.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from lightning_dist.compression import kernels
from lightning_dist.compression.base import BucketLayout, Compressor, Feedback
from lightning_dist.compression.state import Scratch, StagedGenerator
from lightning_dist.compression.transport import Transport

_LEVELS = 126.999  # max|x| / step: codes stay within [-127, 127] with no clamp
_TINY = torch.finfo(torch.float32).tiny
_POINTS = 32768  # noise table length (a multiple of the chunk is used: whole chunks per table period)


class Int8Compressor(Compressor):
    """int8 codes with a float32 step per ``chunk`` elements, stochastic rounding (seeded per rank)."""

    name = "int8"
    summable = False
    light = False
    lossy = True
    wants_error_feedback = True

    def __init__(self, chunk: int = 512, seed: int = 0, start_step: int = 0) -> None:
        super().__init__(start_step)
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
            raise ValueError(f"int8 chunk={chunk!r} must be an int >= 1 (elements per scale; 512 is typical)")
        kernels.mode()  # a bad LIGHTNING_DIST_COMPILE is named here, in the launching process
        self.chunk = chunk
        self.rng = StagedGenerator(seed)
        self._scratch = Scratch()
        self._table: Optional[torch.Tensor] = None  # this rank's shuffled noise points, twice over

    def describe(self) -> str:
        return f"int8(chunk={self.chunk})"

    def reduce(self, flat: torch.Tensor, layout: BucketLayout, transport: Transport,
               feedback: Optional[Feedback] = None) -> torch.Tensor:
        n, numel, chunk = transport.world_size, flat.numel(), self.chunk
        align = 4 // math.gcd(chunk, 4)  # whole chunks per region, and a region of whole 4-byte words
        region = math.ceil(numel / (n * chunk * align)) * chunk * align  # elements each rank owns
        # The parameters in name order, not DDP's: DDP's first step in every process lays a bucket out in a
        # different order than its rebuilt buckets do, and chunks, regions and noise would follow the order
        # (a resumed run would then round its first step differently from an uninterrupted one).
        order = sorted(range(len(layout.names)), key=layout.names.__getitem__)
        every = layout.spans()
        spans = [every[i] for i in order]
        x = self._buffer("x", n * region, flat.device)
        offset = 0
        for i, (_, start, end, _) in zip(order, spans):
            owed = None if feedback is None else feedback.owed[i]
            part = x[offset : offset + end - start]
            if owed is None:
                part.copy_(flat[start:end])
            else:
                torch.add(flat[start:end], owed, out=part)
            offset += end - start
        x[numel:].zero_()
        gen = self.rng.get(transport.rank, flat.device)
        table = self._noise(transport.rank, flat.device)
        # phase 1: region j of every rank's codes goes to rank j, which sums the N of them in rank order
        message = self._buffer("phase1", n * _row(region, chunk), flat.device, torch.uint8).view(n, -1)
        work = self._buffer("work", n * region, flat.device)
        codes8 = self._buffer("codes", n * region, flat.device, torch.int8)
        steps = _encode(x, chunk, table, gen, work, codes8, message[:, :region], message[:, region:],
                        residual=feedback is not None)
        if feedback is not None:  # what this rank owes, x - q s (in `work`), back in the bucket's layout
            offset = 0
            for _, start, end, _ in spans:
                feedback.keep[start:end].copy_(work[offset : offset + end - start])
                offset += end - start
            feedback.finite = bool(torch.isfinite(steps).all())
        arrived = transport.all_to_all(message)
        # the N contributions to this rank's region, decoded and summed in rank order (the same on every owner)
        mine = self._buffer("mine", region, flat.device)
        for i, part in enumerate(arrived):
            codes_i, steps_i = _split(part, region)
            if i == 0:
                mine.copy_(codes_i)
                mine.view(-1, chunk).mul_(steps_i.view(-1, 1))
            else:
                work[:region].copy_(codes_i)
                mine.view(-1, chunk).addcmul_(work[:region].view(-1, chunk), steps_i.view(-1, 1))
        # phase 2: each owner's re-quantized sum goes to every rank, which decodes it into the bucket's layout
        reply = self._buffer("phase2", _row(region, chunk), flat.device, torch.uint8).view(1, -1)
        _encode(mine, chunk, table, gen, work[:region], codes8[:region], reply[:, :region], reply[:, region:])
        everyone = transport.all_gather(reply[0])
        all_steps = torch.cat([_split(part, region)[1] for part in everyone])
        offset = 0
        for _, start, end, _ in spans:
            for a, b, c in _pieces(offset, offset + end - start, chunk, region):
                out = flat[start + a - offset : start + b - offset]
                row = a // region
                out.copy_(_split(everyone[row], region)[0][a - row * region : b - row * region])
                if (b - a) % chunk == 0 and a % chunk == 0:
                    out.view(-1, chunk).mul_(all_steps[c : c + (b - a) // chunk].view(-1, 1))
                else:
                    out.mul_(all_steps[c])
            offset += end - start
        return flat

    def _buffer(self, key: str, numel: int, device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self._scratch.get(key, numel, dtype, device)

    def _noise(self, rank: int, device: torch.device) -> torch.Tensor:
        """The rank's stratified points ``(j + 1/2) / P`` in a shuffled order, the table written twice (any
        ``P`` consecutive entries from an offset below ``P``), ``P`` a multiple of the chunk."""
        if self._table is None or self._table.device != device:
            points = self.chunk * max(1, _POINTS // self.chunk)
            shuffle = torch.Generator().manual_seed(self.rng.seed * 1_000_003 + rank + 7_919)
            order = torch.randperm(points, generator=shuffle)
            table = (order.to(torch.float64) + 0.5) / points
            self._table = table.to(torch.float32).repeat(2).to(device)
        return self._table

    def workspace_bytes(self, numel: int, element_size: int, world_size: int) -> int:
        # kept between steps: the name-ordered copy and the working buffer (4 bytes each per element), the
        # int8 codes and the two messages (~1 byte each per element)
        return numel * (2 * 4 + 3 * 1)

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


def _row(region: int, chunk: int) -> int:
    """Bytes of one destination's message: the region's codes, then its float32 steps."""
    return region + 4 * (region // chunk)


def _encode(x: torch.Tensor, chunk: int, table: torch.Tensor, gen: torch.Generator, work: torch.Tensor,
            codes8: torch.Tensor, codes: torch.Tensor, steps: torch.Tensor, residual: bool = False) -> torch.Tensor:
    """Quantize ``x`` (float32, whole chunks) into ``codes`` (the bytes of int8 codes, shaped as the destinations'
    rows) and ``steps`` (the rows' float32 bytes), through ``codes8`` (int8, as long as ``x``); ``work`` (float32,
    as long as ``x``) receives ``x - q s`` with ``residual``, else serves as scratch. Returns the steps.

    A chunk with a NaN or Inf gets a non-finite step (``amax`` propagates NaN), so it decodes as non-finite.
    """
    blocks = x.view(-1, chunk)
    step = blocks.amax(1)
    # at least the smallest normal float: 1 / step stays finite for a chunk of zeros or of subnormal values
    # (their codes are 0 and decode to 0); NaN stays NaN, and an Inf step has inverse 0
    torch.maximum(step, blocks.amin(1).neg_(), out=step).div_(_LEVELS).clamp_min_(_TINY)
    inverse = torch.reciprocal(step)
    period = table.numel() // 2
    start = int(torch.randint(period, (1,), generator=gen, device=gen.device))
    whole = x.numel() // period * period
    for lo, hi in ((0, whole), (whole, x.numel())):  # the table's periods, then the rest
        if hi > lo:
            rows = (hi - lo) // min(period, hi - lo)
            shape, per_chunk = (rows, -1, chunk), slice(lo // chunk, hi // chunk)
            kernels.int8_encode(x[lo:hi].view(shape), inverse[per_chunk].view(rows, -1, 1),
                                table[start : start + (hi - lo) // rows].view(1, -1, chunk), codes8[lo:hi].view(shape),
                                work[lo:hi].view(shape), step[per_chunk].view(rows, -1, 1), residual)
    codes.view(torch.int8).copy_(codes8.view(codes.shape))
    steps.view(torch.float32).copy_(step.view(steps.shape[0], -1))
    return step


def _split(part: torch.Tensor, region: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One destination's message (:func:`_row` bytes) -> its int8 codes and float32 steps."""
    return part[:region].view(torch.int8), part[region:].view(torch.float32)  # regions are whole 4-byte words


def _pieces(lo: int, hi: int, chunk: int, region: int) -> list[tuple[int, int, int]]:
    """``[lo, hi)`` of the name-ordered layout cut into pieces that are either whole chunks of one region or part
    of one chunk: ``(start, end, first chunk)``, so that each piece takes its steps by one broadcast."""
    pieces, a = [], lo
    while a < hi:
        if a % chunk or hi - a < chunk:
            b = min(hi, (a // chunk + 1) * chunk)
        else:
            b = min(hi // chunk * chunk, (a // region + 1) * region)
        pieces.append((a, b, a // chunk))
        a = b
    return pieces
