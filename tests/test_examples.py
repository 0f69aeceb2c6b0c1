"""Unit tests for the default model and data (no process group); one short single-process fit."""

from __future__ import annotations

import collections

import lightning as L
import pytest
import torch
from sklearn.datasets import load_digits
from torch import nn

from lightning_dist.examples import DigitsCNN, DigitsDataModule
from lightning_dist.testing import quiet_trainer


@pytest.fixture(scope="module")
def datamodule() -> DigitsDataModule:
    dm = DigitsDataModule()
    dm.setup("fit")
    return dm


def test_split_sizes_shapes_and_range(datamodule):
    assert len(datamodule.val_set) == 360
    assert len(datamodule.train_set) == 1797 - 360
    x, y = datamodule.train_set.tensors
    assert x.shape == (1437, 1, 8, 8) and x.dtype == torch.float32
    assert y.dtype == torch.int64
    assert 0.0 <= x.min() and x.max() <= 1.0 and x.max() == 1.0


def test_split_is_stratified_and_disjoint(datamodule):
    _, y_train = datamodule.train_set.tensors
    _, y_val = datamodule.val_set.tensors
    val_counts = collections.Counter(y_val.tolist())
    assert sorted(val_counts) == list(range(10))
    # each class is ~10% of the data: a stratified split keeps every class within one sample of 36
    assert all(abs(count - 36) <= 1 for count in val_counts.values()), val_counts
    # the two sides partition the data set: together they hold each image exactly as often as load_digits does
    x_all = torch.cat([datamodule.train_set.tensors[0], datamodule.val_set.tensors[0]]).flatten(1)
    x_ref = torch.from_numpy(load_digits().data.astype("float32") / 16.0)
    for a, b in zip(x_all.unique(dim=0, return_counts=True), x_ref.unique(dim=0, return_counts=True)):
        assert torch.equal(a, b)
    assert collections.Counter(torch.cat([y_train, y_val]).tolist()) == collections.Counter(
        load_digits().target.tolist()
    )


def test_split_depends_only_on_seed():
    a, b, c = DigitsDataModule(seed=3), DigitsDataModule(seed=3), DigitsDataModule(seed=4)
    for dm in (a, b, c):
        dm.setup("fit")
    assert torch.equal(a.val_set.tensors[0], b.val_set.tensors[0])
    assert not torch.equal(a.val_set.tensors[0], c.val_set.tensors[0])


def test_loaders(datamodule):
    x, y = next(iter(datamodule.train_dataloader()))
    assert x.shape == (32, 1, 8, 8) and y.shape == (32,)
    assert sum(len(batch[1]) for batch in datamodule.val_dataloader()) == 360


def test_loader_before_setup_raises():
    with pytest.raises(RuntimeError, match="setup"):
        DigitsDataModule().train_dataloader()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"batch_size": 0}, "batch_size"),
        ({"batch_size": 2.5}, "batch_size"),
        ({"num_workers": -1}, "num_workers"),
        ({"seed": -1}, "seed"),
        ({"val_fraction": 0.0}, "val_fraction"),
        ({"val_fraction": 1.0}, "val_fraction"),
        ({"val_fraction": "0.2"}, "val_fraction"),
    ],
)
def test_datamodule_bad_args(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DigitsDataModule(**kwargs)


def test_model_forward_and_size():
    model = DigitsCNN()
    assert model(torch.zeros(5, 1, 8, 8)).shape == (5, 10)
    n_params = sum(p.numel() for p in model.parameters())
    assert 10_000 <= n_params <= 40_000, n_params
    bigger = DigitsCNN(channels=8, hidden=16)  # not a multiple of the GroupNorm group count is fine too
    assert bigger(torch.zeros(1, 1, 8, 8)).shape == (1, 10)


def test_model_has_no_batchnorm_or_dropout():
    for module in DigitsCNN().modules():
        assert not isinstance(module, (nn.modules.batchnorm._BatchNorm, nn.SyncBatchNorm, nn.Dropout))


def test_hyperparameters_are_plain_types():
    model = DigitsCNN(lr=1e-3, channels=8, hidden=16, weight_decay=1e-4)
    assert dict(model.hparams) == {"lr": 1e-3, "channels": 8, "hidden": 16, "weight_decay": 1e-4}
    assert all(type(value) in (int, float, str) for value in model.hparams.values())


@pytest.mark.parametrize(
    "kwargs, match",
    [({"lr": 0.0}, "lr"), ({"lr": float("nan")}, "lr"), ({"channels": 0}, "channels"),
     ({"hidden": 1.5}, "hidden"), ({"weight_decay": -1.0}, "weight_decay")],
)
def test_model_bad_args(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DigitsCNN(**kwargs)


@pytest.mark.slow  # a Lightning run
def test_short_fit_logs_metrics_and_checkpoint_loads_weights_only(tmp_path):
    L.seed_everything(0, verbose=False)
    trainer = quiet_trainer(devices=1, max_epochs=1, limit_train_batches=5, limit_val_batches=2, log_every_n_steps=1,
                            default_root_dir=tmp_path)
    model = DigitsCNN()
    trainer.fit(model, DigitsDataModule())
    metrics = trainer.callback_metrics
    for key in ("train/loss", "train/acc", "val/loss", "val/acc"):
        assert key in metrics and torch.isfinite(metrics[key]), key

    path = tmp_path / "last.ckpt"
    trainer.save_checkpoint(path)
    checkpoint = torch.load(path, weights_only=True)
    assert checkpoint["hyper_parameters"]["lr"] == 3e-3
    restored = DigitsCNN.load_from_checkpoint(path)
    for a, b in zip(model.parameters(), restored.parameters()):
        assert torch.equal(a, b)
