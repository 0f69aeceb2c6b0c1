"""int8 and int4: stochastic rounding with one scale per chunk, through a two-phase compressed all-reduce.

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

At 4 bits (``bits=4``, ``compressor="int4"``) the path is the same with step ``s = max|x| / 6.999`` (codes in
[-7, 7]), and two codes share a byte on the wire: byte ``i`` of a region's codes holds ``q + 8`` of element ``i`` in
its low half and of element ``i + region / 2`` in its high half (halves, not neighbours: packing and unpacking then
run over contiguous bytes, ~4x faster than interleaving). That is ``1/2 + 4 / chunk`` bytes per element, against
int8's ``1 + 4 / chunk``: 7.1x fewer bytes than the dense ring at int4's default chunk of 64, 4.0x for int8 at 512.
The noise is the same table and generator, so the result is as unbiased and as bit-identical on every rank; the error
of one rounding is ``127 / 7`` (~18) times int8's at the same chunk (measured 17.6x), which is why int4's default
chunk is smaller (:data:`DEFAULT_CHUNK`; docs/compression.md has the measurement). A non-finite chunk's codes are
whatever the cast makes of NaN: only their low 4 bits are packed, so they never reach another chunk's half-byte.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from lightning_dist.compression import kernels
from lightning_dist.compression.base import BucketLayout, Compressor, Feedback, gather_by_name
from lightning_dist.compression.state import Scratch, StagedGenerator
from lightning_dist.compression.transport import Transport

BITS = (8, 4)  # code widths this codec sends
# max|x| / step, per code width: codes stay within [-127, 127] (8 bits), [-7, 7] (4 bits) with no clamp
_LEVELS = {8: 126.999, 4: 6.999}
# elements per float32 step when chunk=None; at 4 bits measured (docs/compression.md): 64 has 11% less error
# than 128 on an LM's pseudo-gradient for 6% more bytes
DEFAULT_CHUNK = {8: 512, 4: 64}
_TINY = torch.finfo(torch.float32).tiny
_HOST = torch.device("cpu")
_POINTS = 32768  # noise table length (a multiple of the chunk is used: whole chunks per table period)


class Int8Compressor(Compressor):
    """int8 (or, with ``bits=4``, int4) codes with a float32 step per ``chunk`` elements, stochastic rounding
    (seeded per rank), through the two-phase all-reduce.

    Args:
        chunk: elements per float32 step; None: :data:`DEFAULT_CHUNK` for ``bits`` (512 at 8 bits, 64 at 4).
        seed: the rounding noise's seed; each rank draws its own stream from ``(seed, rank)``.
        start_step: optimizer steps sent uncompressed first.
        bits: 8 (``compressor="int8"``) or 4 (``compressor="int4"``: half the bytes, ~18x the rounding error at the
            same chunk).
    """

    name = "int8"  # "int4" on an instance with bits=4
    summable = False
    light = False
    lossy = True
    wants_error_feedback = True

    def __init__(self, chunk: Optional[int] = None, seed: int = 0, start_step: int = 0, bits: int = 8) -> None:
        super().__init__(start_step)
        if isinstance(bits, bool) or not isinstance(bits, int) or bits not in BITS:
            raise ValueError(f"int8 codec bits={bits!r}: the codes are 8 or 4 bits wide; use bits=8 "
                             "(compressor='int8') or bits=4 (compressor='int4')")
        self.bits = bits
        self.name = f"int{bits}"
        default = DEFAULT_CHUNK[bits]
        chunk = default if chunk is None else chunk
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
            raise ValueError(f"{self.name} chunk={chunk!r} must be an int >= 1 (elements per scale; {default} is the "
                             "default)")
        kernels.mode()  # a bad LIGHTNING_DIST_COMPILE is named here, in the launching process
        self.chunk = chunk
        self.rng = StagedGenerator(seed)
        self._scratch = Scratch()
        self._table: Optional[torch.Tensor] = None  # this rank's shuffled noise points, twice over

    def describe(self) -> str:
        return f"{self.name}(chunk={self.chunk})"

    def reduce(self, flat: torch.Tensor, layout: BucketLayout, transport: Transport,
               feedback: Optional[Feedback] = None) -> torch.Tensor:
        n, numel, chunk, bits = transport.world_size, flat.numel(), self.chunk, self.bits
        region = _region(numel, n, chunk, bits)  # elements each rank owns
        width = region * bits // 8  # bytes of one region's codes
        x = self._buffer("x", n * region, flat.device)
        spans = gather_by_name(flat, layout, feedback, x)  # in name order, not DDP's
        # the noise table's offsets come from a CPU generator on every device: reading a draw made on the GPU would
        # wait for every kernel backward has queued (one host sync per rounding, two per bucket)
        gen = self.rng.get(transport.rank, _HOST)
        table = self._noise(transport.rank, flat.device)
        levels = _LEVELS[bits]
        # phase 1: region j of every rank's codes goes to rank j, which sums the N of them in rank order
        message = self._buffer("phase1", n * _row(region, chunk, bits), flat.device, torch.uint8).view(n, -1)
        work = self._buffer("work", n * region, flat.device)
        codes8 = self._buffer("codes", n * region, flat.device, torch.int8)
        steps = _encode(x, chunk, levels, table, gen, work, codes8, residual=feedback is not None)
        _write(codes8, steps, message, width, bits)
        if feedback is not None:  # what this rank owes, x - q s (in `work`), back in the bucket's layout
            offset = 0
            for start, end in spans:
                feedback.keep[start:end].copy_(work[offset : offset + end - start])
                offset += end - start
            feedback.finite = torch.isfinite(steps).all()  # read at the commit, not here (no host sync)
        arrived = transport.all_to_all(message)
        # the N contributions to this rank's region, decoded and summed in rank order (the same on every owner)
        codes = _read(arrived, width, bits, codes8)
        mine = self._buffer("mine", region, flat.device)
        for i in range(n):
            steps_i = arrived[i, width:].view(torch.float32)  # regions are whole 4-byte words
            if i == 0:
                mine.copy_(codes[i])
                mine.view(-1, chunk).mul_(steps_i.view(-1, 1))
            else:
                work[:region].copy_(codes[i])
                mine.view(-1, chunk).addcmul_(work[:region].view(-1, chunk), steps_i.view(-1, 1))
        # phase 2: each owner's re-quantized sum goes to every rank, which decodes it into the bucket's layout
        reply = self._buffer("phase2", _row(region, chunk, bits), flat.device, torch.uint8).view(1, -1)
        _write(codes8[:region], _encode(mine, chunk, levels, table, gen, work[:region], codes8[:region]), reply, width,
               bits)
        everyone = transport.all_gather(reply[0])
        all_steps = torch.cat([part[width:].view(torch.float32) for part in everyone])
        codes = _read(everyone, width, bits, codes8)
        offset = 0
        for start, end in spans:
            for a, b, c in _pieces(offset, offset + end - start, chunk, region):
                out = flat[start + a - offset : start + b - offset]
                row = a // region
                out.copy_(codes[row, a - row * region : b - row * region])
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
        # kept between steps: the name-ordered copy and the working buffer (4 bytes each per element), the int8
        # codes (1 byte per element) and the two messages (int8: ~1 byte each per element; int4: half a byte of
        # codes and 4 / chunk bytes of steps each)
        if self.bits == 8:
            return numel * (2 * 4 + 3 * 1)
        # int4, to the byte: x and work (float32) and the codes (int8) over N regions, the phase-1 message (N rows),
        # the owner's float32 sum and its phase-2 row (the noise table, 256 KiB per compressor, is not per bucket)
        region = _region(numel, world_size, self.chunk, self.bits)
        row = _row(region, self.chunk, self.bits)
        return world_size * region * (2 * 4 + 1) + world_size * row + 4 * region + row

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


def _region(numel: int, world_size: int, chunk: int, bits: int) -> int:
    """Elements each rank owns: whole chunks, enough for ``numel`` over the ranks, and a region whose codes fill whole
    4-byte words (so the float32 steps after them in a message are aligned)."""
    words = 32 // bits  # codes per 4-byte word
    align = words // math.gcd(chunk, words)
    return math.ceil(numel / (world_size * chunk * align)) * chunk * align


def _row(region: int, chunk: int, bits: int = 8) -> int:
    """Bytes of one destination's message: the region's codes (``bits`` each), then its float32 steps."""
    return region * bits // 8 + 4 * (region // chunk)


def _encode(x: torch.Tensor, chunk: int, levels: float, table: torch.Tensor, gen: torch.Generator,
            work: torch.Tensor, codes8: torch.Tensor, residual: bool = False) -> torch.Tensor:
    """Quantize ``x`` (float32, whole chunks) into ``codes8`` (int8, as long as ``x``: codes within
    ``[-levels, levels]`` rounded down) with one step per chunk, ``max|x| / levels``; ``work`` (float32, as long as
    ``x``) receives ``x - q s`` with ``residual``, else serves as scratch. Returns the steps.

    A chunk with a NaN or Inf gets a non-finite step (``amax`` propagates NaN), so it decodes as non-finite (its
    codes are whatever the float-to-int cast makes of NaN: the step alone carries the chunk's state).
    """
    blocks = x.view(-1, chunk)
    step = blocks.amax(1)
    # at least the smallest normal float: 1 / step stays finite for a chunk of zeros or of subnormal values
    # (their codes are 0 and decode to 0); NaN stays NaN, and an Inf step has inverse 0
    torch.maximum(step, blocks.amin(1).neg_(), out=step).div_(levels).clamp_min_(_TINY)
    inverse = torch.reciprocal(step)
    period = table.numel() // 2
    start = int(torch.randint(period, (1,), generator=gen))  # a CPU generator's draw: no wait for the device
    whole = x.numel() // period * period
    for lo, hi in ((0, whole), (whole, x.numel())):  # the table's periods, then the rest
        if hi > lo:
            rows = (hi - lo) // min(period, hi - lo)
            shape, per_chunk = (rows, -1, chunk), slice(lo // chunk, hi // chunk)
            kernels.int8_encode(x[lo:hi].view(shape), inverse[per_chunk].view(rows, -1, 1),
                                table[start : start + (hi - lo) // rows].view(1, -1, chunk), codes8[lo:hi].view(shape),
                                work[lo:hi].view(shape), step[per_chunk].view(rows, -1, 1), residual)
    return step


def _write(codes8: torch.Tensor, step: torch.Tensor, message: torch.Tensor, width: int, bits: int) -> None:
    """Each destination's row of ``message`` (uint8, rows of :func:`_row` bytes): its region's codes in the first
    ``width`` bytes (one per byte at 8 bits; two per byte at 4, ``codes8`` overwritten), then its float32 steps."""
    rows = message.shape[0]
    if bits == 8:  # the codes' own bytes
        message[:, :width].view(torch.int8).copy_(codes8.view(rows, -1))
    else:  # 4 bits: q + 8 in [1, 15]; byte i of a row holds element i (low half) and element i + width (high half)
        halves = codes8.add_(8).view(torch.uint8).view(rows, 2, width)
        packed = message[:, :width]
        torch.bitwise_left_shift(halves[:, 1], 4, out=packed)  # the shift drops all but the high code's 4 bits
        packed.bitwise_or_(halves[:, 0].bitwise_and_(15))  # a non-finite chunk's codes are any byte: keep 4 bits
    message[:, width:].view(torch.float32).copy_(step.view(rows, -1))


def _read(message: torch.Tensor, width: int, bits: int, codes8: torch.Tensor) -> torch.Tensor:
    """The int8 codes of every row of ``message`` (as :func:`_write` wrote them), ``(rows, region)``: a view of the
    message at 8 bits; unpacked into ``codes8`` (int8, ``rows x region``) at 4."""
    rows = message.shape[0]
    if bits == 8:
        return message[:, :width].view(torch.int8)
    packed = message[:, :width]
    halves = codes8.view(torch.uint8).view(rows, 2, width)
    torch.bitwise_and(packed, 15, out=halves[:, 0])
    torch.bitwise_right_shift(packed, 4, out=halves[:, 1])
    return codes8.sub_(8).view(rows, -1)


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
