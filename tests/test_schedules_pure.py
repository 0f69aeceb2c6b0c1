"""The learning-rate schedules of the project's jobs (lightning_dist/examples/schedules.py), written out here from
their definitions: a linear warm-up, then constant, a cosine to a tenth, or warm-up-stable-decay; LambdaLR steps the
optimizer's rate along them; bad values fail naming the fix."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from lightning_dist.examples.cnn import DigitsCNN
from lightning_dist.examples.lm import ByteLM
from lightning_dist.examples.schedules import SCHEDULES, lightning_scheduler, lr_factor

TOTAL, WARMUP = 100, 10


def test_the_warm_up_is_linear_and_constant_follows_it_as_the_lm_always_did():
    for schedule in SCHEDULES:
        assert [lr_factor(schedule, s, TOTAL, WARMUP) for s in range(WARMUP)] == [(s + 1) / WARMUP
                                                                                 for s in range(WARMUP)]
    assert [lr_factor("constant", s, TOTAL, WARMUP) for s in range(TOTAL)] == [min(1.0, (s + 1) / WARMUP)
                                                                              for s in range(TOTAL)]


def test_cosine_runs_from_the_peak_to_a_tenth_at_the_last_step():
    got = [lr_factor("cosine", s, TOTAL, WARMUP) for s in range(WARMUP, TOTAL)]
    span = TOTAL - 1 - WARMUP
    expected = [0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (s - WARMUP) / span)) for s in range(WARMUP, TOTAL)]
    assert got == pytest.approx(expected, abs=1e-12)
    assert got[0] == 1.0 and got[-1] == pytest.approx(0.1) and all(a >= b for a, b in itertools.pairwise(got))


def test_wsd_holds_the_peak_then_decays_linearly_over_the_last_fifth():
    got = [lr_factor("wsd", s, TOTAL, WARMUP) for s in range(TOTAL)]
    assert got[WARMUP:80] == [1.0] * (80 - WARMUP)  # stable until the last 20 steps
    assert got[80:] == pytest.approx([1.0 - 0.9 * (s - 79) / 20 for s in range(80, TOTAL)], abs=1e-12)
    assert got[-1] == pytest.approx(0.1)


def test_the_scheduler_steps_the_optimizers_rate_and_constant_without_warm_up_adds_none():
    weight = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.AdamW([weight], lr=0.01)
    assert lightning_scheduler(optimizer, "constant", 0, lambda: pytest.fail("not read")) is None
    entry = lightning_scheduler(optimizer, "cosine", WARMUP, lambda: TOTAL)
    assert entry["interval"] == "step"
    rates = []
    for _ in range(TOTAL):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        entry["scheduler"].step()
    assert rates == pytest.approx([0.01 * lr_factor("cosine", s, TOTAL, WARMUP) for s in range(TOTAL)], rel=1e-12)
    state = entry["scheduler"].state_dict()  # a checkpoint holds it (a partial, not a lambda)
    assert state["last_epoch"] == TOTAL


@pytest.mark.parametrize("model", [DigitsCNN, ByteLM])
@pytest.mark.parametrize("kwargs, match", [({"schedule": "linear"}, "one of constant, cosine, wsd"),
                                            ({"warmup_steps": -1}, "warmup_steps` must be an int >= 0")])
def test_a_bad_schedule_names_the_fix(model, kwargs, match):
    with pytest.raises(ValueError, match=match):
        model(**kwargs)


def test_the_lms_schedule_spans_the_steps_it_is_given_then_stays_at_its_last_rate():
    model = ByteLM(width=32, depth=1, heads=2, warmup_steps=2, schedule="wsd", schedule_steps=10)
    config = model.configure_optimizers()  # no trainer: the schedule's length is its own
    optimizer, scheduler = config["optimizer"], config["lr_scheduler"]["scheduler"]
    rates = []
    for _ in range(14):  # a fit 4 steps longer than its schedule (the sync benchmark's compressors' curves)
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert rates == pytest.approx([2e-3 * lr_factor("wsd", s, 10, 2) for s in range(10)] + [2e-4] * 4, rel=1e-12)
