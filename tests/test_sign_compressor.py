"""The ``sign`` compressor (issue 42) on emulated ranks: what it sends, its two error feedbacks, bit-identical ranks.

No process group: :func:`~lightning_dist.compression.emulate.emulate_reduce` runs N ranks as threads. The reference,
:func:`sign_reduce` (with :class:`SignGroup` carrying its state from one step to the next), writes the codec and both
error feedbacks out from the module's docstring in plain torch; ``tests/test_onebit_adam.py``'s replay runs on it.
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Optional, Sequence

import pytest
import torch

from lightning_dist.compression import BucketLayout, SignCompressor, build_compressor
from lightning_dist.compression.emulate import MirrorTransport, emulate_reduce

LAYOUT = BucketLayout.of([("w", torch.Size([20, 30])), ("b", torch.Size([300]))])  # 900 elements, name order b, w
NAMED = [("w", 600), ("b", 300)]  # the same, for the reference


# -- the reference ----------------------------------------------------------------------------------------------------
def scaled_sign(x: torch.Tensor, chunk: int) -> torch.Tensor:
    """What ``x``'s encoding decodes to: per chunk of ``chunk`` elements, its mean magnitude with each element's sign
    bit (``-0.0`` counts as negative)."""
    blocks = x.view(-1, chunk)
    scale = blocks.abs().mean(1, keepdim=True)
    return torch.where(torch.signbit(blocks), -scale, scale).view(-1)


def sign_reduce(flats: Sequence[torch.Tensor], named: Sequence[tuple[str, int]], chunk: int = 512,
                owed: Optional[Sequence[Optional[torch.Tensor]]] = None,
                server: Optional[Sequence[Optional[torch.Tensor]]] = None, server_feedback: bool = True):
    """N ranks' buckets (``named``: each parameter's name and size, in the bucket's order) through the sign codec.

    Written out from the docstring, not from the code: elements taken in parameter-name order and cut into N regions
    of whole chunks, a region's bits filling whole 4-byte words (so a region is a multiple of ``lcm(chunk, 32)``
    elements), the last ones zero-padded; every rank sends ``x_r = flat_r + owed_r`` scaled-signed (the worker's
    error feedback keeps ``x_r`` minus that); owner ``j`` sums region ``j`` of the N in rank order, zeroes its
    padding, adds what it owed (``server[j]``), scaled-signs the sum for everyone and keeps the sum minus that
    (padding zero; a chunk whose scale is not finite keeps what it owed before). Returns ``result`` (the decoded sum,
    bucket order), ``keep`` (per rank, what it owes now, bucket order) and ``server`` (per owner, its residual)."""
    n, numel = len(flats), flats[0].numel()
    ranges, offset = [], 0
    for name, size in named:
        ranges.append((name, offset, offset + size))
        offset += size
    assert offset == numel, (offset, numel)
    order = [(a, b) for _, a, b in sorted(ranges)]
    unit = math.lcm(chunk, 32)
    region = max(1, math.ceil(numel / (n * unit))) * unit

    def by_name(flat):
        return torch.cat([flat[a:b] for a, b in order] + [torch.zeros(n * region - numel)])

    def by_bucket(x):
        out, at = torch.empty(numel), 0
        for a, b in order:
            out[a:b] = x[at:at + b - a]
            at += b - a
        return out

    xs = [by_name(f if owed is None or owed[r] is None else f + owed[r]) for r, f in enumerate(flats)]
    sent = [scaled_sign(x, chunk) for x in xs]
    keep = [by_bucket(x - s) for x, s in zip(xs, sent, strict=True)]
    decoded, residuals = [], []
    for j in range(n):
        total = sent[0][j * region:(j + 1) * region].clone()
        for r in range(1, n):
            total += sent[r][j * region:(j + 1) * region]
        valid = min(region, max(0, numel - j * region))
        total[valid:] = 0
        before = server[j] if server_feedback and server is not None and server[j] is not None else None
        if before is not None:
            total += before
        reply = scaled_sign(total, chunk)
        decoded.append(reply)
        residual = total - reply
        residual[valid:] = 0
        finite = torch.isfinite(total.view(-1, chunk).abs().mean(1, keepdim=True))
        old = torch.zeros(region) if before is None else before
        residuals.append(torch.where(finite, residual.view(-1, chunk), old.view(-1, chunk)).view(-1)
                         if server_feedback else None)
    return SimpleNamespace(result=by_bucket(torch.cat(decoded)[:numel]), keep=keep, server=residuals)


class SignGroup:
    """N ranks' ``sign`` compressors with both error feedbacks, by the reference: what each rank owes and each
    owner's residual carried from one reduction to the next (every reduction committed)."""

    def __init__(self, named: Sequence[tuple[str, int]], chunk: int = 512) -> None:
        self.named, self.chunk = list(named), chunk
        self.owed: Optional[list] = None
        self.server: Optional[list] = None

    def reduce(self, flats: Sequence[torch.Tensor]) -> torch.Tensor:
        out = sign_reduce(flats, self.named, self.chunk, self.owed, self.server)
        self.owed, self.server = out.keep, out.server
        return out.result


def _name_ordered(flat):
    w, b = flat[:600], flat[600:]
    return torch.cat([b, w])


def test_every_rank_gets_the_same_bits_and_the_reference_sum():
    torch.manual_seed(0)
    chunk, n = 256, 3  # 768 elements: one whole chunk per rank, no padding
    layout = BucketLayout.of([("a", torch.Size([768]))])
    flats = [torch.randn(768) for _ in range(n)]
    compressors = [SignCompressor(chunk=chunk, server_feedback=False) for _ in range(n)]
    results = emulate_reduce(compressors, flats, layout)
    assert all(torch.equal(r, results[0]) for r in results)
    assert torch.equal(results[0], sign_reduce(flats, [("a", 768)], chunk, server_feedback=False).result)
    # by hand for this one case: each owner's region is one chunk, each rank's chunk its mean magnitude and signs
    regions = []
    for i in range(n):
        total = sum(torch.where(f[i * chunk:(i + 1) * chunk] >= 0, 1.0, -1.0) * f[i * chunk:(i + 1) * chunk].abs()
                    .mean() for f in flats)
        regions.append(torch.where(total >= 0, 1.0, -1.0) * total.abs().mean())
    torch.testing.assert_close(results[0], torch.cat(regions), rtol=1e-6, atol=1e-6)


def test_the_workers_feedback_keeps_exactly_what_was_not_sent():
    torch.manual_seed(1)
    flats = [torch.randn(900) for _ in range(2)]
    owed = [torch.randn(900) * 0.1 for _ in range(2)]
    out = emulate_reduce([SignCompressor(chunk=64) for _ in range(2)], flats, LAYOUT, owed=owed)
    expected = sign_reduce(flats, NAMED, 64, owed=owed)
    for r, (result, keep) in enumerate(out):
        assert torch.equal(keep, expected.keep[r]) and torch.equal(result, expected.result), r
        x = _name_ordered(flats[r] + owed[r])
        blocks = torch.nn.functional.pad(x, (0, 2 * 512 - 900)).view(-1, 64)  # regions of whole 32-aligned chunks
        sent = (torch.where(blocks >= 0, 1.0, -1.0) * blocks.abs().mean(1, keepdim=True)).view(-1)[:900]
        torch.testing.assert_close(_name_ordered(keep), x - sent, rtol=0, atol=1e-6)


def test_error_feedback_on_both_sides_sends_everything_in_the_end():
    torch.manual_seed(2)
    flats = [torch.randn(900) for _ in range(3)]
    dense = sum(flats)
    errors = {}
    for server in (True, False):
        compressors = [build_compressor("sign", server_feedback=server) for _ in range(3)]
        total = torch.zeros(900)
        for _ in range(40):
            total += emulate_reduce(compressors, flats, LAYOUT)[0]
            for c in compressors:
                c.commit()
        errors[server] = float((total / 40 - dense).norm() / dense.norm())
    assert errors[True] < 0.25 and errors[True] < errors[False] / 2, errors  # measured 0.18 and 0.43 (chunk 512)


@pytest.mark.parametrize("chunk", (64, 512))
def test_both_error_feedbacks_match_the_reference_bit_for_bit_step_after_step(chunk):
    """Six steps of 3 ranks through ``build_compressor("sign")`` (the workers' and the owners' feedback) against
    :class:`SignGroup`: every rank's result, every rank's residual and every owner's residual, exactly. At chunk 64
    the regions are 320 elements and owner 2 holds 260 (a chunk of 4 and 60 padding); at 512 owner 2 holds none."""
    torch.manual_seed(5)
    compressors = [build_compressor("sign", chunk=chunk) for _ in range(3)]
    reference, plain = SignGroup(NAMED, chunk), SignGroup(NAMED, chunk)
    key = f"{LAYOUT.key}@3"
    for step in range(6):
        flats = [torch.randn(900) * (1 + r) for r in range(3)]
        results = emulate_reduce(compressors, flats, LAYOUT)
        for c in compressors:
            c.commit()
        expected = reference.reduce(flats)
        plain.server = None  # the workers' feedback alone
        without_server = plain.reduce(flats)
        for r, c in enumerate(compressors):
            assert torch.equal(results[r], expected), (step, r)
            state = c.state_dict()
            residual = torch.cat([state["residuals"]["w"], state["residuals"]["b"]])
            assert torch.equal(residual, reference.owed[r]), (step, r)
            owner = state["inner"]["server"].get(key)
            if reference.server[r].abs().sum() > 0:
                assert torch.equal(owner, reference.server[r]), (step, r)
            else:  # a region of padding only: nothing owed
                assert owner is None or not owner.any(), (step, r)
        assert reference.server[0].abs().sum() > 0
        if step:  # what the owners owed changed the result
            assert not torch.equal(expected, without_server), step


def test_a_non_finite_chunk_keeps_the_owners_residual_and_the_others_move_on():
    torch.manual_seed(6)
    compressors = [build_compressor("sign", chunk=64) for _ in range(2)]
    reference = SignGroup(NAMED, 64)
    key = f"{LAYOUT.key}@2"
    for step in range(2):
        flats = [torch.randn(900) for _ in range(2)]
        if step == 1:
            flats[1][610] = float("nan")  # "b"'s element 10: name-ordered element 10, owner 0's first chunk
        results = emulate_reduce(compressors, flats, LAYOUT)
        before = [None if reference.server is None else reference.server[r].clone() for r in range(2)]
        expected = reference.reduce(flats)
        for c in compressors:
            c.commit()
        assert torch.equal(torch.isnan(results[0]), torch.isnan(expected))
        assert torch.equal(results[0][~torch.isnan(expected)], expected[~torch.isnan(expected)])
        for r, c in enumerate(compressors):
            assert torch.equal(c.state_dict()["inner"]["server"][key], reference.server[r]), (step, r)
    assert torch.equal(reference.server[0][:64], before[0][:64])  # the NaN chunk: what it owed before
    assert not torch.equal(reference.server[0][64:128], before[0][64:128])  # the next one moved on


def test_a_skipped_step_leaves_the_owners_residual_and_a_resume_restores_it():
    torch.manual_seed(3)
    flats = [torch.randn(900) for _ in range(2)]
    compressors = [SignCompressor() for _ in range(2)]
    emulate_reduce(compressors, flats, LAYOUT)
    for c in compressors:
        c.commit()
    saved = [c.state_dict() for c in compressors]
    assert any(v.abs().sum() > 0 for v in saved[0]["server"].values())
    emulate_reduce(compressors, flats, LAYOUT)
    for c in compressors:
        c.discard()  # the ranks skipped this step
    after_skip = emulate_reduce(compressors, flats, LAYOUT)[0]
    restored = [SignCompressor() for _ in range(2)]
    for c, state in zip(restored, saved, strict=True):
        c.load_state_dict(state)
    assert torch.equal(emulate_reduce(restored, flats, LAYOUT)[0], after_skip)
    fresh = [SignCompressor() for _ in range(2)]
    for c, state in zip(fresh, saved, strict=True):
        c.load_state_dict(state, shared_only=True)  # another world size: the owners' residuals restart at zero
    assert fresh[0].state_dict()["server"] == {}


def test_a_non_finite_value_reaches_every_rank_and_no_residual():
    flats = [torch.randn(900) for _ in range(2)]
    flats[1][7] = float("nan")
    compressors = [SignCompressor() for _ in range(2)]
    results = emulate_reduce(compressors, flats, LAYOUT)
    assert all(torch.isnan(r).any() for r in results)
    assert torch.equal(torch.isnan(results[0]), torch.isnan(results[1]))
    for c in compressors:
        c.commit()
        assert all(torch.isfinite(v).all() for v in c.state_dict()["server"].values())


def test_bytes_per_element_are_an_eighth_and_a_scale_per_chunk():
    transport = MirrorTransport(world_size=4)
    numel = 4 * 1024 * 256
    sent = []
    to_all, gather = transport.all_to_all, transport.all_gather
    transport.all_to_all = lambda t: sent.append(t.numel() * t.element_size() * 3 / 4) or to_all(t)
    transport.all_gather = lambda t: sent.append(t.numel() * t.element_size() * 3) or gather(t)
    SignCompressor().reduce(torch.randn(numel), BucketLayout.single(numel), transport)
    # both phases send 3 of 4 regions' bits and scales: 2 (N - 1) / N x (1/8 + 4/512) bytes per element
    dense = 2 * 3 / 4 * 4 * numel
    assert sum(sent) == pytest.approx(2 * 3 / 4 * (1 / 8 + 4 / 512) * numel, rel=1e-3)
    assert dense / sum(sent) == pytest.approx(30.12, rel=1e-3)


@pytest.mark.parametrize("chunk", (0, 12, True, 2.0))
def test_a_bad_chunk_names_the_fix(chunk):
    with pytest.raises(ValueError, match="a multiple of 8"):
        SignCompressor(chunk=chunk)


def test_the_registry_builds_it_with_error_feedback():
    assert build_compressor("sign").describe() == "sign(chunk=512)+ef"
    assert build_compressor("sign", error_feedback=False, server_feedback=False).describe() == \
        "sign(chunk=512, server_feedback=False)"


def test_packing_by_words_writes_the_bytes_the_shifts_write_and_decoding_inverts_it(monkeypatch):
    from lightning_dist.compression import sign
    torch.manual_seed(4)
    rows, chunk, width = 3, 64, 16  # regions of 128 elements: two chunks each
    x = torch.randn(rows * 8 * width)
    x[:9] = torch.tensor([0.0, -0.0, 1.0, -1.0, float("inf"), -float("inf"), 0.5, -0.5, 2.0])
    by_words = torch.empty(rows * sign._row(8 * width, chunk), dtype=torch.uint8)
    by_shifts = torch.empty_like(by_words)
    sign._encode(x, chunk, by_words, rows, width)
    monkeypatch.setattr(sign, "_PACK_BY_WORDS", False)  # a big-endian machine's path
    sign._encode(x, chunk, by_shifts, rows, width)
    assert torch.equal(by_words, by_shifts)
    decoded = sign._decode(by_words.view(rows, -1), width, chunk, torch.empty(rows, 8 * width))
    assert torch.equal(torch.sign(decoded).view(-1), torch.where(torch.signbit(x), -1.0, 1.0))  # -0.0 is negative
