"""``sync="auto"`` on launched ranks (one shared group of 2 ranks, then one of 3 for the changed cluster):

- a fit that switches to int8 after its measuring steps equals a fit with int8 from the start whose ``start_step`` is
  the measuring steps (SGD), bit for bit; one that switches to OneBitAdam equals OneBitAdam from the start with the same
  warm-up (AdamW), bit for bit: the measuring steps are exactly the method's own warm-up;
- a switch away from int8 flushes its residuals into the next step's gradient, and a checkpoint written in the switch
  step carries them into a resumed fit's first step;
- the decision, its table and its history are identical on every rank;
- a fit switched to DiLoCo ends with every rank's parameters identical, and a link that slows (every step sleeps) makes
  it decide again at its next check;
- a resume on the same cluster keeps the decision (and the compressor's state); a resume on 3 ranks from a checkpoint
  of 2 measures and decides again.

A decision is forced where the test needs one: ``Auto(methods=[...], max_bytes_per_step=...)`` below dense's bytes
leaves one candidate, whatever this machine measures; and ``long_s=LONG`` keeps all the measuring steps, however
loaded the machine, where the test needs the decision at step ``MEASURE`` (one fit ends them early on purpose:
``long_s=EARLY``, every step's exposed communication longer, the decision after the first timed step).
"""

from __future__ import annotations

import os
import time
import warnings

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback

from lightning_dist import RingDDPStrategy
from lightning_dist.callbacks import NaNRecovery
from lightning_dist.compression import build_compressor
from lightning_dist.strategy.hook import BucketObserver
from lightning_dist.sync import Auto, OneBitAdam
from lightning_dist.testing import ToyClassifier, launched_externally, quiet_trainer, run_ranks

pytestmark = pytest.mark.slow

MEASURE = 1 + 3  # Auto's default measuring steps
LONG, EARLY = 3600.0, 1e-9  # long_s: no step is longer (all the measuring steps); every step is (1 + 1)
STEPS = 40
FEW_BYTES = 1500  # below dense's 1,928 bytes of the toy's gradients per step, above int8's 1,032 and OneBitAdam's
SLOW_FROM, SLOW_S = 100, 0.02  # the drift fit: every step from here sleeps this long
CHECK = 20


class Sleep(Callback):
    """A link that slows: every step from SLOW_FROM on takes SLOW_S longer, inside the step."""

    def on_before_backward(self, trainer, *args):
        if trainer.global_step >= SLOW_FROM:
            time.sleep(SLOW_S)


class FlushProbe(Callback, BucketObserver):
    """Switches int8 to dense at the check at step ``CHECK`` (only dense allowed and a prediction every step exceeds)
    and records, per rank: the int8 compressor's residuals as the switch step finished, and in the step after it the
    reduced gradient as the comm hook left it (its buckets when reduced) and as the optimizer is handed it. With
    ``save``, a checkpoint written in the switch step; ``resumed``: a fit resumed from it, its first step recorded."""

    def __init__(self, save=None, resumed=False):
        self.compressor, self.owed, self.reduced, self.handed, self._buffers = None, None, {}, None, {}
        self.save, self.resumed = save, resumed

    def on_train_start(self, trainer, *args):
        if self.resumed:
            trainer.strategy.features.add_bucket_observer(self)

    def on_train_batch_end(self, trainer, *args):
        step, features = trainer.global_step, trainer.strategy.features
        if self.resumed:
            return
        if step == CHECK - 1:
            driver = features.sync
            self.compressor = features.compressor  # the int8 compressor auto chose at step MEASURE
            driver.settings.methods, driver.settings.max_bytes_per_step = (), None  # only dense allowed now
            driver.decision.row().predicted_step_s = 1e-9  # the check at CHECK sees a drift and decides again
        elif step == CHECK:
            features.sync.settings.drift = 0  # no later check: one switch
            residuals = self.compressor.residuals  # as the switch step finished (the strategy committed them)
            self.owed = {n: residuals.get(n).clone() for n, _ in trainer.lightning_module.named_parameters()}
            if self.save:
                trainer.save_checkpoint(self.save)
            features.add_bucket_observer(self)
        elif step == CHECK + 1:
            features.remove_bucket_observer(self)

    def bucket_handed(self, index, layout, buffer):
        self._buffers[index] = (layout, buffer)

    def bucket_done(self, index):
        layout, buffer = self._buffers[index]
        self.reduced.update({n: v.clone().view(-1) for n, v in zip(layout.names, layout.views(buffer), strict=True)})

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if trainer.global_step == CHECK:  # (the step that makes global_step CHECK + 1)
            self.handed = {n: p.grad.detach().clone().view(-1) for n, p in pl_module.named_parameters()}


def _model(optimizer):
    return ToyClassifier(optimizer=optimizer, lr=0.1 if optimizer == "sgd" else 0.01, distributed_sampler=True,
                         samples=2048, seed=0)


def _fit(world, strategy_kwargs, optimizer, steps=STEPS, callbacks=(), ckpt_path=None, model=None):
    pl.seed_everything(0, verbose=False)
    model = model or _model(optimizer)
    trainer = quiet_trainer(devices=world, strategy=RingDDPStrategy(timeout=60, start_method="fork", **strategy_kwargs),
                            max_steps=steps, use_distributed_sampler=False, callbacks=list(callbacks))
    trainer.fit(model, ckpt_path=ckpt_path)
    return trainer, [p.detach().clone() for p in model.parameters()]


def _history(trainer):
    return [{k: v for k, v in h.items()} for h in trainer.strategy.features.sync.history]


def _two(rank, world, ckpt_dir):
    out = {}
    with launched_externally(rank, world), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # drift=0: no re-decision from a loaded machine's noise where the test is about the switch
        auto = Auto(methods=["int8"], max_bytes_per_step=FEW_BYTES, drift=0, long_s=LONG)
        trainer, out["int8"] = _fit(world, {"sync": auto}, "sgd")
        out["int8_history"] = _history(trainer)
        out["int8_compressor"] = trainer.strategy.features.compressor.describe()
        path = os.path.join(ckpt_dir, "int8.ckpt")
        trainer.save_checkpoint(path)
        _, out["int8_reference"] = _fit(world, {"compressor": build_compressor("int8", start_step=MEASURE)}, "sgd")
        # the same cluster: the decision is kept, no step measures, the compressor's state comes back
        resumed = Auto(methods=["int8"], max_bytes_per_step=FEW_BYTES, drift=0, long_s=LONG)
        trainer, _ = _fit(world, {"sync": resumed}, "sgd", steps=STEPS + 10, ckpt_path=path)
        out["resumed_history"] = _history(trainer)
        out["resumed_steps"] = trainer.strategy.features.compressor.steps

        trainer, out["onebit"] = _fit(world, {"sync": Auto(methods=["onebit_adam"], max_bytes_per_step=FEW_BYTES,
                                                           drift=0, long_s=LONG)}, "adamw")
        out["onebit_history"] = _history(trainer)
        _, out["onebit_reference"] = _fit(world, {"sync": OneBitAdam()}, "adamw")
        # int8 then dense at the check at step CHECK: int8's residuals flushed into the next step's gradient
        probe = FlushProbe()
        trainer, _ = _fit(world, {"sync": Auto(methods=["int8"], max_bytes_per_step=FEW_BYTES, check_every=CHECK,
                                               long_s=LONG)}, "sgd", callbacks=[probe])
        out["flush_history"] = _history(trainer)
        out["flush"] = {"owed": probe.owed, "reduced": probe.reduced, "handed": probe.handed}
        # the same fit to the flushed step, a checkpoint written in the switch step; then a fit resumed from it
        path = os.path.join(ckpt_dir, "switch.ckpt")
        probe = FlushProbe(save=path)
        flush = Auto(methods=["int8"], max_bytes_per_step=FEW_BYTES, check_every=CHECK, long_s=LONG)
        _fit(world, {"sync": flush}, "sgd", steps=CHECK + 1, callbacks=[probe])
        out["flush_saved"] = probe.handed
        probe = FlushProbe(resumed=True)
        trainer, _ = _fit(world, {"sync": Auto(drift=0)}, "sgd", steps=CHECK + 1, callbacks=[probe], ckpt_path=path)
        out["flush_resumed"] = {"reduced": probe.reduced, "handed": probe.handed, "history": _history(trainer)}
        # a first timed step longer than long_s ends the measuring steps: the switch after step 2, as int8 from there
        trainer, out["early"] = _fit(world, {"sync": Auto(methods=["int8"], max_bytes_per_step=FEW_BYTES, drift=0,
                                                          long_s=EARLY)}, "sgd")
        out["early_history"] = _history(trainer)
        _, out["early_reference"] = _fit(world, {"compressor": build_compressor("int8", start_step=2)}, "sgd")

        # DiLoCo at H=10 (24 syncs need 240 steps after the measuring ones); from step 100 every step sleeps
        # NaNRecovery's replica drift check pauses while DiLoCo's workers hold their own parameters
        steps = MEASURE + 10 * 24 + 12
        nan = NaNRecovery(drift_check_every=5, on_drift="stop")
        trainer, out["diloco"] = _fit(world, {"sync": Auto(methods=["diloco10/int8"], max_bytes_per_step=FEW_BYTES,
                                                           check_every=CHECK, long_s=LONG)}, "sgd", steps=steps,
                                      callbacks=[Sleep(), nan])
        out["diloco_history"] = _history(trainer)
        out["drift"] = (nan.drift_checks, nan.drift_mismatches)
        path = os.path.join(ckpt_dir, "diloco.ckpt")
        trainer.save_checkpoint(path)
    return out


def _three(rank, world, ckpt_dir):
    with launched_externally(rank, world), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer, params = _fit(world, {"sync": Auto(methods=["diloco10/int8"], max_bytes_per_step=FEW_BYTES,
                                                            long_s=LONG)}, "sgd",
                               steps=MEASURE + 10 * 24 + 12 + MEASURE + 10 * 25,
                               ckpt_path=os.path.join(ckpt_dir, "diloco.ckpt"))
        return {"history": _history(trainer), "params": params}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    ckpt_dir = str(tmp_path_factory.mktemp("auto"))
    two = run_ranks(_two, 2, ckpt_dir, deadline_s=240)
    three = run_ranks(_three, 3, ckpt_dir, deadline_s=120)
    return two, three


def _same(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_switching_equals_the_method_from_the_start(runs):
    two, _ = runs
    for out in two:
        assert [h["choice"] for h in out["int8_history"]] == ["int8"]
        assert out["int8_history"][0]["step"] == MEASURE
        assert out["int8_compressor"].startswith("int8")
        assert _same(out["int8"], out["int8_reference"])
        assert [h["choice"] for h in out["onebit_history"]] == ["onebit_adam"]
        assert _same(out["onebit"], out["onebit_reference"])
        (early,) = out["early_history"]
        assert early["step"] == 2
        assert early["reason"].startswith("the first timed step's exposed communication took longer than long_s")
        assert _same(out["early"], out["early_reference"])
    assert _same(two[0]["int8"], two[1]["int8"])  # dense, then int8 every step: every rank the same model


def test_a_switch_away_from_a_compressor_flushes_its_residuals_into_the_next_step(runs):
    two, _ = runs
    for out in two:
        assert [(h["step"], h["choice"]) for h in out["flush_history"]] == [(MEASURE, "int8"), (CHECK, "dense")]
    owed = {n: sum(out["flush"]["owed"][n] for out in two) for n in two[0]["flush"]["owed"]}  # every rank's, summed
    assert sum(float(v.norm()) for v in owed.values()) > 0
    for out in two:
        flush = out["flush"]
        for name, summed in owed.items():  # the optimizer is handed dense's reduced gradient plus the residuals
            handed, reduced = flush["handed"][name], flush["reduced"][name]
            assert not torch.equal(handed, reduced), name
            torch.testing.assert_close(handed - reduced, summed, rtol=1e-5, atol=1e-6)
    assert all(torch.equal(two[0]["flush"]["handed"][n], two[1]["flush"]["handed"][n]) for n in owed)
    for out in two:
        # a checkpoint written in the switch step changes nothing in the fit, and carries the flush: the resumed fit's
        # first step hands the optimizer its reduced gradient plus the same residuals
        assert all(torch.equal(out["flush_saved"][n], out["flush"]["handed"][n]) for n in owed)
        resumed = out["flush_resumed"]
        assert [h["choice"] for h in resumed["history"]] == ["int8", "dense"]
        for name, summed in owed.items():
            torch.testing.assert_close(resumed["handed"][name] - resumed["reduced"][name], summed, rtol=1e-5,
                                       atol=1e-6)


def test_the_decision_is_identical_on_every_rank(runs):
    two, three = runs
    for key in ("int8_history", "onebit_history", "diloco_history"):
        assert two[0][key] == two[1][key], key
        # the table's rows are every candidate's agreed figures: the same numbers on every rank
        assert two[0][key][0]["rows"] and len(two[0][key][0]["rows"]) >= 5
    assert three[0]["history"] == three[1]["history"] == three[2]["history"]


def test_diloco_after_the_switch_and_a_link_that_slows(runs):
    two, _ = runs
    history = two[0]["diloco_history"]
    assert history[0]["choice"] == "diloco10/int8" and history[0]["step"] == MEASURE
    # the first check whose window holds slowed steps decides again (a check before it may too, on a loaded machine)
    first_check = ((SLOW_FROM // CHECK) + 1) * CHECK
    again = [h for h in history[1:] if h["step"] == first_check]
    assert again and again[0]["reason"].startswith("the step took"), history
    # 140 steps left hold 14 syncs of H=10, too few for DiLoCo's measured quality; dense is over the bytes limit: the
    # fit goes on dense, DiLoCo handing over through its final sync
    assert again[0]["choice"] == "dense" and again[0]["why"].startswith("no candidate is allowed"), again
    assert _same(two[0]["diloco"], two[1]["diloco"])  # the final sync: every rank holds theta_global
    checks, mismatches = two[0]["drift"]
    # checked at every 5th step while dense measures and from the step where DiLoCo handed back to dense (a multiple
    # of 5), never while DiLoCo's workers held their own parameters
    end, back = MEASURE + 10 * 24 + 12, again[0]["step"]
    assert mismatches == 0 and checks == MEASURE // 5 + len(range(back, end + 1, 5)), checks


def test_a_resume_keeps_the_decision_unless_the_cluster_changed(runs):
    two, three = runs
    for out in two:
        assert out["resumed_history"] == out["int8_history"]  # no new decision, no measuring
        assert out["resumed_steps"] == STEPS + 10  # the compressor's step count came back and went on
    history = three[0]["history"]
    changed = [h for h in history if h["choice"] is None]
    assert len(changed) == 1 and "resumed on" in changed[0]["reason"]
    resumed_at = changed[0]["step"]
    assert history[-1]["step"] == resumed_at + MEASURE and history[-1]["choice"] == "diloco10/int8"
    assert _same(three[0]["params"], three[1]["params"]) and _same(three[0]["params"], three[2]["params"])
