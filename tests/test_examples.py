"""Unit tests for the example models and data (no process group); one short single-process fit."""

from __future__ import annotations

import collections
import math

import lightning as L
import pytest
import torch
from sklearn.datasets import load_digits
from torch import nn

from lightning_dist.examples import ByteLM, DigitsCNN, DigitsDataModule, StdlibText
from lightning_dist.examples.lm import SKIPPED_DIRS, stdlib_sources
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
    assert 0.0 <= x.min() <= x.max() == 1.0


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
    for a, b in zip(x_all.unique(dim=0, return_counts=True), x_ref.unique(dim=0, return_counts=True), strict=True):
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
    assert dict(model.hparams) == {"lr": 1e-3, "channels": 8, "hidden": 16, "weight_decay": 1e-4,
                                   "schedule": "constant", "warmup_steps": 0, "optimizer": "adam"}
    assert all(type(value) in (int, float, str) for value in model.hparams.values())


@pytest.mark.parametrize(
    "kwargs, match",
    [({"lr": 0.0}, "lr"), ({"lr": float("nan")}, "lr"), ({"channels": 0}, "channels"),
     ({"hidden": 1.5}, "hidden"), ({"weight_decay": -1.0}, "weight_decay"), ({"optimizer": "SGD"}, "optimizer")],
)
def test_model_bad_args(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DigitsCNN(**kwargs)


def test_the_optimizer_is_adam_or_sgd_with_momentum_and_the_loss_is_the_training_steps():
    model = DigitsCNN(lr=2e-3, weight_decay=1e-4, optimizer="sgd")
    sgd = model.configure_optimizers()
    assert type(sgd) is torch.optim.SGD and sgd.defaults["momentum"] == 0.9 and sgd.defaults["lr"] == 2e-3
    assert sgd.defaults["weight_decay"] == 1e-4
    assert type(DigitsCNN().configure_optimizers()) is torch.optim.Adam
    x, y = torch.rand(6, 1, 8, 8), torch.arange(6)
    assert torch.equal(model.loss((x, y)), torch.nn.functional.cross_entropy(model(x), y))


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
    for a, b in zip(model.parameters(), restored.parameters(), strict=True):
        assert torch.equal(a, b)


# ---- the byte-level language model on the standard library's sources (lightning_dist.examples.lm)


@pytest.fixture(scope="module")
def text() -> StdlibText:
    dm = StdlibText()
    dm.setup("fit")
    return dm


def test_text_split_is_by_file_disjoint_and_deterministic(text):
    every_file = [path for path, _ in stdlib_sources()]
    assert not set(text.train_files) & set(text.val_files)
    assert sorted(text.train_files + text.val_files) == every_file
    assert not any(part in SKIPPED_DIRS for path in every_file for part in path.split("/")[:-1])
    # about val_fraction of the files are held out (a hash, not a count: within a few files of 10%)
    assert abs(len(text.val_files) / len(every_file) - 0.1) < 0.03, len(text.val_files)
    again, other_seed = StdlibText(), StdlibText(seed=1)
    for dm in (again, other_seed):
        dm.setup("fit")
    assert (again.train_files, again.val_files) == (text.train_files, text.val_files)
    assert torch.equal(again.val_set.windows, text.val_set.windows)
    assert set(other_seed.val_files) != set(text.val_files)


def test_text_windows_are_context_plus_one_bytes_of_the_files_in_order(text):
    contents = dict(stdlib_sources())
    windows = text.train_set.windows
    assert windows.shape == (2**20 // 129, 129) and windows.dtype == torch.uint8
    stream = b"".join(contents[path] for path in text.train_files)[:windows.numel()]
    assert bytes(windows.flatten().tolist()) == stream  # non-overlapping, in stream order, nothing skipped
    val_stream = b"".join(contents[path] for path in text.val_files)
    assert bytes(text.val_set.windows.flatten().tolist()) == val_stream[:text.val_set.windows.numel()]
    x, y = text.train_set[3]
    assert x.shape == y.shape == (128,) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[1:], y[:-1]) and torch.equal(torch.cat([x, y[-1:]]), windows[3].long())


def test_text_smaller_cap_is_a_prefix_and_loaders_batch_per_rank(text):
    small = StdlibText(context=64, batch_size=4, max_train_bytes=10_000, max_val_bytes=None)
    small.setup("fit")
    assert len(small.train_set) == 10_000 // 65
    assert bytes(small.train_set.windows.flatten().tolist()) == bytes(
        text.train_set.windows.flatten().tolist())[:len(small.train_set) * 65]
    assert len(small.val_set) > len(text.val_set)  # no cap: every held-out byte
    x, y = next(iter(text.train_dataloader()))
    assert x.shape == y.shape == (16, 128)
    assert sum(len(batch[0]) for batch in text.val_dataloader()) == len(text.val_set) == 2**17 // 129
    assert torch.equal(next(iter(text.train_dataloader()))[0], x)  # the seeded shuffle repeats


@pytest.mark.parametrize("kwargs, match", [
    ({"context": 0}, "context"), ({"batch_size": 0}, "batch_size"), ({"val_fraction": 0.0}, "val_fraction"),
    ({"val_fraction": 1.0}, "val_fraction"), ({"max_train_bytes": 100}, "max_train_bytes"),
    ({"max_val_bytes": 2.5}, "max_val_bytes"), ({"seed": -1}, "seed"), ({"num_workers": -1}, "num_workers"),
])
def test_text_bad_args(kwargs, match):
    with pytest.raises(ValueError, match=match):
        StdlibText(**kwargs)


def test_text_loader_before_setup_raises():
    with pytest.raises(RuntimeError, match="setup"):
        StdlibText().train_dataloader()


def test_lm_size_init_loss_and_seeded_init(text):
    torch.manual_seed(0)
    model = ByteLM()
    n_params = sum(p.numel() for p in model.parameters())
    assert 1_000_000 <= n_params <= 5_000_000, n_params
    x, y = next(iter(text.val_dataloader()))
    with torch.no_grad():
        assert model(x).shape == (16, 128, 256)
        loss = model.loss((x, y))
    assert abs(loss.item() - math.log(256)) < 0.3, loss  # near-uniform predictions at init
    torch.manual_seed(0)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ByteLM().parameters(), strict=True))
    assert not any(isinstance(m, (nn.Dropout, nn.modules.batchnorm._BatchNorm)) for m in model.modules())


def test_lm_is_causal():
    torch.manual_seed(0)
    model = ByteLM(width=32, depth=2, heads=2, context=16)
    tokens = torch.randint(0, 256, (2, 16))
    changed = tokens.clone()
    changed[:, 10] = (changed[:, 10] + 1) % 256
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    assert torch.equal(a[:, :10], b[:, :10])  # nothing before position 10 sees it
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_lm_steps_lower_the_loss_on_a_fixed_batch(text):
    torch.manual_seed(0)
    model = ByteLM(width=64, depth=2, warmup_steps=0)
    optimizer = model.configure_optimizers()
    assert isinstance(optimizer, torch.optim.AdamW) and optimizer.defaults["betas"] == (0.9, 0.95)
    batch = next(iter(text.train_dataloader()))
    losses = []
    for _ in range(4):
        optimizer.zero_grad()
        loss = model.loss(batch)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.3, losses
    # weight decay on matrices and embeddings, none on biases and LayerNorm gains
    decayed, plain = optimizer.param_groups
    assert decayed["weight_decay"] == 0.1 and plain["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decayed["params"]) and all(p.dim() == 1 for p in plain["params"])


def test_lm_warmup_is_linear_per_step():
    config = ByteLM(width=32, depth=1, heads=2, warmup_steps=4).configure_optimizers()
    optimizer, schedule = config["optimizer"], config["lr_scheduler"]
    assert schedule["interval"] == "step"
    rates = []
    for _ in range(6):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule["scheduler"].step()
    assert rates == pytest.approx([2e-3 * k / 4 for k in (1, 2, 3, 4, 4, 4)])


def test_lm_hyperparameters_are_plain_types():
    model = ByteLM(lr=1e-3, width=32, depth=1, heads=2, context=16, weight_decay=0.0, warmup_steps=0)
    assert dict(model.hparams) == {"lr": 1e-3, "width": 32, "depth": 1, "heads": 2, "context": 16,
                                   "weight_decay": 0.0, "warmup_steps": 0, "schedule": "constant", "schedule_steps": 0}
    assert all(type(value) in (int, float, str) for value in model.hparams.values())


@pytest.mark.parametrize("kwargs, match", [
    ({"lr": 0.0}, "lr"), ({"lr": float("inf")}, "lr"), ({"width": 0}, "width"), ({"width": 30}, "multiple"),
    ({"depth": 1.5}, "depth"), ({"warmup_steps": -1}, "warmup_steps"), ({"weight_decay": -0.1}, "weight_decay"),
])
def test_lm_bad_args(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ByteLM(**kwargs)
