"""NaN recovery's pure logic, no process group and no Trainer: LossScaler, StepGuard, replica fingerprints,
NaNRecovery's arguments and state, and the compressors' loss-scale seam (set_grad_scale / rescale)."""

from __future__ import annotations

import io
import math

import pytest
import torch
from torch import nn

from lightning_dist.callbacks.nan_recovery import NaNRecovery, _copy, check_settings
from lightning_dist.compression import BucketLayout, ErrorFeedback, ThresholdCompressor, build_compressor
from lightning_dist.compression.emulate import emulate_reduce
from lightning_dist.loss_scaler import LossScaler, check_scaler_settings
from lightning_dist.strategy import replicas
from lightning_dist.strategy.replicas import DriftReport
from lightning_dist.strategy.skip import StepGuard, StepVerdict

INF, NAN = float("inf"), float("nan")
X = torch.tensor([[1.0, 2.0, 3.0]])  # d(model(X).sum()) / d(weight) is X in every row, / d(bias) is 1
TORCH_KEYS = {"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"}
EXTRA_KEYS = {"hysteresis", "_hysteresis_left", "min_scale"}


# ---- helpers: a tiny model driven by a scaler ------------------------------------------------------------------

def _model(lr=0.5):
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    return model, torch.optim.SGD(model.parameters(), lr=lr)


def _backward(scaler, model, opt, bad=False):
    opt.zero_grad(set_to_none=True)
    scaler.scale(model(X).sum()).backward()
    if bad:
        with torch.no_grad():
            model.weight.grad[0, 0] = INF


def _weights(model):
    return [p.detach().clone() for p in model.parameters()]


def _drive(scaler, model, opt, pattern):
    """Run one step per character of ``pattern`` ('g': finite, 'b': an Inf in one gradient); return the scales
    after each step. Checks on every step: the optimizer stepped exactly on the good ones, and scale_value is
    get_scale()."""
    scales = []
    for kind in pattern:
        _backward(scaler, model, opt, bad=kind == "b")
        before = _weights(model)
        scaler.step(opt)
        scaler.update()
        moved = any(not torch.equal(b, a) for b, a in zip(before, _weights(model), strict=True))
        assert moved == (kind == "g"), f"step {len(scales)} ({kind}): optimizer stepped={moved}"
        assert scaler.last_step_bad == (kind == "b")
        assert scaler.scale_value == scaler.get_scale()
        scales.append(scaler.scale_value)
    return scales


def _scaler(**kwargs):
    settings = dict(init_scale=1024.0, growth_interval=1000, hysteresis=2)
    settings.update(kwargs)
    return LossScaler("cpu", **settings)


# ---- 1. LossScaler dynamics ----------------------------------------------------------------------------------

def test_hysteresis_two_tolerates_one_bad_step_then_cuts_every_time():
    scaler = _scaler(hysteresis=2)
    # first bad step: no cut; second: x0.5; further consecutive: x0.5 each; a good step does not restore the
    # hysteresis without consecutive_hysteresis (only growth does), so the next bad step cuts at once
    assert _drive(scaler, *_model(), "bbbbgb") == [1024.0, 512.0, 256.0, 128.0, 128.0, 64.0]
    assert scaler.exhausted is False


def test_hysteresis_one_cuts_on_every_bad_step_like_torch():
    scaler = _scaler(hysteresis=1, backoff_factor=0.25)
    assert _drive(scaler, *_model(), "bgbb") == [256.0, 256.0, 64.0, 16.0]
    plain = torch.amp.GradScaler("cpu", init_scale=1024.0, backoff_factor=0.25, growth_interval=1000)
    model, opt = _model()
    torch_scales = []
    for kind in "bgbb":
        _backward(plain, model, opt, bad=kind == "b")
        plain.step(opt)
        plain.update()
        torch_scales.append(plain.get_scale())
    assert torch_scales == [256.0, 256.0, 64.0, 16.0]


def test_consecutive_hysteresis_is_restored_by_every_good_step():
    scaler = _scaler(hysteresis=2, consecutive_hysteresis=True)
    assert _drive(scaler, *_model(), "bbgbbgb") == [1024.0, 512.0, 512.0, 512.0, 256.0, 256.0, 256.0]


def test_growth_after_growth_interval_good_steps_restores_the_hysteresis():
    scaler = _scaler(hysteresis=2, growth_interval=3, growth_factor=4.0)
    model, opt = _model()
    # two bad steps: one cut, hysteresis used up; three good steps: growth (x4), hysteresis back to 2
    assert _drive(scaler, model, opt, "bbggg") == [1024.0, 512.0, 512.0, 512.0, 2048.0]
    assert scaler._hysteresis_left == 2 and scaler.state_dict()["_growth_tracker"] == 0
    # so the next bad step is tolerated again; it also resets the growth count: 3 more good steps to grow
    assert _drive(scaler, model, opt, "bgggg") == [2048.0, 2048.0, 2048.0, 8192.0, 8192.0]
    assert scaler.state_dict()["_growth_tracker"] == 1


def test_growth_never_overflows_float32():
    scaler = LossScaler("cpu", init_scale=2.0**126, growth_interval=1)
    model, opt = _model()
    for expected in (2.0**127, 2.0**127):  # 2**128 is not a float32
        opt.zero_grad(set_to_none=True)
        scaler.scale(model(X).sum() * 2.0**-4).backward()  # small gradients: finite even at 2**127
        scaler.step(opt)
        scaler.update()
        assert not scaler.last_step_bad
        assert scaler.scale_value == scaler.get_scale() == expected


@pytest.mark.parametrize("floor,expected", [(4.0, [8.0, 4.0, 4.0, 4.0]), (5.0, [8.0, 5.0, 5.0, 5.0])])
def test_min_scale_is_a_floor_and_a_bad_step_at_it_exhausts_the_scaler(floor, expected):
    scaler = LossScaler("cpu", init_scale=16.0, hysteresis=1, min_scale=floor, growth_interval=1000)
    model, opt = _model()
    exhausted = []
    for kind in "bbbg":
        exhausted.append(None)
        _drive(scaler, model, opt, kind)
        exhausted[-1] = scaler.exhausted
    assert scaler.scale_value == expected[-1]
    assert exhausted == [False, False, True, True]  # the third bad step found the scale at the floor already


def test_min_scale_with_hysteresis_exhausts_only_when_a_cut_is_due():
    scaler = LossScaler("cpu", init_scale=2.0, hysteresis=2, min_scale=1.0, growth_interval=1000)
    model, opt = _model()
    assert _drive(scaler, model, opt, "bb") == [2.0, 1.0]
    assert not scaler.exhausted
    assert _drive(scaler, model, opt, "b") == [1.0]
    assert scaler.exhausted


def test_unscale_twice_in_one_step_divides_once():
    scaler = _scaler()
    model, opt = _model(lr=0.5)
    w0, b0 = _weights(model)
    _backward(scaler, model, opt)
    assert torch.equal(model.weight.grad, 1024.0 * X.expand(2, 3))
    scaler.unscale_(opt)
    scaler.unscale_(opt)  # torch's GradScaler raises here; LossScaler's is a no-op
    assert torch.equal(model.weight.grad, X.expand(2, 3))
    assert torch.equal(model.bias.grad, torch.ones(2))
    scaler.step(opt)
    scaler.update()
    assert torch.equal(model.weight.detach(), w0 - 0.5 * X.expand(2, 3))
    assert torch.equal(model.bias.detach(), b0 - 0.5)
    plain = torch.amp.GradScaler("cpu")
    _backward(plain, model, opt)
    plain.unscale_(opt)
    with pytest.raises(RuntimeError, match="already been called"):
        plain.unscale_(opt)


def test_found_inf_says_whether_the_unscaled_gradients_are_finite():
    scaler = _scaler()
    model, opt = _model()
    _backward(scaler, model, opt)
    assert scaler.found_inf(opt) is False
    assert torch.equal(model.weight.grad, X.expand(2, 3))  # unscaled, once
    assert scaler.found_inf(opt) is False  # asking again does not unscale again
    assert torch.equal(model.weight.grad, X.expand(2, 3))
    scaler.step(opt)
    scaler.update()
    _backward(scaler, model, opt, bad=True)
    assert scaler.found_inf(opt) is True
    before = _weights(model)
    scaler.step(opt)
    scaler.update()
    assert all(torch.equal(b, a) for b, a in zip(before, _weights(model), strict=True))


@pytest.mark.parametrize("checked_first", [False, True])
def test_skip_then_update_backs_off_like_a_bad_step_without_stepping(checked_first):
    scaler = _scaler(hysteresis=1)
    model, opt = _model()
    _backward(scaler, model, opt)  # finite gradients: the skip was decided elsewhere (another rank's NaN)
    if checked_first:
        assert scaler.found_inf(opt) is False
    before = _weights(model)
    scaler.skip(opt)
    scaler.update()
    assert all(torch.equal(b, a) for b, a in zip(before, _weights(model), strict=True))
    assert scaler.last_step_bad and scaler.scale_value == scaler.get_scale() == 512.0
    # the next step is an ordinary one again
    assert _drive(scaler, model, opt, "g") == [512.0]


def test_skip_with_hysteresis_counts_as_a_bad_step():
    scaler = _scaler(hysteresis=2)
    model, opt = _model()
    for expected in (1024.0, 512.0):
        _backward(scaler, model, opt)
        scaler.skip(opt)
        scaler.update()
        assert scaler.scale_value == expected


def test_a_disabled_scaler_reports_scale_one_and_nothing_found():
    scaler = LossScaler("cpu", enabled=False)
    model, opt = _model()
    assert scaler.scale_value == 1.0
    _backward(scaler, model, opt, bad=True)
    assert scaler.found_inf(opt) is False
    assert scaler.state_dict() == {}


def test_scale_value_equals_get_scale_with_a_non_dyadic_backoff():
    scaler = LossScaler("cpu", init_scale=1.0, backoff_factor=0.1, hysteresis=1, min_scale=1e-6)
    _drive(scaler, *_model(), "b")


# ---- 2. state_dict compatibility with torch's GradScaler ------------------------------------------------------

def test_state_dict_is_torchs_plus_three_keys_and_torch_loads_it():
    scaler = _scaler(hysteresis=3, growth_interval=4, min_scale=2.0)
    _drive(scaler, *_model(), "bbgg")  # one cut (hysteresis 3: no), tracker 2
    state = scaler.state_dict()
    assert set(torch.amp.GradScaler("cpu").state_dict()) == TORCH_KEYS
    assert set(state) == TORCH_KEYS | EXTRA_KEYS
    assert (state["scale"], state["_growth_tracker"], state["growth_interval"]) == (1024.0, 2, 4)
    assert (state["hysteresis"], state["_hysteresis_left"], state["min_scale"]) == (3, 1, 2.0)
    plain = torch.amp.GradScaler("cpu")
    plain.load_state_dict(state)
    assert plain.get_scale() == 1024.0 and plain.get_growth_interval() == 4
    model, opt = _model()
    for _ in range(2):  # two more good steps complete the interval of 4
        _backward(plain, model, opt)
        plain.step(opt)
        plain.update()
    assert plain.get_scale() == 2048.0


def test_loss_scaler_round_trip_keeps_the_hysteresis_left():
    scaler = _scaler(hysteresis=2)
    _drive(scaler, *_model(), "b")
    restored = _scaler(hysteresis=5, init_scale=2.0**16)
    buffer = io.BytesIO()
    torch.save(scaler.state_dict(), buffer)
    buffer.seek(0)
    restored.load_state_dict(torch.load(buffer, weights_only=True))
    assert (restored.hysteresis, restored._hysteresis_left, restored.scale_value) == (2, 1, 1024.0)
    assert _drive(restored, *_model(), "b") == [512.0]  # the second bad step in a row cuts


def test_loss_scaler_loads_a_plain_grad_scaler_state_with_defaults_for_its_own_keys():
    plain = torch.amp.GradScaler("cpu", init_scale=256.0, growth_interval=2)
    model, opt = _model()
    for kind in "bg":
        _backward(plain, model, opt, bad=kind == "b")
        plain.step(opt)
        plain.update()
    assert (plain.get_scale(), plain._get_growth_tracker()) == (128.0, 1)
    scaler = LossScaler("cpu", hysteresis=3, min_scale=2.0)
    scaler.exhausted = True
    scaler.load_state_dict(plain.state_dict())
    assert (scaler.scale_value, scaler.get_scale(), scaler._good_steps) == (128.0, 128.0, 1)
    assert (scaler.hysteresis, scaler._hysteresis_left, scaler.min_scale) == (3, 3, 2.0)
    assert scaler.get_growth_interval() == 2 and not scaler.exhausted
    assert float(scaler.scale(torch.tensor(1.0))) == 128.0
    assert _drive(scaler, model, opt, "gbb") == [256.0, 256.0, 256.0]  # grew (tracker 1 + 1 = 2), hysteresis 3


def test_like_continues_a_used_plain_scaler():
    plain = torch.amp.GradScaler("cpu", init_scale=512.0, growth_interval=7)
    model, opt = _model()
    _backward(plain, model, opt, bad=True)
    plain.step(opt)
    plain.update()
    scaler = LossScaler.like(plain, hysteresis=3, growth_interval=5)
    assert isinstance(scaler, LossScaler) and scaler._device == "cpu"
    assert (scaler.scale_value, scaler.get_scale()) == (256.0, 256.0)
    assert (scaler.hysteresis, scaler._hysteresis_left) == (3, 3)
    assert scaler.get_growth_interval() == 5  # the new settings, not the plain scaler's
    assert float(scaler.scale(torch.tensor(1.0))) == 256.0
    assert _drive(scaler, model, opt, "bbb") == [256.0, 256.0, 128.0]


def test_like_an_unused_scaler_starts_from_the_settings():
    scaler = LossScaler.like(torch.amp.GradScaler("cpu", init_scale=8.0), init_scale=64.0)
    assert scaler.scale_value == scaler.get_scale() == 64.0


# ---- 3. scaler settings -------------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"growth_factor": 1}, r"growth_factor=1(\.0)? must be > 1"),
        ({"backoff_factor": 1.5}, r"backoff_factor=1\.5 must be in \(0, 1\)"),
        ({"backoff_factor": 0}, r"backoff_factor=0(\.0)? must be in \(0, 1\)"),
        ({"min_scale": 0}, r"min_scale=0(\.0)? must be > 0"),
        ({"min_scale": 100.0, "init_scale": 10.0}, r"min_scale=100\.0 is above init_scale=10\.0"),
        ({"init_scale": INF}, r"init_scale=inf must be a positive finite"),
        ({"hysteresis": 0}, r"hysteresis=0 must be an integer >= 1"),
        ({"hysteresis": 1.5}, r"hysteresis=1\.5 must be an integer >= 1"),
        ({"growth_interval": True}, r"growth_interval=True must be an integer >= 1"),
        ({"growth_factor": "2"}, r"growth_factor='2' must be a number"),
    ],
)
def test_bad_scaler_settings_name_the_value(kwargs, match):
    with pytest.raises(ValueError, match="LossScaler: .*" + match):
        LossScaler("cpu", **kwargs)
    settings = dict(init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000, hysteresis=2,
                    min_scale=1.0)
    assert check_scaler_settings(**settings) == []
    problems = check_scaler_settings(**{**settings, **kwargs})
    assert len(problems) == 1 and __import__("re").search(match, problems[0])


# ---- 4. NaNRecovery arguments and state ----------------------------------------------------------------------

@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"rollback_after": -1}, r"rollback_after=-1 must be an integer >= 0"),
        ({"snapshot_every": 0}, r"snapshot_every=0 must be an integer >= 1"),
        ({"max_rollbacks": -2}, r"max_rollbacks=-2 must be an integer >= 0"),
        ({"drift_check_every": 1.0}, r"drift_check_every=1\.0 must be an integer >= 0"),
        ({"lr_factor": 2}, r"lr_factor=2 must be in \(0, 1\]"),
        ({"lr_factor": 0}, r"lr_factor=0 must be in \(0, 1\]"),
        ({"snapshot_device": "gpu"}, r"snapshot_device='gpu' must be 'cpu' or 'same'"),
        ({"on_drift": "ignore"}, r"on_drift='ignore' must be one of \['repair', 'stop', 'warn'\]"),
        ({"hysteresis": 0}, r"hysteresis=0 must be an integer >= 1"),
        ({"min_scale": -1.0}, r"min_scale=-1\.0 must be > 0"),
        ({"consecutive_hysteresis": "yes"}, r"consecutive_hysteresis='yes' must be True or False"),
    ],
)
def test_nan_recovery_bad_arguments_name_the_value(kwargs, match):
    with pytest.raises(ValueError, match="NaNRecovery: .*" + match):
        NaNRecovery(**kwargs)


def test_nan_recovery_defaults_and_check_settings():
    callback = NaNRecovery()
    assert (callback.rollback_after, callback.snapshot_every, callback.max_rollbacks) == (10, 100, 3)
    assert (callback.lr_factor, callback.snapshot_device, callback.on_drift) == (1.0, "cpu", "repair")
    assert callback.scaler_settings == dict(init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5,
                                            growth_interval=2000, hysteresis=2, min_scale=1.0,
                                            consecutive_hysteresis=False)
    assert LossScaler("cpu", **callback.scaler_settings).hysteresis == 2  # the settings fit LossScaler as they are
    assert callback.state_dict() == {"skipped": 0, "consecutive": 0, "rollbacks": 0, "drift_checks": 0,
                                     "drift_mismatches": 0, "first_bad": None, "history": []}
    full = dict(rollback_after=10, snapshot_every=100, max_rollbacks=3, lr_factor=1.0, snapshot_device="cpu",
                drift_check_every=0, on_drift="repair", **callback.scaler_settings)
    assert check_settings(**full) == []
    bad = dict(rollback_after=-1, snapshot_every=0, lr_factor=2, snapshot_device="gpu", on_drift="x")
    assert len(check_settings(**{**full, **bad})) == 5
    NaNRecovery(rollback_after=0, snapshot_every=1, max_rollbacks=0, lr_factor=0.5, snapshot_device="same",
                on_drift="warn", hysteresis=1, min_scale=2.0**16)


def test_nan_recovery_state_round_trip():
    callback = NaNRecovery()
    callback.skipped, callback.rollbacks, callback.consecutive = 7, 2, 3
    callback.drift_checks, callback.drift_mismatches = 11, 1
    callback.first_bad = "global step 40: non-finite loss on rank(s) [1]"
    callback.history = [{"kind": "skip", "global_step": 40, "detail": "x"},
                        {"kind": "rollback", "global_step": 42, "detail": "y"}]
    buffer = io.BytesIO()
    torch.save(callback.state_dict(), buffer)
    buffer.seek(0)
    fresh = NaNRecovery(rollback_after=5)
    fresh.load_state_dict(torch.load(buffer, weights_only=True))
    assert fresh.state_dict() == callback.state_dict()
    assert (fresh.skipped, fresh.rollbacks, fresh.consecutive, fresh.drift_checks) == (7, 2, 3, 11)
    assert fresh.first_bad == callback.first_bad and fresh.rollback_after == 5
    fresh.history.append({"kind": "drift"})
    assert len(callback.history) == 2  # not aliased
    fresh.load_state_dict({})  # an older checkpoint: everything starts from zero
    assert fresh.state_dict() == NaNRecovery().state_dict()


class _Compressor:
    """A compressor's state seam: one residual tensor, updated in place as a real one's would be."""

    def __init__(self):
        self.residual = torch.zeros(3)

    def state_dict(self):
        return {"residuals": {"0": self.residual.clone()}, "steps": 0}

    def load_state_dict(self, state):
        self.residual = state["residuals"]["0"].clone()


def test_rollback_restores_the_snapshot_exactly_and_scales_the_learning_rate(monkeypatch):
    """A snapshot, four more steps that change weights, momentum, the scheduler and the compressor's residual, then a
    rollback: every one of them as at the snapshot (compared with copies taken here, not the callback's), the learning
    rate and the scheduler's base rate times lr_factor."""
    import copy
    from types import SimpleNamespace

    from lightning_dist.callbacks import nan_recovery

    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.4, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    compressor = _Compressor()
    ring = SimpleNamespace(compressor=compressor)
    monkeypatch.setattr(nan_recovery, "_ring", lambda trainer: ring)
    trainer = SimpleNamespace(global_step=0, optimizers=[optimizer],
                              lr_scheduler_configs=[SimpleNamespace(scheduler=scheduler)])

    def step():
        optimizer.zero_grad()
        model(X).square().sum().backward()
        optimizer.step()
        scheduler.step()
        compressor.residual.add_(1.0)
        trainer.global_step += 1

    step()
    callback = NaNRecovery(rollback_after=2, lr_factor=0.5)
    callback._take_snapshot(trainer, model)
    weights, momentum = _weights(model), [optimizer.state[p]["momentum_buffer"].clone() for p in model.parameters()]
    scheduler_state, residual, lr = copy.deepcopy(scheduler.state_dict()), compressor.residual.clone(), 0.2
    for _ in range(4):
        step()
    assert not torch.equal(model.weight, weights[0]) and optimizer.param_groups[0]["lr"] != lr
    callback.consecutive, callback.first_bad = 2, "global step 3: non-finite loss on rank(s) [0]"
    callback._rollback(trainer, model)
    assert all(torch.equal(a, b) for a, b in zip(_weights(model), weights, strict=True))
    assert all(torch.equal(optimizer.state[p]["momentum_buffer"], m)
               for p, m in zip(model.parameters(), momentum, strict=True))
    assert all(p.grad is None for p in model.parameters())
    assert optimizer.param_groups[0]["lr"] == lr * 0.5
    assert scheduler.last_epoch == scheduler_state["last_epoch"] == 1
    assert scheduler.base_lrs == [0.4 * 0.5]
    assert torch.equal(compressor.residual, residual)
    # the snapshot is a copy: training on from the restored state leaves it as it was, for the next rollback
    step()
    callback.consecutive = 2
    callback._rollback(trainer, model)
    assert all(torch.equal(a, b) for a, b in zip(_weights(model), weights, strict=True))
    assert torch.equal(compressor.residual, residual) and optimizer.param_groups[0]["lr"] == lr * 0.25
    assert callback.rollbacks == 2 and callback.consecutive == 0


def test_copy_clones_every_tensor_and_keeps_the_structure():
    weight = torch.ones(2, 2, requires_grad=True)
    tree = {"model": {"w": weight}, "opt": [torch.zeros(3), (torch.ones(1), 5)], "step": 4, "names": ["a"]}
    copied = _copy(tree, torch.device("cpu"))
    same_device = _copy(tree, None)
    with torch.no_grad():
        weight.add_(1.0)
    tree["opt"][0].add_(1.0)
    tree["names"].append("b")
    for c in (copied, same_device):
        assert torch.equal(c["model"]["w"], torch.ones(2, 2)) and not c["model"]["w"].requires_grad
        assert torch.equal(c["opt"][0], torch.zeros(3))
        assert isinstance(c["opt"][1], tuple) and c["opt"][1][1] == 5
        assert c["step"] == 4 and c["names"] == ["a"]


# ---- 5. StepGuard on one rank --------------------------------------------------------------------------------
# The hook's protocol per bucket: check_local (before compression; a non-finite sum turns the first element, the
# sentinel, into NaN), reduce (world 1: the identity), check_reduced (reads the sentinel, or every element when
# the compressor's format can overflow). decide() then reads what was recorded.

def _guard():
    guard = StepGuard()
    guard.arm()
    return guard


def _bucket(guard, bucket, every_element=False):
    guard.check_local(bucket)
    guard.check_reduced(bucket, every_element=every_element)
    return bucket


def _decide(guard, step=0, optimizer=None, scaler=None):
    return guard.decide(optimizer, scaler, None, 0, 1, step=step)


def test_finite_buckets_are_not_skipped_and_not_touched():
    guard = _guard()
    first = torch.randn(100, generator=torch.Generator().manual_seed(0))
    first[0] = -0.0
    original = first.clone()
    _bucket(guard, first)
    _bucket(guard, torch.randn(10))
    assert torch.equal(first, original) and math.copysign(1.0, float(first[0])) == -1.0  # bit for bit, -0.0 too
    verdict = _decide(guard, step=3)
    assert (verdict.step, verdict.skipped, verdict.bad_loss_ranks, verdict.bad_grad_ranks) == (3, False, [], [])
    assert verdict.scale == 1.0 and verdict.describe() == "global step 3: finite"


@pytest.mark.parametrize("bad", [NAN, INF, -INF])
def test_a_non_finite_local_element_poisons_the_sentinel_and_skips(bad):
    guard = _guard()
    _bucket(guard, torch.randn(10))
    second = torch.randn(50)
    second[17] = bad
    kept = second.clone()
    _bucket(guard, second)
    assert math.isnan(float(second[0]))
    assert torch.equal(second[1:].view(torch.int32), kept[1:].view(torch.int32))  # only the sentinel changed
    verdict = _decide(guard, step=5)
    assert verdict.skipped and verdict.step == 5
    assert verdict.bad_loss_ranks == [] and verdict.bad_grad_ranks == [0]
    assert verdict.describe() == "global step 5: non-finite local gradient on rank(s) [0]"


def test_another_ranks_nan_arrives_as_a_reduced_sentinel():
    guard = _guard()
    guard.loss_factor(torch.tensor(1.0), 1.0)
    guard.check_local(torch.randn(8))  # finite here
    guard.check_reduced(torch.tensor([NAN, 1.0, 2.0]))  # the sum carried another rank's sentinel
    verdict = _decide(guard, step=9)
    assert verdict.skipped and verdict.bad_loss_ranks == [] and verdict.bad_grad_ranks == []
    assert verdict.describe() == ("global step 9: every local loss and gradient finite, the reduced gradient not "
                                  "(an overflow in the all-reduce or the compressor)")


def test_plus_and_minus_inf_sentinels_in_different_buckets_are_skipped():
    guard = _guard()
    guard.check_reduced(torch.tensor([INF, 1.0]))
    guard.check_reduced(torch.tensor([-INF, 1.0]))
    assert _decide(guard).skipped


def test_an_overflowing_compressor_has_every_reduced_element_checked():
    overflowed = torch.tensor([1.0, 2.0, INF, 3.0])  # e.g. fp16 on the wire: finite inputs, Inf out
    guard = _guard()
    guard.check_reduced(overflowed.clone())
    assert not _decide(guard).skipped  # only the sentinel is read by default
    guard.check_reduced(overflowed.clone(), every_element=True)
    assert _decide(guard).skipped


def test_large_finite_buckets_are_not_skipped():
    guard = _guard()
    big = _bucket(guard, torch.full((1000,), 1e30))  # sum 1e33: finite in float32
    assert torch.equal(big, torch.full((1000,), 1e30))
    guard.check_reduced(torch.full((10_000,), 3e38))  # the sentinel of a huge but finite reduced bucket
    _bucket(guard, torch.full((100,), 3e38, dtype=torch.bfloat16)[:1].clone())
    assert not _decide(guard).skipped


def test_empty_buckets_are_ignored():
    guard = _guard()
    _bucket(guard, torch.empty(0))
    assert not _decide(guard).skipped


def test_a_finite_float16_bucket_is_not_skipped():
    guard = _guard()
    bucket = _bucket(guard, torch.full((100_000,), 1.0, dtype=torch.float16))
    assert bool(torch.isfinite(bucket).all())
    assert not _decide(guard).skipped


def test_loss_factor_and_a_nan_loss_named_in_the_verdict():
    guard = _guard()
    finite = guard.loss_factor(torch.tensor(2.5), 0.5)
    assert finite.item() == 0.5 and finite.dtype == torch.float32
    assert guard.loss_factor(torch.tensor(-3.0e38), 0.25).item() == 0.25
    assert not _decide(guard).skipped  # finite losses and nothing reduced: a good step
    for bad in (NAN, INF, -INF):
        assert math.isnan(guard.loss_factor(torch.tensor(bad), 0.5).item()), bad
    assert math.isnan(guard.loss_factor(torch.tensor(INF, dtype=torch.float16), 0.25).item())
    _decide(guard)
    factor = guard.loss_factor(torch.tensor(NAN), 0.5)
    _bucket(guard, torch.full((4,), 1.0) * factor)  # what the NaN factor does to the gradient
    verdict = _decide(guard, step=7)
    assert verdict.skipped and verdict.bad_loss_ranks == [0] and verdict.bad_grad_ranks == [0]
    assert verdict.describe() == "global step 7: non-finite loss on rank(s) [0]"  # the gradient follows the loss


def test_a_later_finite_loss_does_not_hide_an_earlier_nan_one():
    guard = _guard()  # two backward passes in one step (gradient accumulation)
    guard.loss_factor(torch.tensor(NAN), 1.0)
    guard.loss_factor(torch.tensor(1.0), 1.0)
    guard.check_reduced(torch.tensor([NAN]))
    assert _decide(guard).bad_loss_ranks == [0]


def test_verdicts_pop_in_order_and_the_step_state_resets():
    guard = _guard()
    guard.check_reduced(torch.tensor([NAN]))
    _decide(guard, step=10)
    _decide(guard, step=11)  # the last step's buckets do not leak into this one
    guard.check_reduced(torch.tensor([INF]))
    _decide(guard, step=12)
    verdicts = guard.pop_verdicts()
    assert [(v.step, v.skipped) for v in verdicts] == [(10, True), (11, False), (12, True)]
    assert guard.pop_verdicts() == [] and guard.steps == 3
    guard.check_reduced(torch.tensor([NAN]))
    guard.disarm()
    assert not guard.armed and not _decide(guard).skipped


def test_step_verdict_describe():
    assert StepVerdict(step=7, skipped=True, bad_loss_ranks=[1]).describe() == (
        "global step 7: non-finite loss on rank(s) [1]")
    assert StepVerdict(step=7, skipped=True, bad_loss_ranks=[1], bad_grad_ranks=[1, 3], scale=1024.0).describe() == (
        "global step 7: non-finite loss on rank(s) [1]; non-finite local gradient on rank(s) [3] at loss scale 1024")
    assert StepVerdict(step=8, skipped=True, bad_grad_ranks=[0, 2]).describe() == (
        "global step 8: non-finite local gradient on rank(s) [0, 2]")
    assert StepVerdict(step=9, skipped=True, scale=0.5).describe() == (
        "global step 9: every local loss and gradient finite, the reduced gradient not (an overflow in the "
        "all-reduce or the compressor) at loss scale 0.5")
    assert StepVerdict(step=9, skipped=False, bad_loss_ranks=[1]).describe() == "global step 9: finite"


@pytest.mark.parametrize("bad", [False, True])
def test_decide_with_a_loss_scaler_asks_the_unscaled_gradients(bad):
    guard = _guard()
    scaler = _scaler()
    model, opt = _model()
    _backward(scaler, model, opt, bad=bad)
    guard.check_reduced(torch.full((3,), NAN))  # ignored under loss scaling: the scaler's unscale_ decides
    verdict = _decide(guard, step=4, optimizer=opt, scaler=scaler)
    assert verdict.skipped == bad and verdict.scale == 1024.0 and verdict.step == 4
    assert torch.equal(model.bias.grad, torch.ones(2))  # unscaled by the decision
    before = _weights(model)
    if bad:  # what the strategy does with a skipped step
        assert verdict.bad_grad_ranks == [] and verdict.describe().endswith("at loss scale 1024")
        scaler.skip(opt)
    else:
        scaler.step(opt)  # the precision plugin's own unscale_ after the decision is a no-op
    scaler.update()
    assert torch.equal(model.bias.detach(), before[1] if bad else before[1] - 0.5)
    assert scaler.scale_value == 1024.0  # hysteresis 2: one bad step does not cut


# ---- 6. replicas ---------------------------------------------------------------------------------------------

def _net():
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))


def test_fingerprints_see_a_one_ulp_move_and_nothing_else():
    net = _net()
    names, hashes = replicas.fingerprints(net)
    assert names == ["0.weight", "0.bias", "1.weight", "1.bias", "1.running_mean", "1.running_var",
                     "1.num_batches_tracked"]
    assert hashes.dtype == torch.int64 and hashes.shape == (7, 2)
    assert torch.equal(replicas.fingerprints(_net())[1], hashes)  # the same weights: the same hashes
    with torch.no_grad():
        w = net[0].weight
        w[1, 2] = torch.nextafter(w[1, 2], torch.tensor(INF))
    moved = replicas.fingerprints(net)[1]
    assert (moved != hashes).all(dim=1).tolist() == [True, False, False, False, False, False, False]
    with torch.no_grad():
        net[1].running_var[0] = torch.nextafter(net[1].running_var[0], torch.tensor(-INF))
    assert (replicas.fingerprints(net)[1] != hashes).any(dim=1).tolist() == [True, False, False, False, False, True,
                                                                              False]


def test_fingerprints_see_two_elements_each_one_ulp_off():
    net = nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        net.weight.fill_(1.0)
    before = replicas.fingerprints(net)[1]
    with torch.no_grad():
        net.weight.copy_(torch.nextafter(net.weight, torch.tensor(INF)))  # both elements one ulp up
    assert not torch.equal(replicas.fingerprints(net)[1], before)


def test_compare_without_a_process_group_agrees():
    assert not torch.distributed.is_initialized()
    report = replicas.compare(_net())
    assert report.agree and report.checked == 7 and report.mismatched == {}
    assert report.describe() == "all 7 tensors agree on every rank"
    assert replicas.repair(_net()) == 0


def test_drift_report_describe_and_its_limit():
    report = DriftReport(checked=10, mismatched={"b": [1], "a": [1, 2]})
    assert not report.agree
    assert report.describe() == "2 of 10 tensors differ from rank 0: a (ranks [1, 2]), b (ranks [1])"
    many = DriftReport(checked=10, mismatched={f"t{i}": [3] for i in range(7)})
    assert many.describe() == ("7 of 10 tensors differ from rank 0: t0 (ranks [3]), t1 (ranks [3]), t2 (ranks [3]), "
                               "t3 (ranks [3]), t4 (ranks [3]) and 2 more")
    assert many.describe(limit=7).endswith("t6 (ranks [3])")
    assert many.describe(limit=2).endswith("t1 (ranks [3]) and 5 more")


# ---- 7. the compressors' loss-scale seam -------------------------------------------------------------------------

LAYOUT = BucketLayout.of([("fc.weight", torch.Size([20, 10])), ("fc.bias", torch.Size([20]))])


def _grad(seed, scale=1.0):
    return scale * torch.randn(LAYOUT.numel, generator=torch.Generator().manual_seed(seed))


def _residuals(compressor):
    return {name: compressor.residuals.get(name).clone() for name in LAYOUT.names}


def _reduce(compressor, flat, commit=True):
    out = emulate_reduce([compressor], [flat], LAYOUT)[0]
    if commit:
        compressor.commit()
    return out


def test_set_grad_scale_rescales_residuals_and_follows_into_the_inner_compressor():
    c = build_compressor("topk", ratio=0.1)
    assert isinstance(c, ErrorFeedback) and c.grad_scale == c.inner.grad_scale == 1.0
    _reduce(c, _grad(0))
    saved = _residuals(c)
    assert all(float(r.abs().sum()) > 0 for r in saved.values())
    c.set_grad_scale(2.0)
    c.set_grad_scale(8.0)
    for name in LAYOUT.names:
        assert torch.equal(c.residuals.get(name), saved[name] * 8.0), name
    assert c.grad_scale == c.inner.grad_scale == 8.0
    c.set_grad_scale(8.0)  # unchanged: nothing rescaled
    assert torch.equal(c.residuals.get("fc.bias"), saved["fc.bias"] * 8.0)
    c.set_grad_scale(1.0)
    assert torch.equal(c.residuals.get("fc.weight"), saved["fc.weight"])


def test_staged_and_committed_residuals_are_both_rescaled():
    c = build_compressor("topk", ratio=0.1)
    _reduce(c, _grad(0))
    committed = _residuals(c)
    _reduce(c, _grad(1), commit=False)  # a step in flight: its residuals are staged
    staged = _residuals(c)
    c.set_grad_scale(4.0)
    assert all(torch.equal(c.residuals.get(n), staged[n] * 4.0) for n in LAYOUT.names)
    c.discard()  # the step is skipped: the committed residuals, in the new units
    assert all(torch.equal(c.residuals.get(n), committed[n] * 4.0) for n in LAYOUT.names)


def test_a_scaled_run_is_the_unscaled_run_times_the_scale():
    # powers of two commute exactly with top-k's selection and the bf16 values: the scaled compressor's
    # output and residuals are the unscaled one's times the scale, bit for bit, across scale changes
    plain, scaled = build_compressor("topk", ratio=0.1), build_compressor("topk", ratio=0.1)
    for step, scale in enumerate((4.0, 4.0, 1024.0, 0.5)):
        scaled.set_grad_scale(scale)
        expected = _reduce(plain, _grad(step))
        out = _reduce(scaled, _grad(step, scale))
        assert torch.equal(out, expected * scale), step
        assert all(torch.equal(scaled.residuals.get(n), plain.residuals.get(n) * scale) for n in LAYOUT.names)


@pytest.mark.parametrize("bad", [0, 0.0, -1.0, INF, NAN])
def test_set_grad_scale_rejects_a_non_positive_or_non_finite_scale(bad):
    c = build_compressor("topk", ratio=0.1)
    c.set_grad_scale(8.0)
    with pytest.raises(ValueError, match="grad_scale=.* must be a positive finite loss scale"):
        c.set_grad_scale(bad)
    assert c.grad_scale == c.inner.grad_scale == 8.0
    with pytest.raises(ValueError, match="grad_scale="):
        ThresholdCompressor().set_grad_scale(bad)


def test_grad_scale_round_trips_through_the_state_dict():
    c = build_compressor("topk", ratio=0.1)
    _reduce(c, _grad(0))
    c.set_grad_scale(8.0)
    state = c.state_dict()
    assert state["grad_scale"] == 8.0 and state["inner"]["grad_scale"] == 8.0
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    restored = build_compressor("topk", ratio=0.1)
    restored.load_state_dict(torch.load(buffer, weights_only=True))
    assert restored.grad_scale == restored.inner.grad_scale == 8.0
    assert all(torch.equal(restored.residuals.get(n), c.residuals.get(n)) for n in LAYOUT.names)
    restored.set_grad_scale(2.0)  # the resumed run's scale: the residuals follow from the saved units
    assert all(torch.equal(restored.residuals.get(n), c.residuals.get(n) / 4.0) for n in LAYOUT.names)
    old = {k: v for k, v in state.items() if k != "grad_scale"}  # a checkpoint from before loss scaling
    restored.load_state_dict(old)
    assert restored.grad_scale == 1.0


def test_threshold_applies_to_unscaled_values():
    flat = torch.tensor([0.5, 1.9, 2.0, -2.0, -1.99, 3.0, NAN, -INF, 0.0, 2.5])
    layout = BucketLayout.single(flat.numel())
    compressor = ThresholdCompressor(threshold=0.5, max_ratio=1.0)
    assert sorted(compressor.select(flat, layout).tolist()) == [0, 1, 2, 3, 4, 5, 6, 7, 9]
    compressor.set_grad_scale(4.0)
    assert sorted(compressor.select(flat, layout).tolist()) == [2, 3, 5, 6, 7, 9]
    wrapped = build_compressor("threshold", threshold=0.5, max_ratio=1.0)
    wrapped.set_grad_scale(4.0)
    assert sorted(wrapped.inner.select(flat, layout).tolist()) == [2, 3, 5, 6, 7, 9]


def test_clip_norm_applies_to_unscaled_gradients():
    scale = 4.0
    scaled = build_compressor("topk", ratio=1.0, clip_norm=0.5, value_dtype="fp32")
    scaled.set_grad_scale(scale)
    out = _reduce(scaled, torch.full((LAYOUT.numel,), 10.0))
    for view in LAYOUT.views(out):
        assert abs(float(view.norm()) - 0.5 * scale) < 1e-5  # clipped to c * S: unscaled, to c
    unscaled = build_compressor("topk", ratio=1.0, clip_norm=0.5, value_dtype="fp32")
    reference = _reduce(unscaled, torch.full((LAYOUT.numel,), 10.0 / scale))
    assert torch.allclose(out / scale, reference, rtol=1e-6, atol=0)
    # a gradient whose scaled norm is above c but whose unscaled norm is below it is left alone
    small = torch.zeros(LAYOUT.numel)
    small[0], small[LAYOUT.offsets[1]] = 1.0, 1.0
    assert torch.equal(_reduce(scaled, small), small)


def test_loss_scaler_is_exported():
    from lightning_dist import LossScaler as exported

    assert issubclass(exported, torch.amp.GradScaler)
