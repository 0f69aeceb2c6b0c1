"""OneBitAdam's settings, its schedule and one compressed update, without a process group (issue 42); the references
``tests/test_onebit_adam.py``'s replay runs on for the refresh's ``int4`` (:class:`Int4Reference`) and the two-tier
split (:func:`host_parts`), each checked bit for bit against the product here."""

from __future__ import annotations

import math
from typing import Sequence

import pytest
import torch

from lightning_dist import RingDDPStrategy
from lightning_dist.comm import CommStats
from lightning_dist.compression import BucketLayout, NoCompressor, build_compressor
from lightning_dist.compression.emulate import emulate_reduce
from lightning_dist.strategy.tiers import GradientGroups
from lightning_dist.sync import OneBitAdam, SyncContext, as_sync
from lightning_dist.sync.onebit_adam import OneBitAdamDriver
from lightning_dist.sync.onebit_settings import COMPRESSED, REFRESH, WARMUP, phase


def test_the_schedule_warm_up_then_a_refresh_every_r_steps():
    phases = [phase(i, 3, 4) for i in range(13)]
    assert phases[:3] == [WARMUP] * 3
    assert [i for i, p in enumerate(phases) if p == REFRESH] == [7, 11]
    assert phase(100, 3, 0) == COMPRESSED  # refresh=0: never


@pytest.mark.parametrize("settings,match", [
    ({"warmup": -1}, r"warmup=-1\): the dense Adam steps first"),
    ({"warmup": 1.0}, r"a fraction in \[0, 1\)"),
    ({"warmup": True}, "an int >= 0"),
    ({"refresh": -5}, r"refresh=-5\)"),
    ({"bound": 0}, r"bound=0\): the largest update"),
    ({"compressor": "sign9"}, r"compressor='sign9' is unknown.*sync.compressor=int4"),
    ({"refresh_compressor": "int9"}, r"refresh_compressor=.*unknown.*sync.refresh_compressor=none"),
])
def test_bad_settings_name_the_fix(settings, match):
    with pytest.raises(ValueError, match=match):
        OneBitAdam(**settings)


def test_a_per_step_compressor_beside_it_is_refused_before_any_process():
    with pytest.raises(ValueError, match=r"OneBitAdam\(compressor='topk'\).*drop compressor="):
        RingDDPStrategy(sync=OneBitAdam(), compressor="topk")


def test_as_sync_takes_its_name_and_a_dict():
    assert isinstance(as_sync("onebit_adam"), OneBitAdam)
    made = as_sync({"name": "onebit_adam", "warmup": 20, "compressor": "int4", "bound": None})
    assert made.describe() == ("OneBitAdam(warmup=20, compressor=int4(chunk=64)+ef, refresh=25, "
                               "refresh_compressor=int4(chunk=64), bound=None)")
    with pytest.raises(ValueError, match=r"OneBitAdam has no setting\(s\) \['every'\]"):
        as_sync({"name": "onebit_adam", "every": 5})


def _driver(model, compressor="none", bound=4.5, state=None):
    """A driver of one rank (no group, no trainer), bound to ``model``; ``state``: a resume's."""
    context = SyncContext(rank=0, world_size=1, module=model, topology=None, algorithm="auto", timeout=None,
                          stats=CommStats(), reduction=lambda: GradientGroups(None, None, 1, False, []))
    driver = OneBitAdamDriver(OneBitAdam(warmup=1, compressor=compressor, bound=bound), context)
    driver.load_state_dict(state)
    return driver


def test_a_resume_at_another_world_size_restarts_the_residuals_and_keeps_the_rest():
    model = torch.nn.Linear(4, 4)
    saved = _driver(model, compressor="sign")
    saved.compressor.residuals.stage("weight", torch.ones(16))
    saved.compressor.commit()
    saved.compressed_steps, saved.refreshes, saved.adam.variance_updates = 7, 2, {"weight": 3, "bias": 3}
    entry = saved.state_dict()
    assert torch.equal(entry["ranks"][0]["residuals"]["weight"], torch.ones(16))
    same = _driver(model, compressor="sign", state=entry)
    assert torch.equal(same.compressor.residuals.get("weight"), torch.ones(16))
    elastic = _driver(model, compressor="sign", state={**entry, "world_size": 4, "ranks": [
        None, entry["ranks"][0], None, None]})
    assert elastic.compressor.residuals.get("weight") is None  # each rank's debt on its own cut: restarts at zero
    assert (elastic.compressed_steps, elastic.refreshes) == (7, 2)
    assert elastic.adam.variance_updates == {"weight": 3, "bias": 3}
    with pytest.raises(ValueError, match="resume with the same OneBitAdam settings"):
        _driver(model, compressor="int8", state=entry)


def test_a_compressed_update_is_adam_with_v_frozen_masked_and_bounded():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.01)
    # one dense step that leaves weight column 0 with v == 0 (its inputs are 0): masked afterwards
    x = torch.randn(8, 4)
    x[:, 0] = 0
    model(x).square().sum().backward()
    opt.step()
    driver = _driver(model, bound=1.5)
    driver.adam.adam_stepped(opt)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    m_before = {name: opt.state[p]["exp_avg"].clone() for name, p in model.named_parameters()}
    model.zero_grad()
    model(torch.randn(8, 4)).square().sum().backward()  # column 0 now has a gradient: the mask ignores it
    driver._compressed_update(opt)
    (beta1, beta2), lr, eps, wd = opt.param_groups[0]["betas"], 0.1, opt.param_groups[0]["eps"], 0.01
    for name, p in model.named_parameters():
        state = opt.state[p]
        v = state["exp_avg_sq"]
        d = v.sqrt() / math.sqrt(1 - beta2) + eps
        mask = v > 0
        m = (beta1 * m_before[name] + (1 - beta1) * p.grad) * mask
        update = (m / d / (1 - beta1 ** 2)).clamp(-1.5, 1.5)
        torch.testing.assert_close(p.detach(), before[name] * (1 - lr * wd) - lr * update)
        torch.testing.assert_close(state["exp_avg"], m)
        assert int(state["step"]) == 2
    weight = dict(model.named_parameters())["weight"]
    assert not (opt.state[weight]["exp_avg_sq"][:, 0] > 0).any() and (opt.state[weight]["exp_avg"][:, 0] == 0).all()
    assert driver.compressed_steps == 1 and driver.metrics["sync/compressed"] == 1.0


def test_the_frozen_denominator_is_bias_corrected_by_vs_updates_not_adams_step_count():
    """Compressed steps advance Adam's step but not v: d = sqrt(v / (1 - beta2^k)) + eps with k = warm-up steps plus
    refreshes (Adam's count t would make every compressed step sqrt((1 - beta2^t) / (1 - beta2^k)) times Adam's)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, betas=(0.9, 0.999))
    driver = _driver(model)

    def adam_step() -> None:  # a warm-up step or a refresh: Adam's own, counted
        model.zero_grad()
        model(torch.randn(8, 4)).square().sum().backward()
        before = driver.adam.step_counts(opt)
        opt.step()
        driver.adam.adam_stepped(opt, before)

    adam_step(), adam_step()
    for _ in range(5):
        model.zero_grad()
        model(torch.randn(8, 4)).square().sum().backward()
        driver._compressed_update(opt)
    adam_step()  # a refresh at Adam's step 8: v's third update
    assert driver.adam.variance_updates == {"weight": 3, "bias": 3}
    assert all(int(opt.state[p]["step"]) == 8 for p in model.parameters())
    (ds, _), = driver.adam.frozen(opt)[0]
    beta2, eps = 0.999, opt.param_groups[0]["eps"]
    for d, p in zip(ds, model.parameters(), strict=True):
        torch.testing.assert_close(d, opt.state[p]["exp_avg_sq"].sqrt() / math.sqrt(1 - beta2 ** 3) + eps)
    resumed = _driver(model, state=driver.state_dict())
    assert resumed.adam.variance_updates == {"weight": 3, "bias": 3}
    old = {k: v for k, v in driver.state_dict().items() if k != "variance_updates"}
    old["variance_step"] = {"weight": 8, "bias": 8}  # an older checkpoint: Adam's step of v's last update, capped
    # by the warm-up (warmup=1) plus the refreshes
    older = _driver(model, state={**old, "refreshes": 1})
    assert older.adam.variance_updates == {"weight": 2, "bias": 2}


def test_an_optimizer_other_than_adam_is_refused():
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="return torch.optim.Adam or AdamW"):
        _driver(model).adam.check(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match=r"Adam\(amsgrad=True\).*set amsgrad=False"):
        _driver(model).adam.check(torch.optim.Adam(model.parameters(), amsgrad=True))


def test_memory_counts_denominators_masks_buckets_and_residuals():
    model = torch.nn.Linear(10, 10)  # 110 parameters
    assert _driver(model).report().memory == {"cpu": 110 * (2 * 4 + 1)}  # beside the model, on its device
    assert _driver(model, compressor="sign").report().memory_bytes == 110 * 9 + 110 * 4 * 2 + 110 * 4 * 2
    assert _driver(model).refresh_compressor.describe() == "int4(chunk=64)"
    assert not isinstance(_driver(model).compressor, type(None)) and isinstance(_driver(model).compressor, NoCompressor)


# -- the references of the replay (tests/test_onebit_adam.py) --------------------------------------------------------
INT4_CHUNK, INT4_LEVELS, NOISE_POINTS = 64, 6.999, 32768
# the module's toy model (16 -> 32 -> 5) in its bucket's order: the shapes the replay reduces
TOY = [("net.0.weight", (32, 16)), ("net.0.bias", (32,)), ("net.2.weight", (5, 32)), ("net.2.bias", (5,))]


class Int4Reference:
    """One rank's ``int4`` codec without error feedback (the refresh's), written out from
    :mod:`lightning_dist.compression.int8`'s docstring: per chunk of 64 elements a step ``s = max|x| / 6.999`` (at
    least the smallest normal float) and codes ``floor(x / s + u)``, with ``u`` read from this rank's table of the
    ``P`` points ``(j + 1/2) / P`` shuffled from ``(seed, rank)``, from an offset drawn from the rank's generator at
    each rounding. The seeds are the codec's (``seed * 1_000_003 + rank``; the table's ``+ 7_919``): they fix which
    noise a rounding reads, so an exact replay needs them. ``x / s`` is ``x`` times the reciprocal of ``s``, added to
    ``u`` in one fused multiply-add (``torch.addcmul``), as the codec computes it: a floor right at an integer
    would otherwise differ."""

    def __init__(self, rank: int, seed: int = 0) -> None:
        shuffle = torch.Generator().manual_seed(seed * 1_000_003 + rank + 7_919)
        points = (torch.randperm(NOISE_POINTS, generator=shuffle).to(torch.float64) + 0.5) / NOISE_POINTS
        self.table = points.to(torch.float32).repeat(2)
        self.gen = torch.Generator().manual_seed(seed * 1_000_003 + rank)

    def round(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (whole chunks) as its codes decode: ``q s``."""
        assert x.numel() <= NOISE_POINTS  # one read of the table (longer buckets wrap around it)
        start = int(torch.randint(NOISE_POINTS, (1,), generator=self.gen))
        blocks = x.view(-1, INT4_CHUNK)
        step = (blocks.abs().amax(1, keepdim=True) / INT4_LEVELS).clamp_min(torch.finfo(torch.float32).tiny)
        noise = self.table[start:start + x.numel()].view(-1, INT4_CHUNK)
        codes = torch.floor(torch.addcmul(noise, blocks, torch.reciprocal(step)))
        assert codes.abs().max() <= 7  # 4 bits
        return codes, step


def int4_reduce(codecs: Sequence[Int4Reference], flats: Sequence[torch.Tensor],
                named: Sequence[tuple[str, int]]) -> torch.Tensor:
    """N ranks' buckets summed through ``int4``'s two phases (the docstring): elements in parameter-name order, cut
    into N regions of whole chunks, zero-padded; rank ``r`` rounds its whole bucket; owner ``j`` decodes region ``j``
    of the N, sums them in rank order (``q_0 s_0``, then ``+ q_r s_r`` fused), and rounds the sum afresh with its own
    next draw; every rank decodes the owners' sums. Returns the result in the bucket's order."""
    n, numel = len(flats), flats[0].numel()
    ranges, offset = [], 0
    for name, size in named:
        ranges.append((name, offset, offset + size))
        offset += size
    order = [(a, b) for _, a, b in sorted(ranges)]
    unit = math.lcm(INT4_CHUNK, 8)  # whole chunks whose codes fill whole 4-byte words
    region = math.ceil(numel / (n * unit)) * unit
    rounded = [codec.round(torch.cat([f[a:b] for a, b in order] + [torch.zeros(n * region - numel)]))
               for codec, f in zip(codecs, flats, strict=True)]
    per_chunk = region // INT4_CHUNK
    sums = []
    for j in range(n):
        rows = slice(j * per_chunk, (j + 1) * per_chunk)
        total = rounded[0][0][rows] * rounded[0][1][rows]
        for codes, step in rounded[1:]:
            total = torch.addcmul(total, codes[rows], step[rows])
        codes, step = codecs[j].round(total.view(-1))
        sums.append((codes * step).view(-1))
    decoded, out, at = torch.cat(sums), torch.empty(numel), 0
    for a, b in order:
        out[a:b] = decoded[at:at + b - a]
        at += b - a
    return out


def host_parts(named: Sequence[tuple[str, Sequence[int]]], parts: int) -> list[list[tuple[str, int, int]]]:
    """A bucket (``named``: each parameter's name and shape, in the bucket's order) cut into a host's ``parts``: slice
    ``i`` of every parameter, in the bucket's order, makes part ``i``, named ``name#i/parts``. A parameter of at least
    ``parts`` rows is cut between rows, a smaller one between elements, the first slices one row (element) larger
    where they do not divide evenly; empty slices are left out. Per part, ``(piece name, start, end)`` in the
    bucket."""
    out: list[list[tuple[str, int, int]]] = [[] for _ in range(parts)]
    offset = 0
    for name, shape in named:
        numel = math.prod(shape)
        rows, row = (shape[0], numel // shape[0]) if len(shape) and shape[0] >= parts else (numel, 1)
        base, extra = divmod(rows, parts)
        at = 0
        for i in range(parts):
            take = base + (i < extra)
            if take:
                out[i].append((f"{name}#{i}/{parts}", offset + at * row, offset + (at + take) * row))
            at += take
        offset += numel
    return out


def test_the_int4_reference_is_the_refresh_codec_bit_for_bit():
    """Three reductions of 2 ranks (709 elements: regions of 384, owner 1's 325 of them, a chunk of 5 and 59
    padding) and of 3 ranks, through the refresh's ``int4`` (no error feedback) and :func:`int4_reduce`: the same
    bits, every rank."""
    torch.manual_seed(7)
    named = [(name, math.prod(shape)) for name, shape in TOY]
    layout = BucketLayout.of([(name, torch.Size(shape)) for name, shape in TOY])
    for n in (2, 3):
        codecs = [build_compressor("int4", error_feedback=False) for _ in range(n)]
        references = [Int4Reference(r) for r in range(n)]
        for _ in range(3):
            flats = [torch.randn(709) * 0.01 * (r + 1) for r in range(n)]
            results = emulate_reduce(codecs, flats, layout)
            for c in codecs:
                c.commit()
            expected = int4_reduce(references, flats, named)
            assert all(torch.equal(r, expected) for r in results), n
            assert not torch.equal(expected, sum(flats))  # rounded, not the dense sum


@pytest.mark.parametrize("parts", (2, 3))
def test_the_two_tier_split_reference_is_the_buckets_split(parts):
    named = [*TOY, ("tiny", (1,)), ("flat", (7,))]
    layout = BucketLayout.of([(name, torch.Size(shape)) for name, shape in named])
    expected = host_parts(named, parts)
    split = layout.split(parts)
    assert len(split) == parts
    for i, (part, spans) in enumerate(split):
        assert [(name, a, b) for name, (a, b) in zip(part.names, spans, strict=True)] == expected[i], i
        assert len(part.names) == len(spans)
    if parts == 2:  # net.2.weight's 5 rows: 3 and 2 of them (not 80 and 80 elements)
        assert ("net.2.weight#0/2", 544, 640) in expected[0] and ("tiny#0/2", 709, 710) in expected[0]
        assert all(not name.startswith("tiny") for name, _, _ in expected[1])
