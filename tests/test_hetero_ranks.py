"""Heterogeneous batching on 2 gloo ranks, Lightning in-process: one launched group serves every assertion."""

from __future__ import annotations

import os
import warnings

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_dist import RingDDPStrategy
from lightning_dist.compression import BucketLayout, build_compressor
from lightning_dist.compression.emulate import emulate_reduce
from lightning_dist.hetero import HeteroBatching
from lightning_dist.testing import Slowdown, ToyClassifier, launched_externally, quiet_trainer, run_ranks

pytestmark = pytest.mark.slow  # one launched group of 2 ranks serves every test

N_SAMPLES, BATCH = 100, 8  # 2 ranks: a global batch of 16, 7 steps per epoch (the last holds 4)


class Net(ToyClassifier):
    """Its samples carry their index; it records which it saw per step, and the first step's reduced gradient."""

    def __init__(self):
        super().__init__(features=16, hidden=(32,), classes=4, samples=N_SAMPLES, batch_size=BATCH, shuffle=True)
        self.seen: list[tuple[int, int, list[int]]] = []
        self.first_grads = None

    def dataset(self):
        return TensorDataset(*self.data(), torch.arange(N_SAMPLES))

    def training_step(self, batch, batch_idx):
        x, y, index = batch
        self.seen.append((self.current_epoch, batch_idx, index.tolist()))
        return nn.functional.cross_entropy(self.net(x), y)

    def on_before_optimizer_step(self, optimizer):
        if self.first_grads is None:
            self.first_grads = {n: p.grad.clone() for n, p in self.named_parameters()}


def _fit(strategy, callbacks=(), ckpt_path=None, model=None, **kwargs):
    pl.seed_everything(0, verbose=False)
    model = model or Net()
    trainer = quiet_trainer(**{"devices": 2, "max_epochs": 2, "strategy": strategy, "callbacks": list(callbacks),
                               **kwargs})
    trainer.fit(model, ckpt_path=ckpt_path, weights_only=True)
    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return model, trainer, weights


def _fits(rank, world_size, workdir):
    out = {}
    with launched_externally(rank, world_size), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for accumulate in (1, 2):
            model, _, weights = _fit(DDPStrategy(), accumulate_grad_batches=accumulate)
            out[f"ddp_{accumulate}"] = (model.seen, weights)
            model, _, weights = _fit(RingDDPStrategy(hetero=HeteroBatching(batch_sizes=[12, 4])),
                                     accumulate_grad_batches=accumulate)
            out[f"hetero_{accumulate}"] = (model.seen, weights)
        # a lossy compressor on the weighted gradients: the first step's reduced gradient
        compressor = build_compressor("topk", ratio=0.25, value_dtype="fp32")
        model, _, _ = _fit(RingDDPStrategy(hetero={"batch_sizes": [12, 4]}, compressor=compressor), max_steps=1)
        out["topk_first"] = (model.seen, model.first_grads)
        # online: rank 1 three times slower; decisions within the epoch every 4 steps and at epoch ends
        hetero = HeteroBatching(window=3, every_n_steps=4, threshold=0.1)
        model, trainer, _ = _fit(RingDDPStrategy(hetero=hetero), callbacks=[Slowdown({1: 3.0})], max_epochs=3)
        out["rebalanced"] = (model.seen, hetero.events, trainer.strategy.features.step_metrics)
        # mid-epoch checkpoint (step 9 of 14), resumed: the same weights as without the interruption
        _, _, straight = _fit(RingDDPStrategy(hetero=HeteroBatching(batch_sizes=[12, 4])))
        checkpoint = ModelCheckpoint(dirpath=workdir, filename="mid", every_n_train_steps=9, save_top_k=-1)
        _fit(RingDDPStrategy(hetero=HeteroBatching(batch_sizes=[12, 4])), callbacks=[checkpoint],
             enable_checkpointing=True, max_steps=9)
        model, _, resumed = _fit(RingDDPStrategy(hetero=HeteroBatching(batch_sizes=[12, 4])),
                                 ckpt_path=os.path.join(workdir, "mid.ckpt"))
        out["resume"] = (straight, resumed, model.seen)
        # only the training loader changes; a validation loader keeps its own sampler and batch size
        _, trainer, _ = _fit(RingDDPStrategy(hetero=HeteroBatching(batch_sizes=[12, 4])), model=WithValidation(),
                             max_epochs=1)
        val = trainer.val_dataloaders
        out["loaders"] = (type(trainer.train_dataloader).__name__, type(val).__name__, val.batch_size,
                          type(val.sampler).__name__)
    return out


class WithValidation(Net):
    def validation_step(self, batch, batch_idx):
        x, y, _ = batch
        self.log("val_loss", nn.functional.cross_entropy(self.net(x), y), sync_dist=True)

    def val_dataloader(self):
        return DataLoader(self.dataset(), batch_size=5)


@pytest.fixture(scope="module")
def fits(tmp_path_factory):
    return run_ranks(_fits, 2, str(tmp_path_factory.mktemp("hetero")), deadline_s=200)


def _global_batches(results, key):
    ranks = [r[key][0] for r in results]
    assert len(ranks[0]) == len(ranks[1])  # the same number of steps on every rank
    return [sorted(a[2] + b[2]) for a, b in zip(*ranks, strict=True)]


@pytest.mark.parametrize("accumulate", [1, 2])
def test_each_step_uses_stock_ddps_samples_and_trains_the_same_weights(fits, accumulate):
    assert _global_batches(fits, f"hetero_{accumulate}") == _global_batches(fits, f"ddp_{accumulate}")
    key = f"hetero_{accumulate}"
    sizes = [(len(a[2]), len(b[2])) for a, b in zip(fits[0][key][0], fits[1][key][0], strict=True)]
    assert sizes[:6] == [(12, 4)] * 6 and sizes[6] == (3, 1)  # the epoch's last global batch holds 4
    hetero, stock = fits[0][f"hetero_{accumulate}"][1], fits[0][f"ddp_{accumulate}"][1]
    assert torch.allclose(hetero, stock, atol=1e-6), float((hetero - stock).abs().max())  # summation order only
    assert torch.equal(hetero, fits[1][f"hetero_{accumulate}"][1])


def test_a_lossy_compressor_compresses_the_sample_weighted_gradients(fits):
    pl.seed_everything(0, verbose=False)
    reference = Net()
    x, y = reference.data()
    weighted = []
    for r in range(2):
        _, _, index = fits[r]["topk_first"][0][0]
        reference.zero_grad()
        nn.functional.cross_entropy(reference.net(x[index]), y[index]).backward()
        weighted.append(torch.cat([p.grad.reshape(-1) * len(index) / 16 for p in reference.parameters()]))
    layout = BucketLayout.of([(n, p.shape) for n, p in reference.named_parameters()])
    emulated = emulate_reduce([build_compressor("topk", ratio=0.25, value_dtype="fp32") for _ in range(2)],
                              weighted, layout)[0]
    got = torch.cat([g.reshape(-1) for g in fits[0]["topk_first"][1].values()])
    assert torch.allclose(got, emulated, atol=1e-6), float((got - emulated).abs().max())


def test_online_rebalancing_moves_work_to_the_fast_rank_and_every_rank_agrees(fits):
    events = fits[0]["rebalanced"][1]
    assert events and events == fits[1]["rebalanced"][1]  # decided alike on both ranks
    last = events[-1]["new"]
    assert sum(last) == 16 and last[0] > last[1]  # rank 1 is 3x slower: it gets less
    # still stock DDP's samples at every step (epochs 0 and 1 of the 3)
    assert _global_batches(fits, "rebalanced")[:14] == _global_batches(fits, "ddp_1")
    metrics = fits[0]["rebalanced"][2]
    assert metrics["dist/rank0/samples"] > metrics["dist/rank1/samples"]


def test_a_mid_epoch_checkpoint_resumes_at_the_next_batch_bit_identically(fits):
    for r in fits:
        straight, resumed, seen = r["resume"]
        assert seen[0][:2] == (1, 2)  # step 9 of 14 was epoch 1's third batch: the resumed run starts after it
        assert torch.equal(straight, resumed), float((straight - resumed).abs().max())


def test_only_the_training_loader_is_rebuilt(fits):
    assert fits[0]["loaders"] == ("HeteroDataLoader", "DataLoader", 5, "DistributedSampler")
