"""The sync driver seam (:mod:`lightning_dist.sync.driver`): a way of syncing of one's own, through the worked example
of docs/contributing/feature-seam.md executed as written.

``ParameterAveraging(every)`` averages every rank's parameters every ``every`` steps, which is
``DiLoCo(every, outer_lr=1.0, outer_momentum=0.0)``: the launched fits must match each other at every step (float
rounding: the two sum in other orders), ranks bit-identical after every average and apart between them, the hooks
called in the protocol's order, and a resumed fit the same as the uninterrupted one. One launched group of 2 fork
ranks holds every fit.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback

from lightning_dist import RingDDPStrategy
from lightning_dist.strategy import features_of
from lightning_dist.sync import DiLoCo, EveryStep, SyncDriver, SyncSettings, as_sync
from lightning_dist.testing import ToyClassifier, launched_externally, quiet_trainer, run_ranks

DOC = Path(__file__).resolve().parents[1] / "docs" / "contributing" / "feature-seam.md"
EVERY, WORLD, STEPS_PER_EPOCH = 3, 2, 6  # 96 samples, batches of 8 on 2 ranks


def _example() -> dict:
    """The worked example's classes, from the page's code block, run as written."""
    section = DOC.read_text().split("## A way of syncing of your own", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    namespace: dict = {}
    exec(compile(code, str(DOC), "exec"), namespace)
    return namespace


EXAMPLE = _example()
ParameterAveraging, Averaging = EXAMPLE["ParameterAveraging"], EXAMPLE["Averaging"]


class Recording(ParameterAveraging):
    """The example, recording which hook the strategy called (the step hooks with the global step)."""

    def __init__(self, every):
        super().__init__(every)
        self.calls = []

    def bind(self, context):
        self.calls.append("bind")
        driver = RecordingDriver(self.every, context)
        driver.calls = self.calls
        return driver


class RecordingDriver(Averaging):
    calls: list

    def before_forward(self):
        self.calls.append("before_forward")

    def optimizer_step(self, optimizer, closure, step):
        self.calls.append("optimizer_step")
        return super().optimizer_step(optimizer, closure, step)

    def after_step(self, global_step):
        self.calls.append(f"after_step {global_step}")
        super().after_step(global_step)

    def end_of_fit(self):
        self.calls.append("end_of_fit")

    def close(self):
        self.calls.append("close")
        super().close()


# -- before any process ---------------------------------------------------------------------------------------------
def test_a_driver_of_ones_own_is_taken_as_it_is():
    settings = ParameterAveraging(every=4)
    assert isinstance(settings, SyncSettings) and as_sync(settings) is settings
    assert RingDDPStrategy(sync=settings).sync is settings
    assert as_sync(EveryStep()) is None and as_sync("every_step") is None and RingDDPStrategy().sync is None
    assert isinstance(as_sync("diloco"), DiLoCo) and isinstance(DiLoCo(every=5), SyncSettings)
    assert not isinstance(DiLoCo(every=5), SyncDriver)  # the settings, apart from the driver they bind



def test_a_drivers_check_refuses_before_any_process():
    with pytest.raises(ValueError, match="drop compressor="):
        RingDDPStrategy(sync=ParameterAveraging(every=4), compressor="topk")
    with pytest.raises(ValueError, match="SyncSettings of your own"):
        RingDDPStrategy(sync=object())
    with pytest.raises(ValueError, match="every=0"):
        ParameterAveraging(every=0)


# -- launched -------------------------------------------------------------------------------------------------------
class Net(ToyClassifier):
    def __init__(self):
        super().__init__(features=16, hidden=(32,), classes=5, samples=96, batch_size=8, momentum=0.9, lr=0.1,
                         distributed_sampler=True, seed=0, keep_batches=True)


class Params(Callback):
    """This rank's parameters after every optimizer step."""

    def __init__(self):
        self.params = []

    def on_train_batch_end(self, trainer, pl_module, *args):
        self.params.append(torch.cat([p.detach().reshape(-1) for p in pl_module.parameters()]).clone())


def _fit(sync, epochs=2, ckpt_path=None, **strategy):
    pl.seed_everything(0, verbose=False)
    record = Params()
    trainer = quiet_trainer(devices=WORLD, max_epochs=epochs, callbacks=[record], use_distributed_sampler=False,
                            strategy=RingDDPStrategy(sync=sync, timeout=60, start_method="fork", **strategy))
    trainer.fit(model := Net(), ckpt_path=ckpt_path)
    trainer.seen = model.seen
    return trainer, record.params


def _run(rank, world, ckpt_dir):
    out = {}
    with launched_externally(rank, world), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        driver = Recording(EVERY)
        trainer, out["averaging"] = _fit(driver)
        out["calls"], out["syncs"] = driver.calls, features_of(trainer.strategy).sync.report().syncs
        _, out["diloco"] = _fit(DiLoCo(every=EVERY, outer_lr=1.0, outer_momentum=0.0))
        trainer, _ = _fit(ParameterAveraging(EVERY), epochs=1)
        path = f"{ckpt_dir}/averaging.ckpt"
        trainer.save_checkpoint(path)
        out["saved"] = torch.load(path, weights_only=True)["lightning_dist"]["sync"] if rank == 0 else None
        trainer, out["resumed"] = _fit(ParameterAveraging(EVERY), ckpt_path=path)
        out["resumed_syncs"] = features_of(trainer.strategy).sync.report().syncs
        # uneven batches: a rank's share of its gradient is taken among its worker's ranks (itself), not every rank
        trainer, params = _fit(ParameterAveraging(EVERY), epochs=1, hetero={"batch_sizes": [12, 4]})
        out["hetero"] = (params[0], trainer.seen[0])
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_ranks(_run, WORLD, str(tmp_path_factory.mktemp("driver")), deadline_s=240)


@pytest.mark.slow
def test_the_example_averages_as_diloco_with_outer_lr_1_does(ranks):
    steps = 2 * STEPS_PER_EPOCH
    for out in ranks:
        assert len(out["averaging"]) == len(out["diloco"]) == steps
        for step, (mine, diloco) in enumerate(zip(out["averaging"], out["diloco"], strict=True), 1):
            assert torch.allclose(mine, diloco, rtol=0, atol=1e-6), (step, float((mine - diloco).abs().max()))
    for step in range(1, steps + 1):  # every rank alike after each average, apart between them (own batches)
        same = torch.equal(ranks[0]["averaging"][step - 1], ranks[1]["averaging"][step - 1])
        assert same == (step % EVERY == 0), step


@pytest.mark.slow
def test_the_strategy_calls_the_hooks_in_the_protocols_order(ranks):
    steps = 2 * STEPS_PER_EPOCH
    # Lightning's closure runs the training step inside the optimizer's step
    per_step = [["optimizer_step", "before_forward", f"after_step {s}"] for s in range(1, steps + 1)]
    expected = ["bind", *[call for calls in per_step for call in calls], "end_of_fit", "close"]
    for out in ranks:
        assert out["calls"] == expected
        assert out["syncs"] == steps // EVERY


@pytest.mark.slow
def test_the_example_saves_and_resumes(ranks):
    saved = ranks[0]["saved"]
    assert saved["averaged"] == STEPS_PER_EPOCH // EVERY
    assert len(saved["optimizers"]) == WORLD and all(states for states in saved["optimizers"])  # every rank's own
    for out in ranks:
        assert out["resumed_syncs"] == 2 * STEPS_PER_EPOCH // EVERY  # counted on from the checkpoint
        assert len(out["resumed"]) == STEPS_PER_EPOCH  # the second epoch, the same steps as uninterrupted
        for mine, uninterrupted in zip(out["resumed"], out["averaging"][STEPS_PER_EPOCH:], strict=True):
            assert torch.equal(mine, uninterrupted)


@pytest.mark.slow
def test_under_uneven_batches_each_rank_steps_on_its_own_mean_gradient(ranks):
    # the example leaves the share to the strategy, which takes it among the worker's ranks: each rank's first step is
    # plain SGD on its own batch's mean loss at the full learning rate (12 and 4 samples), not lr times its share
    for rank, out in enumerate(ranks):
        first, (x, y) = out["hetero"]
        assert len(y) == (12, 4)[rank]
        model = Net()
        torch.nn.functional.cross_entropy(model.net(x), y).backward()
        expected = torch.cat([(p - 0.1 * p.grad).detach().reshape(-1) for p in model.parameters()])
        assert torch.allclose(first, expected, rtol=0, atol=1e-6), float((first - expected).abs().max())
