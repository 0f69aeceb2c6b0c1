"""The compatibility matrix (docs/compatibility.md): every way of syncing under the settings users train with, each
cell equal to its reference or refused at set-up on every rank with the fix.

The recipe every fit trains (:class:`Recipe`): AdamW with two param groups (their own learning rates and weight
decay), a scheduler stepped every optimizer step and one stepped every epoch, a frozen layer inside the forward, a
layer no forward uses (``find_unused_parameters=True``) and, where the way of syncing takes it, clipping by norm.
The references:

- **stock DDP** on the same samples for the dense ways (ring_ddp, and OneBitAdam's warm-up, which is ring_ddp bit for
  bit): within float rounding at every step, under accumulation, bf16 and fp16 loss scaling too;
- **the same way without accumulation**, for every way: ``accumulate_grad_batches=2`` of micro-batches of 4 against
  batches of 8 whose rows are the two micro-batches' (an unshuffled DistributedSampler), so one optimizer step sees
  the same samples. The way's plain recipe is checked against its own reference elsewhere (the one-process replays of
  tests/test_sync.py and tests/test_onebit_adam.py, tests/test_compression_ranks.py); a way that reduced a window's
  earlier micro-batches again, or once per micro-batch, differs from it by whole gradients;
- **the initial weights**: a frozen or unused parameter is exactly where it started, under every way;
- **the same fit again with the same settings object**: bit for bit (no state carried from one fit to the next);
- **a stop by a callback** (``trainer.should_stop``, as EarlyStopping and ``max_time`` stop): every rank ends with
  the same parameters where the way promises them (DiLoCo's final sync).

One launched group of 2 fork ranks holds every fit; the assertions share it.
"""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins import MixedPrecision
from torch import nn

from lightning_dist import FaultTolerance, LossScaler, MemoryMonitor, RingDDPStrategy
from lightning_dist.callbacks import NaNRecovery
from lightning_dist.compression import build_compressor
from lightning_dist.sync import Auto, DiLoCo, OneBitAdam
from lightning_dist.testing import ToyClassifier, launched_externally, quiet_trainer, run_ranks

pytestmark = pytest.mark.slow

WORLD, SAMPLES, STEPS = 2, 64, 8  # ranks per host; samples per host: 2 epochs of 4 optimizer steps
CLIP = 0.5
SAVED_AT = 4  # the resume's checkpoint: after the first epoch's 4 optimizer steps
DENSE_TOL = 1e-5  # relative to the parameters' largest value
# accumulation against one batch, by precision: for exact ways the largest difference (a reduced-precision forward of
# 4 rows rounds otherwise than of 8: stock DDP 3e-4 under bf16); for lossy codecs in fp32 the same, and under mixed
# precision the difference's norm over how far the fit moved the parameters (a rounding that flips a codec's quantum
# or a top-k choice moves one coordinate by a whole Adam step, lr: up to 4.2% of the way here, measured)
TOLERANCES = {"fp32": (DENSE_TOL, 2e-3), "bf16": (1e-3, None), "fp16": (1e-4, None)}
LOSSY_MIXED = 0.1
EXACT = ("dense", "hetero", "onebit_warmup", "streaming", "diloco_two_tier")  # "diloco" sends at int8

# the ways of syncing: the strategy's arguments for a fit accumulating ``a`` micro-batches (a settings object is made
# anew for each fit but the two that check a second fit), the optimizer steps (0-based) after which every rank holds
# the same parameters, and the hosts the ranks pose as (2 flat ranks, or 2 hosts of 2 ranks under two_tier)
EVERY_STEP = tuple(range(STEPS))
WAYS = {
    "dense": (lambda a: {}, EVERY_STEP, 1),
    "int8": (lambda a: {"compressor": "int8"}, EVERY_STEP, 1),
    "topk": (lambda a: {"compressor": {"name": "topk", "ratio": 0.1}}, EVERY_STEP, 1),
    "hetero": (lambda a: {"hetero": {"batch_sizes": [12 // a, 4 // a]}}, EVERY_STEP, 1),  # the same global batch
    "diloco": (lambda a: {"sync": DiLoCo(every=3, compressor="int8")}, (2, 5, 7), 1),  # its syncs, the final one
    # fragments land a step late, mixed with each worker's own progress: alike after the fit's final sync only
    "streaming": (lambda a: {"sync": DiLoCo(every=4, fragments=2, delay=1)}, (7,), 1),
    "onebit_warmup": (lambda a: {"sync": OneBitAdam(warmup=STEPS - 1)}, EVERY_STEP, 1),
    "onebit": (lambda a: {"sync": OneBitAdam(warmup=2, refresh=3)}, EVERY_STEP, 1),
    "two_tier": (lambda a: {"topology": "two_tier", "compressor": "int8"}, EVERY_STEP, 2),
    "diloco_two_tier": (lambda a: {"topology": "two_tier", "sync": DiLoCo(every=3)}, (2, 5, 7), 2),
    "onebit_two_tier": (lambda a: {"topology": "two_tier", "sync": OneBitAdam(warmup=2, refresh=3)}, EVERY_STEP, 2),
    # sync="auto" measuring 1 + 2 dense steps (long_s: however slow a loaded machine's step), then OneBitAdam whatever
    # this machine measures (the only candidate under
    # AdamW, and dense over the bytes budget: the Recipe's dense step sends 3,176 bytes, OneBitAdam's a few hundred)
    "auto": (lambda a: {"sync": Auto(warmup_steps=1, steps=2, methods=["onebit_adam"], max_bytes_per_step=2000,
                                     drift=0, long_s=3600.0)}, EVERY_STEP, 1),
}
ONEBIT = ("onebit_warmup", "onebit", "onebit_two_tier", "auto")  # OneBitAdam refuses clipping (test below)


class Recipe(ToyClassifier):
    """16 -> frozen 16 -> 32 -> 5, and a layer no forward uses; AdamW in two param groups with a per-step and a
    per-epoch scheduler. ``nan_at``: (rank, global step) whose loss is NaN (an fp16 overflow on one rank)."""

    def __init__(self, batch_size=8, nan_at=None, hosts=1):
        super().__init__(features=16, hidden=(32,), classes=5, samples=SAMPLES * hosts, batch_size=batch_size,
                         distributed_sampler=True, seed=0)
        self.frozen = nn.Linear(16, 16).requires_grad_(False)
        self.unused = nn.Linear(16, 5)
        self.nan_at = nan_at

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(torch.tanh(self.frozen(x))), y)
        if (self.global_rank, self.trainer.global_step) == self.nan_at:
            loss = loss * float("nan")
        return loss

    def configure_optimizers(self):
        first, last = self.net[0], self.net[2]
        opt = torch.optim.AdamW([
            {"params": list(first.parameters()), "lr": 0.02, "weight_decay": 0.0},
            {"params": [*last.parameters(), *self.unused.parameters()], "lr": 0.01, "weight_decay": 0.05}])
        per_step = torch.optim.lr_scheduler.MultiplicativeLR(opt, lambda _: 0.9)
        per_epoch = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        return [opt], [{"scheduler": per_step, "interval": "step"}, {"scheduler": per_epoch, "interval": "epoch"}]


class Steps(Callback):
    """The parameters after every optimizer step (once per step under accumulation), and the learning rates."""

    def __init__(self):
        self.params, self.lrs, self._last = [], [], 0

    def on_train_batch_end(self, trainer, pl_module, *args):
        if trainer.global_step > self._last:
            self._last = trainer.global_step
            self.params.append(_flat(pl_module))
            self.lrs.append([g["lr"] for g in trainer.optimizers[0].param_groups])


class ManualRecipe(Recipe):
    """The recipe under manual optimization: the training step steps the optimizer and both schedulers itself."""

    def __init__(self, hosts=1):
        super().__init__(hosts=hosts)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt, (per_step, per_epoch) = self.optimizers(), self.lr_schedulers()
        loss = super().training_step(batch, batch_idx)
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        per_step.step()
        if self.trainer.is_last_batch:
            per_epoch.step()
        return loss


class SaveAtEpochEnd(Callback):
    """A checkpoint at the end of the first epoch, as ModelCheckpoint writes it (every rank calls it: the strategy
    gathers every rank's state), mid-cycle under DiLoCo(every=3)."""

    def __init__(self, path):
        self.path = path

    def on_train_epoch_end(self, trainer, *args):
        if trainer.current_epoch == 0:
            trainer.save_checkpoint(self.path)


class StopAt(Callback):
    """Stops the fit after global step ``step`` (trainer.should_stop, as EarlyStopping and max_time do)."""

    def __init__(self, step):
        self.step = step

    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step >= self.step:
            trainer.should_stop = True


def _flat(module):
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()]).clone()


def _fit(strategy, accumulate=1, clip=None, callbacks=(), model=None, ckpt_path=None, hosts=1, **trainer):
    pl.seed_everything(0, verbose=False)
    steps = Steps()
    model = model or Recipe(batch_size=8 // accumulate, hosts=hosts)
    if strategy == "ddp":
        strategy = pl.strategies.DDPStrategy(find_unused_parameters=True)  # launches nothing here
    else:
        strategy = RingDDPStrategy(timeout=60, start_method="fork", find_unused_parameters=True, **strategy)
    trainer = {"max_epochs": 2, **trainer}
    fit = quiet_trainer(devices=WORLD, num_nodes=hosts, accumulate_grad_batches=accumulate, gradient_clip_val=clip,
                        callbacks=[steps, *callbacks], strategy=strategy, use_distributed_sampler=False, **trainer)
    fit.fit(model, ckpt_path=ckpt_path)
    decision = getattr(getattr(getattr(fit.strategy, "features", None), "sync", None), "decision", None)
    return {"params": steps.params, "lrs": steps.lrs, "final": _flat(model),
            "frozen": _flat(model.frozen), "unused": _flat(model.unused),
            "auto_choice": decision.choice if decision is not None else None}  # (sync="auto"'s)


def _refused(strategy, **fit):
    try:
        _fit(strategy, **fit)
    except ValueError as err:
        return str(err)
    return None


def _fp16(scaler=None):
    """fp16 loss scaling on the CPU: Lightning's plugin with torch's GradScaler, or the project's LossScaler."""
    return {"plugins": [MixedPrecision("16-mixed", "cpu", scaler=scaler or LossScaler("cpu", hysteresis=1))]}


PRECISIONS = {"fp32": dict, "bf16": lambda: {"precision": "bf16-mixed"}, "fp16": _fp16}


def _run(rank, world, ckpt_dir, hosts):
    out = {}
    with launched_externally(rank, world, hosts), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        start = Recipe(hosts=hosts)
        out["initial"] = {"frozen": _flat(start.frozen), "unused": _flat(start.unused), "params": _flat(start)}
        for name, (make, _, on) in WAYS.items():
            if on != hosts:
                continue
            clip = None if name in ONEBIT else CLIP
            for precision, trainer in PRECISIONS.items():
                out[name, "accumulate", precision] = _fit(make(2), accumulate=2, clip=clip, hosts=hosts, **trainer())
                out[name, "plain", precision] = _fit(make(1), clip=clip, hosts=hosts, **trainer())
            same = make(1)  # one settings object (and one compressor object) for two fits in a row
            if name == "topk":
                same = {"compressor": build_compressor("topk", ratio=0.1)}
            out[name, "first"], out[name, "second"] = (_fit(same, clip=clip, hosts=hosts) for _ in range(2))
            out[name, "stopped"] = _fit(make(1), clip=clip, callbacks=[StopAt(5)], hosts=hosts)
            # the first epoch's checkpoint, resumed, against the uninterrupted fit
            path = f"{ckpt_dir}/{name}.ckpt"
            _fit(make(1), clip=clip, callbacks=[SaveAtEpochEnd(path)], hosts=hosts)
            out[name, "resumed"] = _fit(make(1), clip=clip, ckpt_path=path, hosts=hosts)
            # FaultTolerance and MemoryMonitor at their defaults change nothing of the fit
            out[name, "callbacks"] = _fit(make(1), clip=clip, hosts=hosts, callbacks=[
                FaultTolerance(dirpath=f"{ckpt_dir}/{name}-ft"), MemoryMonitor()])
            # NaNRecovery: rank 1's loss is NaN at step 5 (index 4)
            nan = NaNRecovery()
            out[name, "nan"] = _fit(make(1), clip=clip, model=Recipe(nan_at=(1, 4), hosts=hosts), callbacks=[nan],
                                    hosts=hosts)
            out[name, "nan"]["skipped"] = nan.skipped
            if name not in ONEBIT:  # (OneBitAdam refuses manual optimization: test below)
                out[name, "manual"] = _fit(make(1), model=ManualRecipe(hosts=hosts), hosts=hosts)
                out[name, "automatic"] = _fit(make(1), hosts=hosts)
        if hosts > 1:
            return out
        for accumulate in (1, 2):
            out["ddp", accumulate] = _fit("ddp", accumulate=accumulate, clip=CLIP)
            out["ddp_noclip", accumulate] = _fit("ddp", accumulate=accumulate)
        out["ddp", "bf16"] = _fit("ddp", accumulate=2, clip=CLIP, precision="bf16-mixed")
        out["ddp_noclip", "bf16"] = _fit("ddp", accumulate=2, precision="bf16-mixed")
        out["ddp", "fp16"] = _fit("ddp", accumulate=2, clip=CLIP, **_fp16(torch.amp.GradScaler("cpu")))
        out["ddp_noclip", "fp16"] = _fit("ddp", accumulate=2, **_fp16(torch.amp.GradScaler("cpu")))
        out["dense", "fp16_torch"] = _fit({}, accumulate=2, clip=CLIP, **_fp16(torch.amp.GradScaler("cpu")))
        out["ddp", "manual"] = _fit("ddp", model=ManualRecipe())
        for strategy in ("ddp", {}):  # clipping by value
            out["ddp" if strategy == "ddp" else "dense", "clip_value"] = _fit(
                strategy, accumulate=2, clip=CLIP / 50, gradient_clip_algorithm="value")
        # fp16 loss scaling, one rank's gradients overflowing after OneBitAdam's warm-up: skipped on every rank
        # (each rank's scaler decided alone, and the other entered the compressed step's collectives: a hang)
        for key, callbacks in (("fp16_nan", ()), ("fp16_nan_recovery", (NaNRecovery(),))):
            out["onebit", key] = _fit(WAYS["onebit"][0](1), model=Recipe(nan_at=(1, 5)), callbacks=callbacks,
                                      **_fp16(torch.amp.GradScaler("cpu")))
        out["refused"] = {
            "onebit_clip": _refused({"sync": OneBitAdam(warmup=2)}, clip=CLIP),
            "onebit_clip_value": _refused({"sync": OneBitAdam(warmup=2)}, clip=CLIP,
                                          gradient_clip_algorithm="value"),
            "onebit_manual": _refused({"sync": OneBitAdam(warmup=2)}, model=ManualRecipe()),
            "diloco_drift": _refused({"sync": DiLoCo(every=3)}, callbacks=[NaNRecovery(drift_check_every=2)]),
        }
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_ranks(_run, WORLD, str(tmp_path_factory.mktemp("compat")), 1, deadline_s=180)


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    return run_ranks(_run, 2 * WORLD, str(tmp_path_factory.mktemp("compat_hosts")), 2, deadline_s=180)


def _group(request, way):
    """The launched group that fitted ``way``: 2 flat ranks, or 2 hosts of 2."""
    return request.getfixturevalue("ranks" if WAYS[way][2] == 1 else "hosts")


def _close(got, expected, tolerance, what, steps=STEPS):
    assert len(got) == len(expected) == steps, (what, len(got), len(expected))
    for step, (a, b) in enumerate(zip(got, expected, strict=True), 1):
        error = (a - b).abs().max().item()
        assert error <= tolerance * max(1.0, b.abs().max().item()), f"{what}, step {step}: {error:.3g}"


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("way", WAYS)
def test_accumulation_equals_the_same_samples_in_one_batch(request, way, precision):
    tolerance = TOLERANCES[precision][way not in EXACT]
    for rank, out in enumerate(_group(request, way)):
        got, expected = out[way, "accumulate", precision], out[way, "plain", precision]
        what = f"{way}, {precision}, rank {rank}"
        if tolerance is not None:
            _close(got["params"], expected["params"], tolerance, what)
        else:
            start = out["initial"]["params"]
            assert len(got["params"]) == len(expected["params"]) == STEPS, what
            for step, (a, b) in enumerate(zip(got["params"], expected["params"], strict=True), 1):
                assert (a - b).norm() <= LOSSY_MIXED * (b - start).norm(), f"{what}, step {step}"
        assert got["lrs"] == expected["lrs"]  # both schedulers, stepped alike


@pytest.mark.parametrize("way", WAYS)
def test_frozen_and_unused_parameters_stay_where_they_started(request, way):
    for out in _group(request, way):
        for fit in [key for key in out if key[0] == way and key[1] in ("accumulate", "plain", "first", "resumed")]:
            assert torch.equal(out[fit]["frozen"], out["initial"]["frozen"]), fit
            assert torch.equal(out[fit]["unused"], out["initial"]["unused"]), fit


@pytest.mark.parametrize("way", WAYS)
def test_a_second_fit_with_the_same_settings_object_is_the_first_again(request, way):
    for out in _group(request, way):
        first, second = out[way, "first"]["params"], out[way, "second"]["params"]
        assert len(first) == STEPS and all(torch.equal(a, b) for a, b in zip(first, second, strict=True)), way
        assert all(torch.equal(a, b) for a, b in zip(first, out[way, "plain", "fp32"]["params"], strict=True))


@pytest.mark.parametrize("way", WAYS)
def test_a_resume_mid_run_is_the_uninterrupted_fit(request, way):
    for out in _group(request, way):
        resumed, uninterrupted = out[way, "resumed"]["params"], out[way, "first"]["params"][SAVED_AT:]
        assert len(resumed) == STEPS - SAVED_AT, way
        assert all(torch.equal(a, b) for a, b in zip(resumed, uninterrupted, strict=True)), way


@pytest.mark.parametrize("way", WAYS)
def test_ranks_agree_where_the_way_promises_and_after_a_callbacks_stop(request, way):
    group = _group(request, way)
    for fit in [key for key in group[0] if key[0] == way and key[1] in ("accumulate", "plain")]:
        for out in group[1:]:
            assert all(torch.equal(group[0][fit]["params"][s], out[fit]["params"][s]) for s in WAYS[way][1]), fit
    stopped = [out[way, "stopped"] for out in group]
    assert len(stopped[0]["params"]) == 5  # stopped after step 5, mid-cycle for DiLoCo
    assert all(torch.equal(stopped[0]["final"], other["final"]) for other in stopped[1:]), way  # the final sync ran


@pytest.mark.parametrize("way", WAYS)
def test_fault_tolerance_and_memory_monitor_leave_the_fit_as_it_was(request, way):
    for out in _group(request, way):
        got, expected = out[way, "callbacks"]["params"], out[way, "first"]["params"]
        assert len(got) == STEPS and all(torch.equal(a, b) for a, b in zip(got, expected, strict=True)), way


def test_auto_switched_in_every_fit(ranks):
    """The "auto" cells are OneBitAdam's after the measuring steps, not dense's all along."""
    for out in ranks:
        fits = [key for key in out if key[0] == "auto"]
        assert len(fits) >= 12
        assert all(out[key]["auto_choice"] == "onebit_adam" for key in fits), {k: out[k]["auto_choice"] for k in fits}


# the ranks that skip a step whose loss is NaN on rank 1: every rank, or the ranks of rank 1's worker
NAN_SKIPPED = {"diloco": (1,), "diloco_two_tier": (0, 1), "streaming": (1,)}


@pytest.mark.parametrize("way", WAYS)
def test_nan_recovery_skips_the_step_where_the_way_agrees_on_it(request, way):
    group = _group(request, way)
    skipping = NAN_SKIPPED.get(way, range(len(group)))
    for rank, out in enumerate(group):
        params = out[way, "nan"]["params"]
        assert len(params) == STEPS and all(torch.isfinite(p).all() for p in params), (way, rank)
        assert out[way, "nan"]["skipped"] == (1 if rank in skipping else 0), (way, rank)
        if rank in skipping and way != "streaming":  # (streaming: a fragment lands after that step)
            assert torch.equal(params[4], params[3]), (way, rank)
    for out in group[1:]:
        assert all(torch.equal(group[0][way, "nan"]["params"][s], out[way, "nan"]["params"][s]) for s in WAYS[way][1])


@pytest.mark.parametrize("way", [way for way in WAYS if way not in ONEBIT])
def test_manual_optimization_is_the_automatic_fit(request, way):
    for out in _group(request, way):
        _close(out[way, "manual"]["params"], out[way, "automatic"]["params"], DENSE_TOL, way)
    for out in request.getfixturevalue("ranks"):
        _close(out["ddp", "manual"]["params"], out["ddp_noclip", 1]["params"], DENSE_TOL, "stock DDP")


def test_clipping_by_value_is_stock_ddps(ranks):
    for out in ranks:
        _close(out["dense", "clip_value"]["params"], out["ddp", "clip_value"]["params"], DENSE_TOL, "by value")
        assert not torch.equal(out["dense", "clip_value"]["params"][0], out["dense", "accumulate", "fp32"]["params"][0])


@pytest.mark.parametrize("accumulate", (1, 2))
def test_ring_ddp_is_stock_ddp_under_the_recipe(ranks, accumulate):
    fit = ("dense", "plain" if accumulate == 1 else "accumulate", "fp32")
    for out in ranks:
        _close(out[fit]["params"], out["ddp", accumulate]["params"], DENSE_TOL, f"dense x{accumulate}")


@pytest.mark.parametrize("precision", ("fp32", "bf16", "fp16"))
def test_onebit_adams_warm_up_is_stock_ddp_under_accumulation(ranks, precision):
    # the warm-up's steps (all but the last) are ring_ddp's, so stock DDP's: a window's first micro-batch is not
    # reduced twice (the warm-up used to turn DDP's synchronisation back on inside Lightning's no_sync window)
    for out in ranks:
        got = out["onebit_warmup", "accumulate", precision]["params"]
        expected = out["ddp_noclip", 2 if precision == "fp32" else precision]["params"]
        _close(got[:STEPS - 1], expected[:STEPS - 1], DENSE_TOL, precision, steps=STEPS - 1)


@pytest.mark.parametrize("precision", ("bf16", "fp16"))
def test_mixed_precision_is_stock_ddps(ranks, precision):
    for out in ranks:
        _close(out["dense", "accumulate", precision]["params"], out["ddp", precision]["params"], DENSE_TOL, precision)
    for out in ranks:  # Lightning's plugin with torch's own GradScaler
        _close(out["dense", "fp16_torch"]["params"], out["ddp", "fp16"]["params"], DENSE_TOL, "torch's GradScaler")


@pytest.mark.parametrize("key", ("fp16_nan", "fp16_nan_recovery"))
def test_onebit_adam_skips_one_ranks_fp16_overflow_on_every_rank(ranks, key):
    # the fit ended (no hang), rank 1's NaN at global step 5 skipped the step on both ranks, ranks identical
    a, b = ranks[0]["onebit", key]["params"], ranks[1]["onebit", key]["params"]
    assert len(a) == len(b) == STEPS and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert torch.equal(a[5], a[4])  # step 5 (the sixth) changed nothing
    assert all(torch.isfinite(p).all() for p in a)


def test_refusals_name_the_fix_on_every_rank(ranks):
    for out in ranks:
        refused = out["refused"]
        for name in ("onebit_clip", "onebit_clip_value"):
            assert refused[name] is not None and "drop gradient_clip_val" in refused[name], name
        assert refused["onebit_manual"] is not None and "manual optimization" in refused["onebit_manual"]
        assert refused["diloco_drift"] is not None and "drop drift_check_every" in refused["diloco_drift"]
