"""NaNRecovery with injected faults on 2 gloo ranks, Lightning in-process: one launched group serves every assertion.

Faults: a NaN loss on one rank, an Inf in one gradient element on one rank (every compressor), persistent
NaN (rollback, then recovery), NaN that never ends (a clear error on every rank), a forced replica drift;
under 32-bit, bf16-mixed and fp16 loss scaling, and with heterogeneous batches.

A skipped step is checked against a run that never saw its batch (the same setting, that global batch left out of
the data): bit for bit the same weights, since a skipped step must leave weights and optimizer state as they were. A
rollback is checked against a clean run of the snapshot's steps continued at the reduced learning rate from that
run's weights and momentum.
"""

from __future__ import annotations

import copy
import warnings

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins import MixedPrecision
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import TensorDataset

from lightning_dist import NaNRecovery, RingDDPStrategy
from lightning_dist.callbacks import NaNRecoveryError
from lightning_dist.compression import COMPRESSORS, build_compressor
from lightning_dist.hetero import HeteroBatching
from lightning_dist.testing import RecordingLogger, ToyClassifier, launched_externally, quiet_trainer, run_ranks

pytestmark = pytest.mark.slow  # one launched group of 2 ranks serves every test

N_SAMPLES, BATCH, STEPS = 96, 8, 6  # 2 ranks: 6 optimizer steps per epoch
SETTINGS = {"topk": {"ratio": 0.1}, "threshold": {"threshold": 1e-3, "max_ratio": 0.2}, "powersgd": {"rank": 2}}


class Net(ToyClassifier):
    """Faults by (rank, global step): ``nan_loss`` adds NaN to the loss, ``inf_grad`` puts +Inf into one element
    of the first layer's weight gradient before DDP takes it; ``nan_batch``, by (rank, batch index), adds NaN to the
    loss of one micro-batch only; ``drop`` removes those global batches from the data (the reference for a skipped
    step: the same updates, one fewer step). The same initial weights in every fit; Lightning's own sampler always
    shuffles training data, by a permutation that depends on the length: the loader brings an unshuffled one."""

    def __init__(self, nan_loss=(), inf_grad=(), drop=(), value=float("inf"), nan_batch=()):
        super().__init__(features=16, hidden=(32,), classes=4, samples=N_SAMPLES, batch_size=BATCH, momentum=0.9,
                         distributed_sampler=True, seed=0)
        self.nan_loss, self.inf_grad, self.drop, self.value = set(nan_loss), set(inf_grad), set(drop), value
        self.nan_batch = set(nan_batch)
        self.net[0].weight.register_hook(self._poison)

    def _poison(self, grad):
        if (self.global_rank, self.trainer.global_step) in self.inf_grad:
            grad = grad.clone()
            grad[1, 2] = self.value
        return grad

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        rank = self.global_rank
        if (rank, self.trainer.global_step) in self.nan_loss or (rank, batch_idx) in self.nan_batch:
            loss = loss + float("nan")
        return loss

    def dataset(self):
        x, y = self.data()
        # global batch k holds samples 16k..16k+15 (DistributedSampler, no shuffle)
        keep = [i for i in range(N_SAMPLES) if i // (2 * BATCH) not in self.drop]
        return TensorDataset(x[keep], y[keep])


class Drift(Callback):
    """Nudges one weight on rank 1 by one ulp after global step ``at`` (before NaNRecovery's check)."""

    def __init__(self, at):
        self.at = at

    def on_train_batch_end(self, trainer, pl_module, *args):
        if trainer.global_rank == 1 and trainer.global_step == self.at:
            with torch.no_grad():
                w = pl_module.net[2].weight
                w[0, 0] = torch.nextafter(w[0, 0], torch.tensor(1.0))


class Record(Callback):
    """After every training batch (listed after NaNRecovery: what its rollback left), by global step: the weights,
    the optimizer's momentum buffers and its learning rate."""

    def __init__(self):
        self.seen = {}

    def on_train_batch_end(self, trainer, pl_module, *args):
        optimizer = trainer.optimizers[0]
        self.seen[trainer.global_step] = (_flat(pl_module), _momentum(optimizer), optimizer.param_groups[0]["lr"])


class LoadOptimizer(Callback):
    """At the start of training: the optimizer's state from ``state``, at learning rate ``lr``."""

    def __init__(self, state, lr):
        self.state, self.lr = state, lr

    def on_train_start(self, trainer, pl_module):
        optimizer = trainer.optimizers[0]
        optimizer.load_state_dict(copy.deepcopy(self.state))
        for group in optimizer.param_groups:
            group["lr"] = self.lr


def _flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _momentum(optimizer):
    return torch.cat([optimizer.state[p]["momentum_buffer"].reshape(-1) for group in optimizer.param_groups
                      for p in group["params"]])


def _fit(strategy, model, callbacks=(), **kwargs):
    pl.seed_everything(0, verbose=False)
    trainer = quiet_trainer(**{"devices": 2, "max_epochs": 1, "use_distributed_sampler": False, "strategy": strategy,
                               "callbacks": list(callbacks), **kwargs})
    trainer.fit(model)
    return trainer, _flat(model)


def _faults(rank, world_size):
    out = {}
    with launched_externally(rank, world_size), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # 1. NaN loss on rank 1 at step 2, against a run that skips step 2's batch on every rank
        _, out["reference"] = _fit(RingDDPStrategy(), Net(drop=[2]))
        _, out["ddp_reference"] = _fit(DDPStrategy(), Net(drop=[2]))
        memory = RecordingLogger()
        cb = NaNRecovery()
        _, weights = _fit(RingDDPStrategy(), Net(nan_loss={(1, 2)}), [cb], logger=memory, log_every_n_steps=1)
        out["nan_loss"] = (weights, cb.skipped, list(cb.history), memory.logged)
        _, out["no_recovery"] = _fit(RingDDPStrategy(), Net(inf_grad={(1, 2)}))
        # 2. Inf in one gradient element on rank 0, with every compressor and without
        for name in COMPRESSORS:
            ref_compressor = build_compressor(name, **SETTINGS.get(name, {}))
            _, reference = _fit(RingDDPStrategy(compressor=ref_compressor), Net(drop=[3]))
            cb = NaNRecovery()
            compressor = build_compressor(name, **SETTINGS.get(name, {}))
            _, weights = _fit(RingDDPStrategy(compressor=compressor), Net(inf_grad={(0, 3)}), [cb])
            out[f"inf_{name}"] = (weights, reference, cb.skipped, list(cb.history))
        # nothing to recover: the guard changes no bit (stock DDP's weights)
        _, out["clean_guarded"] = _fit(RingDDPStrategy(), Net(), [NaNRecovery()])
        _, out["clean_ddp"] = _fit(DDPStrategy(), Net())
        # a finite gradient that fp16's wire format cannot hold (1e6 / 2 ranks > 65504): the reduced bucket is
        # checked in full for fp16, so the overflow is caught though every local gradient was finite
        cb = NaNRecovery()
        _, weights = _fit(RingDDPStrategy(compressor="fp16"), Net(inf_grad={(1, 3)}, value=1e6), [cb])
        out["fp16_overflow"] = (weights, cb.skipped, list(cb.history))
        # gradient accumulation: a NaN in the first micro-batch of step 1 only (global batch 2 of 2 and 3), against
        # a run without batches 2 and 3
        cb = NaNRecovery()
        _, weights = _fit(RingDDPStrategy(), Net(nan_batch={(0, 2)}), [cb], accumulate_grad_batches=2)
        _, reference = _fit(RingDDPStrategy(), Net(drop=[2, 3]), accumulate_grad_batches=2)
        out["accumulate"] = (weights, cb.skipped, reference)
        # 3. blocking hook (the reference of 1.: the hook's arithmetic is the overlapping one's), bf16-mixed,
        # heterogeneous batches, each against the same setting without that step's batch
        cb = NaNRecovery()
        _, weights = _fit(RingDDPStrategy(overlap=False), Net(nan_loss={(0, 2)}), [cb])
        out["blocking"] = (weights, cb.skipped, out["reference"])
        cb = NaNRecovery()
        _, weights = _fit(RingDDPStrategy(), Net(nan_loss={(1, 1)}), [cb], precision="bf16-mixed")
        _, reference = _fit(RingDDPStrategy(), Net(drop=[1]), precision="bf16-mixed")
        out["bf16"] = (weights, cb.skipped, reference)
        cb = NaNRecovery()
        _, weights = _fit(RingDDPStrategy(hetero=HeteroBatching(batch_sizes=[12, 4])), Net(inf_grad={(1, 2)}), [cb])
        _, reference = _fit(RingDDPStrategy(hetero=HeteroBatching(batch_sizes=[12, 4])), Net(drop=[2]))
        out["hetero"] = (weights, cb.skipped, reference)
        # 4. fp16 loss scaling on the CPU: the GradScaler becomes a LossScaler; two bad steps in a row cut
        # the scale once (hysteresis 2); error-feedback residuals follow the scale
        for name in ("none", "topk"):
            cb = NaNRecovery(init_scale=2.0**10, hysteresis=2)
            plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**10))
            trainer, weights = _fit(RingDDPStrategy(compressor=build_compressor(name, **SETTINGS.get(name, {}))),
                                    Net(nan_loss={(1, 1), (1, 2)}), [cb], plugins=[plugin])
            scaler = trainer.precision_plugin.scaler
            out[f"fp16_{name}"] = (weights, cb.skipped, type(scaler).__name__, scaler.scale_value,
                                   trainer.strategy.features.compressor.grad_scale)
        # ... and at the floor: 4 -> 2 -> 1, then a bad step at min_scale=1 stops every rank
        cb = NaNRecovery(init_scale=4.0, hysteresis=1, min_scale=1.0, rollback_after=0)
        plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=4.0))
        try:
            _fit(RingDDPStrategy(), Net(nan_loss={(0, s) for s in range(1, 100)}), [cb], plugins=[plugin])
            out["fp16_floor"] = None
        except NaNRecoveryError as error:
            out["fp16_floor"] = (str(error), cb.skipped)
        # 5. persistent NaN: rollback to the snapshot of step 2, learning rate halved, then recovery. The reference:
        # a clean run of 2 steps (the snapshot), then one epoch from its weights and momentum at half the rate (the
        # faulty run's epoch 2: the batches of steps 3-5 are not replayed)
        cb, record = NaNRecovery(rollback_after=3, snapshot_every=2, lr_factor=0.5), Record()
        trainer, weights = _fit(RingDDPStrategy(), Net(nan_loss={(0, 3), (0, 4), (0, 5)}), [cb, record],
                                max_epochs=2)
        out["rollback"] = (weights, cb.rollbacks, cb.skipped, list(cb.history),
                           trainer.optimizers[0].param_groups[0]["lr"], cb.state_dict(), record.seen[6])
        model = Net()
        trainer, at_step_2 = _fit(RingDDPStrategy(), model, max_steps=2)
        state = copy.deepcopy(trainer.optimizers[0].state_dict())
        momentum = _momentum(trainer.optimizers[0])
        _, continued = _fit(RingDDPStrategy(), model, [LoadOptimizer(state, lr=0.05)])
        out["rollback_reference"] = (at_step_2, momentum, continued)
        # 6. NaN that never ends: every rank stops with the same clear error
        cb = NaNRecovery(rollback_after=2, snapshot_every=1, max_rollbacks=1)
        try:
            _fit(RingDDPStrategy(), Net(nan_loss={(1, s) for s in range(2, 100)}), [cb], max_epochs=3)
            out["unrecoverable"] = None
        except NaNRecoveryError as error:
            out["unrecoverable"] = (str(error), cb.rollbacks)
        # 7. a one-ulp drift on rank 1 after step 3, found at the check after step 4 and repaired
        cb = NaNRecovery(drift_check_every=2)
        _, weights = _fit(RingDDPStrategy(), Net(), [Drift(at=3), cb])
        out["drift"] = (weights, cb.drift_checks, cb.drift_mismatches, list(cb.history))
        cb = NaNRecovery(drift_check_every=2, on_drift="stop")
        try:
            _fit(RingDDPStrategy(), Net(), [Drift(at=3), cb])
            out["drift_stop"] = None
        except NaNRecoveryError as error:
            out["drift_stop"] = str(error)
        # 8. another strategy: a clear error, before any step
        try:
            _fit(DDPStrategy(), Net(), [NaNRecovery()])
            out["stock_ddp"] = None
        except ValueError as error:
            out["stock_ddp"] = str(error)
    return out


@pytest.fixture(scope="module")
def faults():
    return run_ranks(_faults, 2, deadline_s=200)


def _same_on_both(results, key, index=0):
    a, b = results[0][key], results[1][key]
    a, b = (a[index], b[index]) if isinstance(a, tuple) else (a, b)
    assert torch.equal(a, b), f"{key}: ranks differ"
    assert torch.isfinite(a).all(), f"{key}: non-finite weights"
    return a


def test_nan_loss_on_one_rank_skips_on_both_and_equals_skipping_that_batch(faults):
    reference = _same_on_both(faults, "reference")
    assert torch.equal(reference, faults[0]["ddp_reference"])  # the reference is stock DDP's too
    weights = _same_on_both(faults, "nan_loss")
    assert torch.equal(weights, reference)
    _, skipped, history, _ = faults[0]["nan_loss"]
    assert skipped == 1
    assert history == [{"kind": "skip", "global_step": 2, "detail": "global step 2: non-finite loss on rank(s) [1]"}]
    assert not torch.isfinite(faults[0]["no_recovery"]).all()  # without it, an Inf gradient reaches the weights


def test_metrics_are_logged_from_rank_zero(faults):
    logged = faults[0]["nan_loss"][3]
    assert faults[1]["nan_loss"][3] == []
    nan_logs = [(step, m) for step, m in logged if "nan/skipped_steps" in m]
    assert [m["nan/skipped_steps"] for step, m in nan_logs if step >= 3] == [1.0] * (STEPS - 2)
    assert {m["nan/loss_scale"] for _, m in nan_logs} == {1.0}
    assert {"nan/rollbacks", "nan/drift_checks", "nan/drift_mismatches"} <= set(nan_logs[0][1])


@pytest.mark.parametrize("name", list(COMPRESSORS))
def test_inf_in_one_gradient_element_with_every_compressor(faults, name):
    weights = _same_on_both(faults, f"inf_{name}")
    _, reference, skipped, history = faults[0][f"inf_{name}"]
    assert skipped == 1
    assert history[0]["detail"] == "global step 3: non-finite local gradient on rank(s) [0]"
    assert torch.equal(weights, reference), f"{name}: not the run that skipped step 3"


def test_without_faults_the_guard_changes_no_bit(faults):
    assert torch.equal(_same_on_both(faults, "clean_guarded"), faults[0]["clean_ddp"])


def test_an_overflow_in_fp16_compression_is_caught(faults):
    _same_on_both(faults, "fp16_overflow")
    _, skipped, history = faults[0]["fp16_overflow"]
    assert skipped == 1 and "every local loss and gradient finite" in history[0]["detail"]


@pytest.mark.parametrize("key", ["blocking", "bf16", "hetero", "accumulate"])
def test_blocking_hook_bf16_hetero_and_accumulation_equal_the_run_without_that_batch(faults, key):
    weights = _same_on_both(faults, key)
    _, skipped, reference = faults[0][key]
    assert skipped == 1
    assert torch.equal(weights, reference), f"{key}: not the run without the skipped step's batch"


@pytest.mark.parametrize("name", ["none", "topk"])
def test_fp16_loss_scaling_backs_off_with_hysteresis(faults, name):
    _same_on_both(faults, f"fp16_{name}")
    _, skipped, kind, scale, grad_scale = faults[0][f"fp16_{name}"]
    assert (skipped, kind, scale) == (2, "LossScaler", 2.0**9)  # two bad steps, one cut (hysteresis 2)
    if name == "topk":
        assert grad_scale == 2.0**9  # the compressor followed the scale


def test_a_bad_step_at_the_minimum_scale_stops_every_rank(faults):
    text, skipped = faults[0]["fp16_floor"]
    assert faults[1]["fp16_floor"] == (text, skipped)
    assert skipped == 3  # scale 4 and 2 backed off, then bad at 1
    assert "non-finite at the minimum loss scale (min_scale=1)" in text and "loss on rank(s) [0]" in text


def test_persistent_nan_rolls_back_then_recovers(faults):
    weights = _same_on_both(faults, "rollback")
    _, rollbacks, skipped, history, lr, state, after_rollback = faults[0]["rollback"]
    assert (rollbacks, skipped, lr) == (1, 3, 0.05)
    assert [h["kind"] for h in history] == ["skip", "skip", "skip", "rollback"]
    assert "restored the snapshot of global step 2" in history[-1]["detail"]
    assert state["rollbacks"] == 1 and state["skipped"] == 3 and state["consecutive"] == 0
    at_step_2, momentum, continued = faults[0]["rollback_reference"]
    # right after the rollback (global step 6): the weights and momentum of a clean run's step 2, the rate halved
    restored_weights, restored_momentum, restored_lr = after_rollback
    assert torch.equal(restored_weights, at_step_2) and torch.equal(restored_momentum, momentum)
    assert restored_lr == 0.05
    # and the rest of the run is that state trained on at half the rate, bit for bit
    assert torch.equal(weights, continued)
    assert torch.equal(continued, faults[1]["rollback_reference"][2])


def test_unrecoverable_stops_every_rank_with_a_clear_error(faults):
    messages = [r["unrecoverable"] for r in faults]
    assert all(m is not None for m in messages)
    assert messages[0] == messages[1]
    text, rollbacks = messages[0]
    assert rollbacks == 1
    assert "after 1 rollback(s) (max_rollbacks=1)" in text
    assert "non-finite loss on rank(s) [1]" in text
    assert "global step" in text and "lower learning rate" in text


def test_drift_is_found_and_repaired(faults):
    _same_on_both(faults, "drift")
    _, checks, mismatches, history = faults[0]["drift"]
    assert (checks, mismatches) == (STEPS // 2, 1)
    assert history[0]["kind"] == "drift" and "net.2.weight (ranks [1])" in history[0]["detail"]
    assert all("replicas differ" in r["drift_stop"] for r in faults)


def test_other_strategies_get_a_clear_error(faults):
    for r in faults:
        assert "NaNRecovery needs RingDDPStrategy" in r["stock_ddp"] and "DDPStrategy" in r["stock_ddp"]

