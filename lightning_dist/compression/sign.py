"""sign: one bit per element and a float32 scale per chunk, through int8's two-phase compressed all-reduce.

Encoding a chunk of ``chunk`` elements: ``s = mean |x|`` (the scale that minimises ``||x - s sign(x)||``), and one bit
per element, its sign bit; it decodes to ``-s`` where the bit is set (``-0.0`` included), else ``s``. This is the
scaled sign of 1-bit SGD (Seide et al., 2014) and of DeepSpeed's 1-bit Adam (Tang et al., arXiv 2102.02888). A chunk
holding a NaN or Inf gets a non-finite scale and decodes as non-finite on every rank.

The bucket travels as int8's does (:mod:`lightning_dist.compression.int8`): cut into N regions, one per rank;

1. every rank encodes its bucket (plus what it owes: the *worker's* error feedback, :class:`ErrorFeedback`, on by
   default) and sends region ``j``'s bits and scales to rank ``j`` (an all-to-all);
2. each owner decodes the N contributions, sums them in rank order, adds what it still owes from earlier steps on
   this region (the *server's* error feedback, this compressor's own state, staged and committed like every
   compressor's), encodes the sum afresh, keeps the new error, and sends it to every rank (an all-gather); every rank
   decodes the same bytes, so the result is bit-identical everywhere.

Each rank sends ``2 (N - 1) / N`` of the bucket at ``1/8 + 4 / chunk`` bytes per element, against the dense ring's
``2 (N - 1) / N x 4``: 30.1x fewer bytes at the default chunk of 512 (28.4x at 256; on the LM of docs/onebit-adam.md
the two lose the same within noise under OneBitAdam). The error of one encoding is large
(every element becomes its chunk's mean magnitude): without error feedback on both sides the sum drifts, with it every
value is sent in the end. It suits a signal that error feedback can carry, such as Adam's momentum under
:class:`~lightning_dist.sync.OneBitAdam`; on raw gradients it is a per-step compressor like the others.

The server's residual is kept per bucket layout and region, so it survives a resume at the same world size (a resume
at another size, or a bucket laid out anew, starts it from zero). Elements are taken in parameter-name order, as int8
takes them, so chunks do not depend on the order DDP lays a bucket out in.
"""

from __future__ import annotations

import math
import sys
from typing import Any, Optional

import torch

from lightning_dist.compression.base import BucketLayout, Compressor, Feedback, gather_by_name
from lightning_dist.compression.state import Scratch
from lightning_dist.compression.transport import Transport

DEFAULT_CHUNK = 512
# Bit i of a byte holds element i of its 8: set when its sign bit is (a negative value, -0.0 included: it decodes to
# -s, as copysign would give it). Packing: the 8 bytes (0 or 1) of 8 elements read as one little-endian int64 hold
# element i at bit 8 i; times _GATHER (the sum of 2 ** (56 - 7 i)) puts it at bit 56 + i with no carries, and the
# top byte is the packed byte. Unpacking: a table of the 256 bytes' 8 signs.
_GATHER = 0x0102040810204080
_PACK_BY_WORDS = sys.byteorder == "little"
_SHIFTS = torch.arange(8, dtype=torch.uint8)
_SIGNS = torch.tensor([[-1.0 if byte >> i & 1 else 1.0 for i in range(8)] for byte in range(256)])
_SIGNS_ON: dict[torch.device, torch.Tensor] = {}


class SignCompressor(Compressor):
    """One bit per element and a float32 scale (mean magnitude) per ``chunk`` elements, through the two-phase
    all-reduce, with the owners' error feedback.

    Args:
        chunk: elements per scale, a multiple of 8 (default 512: ``1/8 + 4/512`` bytes per element).
        server_feedback: keep what each owner's re-encoding of the sum lost, and add it to the next sum (default
            True; the workers' own error feedback is :class:`ErrorFeedback`'s, on by default from the registry).
        start_step: optimizer steps sent uncompressed first.
    """

    name = "sign"
    summable = False
    light = False
    lossy = True
    wants_error_feedback = True

    def __init__(self, chunk: int = DEFAULT_CHUNK, server_feedback: bool = True, start_step: int = 0) -> None:
        super().__init__(start_step)
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 8 or chunk % 8:
            raise ValueError(f"sign chunk={chunk!r} must be a multiple of 8 (elements per scale; "
                             f"{DEFAULT_CHUNK} is the default)")
        if not isinstance(server_feedback, bool):
            raise ValueError(f"sign server_feedback={server_feedback!r} must be true or false")
        self.chunk = chunk
        self.server_feedback = server_feedback
        self._server: dict[str, torch.Tensor] = {}  # layout key -> this rank's region's residual (committed)
        self._staged: dict[str, torch.Tensor] = {}
        self._scratch = Scratch()

    def describe(self) -> str:
        return f"sign(chunk={self.chunk}{'' if self.server_feedback else ', server_feedback=False'})"

    def reduce(self, flat: torch.Tensor, layout: BucketLayout, transport: Transport,
               feedback: Optional[Feedback] = None) -> torch.Tensor:
        n, numel, chunk = transport.world_size, flat.numel(), self.chunk
        region = _region(numel, n, chunk)
        width = region // 8  # bytes of one region's bits
        x = self._scratch.get("x", n * region, torch.float32, flat.device)
        spans = gather_by_name(flat, layout, feedback, x)  # in name order, not DDP's
        # phase 1: region j of every rank's bits and scales goes to rank j
        message = self._scratch.get("phase1", n * _row(region, chunk), torch.uint8, flat.device).view(n, -1)
        scales = _encode(x, chunk, message.view(-1), n, width)
        if feedback is not None:  # what this rank owes: x - s sign(x), back in the bucket's layout
            offset = 0
            decoded = _sent(x, chunk, scales, self._scratch.get("decoded", n * region, torch.float32, flat.device))
            for start, end in spans:
                torch.sub(x[offset: offset + end - start], decoded.view(-1)[offset: offset + end - start],
                          out=feedback.keep[start:end])
                offset += end - start
        arrived = transport.all_to_all(message)
        contributions = _decode(arrived, width, chunk,
                                self._scratch.get("arrived", n * region, torch.float32, flat.device).view(n, -1))
        mine = self._scratch.get("mine", region, torch.float32, flat.device)
        mine.copy_(contributions[0])
        for i in range(1, n):
            mine.add_(contributions[i])
        valid = max(0, min(region, numel - transport.rank * region))  # the rest of the region is padding
        mine[valid:].zero_()
        key = f"{layout.key}@{n}"
        owed_here = self._server.get(key) if self.server_feedback else None
        if owed_here is not None:
            mine.add_(owed_here.to(mine.device))
        # phase 2: the owner's re-encoded sum goes to every rank
        reply = self._scratch.get("phase2", _row(region, chunk), torch.uint8, flat.device)
        scales = _encode(mine, chunk, reply, 1, width)
        if self.server_feedback:
            residual = mine - _sent(mine, chunk, scales, self._scratch.get("sent", region, torch.float32, mine.device))
            residual[valid:].zero_()
            # a non-finite chunk (its scale is: a finite scale means finite values) never reaches the residual: it
            # keeps what it owed before (without a host sync)
            before = owed_here if owed_here is not None else torch.zeros_like(residual)
            self._staged[key] = torch.where(torch.isfinite(scales).view(-1, 1), residual.view(-1, chunk),
                                            before.to(residual.device).view(-1, chunk)).view(-1)
        everyone = transport.all_gather(reply)
        result = _decode(everyone, width, chunk, self._scratch.get("result", n * region, torch.float32,
                                                                     flat.device).view(n, -1)).view(-1)
        offset = 0
        for start, end in spans:
            flat[start:end].copy_(result[offset: offset + end - start])
            offset += end - start
        return flat

    def state_bytes(self, layout: BucketLayout, element_size: int) -> int:
        # the owner's residual, committed and staged: a region's worth at most per bucket (counted at the whole
        # bucket, the bound at one rank)
        return 2 * 4 * layout.numel if self.server_feedback else 0

    def workspace_bytes(self, numel: int, element_size: int, world_size: int) -> int:
        region = _region(numel, world_size, self.chunk)
        # x and four float32 decodes of N regions, the owner's sum, the two messages
        return world_size * region * 4 * 5 + 4 * region + (world_size + 1) * _row(region, self.chunk)

    def commit(self) -> None:
        super().commit()
        self._server.update(self._staged)
        self._staged = {}

    def discard(self) -> None:
        self._staged = {}

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "server": {k: v.detach().cpu().clone() for k, v in self._server.items()}}

    def load_state_dict(self, state: dict[str, Any], shared_only: bool = False) -> None:
        super().load_state_dict(state, shared_only)
        self._staged = {}
        self._server = {} if shared_only else {k: v.clone() for k, v in state.get("server", {}).items()}


def _region(numel: int, world_size: int, chunk: int) -> int:
    """Elements each rank owns: whole chunks, enough for ``numel`` over the ranks, whose bits fill whole 4-byte words
    (so the float32 scales after them in a message are aligned)."""
    align = 32 // math.gcd(chunk, 32)
    return math.ceil(max(numel, 1) / (world_size * chunk * align)) * chunk * align


def _row(region: int, chunk: int) -> int:
    """Bytes of one destination's message: the region's bits, then its float32 scales."""
    return region // 8 + 4 * (region // chunk)


def _encode(x: torch.Tensor, chunk: int, out: torch.Tensor, rows: int, width: int) -> torch.Tensor:
    """``x`` (``rows`` regions) into ``out`` (uint8, ``rows`` messages of :func:`_row` bytes): each region's bits, then
    its chunks' scales (``mean |x|``; NaN for a chunk with a NaN, Inf for one with an Inf). Returns the scales."""
    scales = x.view(-1, chunk).abs().mean(1)
    message = out.view(rows, -1)
    if _PACK_BY_WORDS:  # one multiply per 8 elements (int64 overflow wraps; only the top byte is kept)
        words = torch.signbit(x).view(torch.uint8).view(torch.int64).view(rows, width)
        message[:, :width].copy_(words.mul(_GATHER).bitwise_right_shift_(56))
    else:
        bits = torch.signbit(x).view(rows, width, 8).to(torch.uint8)
        torch.sum(bits << _SHIFTS.to(x.device), dim=2, dtype=torch.uint8, out=message[:, :width])
    message[:, width:].view(torch.float32).copy_(scales.view(rows, -1))
    return scales


def _sent(x: torch.Tensor, chunk: int, scales: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """What :func:`_decode` makes of ``x``'s encoding, from ``x`` and its ``scales`` without unpacking bits: ``+-s``
    with ``x``'s sign bit."""
    torch.copysign(scales.view(-1, 1).expand(-1, chunk), x.view(-1, chunk), out=out.view(-1, chunk))
    return out


def _decode(message: torch.Tensor, width: int, chunk: int, out: torch.Tensor) -> torch.Tensor:
    """Every row of ``message`` (as :func:`_encode` wrote them) into ``out`` (float32, ``rows x region``): ``+-s``."""
    rows = message.shape[0]
    signs = _SIGNS_ON.get(out.device)
    if signs is None:
        signs = _SIGNS_ON.setdefault(out.device, _SIGNS.to(out.device))
    torch.index_select(signs, 0, message[:, :width].reshape(-1).to(torch.int64), out=out.view(-1, 8))
    scales = message[:, width:].contiguous().view(torch.float32)
    out.view(rows, -1, chunk).mul_(scales.view(rows, -1, 1))
    return out
