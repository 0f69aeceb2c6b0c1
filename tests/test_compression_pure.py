"""Compressors without a process group: N ranks emulated in threads (lightning_dist.compression.emulate)."""

from __future__ import annotations

import io
import math

import pytest
import torch

from lightning_dist.compression import (
    COMPRESSORS,
    BucketLayout,
    ErrorFeedback,
    Int8Compressor,
    NoCompressor,
    as_compressor,
    build_compressor,
    kernels,
    sparse,
)
from lightning_dist.compression.emulate import MirrorTransport, emulate_reduce
from lightning_dist.compression.sparse import SMALL, largest
from lightning_dist.strategy import RingDDPStrategy
from lightning_dist.strategy.checkpoint import restore_compressor

LAYOUT = BucketLayout.of([("fc.weight", torch.Size([48, 40])), ("fc.bias", torch.Size([48])),
                          ("conv.weight", torch.Size([8, 4, 3, 3])), ("head.weight", torch.Size([10, 48]))])
LOSSY = [name for name in COMPRESSORS if name != "none"]


def _grads(world_size, seed=0, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return [scale * torch.randn(LAYOUT.numel, generator=gen) for _ in range(world_size)]


def _ranks(name, world_size, **kwargs):
    return [build_compressor(name, **kwargs) for _ in range(world_size)]


def _step(compressors, flats):
    out = emulate_reduce(compressors, flats, LAYOUT)
    for c in compressors:
        c.commit()
    return out


# ---- round trips: error bounds ----------------------------------------------------------------------------

@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_every_compressor_gives_every_rank_the_same_bits(world_size):
    flats = _grads(world_size)
    for name in COMPRESSORS:
        out = _step(_ranks(name, world_size), flats)
        assert all(torch.equal(out[0], o) for o in out), name


def test_none_is_exact_and_casts_are_within_their_rounding():
    flats = _grads(2)
    dense = flats[0] + flats[1]
    assert torch.equal(_step(_ranks("none", 2), flats)[0], dense)
    for name, bits in (("fp16", 11), ("bf16", 8)):
        out = _step(_ranks(name, 2), flats)[0]
        # each rank's cast and the sum are each within half an ulp: 3 roundings of 2^-bits relative
        bound = 3 * 2.0 ** -bits * (flats[0].abs() + flats[1].abs())
        assert ((out - dense).abs() <= bound).all(), name


def test_int8_error_is_within_one_step_per_rounding():
    flats = _grads(3)
    dense = sum(flats)
    out = _step(_ranks("int8", 3, error_feedback=False, chunk=64), flats)[0]
    # each rank's codes are within one step (max|chunk| / 127) of its values; the owner's re-quantization of
    # the sum within one step of the sum
    step = lambda x: x.view(-1, 64).abs().amax(1).repeat_interleave(64) / 126.999  # noqa: E731
    padded = lambda x: torch.nn.functional.pad(x, (0, -x.numel() % (3 * 64)))  # noqa: E731
    bound = sum(step(padded(f)) for f in flats) + step(padded(dense)) * 1.001 + 1e-6
    assert ((padded(out) - padded(dense)).abs() <= bound).all()
    ratio = (out - dense).norm() / dense.norm()
    assert 0 < ratio < 0.05


def test_int8_codes_chunks_of_zeros_and_of_subnormal_values_as_zeros():
    # 1 / (max|x| / 127) overflows for subnormal values: such a chunk must code as zeros, its residual finite
    layout = BucketLayout.single(3 * 64)
    flat = torch.randn(3 * 64) * 1e-2
    flat[:64] = 0.0
    flat[64:128] = torch.randn(64) * 1e-41  # subnormal float32
    (out, keep), = emulate_reduce([build_compressor("int8", error_feedback=False, chunk=64)], [flat], layout,
                                  owed=[None])
    assert torch.isfinite(out).all() and torch.isfinite(keep).all()
    # out + keep rounds to within an ulp of out (~0.02 * 2**-24), which atol must allow where flat is near 0
    assert (out[:128].abs() <= 1e-38).all() and torch.allclose(out + keep, flat, atol=1e-8)
    ef = build_compressor("int8", chunk=64)
    for _ in range(3):
        emulate_reduce([ef], [flat], layout)
        ef.commit()
    assert torch.isfinite(ef.residuals.get("tensor")).all()


def test_int8_is_unbiased():
    # 2 ranks, one fixed gradient, 300 independent roundings (each step draws fresh noise). The mean of T
    # unbiased draws differs from the truth by about sigma / sqrt(T) per element, sigma <= step / 2 (a
    # rounding of width one step): z-scores of the mean error over all elements are then ~N(0, 1) and the
    # mean over 2000 elements has sd 1/sqrt(2000). A biased rounding (e.g. round-to-nearest of values placed
    # consistently off-grid) gives mean errors of ~0.1-0.5 step, z far above the bound of 5.
    layout = BucketLayout.single(2000)
    gen = torch.Generator().manual_seed(1)
    flats = [torch.rand(2000, generator=gen) * 0.37 + 0.01 for _ in range(2)]
    dense = flats[0] + flats[1]
    ranks = [build_compressor("int8", error_feedback=False, chunk=100, seed=7) for _ in range(2)]
    trials = 300
    total = torch.zeros(2000, dtype=torch.float64)
    for _ in range(trials):
        out = emulate_reduce(ranks, flats, layout)[0]
        for c in ranks:
            c.commit()
        total += out.double()
    mean_error = total / trials - dense.double()
    step = sum(f.view(-1, 100).abs().amax(1).repeat_interleave(100) / 126.999 for f in flats).double()
    z = mean_error / (step / math.sqrt(trials))  # in units of the mean's standard error bound
    assert abs(float(z.mean())) * math.sqrt(2000) < 5, float(z.mean())
    assert float(z.abs().max()) < 6  # no element is off by far more than chance allows


def test_topk_sends_the_largest_entries_of_every_layer():
    flats = _grads(1)
    compressor = build_compressor("topk", ratio=0.05, error_feedback=False, value_dtype="fp32")
    out = _step([compressor], flats)[0]
    for (name, start, end, _), k in zip(LAYOUT.spans(), compressor.counts(LAYOUT), strict=True):
        part, original = out[start:end], flats[0][start:end]
        assert k == max(1, math.ceil(0.05 * (end - start)))
        kept = part != 0
        assert int(kept.sum()) == k, name
        assert torch.equal(part[kept], original[kept])  # fp32 values: exact
        assert original[kept].abs().min() >= original[~kept].abs().max()  # the largest ones


def test_threshold_sends_what_crosses_it_up_to_the_cap():
    flats = _grads(1, scale=0.01)
    out = _step([build_compressor("threshold", threshold=0.02, max_ratio=1.0, error_feedback=False,
                                  value_dtype="fp32")], flats)[0]
    assert torch.equal(out != 0, flats[0].abs() >= 0.02)
    capped = _step([build_compressor("threshold", threshold=0.001, max_ratio=0.01, error_feedback=False)], flats)[0]
    assert int((capped != 0).sum()) == math.floor(0.01 * LAYOUT.numel)
    # nothing crosses on any rank: nothing is sent, the update is zero, nothing breaks
    empty = _step(_ranks("threshold", 2, threshold=10.0), _grads(2, scale=0.01))
    assert all(float(o.abs().sum()) == 0 for o in empty)


def test_powersgd_reproduces_a_gradient_of_its_rank():
    gen = torch.Generator().manual_seed(2)
    flat = torch.zeros(LAYOUT.numel)
    for view in LAYOUT.views(flat):
        if view.dim() >= 2:
            n = view.shape[0]
            low = torch.randn(n, 2, generator=gen) @ torch.randn(2, view[0].numel(), generator=gen)
            view.copy_(low.view_as(view))
        else:
            view.copy_(torch.randn(view.shape, generator=gen))
    halves = [flat * 0.25, flat * 0.75]
    out = _step(_ranks("powersgd", 2, rank=2, error_feedback=False), halves)[0]
    assert torch.allclose(out, flat, atol=1e-4, rtol=1e-4)


def test_powersgd_warm_start_converges_to_the_best_rank_r_approximation():
    gen = torch.Generator().manual_seed(3)
    layout = BucketLayout.of([("w", torch.Size([30, 20]))])
    u, _ = torch.linalg.qr(torch.randn(30, 20, generator=gen))
    v, _ = torch.linalg.qr(torch.randn(20, 20, generator=gen))
    spectrum = torch.tensor([8.0, 4.0] + [1.0 / (i + 1) for i in range(18)])
    m = (u * spectrum) @ v.t()
    best = (u[:, :2] * spectrum[:2]) @ v[:, :2].t()

    def error_after(steps, warm):
        compressor = build_compressor("powersgd", rank=2, error_feedback=False)
        for _ in range(steps):  # one power iteration per step on the same matrix
            if not warm:
                compressor = build_compressor("powersgd", rank=2, error_feedback=False, seed=_)
            out = emulate_reduce([compressor], [m.reshape(-1)], layout)[0]
            compressor.commit()
        return float((out.view(30, 20) - best).norm() / best.norm())

    # subspace iteration: the error shrinks like (sigma_3 / sigma_2)^steps = 4^-steps; without the kept
    # factors every step starts from a random Q
    assert error_after(12, warm=True) < 1e-4 < error_after(12, warm=False)


# ---- error feedback ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["int8", "topk", "threshold", "powersgd", "fp16"])
def test_error_feedback_invariant_sent_plus_new_residual_equals_gradient_plus_old(name):
    # what each rank sent is gradient + old residual - new residual; the ranks' sends must sum to the result
    # (int8: within one step of the owner's re-quantization; fp16: within the rounding of its fp16 sum)
    ranks = _ranks(name, 2, error_feedback=True)
    for step in range(3):
        flats = _grads(2, seed=step)
        old = [torch.cat([_residual(c, n, s) for n, s in zip(LAYOUT.names, LAYOUT.shapes, strict=True)]) for c in ranks]
        out = _step(ranks, flats)[0]
        sent = []
        for r, c in enumerate(ranks):
            new = torch.cat([_residual(c, n, s) for n, s in zip(LAYOUT.names, LAYOUT.shapes, strict=True)])
            sent.append(flats[r] + old[r] - new)
            if step:
                assert new.abs().sum() > 0, "a lossy compressor left no residual"
            if name == "int8":  # each rank's own rounding: within one step of what it owed
                assert new.abs().max() <= (flats[r] + old[r]).abs().max() / 126.999 * 1.0001
        total = sent[0] + sent[1]
        if name == "int8":
            assert (out - total).abs().max() <= total.abs().max() / 126.999 * 1.0001, step
        elif name == "fp16":
            assert torch.allclose(out, total, rtol=2.0 ** -10, atol=1e-6), step
        else:
            assert torch.allclose(out, total, atol=1e-5), (name, step)


@pytest.mark.parametrize("name", ["int8", "topk", "threshold", "powersgd", "fp16"])
def test_a_codec_fed_owed_reduces_the_corrected_gradient(name):
    # the Feedback seam alone (no ErrorFeedback): owing x and sending g is sending g + x, and keep is what
    # is left owed; a codec reading owed before writing keep may be handed keep == owed's own buffer
    flats, owed = _grads(2, seed=3), _grads(2, seed=4, scale=0.1)
    plain = emulate_reduce(_ranks(name, 2, error_feedback=False),
                           [f + o for f, o in zip(flats, owed, strict=True)], LAYOUT, owed=[None, None])
    fed = emulate_reduce(_ranks(name, 2, error_feedback=False), flats, LAYOUT, owed=owed)
    for (out_plain, keep_plain), (out_fed, keep_fed) in zip(plain, fed, strict=True):
        assert torch.allclose(out_plain, out_fed, atol=1e-6)
        assert torch.allclose(keep_plain, keep_fed, atol=1e-6)


def _residual(compressor, name, shape):
    value = compressor.residuals.get(name)
    return torch.zeros(math.prod(shape)) if value is None else value.reshape(-1)


def test_error_feedback_lets_topk_send_everything_eventually():
    # a constant gradient: without feedback the same 1% is sent forever; with it, every entry is sent in turn
    flat = torch.linspace(1.0, 2.0, LAYOUT.numel)
    with_ef, without = build_compressor("topk", ratio=0.01), build_compressor("topk", ratio=0.01, error_feedback=False)
    sent_with, sent_without = torch.zeros(LAYOUT.numel), torch.zeros(LAYOUT.numel)
    for _ in range(150):
        sent_with += _step([with_ef], [flat])[0]
        sent_without += _step([without], [flat])[0]
    assert (sent_with > 0).all() and float((sent_without > 0).float().mean()) < 0.02
    # everything owed was sent or still waits: the sum of what was sent plus the last residual is 150 gradients
    owed = torch.cat([with_ef.residuals.get(name).reshape(-1) for name in LAYOUT.names])
    assert torch.allclose(sent_with + owed, 150 * flat, rtol=1e-4)


def test_local_clipping_bounds_each_parameters_contribution():
    flats = [torch.full((LAYOUT.numel,), 10.0)]
    compressor = build_compressor("topk", ratio=1.0, clip_norm=0.5, value_dtype="fp32")
    out = _step([compressor], flats)[0]
    for view in LAYOUT.views(out):
        assert abs(float(view.norm()) - 0.5) < 1e-4


# ---- state: keyed by name, staged per step, checkpointed --------------------------------------------------

def test_state_follows_parameter_names_when_buckets_are_rebuilt():
    a = BucketLayout.of([("x", torch.Size([50])), ("y", torch.Size([40]))])
    b_first = BucketLayout.of([("y", torch.Size([40]))])
    b_second = BucketLayout.of([("x", torch.Size([50]))])
    c = build_compressor("topk", ratio=0.1, value_dtype="fp32")
    gen = torch.Generator().manual_seed(4)
    g = torch.randn(90, generator=gen)
    emulate_reduce([c], [g], a)
    c.commit()
    x_res, y_res = c.residuals.get("x").clone(), c.residuals.get("y").clone()
    # DDP rebuilt its buckets: y comes alone, then x; each finds its own residual
    g2 = torch.randn(90, generator=gen)
    out_y = emulate_reduce([c], [g2[50:]], b_first)[0]  # one rank: the result is what it sent
    out_x = emulate_reduce([c], [g2[:50]], b_second)[0]
    assert torch.allclose(out_y + c.residuals.get("y"), g2[50:] + y_res, atol=1e-6)
    assert torch.allclose(out_x + c.residuals.get("x"), g2[:50] + x_res, atol=1e-6)


@pytest.mark.parametrize("name", ["int8", "topk", "threshold", "powersgd"])
def test_a_discarded_step_leaves_the_state_as_it_was(name):
    steps = [_grads(2, seed=s) for s in range(3)]
    plain, skipping = _ranks(name, 2), _ranks(name, 2)
    _step(plain, steps[0])
    _step(skipping, steps[0])
    emulate_reduce(skipping, steps[1], LAYOUT)  # a step the ranks agree to skip
    for c in skipping:
        c.discard()
    assert _step(plain, steps[2])[0].equal(_step(skipping, steps[2])[0])
    assert [c.steps for c in skipping] == [2, 2]


@pytest.mark.parametrize("name", LOSSY)
def test_state_dict_round_trip_loads_weights_only_and_continues_identically(name):
    ranks = _ranks(name, 2)
    for s in range(2):
        _step(ranks, _grads(2, seed=s))
    restored = _ranks(name, 2)
    for src, dst in zip(ranks, restored, strict=True):
        buffer = io.BytesIO()
        torch.save(src.state_dict(), buffer)
        buffer.seek(0)
        dst.load_state_dict(torch.load(buffer, weights_only=True))
        assert dst.steps == 2
    nxt = _grads(2, seed=5)
    assert _step(ranks, nxt)[0].equal(_step(restored, nxt)[0])


def test_warm_up_steps_are_sent_dense():
    c = build_compressor("topk", ratio=0.01, start_step=2)
    assert c.warming_up
    c.commit()
    c.commit()
    assert not c.warming_up


# ---- non-finite gradients never vanish ---------------------------------------------------------------------

@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("name", LOSSY)
def test_a_non_finite_gradient_on_one_rank_reaches_every_rank_and_no_state(name, bad):
    ranks = _ranks(name, 2)
    _step(ranks, _grads(2))
    before = [c.state_dict() for c in ranks]
    flats = _grads(2, seed=1)
    flats[1][LAYOUT.offsets[2] + 5] = bad  # inside conv.weight, on rank 1 only
    out = emulate_reduce(ranks, flats, LAYOUT)
    for o in out:
        assert not torch.isfinite(o).all(), name
    for c in ranks:
        c.commit()
    for c in ranks:
        for key, value in _tensors(c.state_dict()):
            if value.is_floating_point():
                assert torch.isfinite(value).all(), (name, key)
    if isinstance(ranks[1], ErrorFeedback):  # rank 1's residuals stay as they were (not kept with a NaN)
        for param in LAYOUT.names:
            assert torch.equal(ranks[1].residuals.get(param), before[1]["residuals"][param]), (name, param)


def _tensors(state, prefix=""):
    for key, value in state.items():
        if isinstance(value, dict):
            yield from _tensors(value, f"{prefix}{key}.")
        elif isinstance(value, torch.Tensor):
            yield prefix + key, value


# ---- arguments -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "name,kwargs,match",
    [
        ("zip", {}, "compressor='zip' is unknown"),
        ("topk", {"ratio": 0}, r"ratio=0 must be in \(0, 1\]"),
        ("topk", {"ratio": 1.5}, r"ratio=1.5 must be in \(0, 1\]"),
        ("topk", {"rank": 2}, r"no option \['rank'\]"),
        ("powersgd", {"rank": 0}, "rank=0 must be an int >= 1"),
        ("threshold", {"threshold": -0.1}, "threshold=-0.1 must be > 0"),
        ("threshold", {"max_ratio": 0}, "max_ratio=0"),
        ("int8", {"chunk": 0}, "chunk=0"),
        ("topk", {"value_dtype": "fp8"}, "value_dtype='fp8'"),
        ("topk", {"start_step": -1}, "start_step=-1"),
        ("fp16", {"clip_norm": 1.0}, "clip_norm=1.0 clips"),
        ("topk", {"clip_norm": -1.0}, "clip_norm=-1.0"),
        ("none", {"error_feedback": True}, "nothing to feed back"),
        ("topk", {"selection": "fast"}, "selection='fast': use 'sampled'"),
        ("threshold", {"selection": "approx"}, "selection='approx'"),
    ],
)
def test_bad_arguments_name_the_value_and_the_fix(name, kwargs, match):
    with pytest.raises(ValueError, match=match):
        build_compressor(name, **kwargs)


def test_the_strategy_takes_a_name_a_dict_or_an_instance():
    assert isinstance(RingDDPStrategy(compressor=None).features.compressor, NoCompressor)
    topk = RingDDPStrategy(compressor="topk").features.compressor
    assert isinstance(topk, ErrorFeedback) and topk.describe() == "topk(ratio=0.01, values=bf16)+ef"
    from_hydra = {"_target_": "lightning_dist.compression.build_compressor", "name": "powersgd", "rank": 4}
    assert as_compressor(from_hydra).describe() == "powersgd(rank=4)+ef"
    with pytest.raises(ValueError, match="ratio=0"):
        RingDDPStrategy(compressor={"name": "topk", "ratio": 0})
    assert build_compressor("int8", error_feedback=False).describe() == "int8(chunk=512)"


# ---- restoring a checkpoint's compressor state (no process group) ------------------------------------------

def _strategy(compressor, world_size, rank=0):
    from lightning.fabric.plugins.environments import LightningEnvironment

    environment = LightningEnvironment()
    environment.set_world_size(world_size)
    environment.set_global_rank(rank)  # (sets rank_zero_only.rank: the tests restore it)
    return RingDDPStrategy(compressor=compressor, cluster_environment=environment)


def _checkpoint(compressor, world_size, name="powersgd"):
    ranks = []
    for r in range(world_size):
        c = build_compressor(name)
        emulate_reduce([c], [_grads(1, seed=r)[0]], LAYOUT)
        c.commit()
        ranks.append(c.state_dict())
    return {"lightning_dist": {"compressor": {"describe": compressor.describe(), "world_size": world_size,
                                              "ranks": ranks}}}


def _restore(strategy, checkpoint):
    """What RingDDPStrategy.load_model_state_dict does with the checkpoint's compressor entry."""
    restore_compressor(strategy.features.compressor, checkpoint, strategy.global_rank, strategy.world_size)


@pytest.fixture(autouse=True)
def _rank_zero(monkeypatch):
    from lightning.pytorch.utilities.rank_zero import rank_zero_only

    monkeypatch.setattr(rank_zero_only, "rank", 0)


def test_a_checkpoint_from_another_world_size_restores_only_shared_state(recwarn):
    strategy = _strategy(build_compressor("powersgd"), 2)
    _restore(strategy, _checkpoint(strategy.features.compressor, 3))
    compressor = strategy.features.compressor
    assert compressor.steps == 1 and len(compressor.residuals) == 0  # per-rank residuals start at zero
    assert len(compressor.inner.q) == 3  # PowerSGD's factors are the same on every rank: kept
    assert any("written by 3 ranks" in str(w.message) for w in recwarn)


def test_a_checkpoint_of_another_compressor_or_none_starts_afresh(recwarn):
    strategy = _strategy(build_compressor("topk"), 2)
    _restore(strategy, _checkpoint(build_compressor("powersgd"), 2))
    assert strategy.features.compressor.steps == 0
    assert any("compressor was powersgd(rank=2)+ef" in str(w.message) for w in recwarn)
    _restore(strategy, {})
    assert any("holds no compressor state" in str(w.message) for w in recwarn)
    same = _strategy(build_compressor("powersgd"), 2, rank=1)
    _restore(same, _checkpoint(same.features.compressor, 2))
    assert same.features.compressor.steps == 1 and len(same.features.compressor.residuals) == 4
    saved = _checkpoint(same.features.compressor, 2)["lightning_dist"]["compressor"]["ranks"][1]["residuals"]
    assert torch.equal(same.features.compressor.residuals.get("fc.weight"), saved["fc.weight"])  # this rank's own


# ---- codecs near memory speed: each fast path against the exact one ------------------------------------------

def _heavy(n, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=gen) * torch.rand(n, generator=gen).pow(4) * 1e-2  # heavy-tailed magnitudes


@pytest.mark.parametrize("data", ["normal", "heavy", "nonfinite", "sparse"])
def test_sampled_top_k_is_the_exact_top_k(data):
    n = 3 * SMALL + 5  # not a multiple of the rows: the tail is searched too
    gen = torch.Generator().manual_seed(11)
    x = {"normal": lambda: torch.randn(n, generator=gen), "heavy": lambda: _heavy(n, 12),
         "nonfinite": lambda: torch.randn(n, generator=gen), "sparse": lambda: torch.zeros(n)}[data]()
    if data == "nonfinite":
        x[[3, n - 2]] = torch.tensor([float("nan"), float("-inf")])
    if data == "sparse":  # mostly zeros: the sampled threshold is 0, torch.topk decides
        x[torch.randperm(n, generator=gen)[:500]] = torch.randn(500, generator=gen)
    for k in (1, n // 1000, n // 100, n // 20):
        for step in (0, 7):
            picked = largest(x, k, offset=step)
            exact = torch.topk(x.abs(), k).indices
            assert picked.numel() == k and set(picked.tolist()) == set(exact.tolist()), (data, k, step)


@pytest.mark.parametrize("overshoot", [1.5, 100.0])
def test_a_sample_that_aims_too_high_still_gives_the_exact_top_k(monkeypatch, overshoot):
    # a threshold that leaves too few candidates is lowered (x1/4), and failing that torch.topk decides
    x = torch.randn(2 * SMALL, generator=torch.Generator().manual_seed(8))
    k = 1000
    kth = float(torch.topk(x.abs(), k).values.min())
    monkeypatch.setattr(sparse, "sampled_threshold", lambda *args, **kwargs: kth * overshoot)
    picked = largest(x, k)
    assert set(picked.tolist()) == set(torch.topk(x.abs(), k).indices.tolist())


def test_threshold_cap_sends_the_largest_entries_up_to_the_cap_on_a_large_bucket():
    n = 4 * SMALL
    layout = BucketLayout.of([("w", torch.Size([n // 256, 256]))])
    gen = torch.Generator().manual_seed(5)
    g = torch.randn(n, generator=gen) * 1e-2  # 92% of the entries cross 1e-3: the 5% cap binds
    g[17] = float("nan")
    compressor = build_compressor("threshold", error_feedback=False, value_dtype="fp32")
    index = compressor.select(g, layout)
    cap = math.floor(0.05 * n)
    assert 0.8 * cap <= index.numel() <= cap and 17 in index.tolist()
    sent = torch.zeros(n, dtype=torch.bool)
    sent[index] = True
    finite = torch.isfinite(g)
    assert g[sent & finite].abs().min() >= g[~sent].abs().max()  # the largest entries, nothing skipped
    exact = build_compressor("threshold", error_feedback=False, selection="exact").select(g, layout)
    assert exact.numel() == cap and set(index.tolist()) <= set(exact.tolist())


def test_int8_noise_is_a_shuffled_stratified_table_per_rank():
    tables = [Int8Compressor(chunk=512, seed=3)._noise(rank, torch.device("cpu")) for rank in (0, 1)]
    period = tables[0].numel() // 2
    points = (torch.arange(period, dtype=torch.float64) + 0.5) / period
    for table in tables:
        assert torch.equal(table[:period], table[period:])
        assert torch.allclose(table[:period].double().sort().values, points)
    assert not torch.equal(tables[0], tables[1])  # ranks' roundings are not correlated


def test_a_bucket_reduced_twice_in_a_skipped_step_leaves_the_committed_residuals():
    # LBFGS evaluates its closure several times a step: the residuals alternate between two buffers, and the
    # second reduce must not write over the committed ones that the skipped step returns to
    steps = [_grads(2, seed=s) for s in range(3)]
    plain, twice = _ranks("topk", 2), _ranks("topk", 2)
    _step(plain, steps[0])
    _step(twice, steps[0])
    emulate_reduce(twice, steps[1], LAYOUT)
    emulate_reduce(twice, steps[2], LAYOUT)
    for c in twice:
        c.discard()
    assert _step(plain, steps[2])[0].equal(_step(twice, steps[2])[0])


@pytest.mark.parametrize("name", ["fp16", "topk", "powersgd"])
def test_the_mirror_transport_reduces_as_identical_ranks_do(name):
    flat = _grads(1)[0]
    mirrored = _ranks(name, 1)[0].reduce(flat.clone(), LAYOUT, MirrorTransport(2))
    emulated = emulate_reduce(_ranks(name, 2), [flat, flat], LAYOUT)[0]
    assert torch.equal(mirrored, emulated)


def test_a_bad_compile_mode_is_named_where_int8_is_built(monkeypatch):
    monkeypatch.setenv("LIGHTNING_DIST_COMPILE", "sometimes")
    with pytest.raises(ValueError, match="LIGHTNING_DIST_COMPILE='sometimes': use auto"):
        build_compressor("int8")


@pytest.mark.slow  # compiles two kernels: ~10 s with a cold Inductor cache, ~2 s warm
def test_the_compiled_int8_kernels_match_the_plain_path(monkeypatch):
    shape = (2, 1024, 512)  # 1 M elements, over kernels.MIN_ELEMENTS
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(shape, generator=gen) * 1e-2
    step = x.abs().amax(2, keepdim=True) / 126.999
    inverse, noise = 1.0 / step, torch.rand((1, 1024, 512), generator=gen)
    results = {}
    for compile_mode in ("0", "1"):
        monkeypatch.setenv("LIGHTNING_DIST_COMPILE", compile_mode)
        codes, residual = torch.empty(shape, dtype=torch.int8), torch.empty(shape)
        kernels.int8_encode(x, inverse, noise, codes, residual, step, residual=True)
        plain_codes = torch.empty(shape, dtype=torch.int8)
        kernels.int8_encode(x, inverse, noise, plain_codes, torch.empty(shape))
        assert torch.equal(codes, plain_codes)
        results[compile_mode] = codes, residual
    assert "int8_codes_and_residual" in kernels.COMPILE_SECONDS and "int8_codes" in kernels.COMPILE_SECONDS
    (plain_codes, plain_residual), (fused_codes, fused_residual) = results["0"], results["1"]
    # a fused multiply-add may round a value that lies within an ulp of an integer the other way
    assert (plain_codes != fused_codes).float().mean() < 1e-5
    assert (plain_codes.int() - fused_codes.int()).abs().max() <= 1
    same = plain_codes == fused_codes
    assert torch.allclose(plain_residual[same], fused_residual[same], atol=1e-8)
