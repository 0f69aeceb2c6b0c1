"""Per-rank gradient accumulation (``HeteroBatching(accumulate=...)``) on 2 and 3 gloo ranks, Lightning in-process:
one launched group per world size serves every assertion.

The reference is the gradient path without micro-batches: stock DDP on the same samples at 2 ranks, and at 3 ranks
(where a global batch of 64 has no even split) a one-process replay of SGD over the union of the ranks' samples.
"""

from __future__ import annotations

import os
import warnings

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins import MixedPrecision
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import TensorDataset

from lightning_dist import NaNRecovery, RingDDPStrategy
from lightning_dist.compression import BucketLayout, build_compressor
from lightning_dist.compression.emulate import emulate_reduce
from lightning_dist.hetero import HeteroBatching
from lightning_dist.sync import DiLoCo
from lightning_dist.testing import ToyClassifier, launched_externally, quiet_trainer, run_ranks

pytestmark = pytest.mark.slow

N_SAMPLES, GLOBAL, STEPS = 768, 64, 20  # 12 steps per epoch (a multiple of 2 and 3 ranks)


class Net(ToyClassifier):
    """Records every training_step call (epoch, batch_idx, the sample indices of the micro-batch), logs its loss with
    ``sync_dist=True`` (a reduction ranks with fewer micro-batches would not join), and can turn one micro-batch's
    loss non-finite: ``bad=(rank, global_step, micro_batch)``."""

    def __init__(self, bad=None, batch_size=GLOBAL // 2):
        super().__init__(features=16, hidden=(32,), classes=4, samples=N_SAMPLES, batch_size=batch_size, shuffle=True,
                         lr=0.05, seed=0)
        self.calls: list[tuple[int, int, list[int]]] = []
        self.losses: list[tuple[int, float, int]] = []  # (epoch, loss, samples) of every call
        self.bad, self.first_grads = bad, None

    def dataset(self):
        return TensorDataset(*self.data(), torch.arange(N_SAMPLES))

    def training_step(self, batch, batch_idx):
        x, y, index = batch
        calls_this_step = sum(1 for c in self.calls if c[:2] == (self.current_epoch, batch_idx))
        self.calls.append((self.current_epoch, batch_idx, index.tolist()))
        loss = nn.functional.cross_entropy(self.net(x), y)
        if self.bad == (self.global_rank, self.trainer.global_step, calls_this_step):
            loss = loss * float("inf")
        self.losses.append((self.current_epoch, float(loss), len(index)))
        self.log("train/loss", loss, sync_dist=True, on_step=True, on_epoch=True)
        self.log("train/rank_loss", loss, on_step=False, on_epoch=True)  # this rank's mean over its samples
        return loss

    def on_before_optimizer_step(self, optimizer):
        if self.first_grads is None:
            self.first_grads = {n: p.grad.clone() for n, p in self.named_parameters()}


def _fit(strategy, model=None, callbacks=(), ckpt_path=None, **kwargs):
    pl.seed_everything(0, verbose=False)
    model = model or Net()
    trainer = quiet_trainer(**{"devices": dist.get_world_size(), "max_steps": STEPS, "strategy": strategy,
                               "callbacks": list(callbacks), **kwargs})
    trainer.fit(model, ckpt_path=ckpt_path, weights_only=True)
    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return model, trainer, weights


def _two_ranks(rank, world_size, workdir):
    out = {}
    capped = {"batch_sizes": [48, 16], "memory_caps": [16, 64]}  # rank 0: 3 micro-batches of 16
    with launched_externally(rank, world_size), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, _, weights = _fit(DDPStrategy())
        out["ddp"] = (model.calls, weights)
        model, trainer, weights = _fit(RingDDPStrategy(hetero=HeteroBatching(**capped)))
        out["auto"] = (model.calls, weights, float(trainer.callback_metrics["train/loss_epoch"]),
                       trainer.strategy.features.last_step["samples"])
        # accumulate="off": the cap moves samples, as batch_sizes=[16, 48] would (today's behaviour)
        model, _, weights = _fit(RingDDPStrategy(hetero=HeteroBatching(**capped, accumulate="off")))
        _, _, moved = _fit(RingDDPStrategy(hetero=HeteroBatching(batch_sizes=[16, 48])))
        out["off"] = (model.calls, weights, moved)
        # per-rank counts, with Lightning's own accumulation on top (2 Lightning batches per optimizer step)
        model, _, weights = _fit(DDPStrategy(), accumulate_grad_batches=2)
        out["ddp_acc2"] = (model.calls, weights)
        model, _, weights = _fit(RingDDPStrategy(hetero=HeteroBatching(batch_sizes=[48, 16], accumulate=[4, 1])),
                                 accumulate_grad_batches=2)
        out["counts_acc2"] = (model.calls, weights)
        # a compressor compresses the accumulated, sample-weighted gradient once per step
        compressor = build_compressor("topk", ratio=0.25, value_dtype="fp32")
        model, _, _ = _fit(RingDDPStrategy(hetero=HeteroBatching(**capped), compressor=compressor), max_steps=1)
        out["topk_first"] = (model.calls, model.first_grads)
        # fp16 loss scaling: rank 0's second micro-batch of step 3 overflows; every rank skips that step
        nan = NaNRecovery(init_scale=2.0**10, hysteresis=1)
        plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**10))
        _, trainer, weights = _fit(RingDDPStrategy(hetero=HeteroBatching(**capped)), Net(bad=(0, 3, 1)), [nan],
                                   plugins=[plugin], max_steps=6)
        out["fp16"] = (weights, nan.skipped, list(nan.history), trainer.precision_plugin.scaler.scale_value)
        # a checkpoint mid-epoch (step 13 of 20) resumes at the next batch, bit for bit
        _, _, straight = _fit(RingDDPStrategy(hetero=HeteroBatching(**capped)))
        checkpoint = ModelCheckpoint(dirpath=workdir, filename="mid", every_n_train_steps=13, save_top_k=-1)
        _fit(RingDDPStrategy(hetero=HeteroBatching(**capped)), callbacks=[checkpoint], enable_checkpointing=True,
             max_steps=13)
        model, _, resumed = _fit(RingDDPStrategy(hetero=HeteroBatching(**capped)),
                                 ckpt_path=os.path.join(workdir, "mid.ckpt"))
        out["resume"] = (straight, resumed, model.calls[0][:2])
        # DiLoCo (each rank a worker, a sync every 5 steps): the same run as without micro-batches, up to rounding
        _, _, micro = _fit(RingDDPStrategy(hetero=HeteroBatching(**capped), sync=DiLoCo(every=5)))
        _, _, whole = _fit(RingDDPStrategy(hetero=HeteroBatching(batch_sizes=[48, 16]), sync=DiLoCo(every=5)))
        out["diloco"] = (micro, whole)
    return out


def _three_ranks(rank, world_size):
    with launched_externally(rank, world_size), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # rank 0 runs its 40 samples as micro-batches of 14, 13 and 13
        hetero = HeteroBatching(batch_sizes=[40, 16, 8], memory_caps=[14, 16, 8], global_batch_size=GLOBAL)
        model, trainer, weights = _fit(RingDDPStrategy(hetero=hetero), Net(batch_size=22))
        return model.calls, weights, model.losses, float(trainer.callback_metrics["train/rank_loss"])


def _two_hosts(rank, world_size):
    with launched_externally(rank, world_size, hosts=2), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, _, stock = _fit(DDPStrategy(), Net(batch_size=16), devices=2, num_nodes=2)
        # the first rank of each host runs its 24 samples as 3 micro-batches of 8
        hetero = HeteroBatching(batch_sizes=[24, 8, 24, 8], memory_caps=[8, 8, 8, 8])
        model, trainer, weights = _fit(RingDDPStrategy(hetero=hetero, topology="two_tier"), Net(batch_size=16),
                                       devices=2, num_nodes=2)
        return model.calls, weights, stock, trainer.strategy.topology.kind


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    return run_ranks(_two_ranks, 2, str(tmp_path_factory.mktemp("accumulate")), deadline_s=240)


@pytest.fixture(scope="module")
def three():
    return run_ranks(_three_ranks, 3, deadline_s=120)


@pytest.fixture(scope="module")
def hosts():
    return run_ranks(_two_hosts, 4, deadline_s=120)


def _steps(calls):
    """(epoch, batch_idx) -> the micro-batches' sample indices, in call order."""
    steps: dict[tuple[int, int], list[list[int]]] = {}
    for epoch, batch_idx, index in calls:
        steps.setdefault((epoch, batch_idx), []).append(index)
    return steps


def _union(calls):
    """Every step's samples over all ranks (``calls``: each rank's), sorted."""
    per_rank = [_steps(c) for c in calls]
    return [sorted(i for rank in per_rank for piece in rank[step] for i in piece) for step in per_rank[0]]


def _close(got, want, rtol=1e-6):
    error = float((got - want).abs().max() / want.abs().max())
    assert error <= rtol, error


def test_a_capped_share_runs_as_micro_batches_and_trains_stock_ddps_weights(two):
    micro = _steps(two[0]["auto"][0])
    assert len(micro) == STEPS and all([len(p) for p in pieces] == [16, 16, 16] for pieces in micro.values())
    assert all(len(pieces) == 1 and len(pieces[0]) == 16 for pieces in _steps(two[1]["auto"][0]).values())
    # stock DDP's samples at every step
    assert _union([r["auto"][0] for r in two]) == _union([r["ddp"][0] for r in two])
    _close(two[0]["auto"][1], two[0]["ddp"][1])
    assert torch.equal(two[0]["auto"][1], two[1]["auto"][1])  # ranks bit-identical
    assert two[0]["auto"][2] == two[1]["auto"][2]  # self.log(sync_dist=True) ran, and agreed
    # a rank's samples (and so its measured speed) count every micro-batch of its step
    assert two[0]["auto"][3] == 48 and two[1]["auto"][3] == 16


def test_per_rank_counts_compose_with_lightnings_accumulation(two):
    micro = _steps(two[0]["counts_acc2"][0])
    assert all([len(p) for p in pieces] == [12, 12, 12, 12] for pieces in micro.values())
    assert _union([r["counts_acc2"][0] for r in two]) == _union([r["ddp_acc2"][0] for r in two])
    _close(two[0]["counts_acc2"][1], two[0]["ddp_acc2"][1])
    assert torch.equal(two[0]["counts_acc2"][1], two[1]["counts_acc2"][1])


def test_accumulate_off_keeps_caps_moving_samples(two):
    calls, weights, moved = two[0]["off"]
    assert all([len(p) for p in pieces] == [16] for pieces in _steps(calls).values())
    assert torch.equal(weights, moved)  # exactly the run with the capped sizes given


def test_a_compressor_compresses_the_accumulated_weighted_gradient(two):
    reference = Net()
    x, y, _ = reference.dataset().tensors
    weighted = []
    for r in range(2):
        pieces = _steps(two[r]["topk_first"][0])[(0, 0)]
        reference.zero_grad()
        for piece in pieces:  # micro-batch j weighs b_ij / B
            (nn.functional.cross_entropy(reference.net(x[piece]), y[piece]) * len(piece) / GLOBAL).backward()
        weighted.append(torch.cat([p.grad.reshape(-1) for p in reference.parameters()]))
    layout = BucketLayout.of([(n, p.shape) for n, p in reference.named_parameters()])
    emulated = emulate_reduce([build_compressor("topk", ratio=0.25, value_dtype="fp32") for _ in range(2)],
                              weighted, layout)[0]
    got = torch.cat([g.reshape(-1) for g in two[0]["topk_first"][1].values()])
    assert torch.allclose(got, emulated, atol=1e-6), float((got - emulated).abs().max())


def test_a_non_finite_micro_batch_under_fp16_skips_the_step_on_every_rank(two):
    weights, skipped, history, scale = two[0]["fp16"]
    assert skipped == 1 and two[1]["fp16"][1] == 1
    assert torch.isfinite(weights).all() and torch.equal(weights, two[1]["fp16"][0])
    assert scale == two[1]["fp16"][3] and scale < 2.0**10  # the scale backed off on both


def test_a_mid_epoch_checkpoint_resumes_at_the_next_step_bit_identically(two):
    for r in two:
        straight, resumed, first = r["resume"]
        assert first == (1, 1)  # step 13 of 20 was epoch 1's first batch: the resumed run starts after it
        assert torch.equal(straight, resumed), float((straight - resumed).abs().max())


def test_three_ranks_match_a_one_process_replay(three):
    micro = _steps(three[0][0])
    assert all([len(p) for p in pieces] == [14, 13, 13] for pieces in micro.values())
    assert all(torch.equal(three[0][1], r[1]) for r in three[1:])
    pl.seed_everything(0, verbose=False)
    reference = Net()
    x, y, _ = reference.dataset().tensors
    optimizer = reference.configure_optimizers()
    for index in _union([r[0] for r in three]):
        optimizer.zero_grad()
        nn.functional.cross_entropy(reference.net(x[index]), y[index]).backward()
        optimizer.step()
    _close(three[0][1], torch.cat([p.detach().reshape(-1) for p in reference.parameters()]))


def test_diloco_and_two_tiers_see_the_accumulated_gradient(two, hosts):
    micro, whole = two[0]["diloco"]
    _close(micro, whole)  # the same samples per rank and worker, in one pass or three
    assert torch.equal(micro, two[1]["diloco"][0])
    calls, weights, stock, kind = hosts[0]
    assert kind == "two_tier" and all([len(p) for p in pieces] == [8, 8, 8] for pieces in _steps(calls).values())
    _close(weights, stock)
    assert all(torch.equal(weights, r[1]) for r in hosts[1:])


def test_self_log_weighs_each_micro_batch_by_its_own_samples(three):
    # an on_epoch mean is Lightning's sample-weighted mean over the epoch's calls, each micro-batch's size inferred
    # from the micro-batch itself (14, 13, 13 on rank 0), not from the whole share of 40
    calls = [c for c in three[0][2] if c[0] == 1]  # the last epoch's
    weighted = sum(loss * n for _, loss, n in calls) / sum(n for _, _, n in calls)
    unweighted = sum(loss for _, loss, _ in calls) / len(calls)
    assert abs(three[0][3] - weighted) <= 1e-6 * weighted < abs(unweighted - weighted)
