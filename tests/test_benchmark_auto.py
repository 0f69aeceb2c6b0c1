"""The auto benchmark (issue 53): its target loss, cells, slowdown record and verdicts on hand-made records, and one
quick run (the benchmark tier: ``pytest -m benchmark``)."""

from __future__ import annotations

import argparse
import json

import pytest

from lightning_dist.benchmarks import auto
from lightning_dist.benchmarks import sync as S
from lightning_dist.simcluster import unavailable
from lightning_dist.sync import Auto

MEASURE = Auto().warmup_steps + Auto().steps


def _curve(shape, method, losses, every=100, final=None):
    steps = [every * (i + 1) for i in range(len(losses))]
    return {"shape": shape, "method": method, "curve_steps": steps, "curve_loss": losses,
            "final_loss": losses[-1] if final is None else final, "error": None}


def test_the_target_is_what_dense_and_another_both_reach():
    curves = {"dense": {"final_loss": 2.0}, "diloco50": {"final_loss": 2.1, "curve_loss": [2.5, 2.1, 2.15]},
              "topk1%": {"final_loss": None, "curve_loss": [2.6]}}  # (top-k stopped before equal samples)
    assert auto.target_loss(curves) == 2.1  # no other method reaches dense's 2.0: the lowest another reaches
    curves["onebit-adam"] = {"final_loss": 2.01, "curve_loss": [2.2, 1.99, 2.01]}
    assert auto.target_loss(curves) == 2.0  # OneBitAdam's curve reaches dense's own (then rises above it)
    assert auto.target_loss({"topk1%": {"final_loss": 2.0, "curve_loss": [2.0]}}) is None


def test_a_curve_stops_where_it_can_no_longer_come_near_the_best():
    """A fixed method's curve may stop at the step where reaching the target would take CONTENDER x the best time so
    far in every cell: a method that reaches it later is no contender anywhere (its ranking clear)."""
    step_s = {10.0: {"dense": 1.0, "int8": 0.5, "diloco10/int8": 0.1}, 100.0: {"dense": 0.2, "int8": 0.25}}
    best = {10.0: 30.0, 100.0: 100.0}  # s: DiLoCo's at 10 Mbit/s, dense's at 100
    # int8: 1.5 x 30 / 0.5 = 90 steps at 10 Mbit/s, 1.5 x 100 / 0.25 = 600 at 100: the larger, on its grid of 20
    assert auto.curve_cap("int8", step_s, best, 20) == 600
    assert auto.curve_cap("int8", step_s, {10.0: 31.0, 100.0: None}, 20) == 100  # 93 steps, on the grid
    assert auto.curve_cap("topk1%", step_s, best, 20) is None  # no time per step: no bound
    curves = [{"method": "dense", "curve_steps": [100, 200], "curve_loss": [2.5, 2.0]},
              {"method": "diloco10/int8", "curve_steps": [100, 200], "curve_loss": [2.1, 1.9]},
              {"method": "auto:diloco10/int8", "curve_steps": [100], "curve_loss": [1.0]}]  # not a fixed method
    assert auto.best_times(curves, 2.0, step_s) == {10.0: 20.0, 100.0: 40.0}  # dense at 100 Mbit/s: 200 x 0.2


def test_a_curve_out_of_reach_stops_at_its_second_point_in_a_row_and_never_while_it_can_reach():
    """CurveStop: the loss going on at its slope over the last window (optimistic where the loss flattens) still above
    the target at the fit's last step, at two points in a row; never before a window of points."""
    stop = S.CurveStop(2.0, out_of_reach=True, window=200)
    flattening = [(100, 3.0), (200, 2.8), (300, 2.7), (400, 2.65)]  # slope over 200 steps: 0.0015/step at 300
    assert not stop.hopeless(flattening[:2], 1200)  # no point a window back
    # at 300: 2.7 - 0.0015 x 900 = 1.35 (reachable); at 400: 2.65 - 0.00075 x 800 = 2.05 (not): one point only
    assert not stop.hopeless(flattening, 1200)
    flattening.append((500, 2.62))  # 2.62 - 0.0004 x 700 = 2.34: the second in a row
    assert stop.hopeless(flattening, 1200)
    assert not stop.hopeless(flattening, 4000)  # 2.62 - 0.0004 x 3,500 = 1.22: in reach of a longer fit
    assert not S.CurveStop(2.0).hopeless(flattening, 1200)  # out_of_reach off: only reaching ends it
    rising = [(100, 2.5), (200, 2.6), (300, 2.7)]  # a slope of the wrong sign: no progress, out of reach
    assert S.CurveStop(2.0, out_of_reach=True, window=100).hopeless(rising, 1200)
    assert stop.reached(2.0) and not stop.reached(2.01)


def test_shape_curves_stop_every_curve_at_the_target_and_cap_the_far_ones(monkeypatch):
    calls = []

    def run_curves(args, shape, methods, steps, horizon, stop=None, cap=None, agreed=True):
        (label, _), = methods.items()
        assert not agreed  # (theta_global's loss: no figure of this benchmark reads it)
        calls.append((label, stop and stop.below, cap))
        if stop is not None:  # fixed methods also end out of reach (a constant rate after warm-up); auto's do not
            assert stop.out_of_reach == (not label.startswith("auto:"))
        losses = {"dense": [3.0, 2.0], "diloco10/int8": [2.5, 1.9], "int8": [2.9, 2.5], "auto:diloco10/int8": [2.0]}
        return [{"method": label, "curve_steps": [100, 200][:len(losses[label])], "curve_loss": losses[label],
                 "final_loss": losses[label][-1] if len(losses[label]) == 2 else None}]

    monkeypatch.setattr(S, "run_curves", run_curves)
    args = argparse.Namespace(sizes=auto.DIGITS)
    methods = {label: S.METHODS[label] for label in ("dense", "int8", "diloco10/int8")}
    methods["auto:diloco10/int8"] = auto.forced("diloco10/int8", [
        {"label": "diloco10/int8", "kind": "diloco", "every": 10, "bytes_per_step": 10.0},
        {"label": "dense", "kind": "dense", "bytes_per_step": 100.0}])
    step_s = {10.0: {"dense": 1.0, "int8": 0.5, "diloco10/int8": 0.1}}
    curves = auto.shape_curves(args, "flat", methods, step_s)
    assert [c["method"] for c in curves] == ["dense", "diloco10/int8", "int8", "auto:diloco10/int8"]
    # dense whole; DiLoCo capped by dense's 200 s (1.5 x 200 / 0.1 = 3,000 steps), int8 by DiLoCo's 20 s (60 steps,
    # on its grid of 10), auto not capped; every other stops at dense's final loss
    assert calls == [("dense", None, None), ("diloco10/int8", 2.0, 3000), ("int8", 2.0, 60),
                     ("auto:diloco10/int8", 2.0, None)]
    # the next shape takes dense's curve as its own (the same mean gradient), its target with it
    calls.clear()
    two_tier = auto.shape_curves(args, "two_tier", methods, step_s, dense={**curves[0], "shape": "flat", "wall_s": 9.0})
    assert [c for c, _, _ in calls] == ["diloco10/int8", "int8", "auto:diloco10/int8"] and calls[0][1] == 2.0
    assert {k: two_tier[0][k] for k in ("method", "shape", "run_on", "wall_s")} == {
        "method": "dense", "shape": "two_tier", "run_on": "flat", "wall_s": 0.0}


def test_cells_time_auto_from_its_decision_and_its_choices_steps():
    decisions = [{"shape": "flat", "rate_mbit": 10.0, "choice": "diloco10/int8", "step": 8, "decided_s": 30.0},
                 {"shape": "flat", "rate_mbit": 100.0, "choice": "dense", "step": 8, "decided_s": 3.0}]
    curves = [_curve("flat", "dense", [3.0, 2.5, 2.0]), _curve("flat", "diloco10/int8", [3.1, 2.6, 2.1]),
              _curve("flat", "auto:diloco10/int8", [3.0, 2.6, 2.1])]
    timings = [{"shape": "flat", "rate_mbit": 10.0, "method": "dense", "per_step_s": 2.0},
               {"shape": "flat", "rate_mbit": 10.0, "method": "diloco10/int8", "per_step_s": 0.1},
               {"shape": "flat", "rate_mbit": 100.0, "method": "dense", "per_step_s": 0.2},
               {"shape": "flat", "rate_mbit": 100.0, "method": "diloco10/int8", "per_step_s": 0.1}]
    slow, fast = auto.cell_rows(decisions, curves, timings)
    assert slow["target_loss"] == 2.1  # dense's 2.0 reached by no other
    assert slow["times_s"] == {"dense": 600.0, "diloco10/int8": 30.0}  # step 300 of diloco, 300 of dense (2.0 <= 2.1)
    assert slow["auto_s"] == pytest.approx(30.0 + (300 - 8) * 0.1)  # its curve reaches 2.1 at step 300
    assert slow["best"] == "diloco10/int8" and slow["vs_best"] == pytest.approx(59.2 / 30.0)
    assert slow["vs_dense"] == pytest.approx(59.2 / 600.0)
    assert fast["auto_s"] == pytest.approx(3.0 + (300 - 8) * 0.2)  # dense chosen: dense's own curve
    assert fast["best"] == "diloco10/int8"  # 30 s against dense's 60
    # a record with its first step's time: that step counts as a steady dense step (no fixed method's first is counted)
    decisions[0]["first_step_s"] = 5.0
    slow, _ = auto.cell_rows(decisions, curves, timings)
    assert slow["auto_s"] == pytest.approx(30.0 - 5.0 + 2.0 + (300 - 8) * 0.1)


def test_the_two_jobs_cells_keep_apart_and_a_choice_is_timed_as_its_fixed_method():
    """The LM and the digits job share shapes and links, not curves or times; auto's ``powersgd`` is timed as the fixed
    ``powersgd-r2`` (the codec it builds from its defaults)."""
    decisions = [{"workload": "lm", "shape": "flat", "rate_mbit": 10.0, "choice": "dense", "step": 4,
                  "decided_s": 4.0},
                 {"workload": "digits", "shape": "flat", "rate_mbit": 10.0, "choice": "powersgd", "step": 4,
                  "decided_s": 1.0}]
    curves = [{**_curve("flat", "dense", [3.0, 2.0]), "workload": "lm"},
              {**_curve("flat", "dense", [0.5, 0.1]), "workload": "digits"},
              {**_curve("flat", "powersgd-r2", [0.4, 0.1]), "workload": "digits"},
              {**_curve("flat", "auto:powersgd", [0.5, 0.1]), "workload": "digits"}]
    timings = [{"workload": "lm", "shape": "flat", "rate_mbit": 10.0, "method": "dense", "per_step_s": 1.0},
               {"workload": "digits", "shape": "flat", "rate_mbit": 10.0, "method": "dense", "per_step_s": 0.1},
               {"workload": "digits", "shape": "flat", "rate_mbit": 10.0, "method": "powersgd-r2", "per_step_s": 0.02}]
    lm, digits = auto.cell_rows(decisions, curves, timings)
    assert (lm["workload"], lm["target_loss"], lm["times_s"]) == ("lm", 2.0, {"dense": 200.0})
    assert lm["auto_s"] == pytest.approx(4.0 + 196 * 1.0)
    assert digits["target_loss"] == 0.1 and digits["times_s"] == {"dense": 20.0, "powersgd-r2": pytest.approx(4.0)}
    assert digits["auto_s"] == pytest.approx(1.0 + 196 * 0.02) and digits["best"] == "powersgd-r2"
    assert "digits flat @ 10" in auto.check_targets([lm, digits], None)[0]
    assert "powersgd-r2 s" in auto.cells_table([lm, digits], "digits")
    assert "powersgd-r2 s" not in auto.cells_table([lm, digits], "lm")
    assert auto.plot([lm, digits]) is not None


def test_seeds_are_judged_each_against_its_own_target_and_paired():
    """Curves of three seeds: each seed's times against its own dense's target, a method's time the median over its
    seeds, auto's ratios the medians of its per-seed ratios; a method that ran the first seed alone keeps its time."""
    decisions = [{"workload": "digits", "shape": "flat", "rate_mbit": 10.0, "choice": "diloco10/int8", "step": 4,
                  "decided_s": 1.0}]
    timings = [{"workload": "digits", "shape": "flat", "rate_mbit": 10.0, "method": m, "per_step_s": t}
               for m, t in (("dense", 0.1), ("diloco10/int8", 0.01), ("int8", 0.05))]
    # auto reaches the target a curve point after DiLoCo at seed 0, a point before it at seed 2
    reach = {0: (3, 4), 1: (3, 3), 2: (4, 3)}  # seed: (diloco's point, auto's)
    curves = []
    for seed, (fixed, mine) in reach.items():
        target = 1.0 + seed / 10  # each seed's dense ends elsewhere
        for label, at in (("dense", 8), ("diloco10/int8", fixed), ("auto:diloco10/int8", mine), ("int8", 6)):
            if label == "int8" and seed:
                continue  # far from the best at the first seed: the other seeds run without it
            losses = [target + 1.0] * (at - 1) + [target] * (9 - at)
            curves.append({**_curve("flat", label, losses, every=10), "workload": "digits", "seed": seed})
    row, = auto.cell_rows(decisions, curves, timings)
    assert [c["target_loss"] for c in row["seeds"]] == [1.0, 1.1, 1.2]
    assert row["times_s"]["diloco10/int8"] == pytest.approx(30 * 0.01)  # points 3, 3, 4: the median step 30
    assert row["times_s"]["int8"] == pytest.approx(60 * 0.05)  # the first seed's alone
    auto_s = {seed: 1.0 + (10 * mine - 4) * 0.01 for seed, (_, mine) in reach.items()}
    assert row["auto_s"] == pytest.approx(auto_s[0 if auto_s[0] < auto_s[2] else 2])  # the median of three
    ratios = sorted(auto_s[seed] / (10 * fixed * 0.01) for seed, (fixed, _) in reach.items())
    assert row["vs_best"] == pytest.approx(ratios[1])  # paired by seed, not a ratio of medians
    assert "medians over 3 seeds" in auto.cells_table([row], "digits")
    assert auto.contenders([row], "flat") == {"dense", "diloco10/int8"}  # int8 at 10x the best: its ranking clear
    assert auto.contenders([row], "two_tier") == {"dense"}
    assert auto._median_reached([1.0, None, 3.0]) == 3.0 and auto._median_reached([None, None, 3.0]) is None


def test_diloco_times_per_step_share_their_cells_one_local_step():
    def timing(method, every, cycle, sync, rate=10.0):
        return {"shape": "two_tier", "rate_mbit": rate, "method": method, "every": every, "cycle_s": cycle,
                "sync_step_s": sync, "per_step_s": cycle / every}

    # local steps (cycle - sync) / (H - 1): 0.1, 0.08 and 0.09 (the machine's drift between fits): the median 0.09
    timings = [timing("diloco50", 50, 0.1 * 49 + 0.3, 0.3), timing("diloco50/int8", 50, 0.08 * 49 + 0.5, 0.5),
               timing("diloco10/int8", 10, 0.09 * 9 + 0.2, 0.2), timing("diloco50", 50, 4.0, 0.2, rate=100.0),
               {"shape": "two_tier", "rate_mbit": 10.0, "method": "dense", "per_step_s": 0.5, "every": 1,
                "cycle_s": 0.5, "sync_step_s": 0.5}]
    out = {(t["method"], t["rate_mbit"]): t for t in auto.pooled_local_steps(timings)}
    assert out[("diloco50", 10.0)]["per_step_s"] == pytest.approx((49 * 0.09 + 0.3) / 50)
    assert out[("diloco50", 10.0)]["measured_per_step_s"] == pytest.approx((0.1 * 49 + 0.3) / 50)
    assert out[("diloco50/int8", 10.0)]["per_step_s"] == pytest.approx((49 * 0.09 + 0.5) / 50)  # its own sync
    assert out[("diloco10/int8", 10.0)]["per_step_s"] == pytest.approx((9 * 0.09 + 0.2) / 10)
    assert out[("diloco50", 100.0)]["per_step_s"] == pytest.approx(4.0 / 50)  # alone in its cell: as measured
    assert out[("dense", 10.0)]["per_step_s"] == 0.5 and "measured_per_step_s" not in out[("dense", 10.0)]
    # the cells use them: the int8 twin no faster than its sync makes it
    curves = [_curve("two_tier", label, [3.0, 2.0]) for label in ("dense", "diloco50", "diloco50/int8")]
    decisions = [{"shape": "two_tier", "rate_mbit": 10.0, "choice": "diloco50", "step": 4, "decided_s": 2.0}]
    row, = auto.cell_rows(decisions, curves, timings[:3] + timings[4:])
    assert row["times_s"]["diloco50"] == pytest.approx(200 * (49 * 0.09 + 0.3) / 50)
    assert row["best"] == "diloco50"


def test_auto_switched_to_diloco_is_validated_on_the_model_diloco_validates(monkeypatch):
    """The curve of a fit that auto handed to DiLoCo holds the workers' mean, as DiLoCo's own fits' do (it held rank
    0's own worker mid-cycle before: 1.5% higher on two_tier)."""
    from types import SimpleNamespace

    calls = []
    loop = SimpleNamespace(swap_in_validated=lambda: calls.append("in"), swap_back=lambda: calls.append("back"))
    monkeypatch.setattr(S, "val_loss", lambda module, batch: 2.0 if calls[-1:] == ["in"] else 3.0)
    monkeypatch.setattr(S, "global_model", lambda module, loop_: module)
    for sync in (SimpleNamespace(loop=loop), SimpleNamespace(inner=SimpleNamespace(loop=loop))):  # DiLoCo, auto
        calls.clear()
        assert S.validated_losses(None, SimpleNamespace(sync=sync), None)[0] == 2.0 and calls == ["in", "back"]
    for sync in (None, SimpleNamespace(inner=SimpleNamespace())):  # every step; auto on a per-step method
        calls.clear()
        assert S.validated_losses(None, SimpleNamespace(sync=sync), None) == (3.0, None) and calls == []


def test_the_slowdown_record_and_the_verdicts():
    def fit(method, losses, history=()):
        # (step, loss, global, end, eval seconds): 1 s per 20 steps, 0.5 s of evaluation at each point
        curve = [[20 * (i + 1), loss, None, 1.5 * (i + 1), 0.5] for i, loss in enumerate(losses)]
        return {"method": method, "curve": curve, "starts": [0.0], "ends": [], "history": list(history)}

    raw = {"slow_0": fit("auto", [3.0, 2.5, 2.2], [{"step": 8, "choice": "onebit_adam", "reason": "first"},
                                                   {"step": 250, "choice": "diloco10/int8", "reason": "drift"}]),
           "slow_1": fit("onebit-adam", [3.0, 2.6, 2.3, 2.2])}
    record = auto.slowdown_record(raw, at=200, error=None)
    assert record["target_loss"] == 2.2
    assert record["fits"]["auto"]["seconds_to_target"] == pytest.approx(4.5 - 1.0)  # two evaluations before it
    assert record["fits"]["onebit-adam"]["seconds_to_target"] == pytest.approx(6.0 - 1.5)
    assert record["redecided_at"] == 250 and record["choices"] == ["onebit_adam", "diloco10/int8"]
    rows = [{"shape": "flat", "rate_mbit": 10.0, "vs_best": 1.1, "vs_dense": 0.05},
            {"shape": "flat", "rate_mbit": 100.0, "vs_best": 1.2, "vs_dense": 1.01}]
    lines = auto.check_targets(rows, record)
    assert lines[0].startswith("target auto within 15% of the best fixed method in every cell: MISSED")
    assert "worst 1.20x in lm flat @ 100" in lines[0]
    assert lines[1].startswith("target auto never more than 5% slower than dense: MET")
    assert lines[2].startswith("target auto decides again within 50 steps of the link's change: MET")
    assert lines[3].startswith("target auto beats every fixed method that was best before the change: MET")
    record["redecided_at"] = 260
    assert "MISSED" in auto.check_targets(rows, record)[2]


def test_every_choice_auto_can_make_is_a_timed_fixed_method():
    """auto's time in a cell is its choice's time per step: each job's fixed methods, --quick's too, hold every
    per-step compressor the family's quality table allows (DiLoCo and OneBitAdam where the job runs them)."""
    from lightning_dist.sync.auto_rule import ADAM, SGD, compressor_quality
    from lightning_dist.sync.auto_settings import COMPRESSOR_CANDIDATES

    for job, optimizer in (("lm", ADAM), ("digits", SGD)):
        allowed = [n for n in COMPRESSOR_CANDIDATES if compressor_quality(n, optimizer)[1] is None]
        for sizes in auto.WORKLOADS[job]:
            missing = [n for n in allowed if auto.FIXED_LABEL.get(n, n) not in sizes.methods]
            assert not missing, (job, sizes.steps, missing)


def test_forced_auto_decides_the_choice_whatever_the_links():
    rows = [{"label": "dense", "kind": "dense", "bytes_per_step": 1000.0, "every": 1},
            {"label": "onebit_adam", "kind": "onebit_adam", "bytes_per_step": 40.0, "every": 1},
            {"label": "diloco50", "kind": "diloco", "bytes_per_step": 20.0, "every": 50}]
    method = auto.forced("onebit_adam", rows)
    settings = method.settings()
    assert settings.methods == ("onebit_adam",) and 40.0 < settings.max_bytes_per_step < 1000.0
    assert method.cycle == 1 and S.eval_every(method, S.DIGITS) == S.DIGITS.eval_every
    # a DiLoCo choice: its curve read at its synced models (multiples of H), to the fit's steps
    method = auto.forced("diloco50", rows)
    assert method.cycle == 50 and S.eval_every(method, S.DIGITS) == 50
    rows[0]["bytes_per_step"] = None  # dense not measured (ruled out by its bound): twice the choice's bytes
    assert auto.forced("diloco50", rows).settings().max_bytes_per_step == 40.0


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    if (reason := unavailable()) is not None:
        pytest.skip(f"the simulated cluster cannot run here: {reason}")
    out = tmp_path_factory.mktemp("auto")
    return auto.main(["--quick", "--out", str(out)]), out


@pytest.mark.slow
@pytest.mark.benchmark
def test_quick_run_decides_on_the_cluster_and_writes_its_outputs(quick):
    payload, out = quick
    for name in ("auto.json", "auto.txt", "auto.png"):
        assert (out / name).stat().st_size > 0
    assert json.loads((out / "auto.json").read_text())["cells"] == payload["cells"]
    assert [d["workload"] for d in payload["decisions"]] == ["lm", "digits"]
    for decision in payload["decisions"]:
        measured = 2 if decision["reason"].startswith("the first timed") else MEASURE  # past long_s: 1 + 1
        assert decision["error"] is None and decision["step"] == measured and decision["choice"] in {
            r["label"] for r in decision["rows"]}
    labels = {d["workload"]: {r["label"] for r in d["rows"]} for d in payload["decisions"]}
    assert "onebit_adam" in labels["lm"] and "onebit_adam" not in labels["digits"]  # an Adam method, not under SGD
    for cell in payload["cells"]:
        assert cell["auto_s"] is not None and cell["times_s"]["dense"] is not None
    slow = payload["slowdown"]
    first = slow["fits"]["auto"]["history"][0]  # all the measuring steps, or 1 + 1 past long_s (its reason says)
    assert slow["error"] is None and first["step"] == (2 if first["reason"].startswith("the first timed") else MEASURE)
    assert len(payload["targets"]) == 4


@pytest.mark.slow
@pytest.mark.benchmark
def test_quick_slowdown_runs_every_fixed_method_then_auto_to_their_loss(tmp_path):
    """Two fixed methods best before the change (a full run's cells once had OneBitAdam 2% ahead of dense, auto's
    choice): each runs whole, then auto, which stops at the loss they all reach, every rank at the same step (the
    first version of this stop hung: only rank 0 knew the fixed fits' losses)."""
    if (reason := unavailable()) is not None:
        pytest.skip(f"the simulated cluster cannot run here: {reason}")
    args = auto._parse_args(["--quick", "--out", str(tmp_path)])
    (tmp_path / "logs").mkdir()
    rows = [{"workload": "lm", "shape": auto.SLOW_SHAPE, "rate_mbit": auto.SLOW_RATE, "best": "onebit-adam",
             "choice": "dense"}]
    slow = auto.run_slowdown(args, tmp_path / "logs", rows)
    assert slow["error"] is None and slow["methods"] == ["onebit-adam", "dense", "auto"]
    fixed = [slow["fits"][label]["final_loss"] for label in ("onebit-adam", "dense")]
    assert slow["target_loss"] == pytest.approx(max(fixed) if slow["fits"]["auto"]["seconds_to_target"] is not None
                                                 else slow["fits"]["auto"]["final_loss"])
    if slow["fits"]["auto"]["seconds_to_target"] is not None:  # it stopped at its first point at or below the target
        assert slow["fits"]["auto"]["final_loss"] <= max(fixed)
