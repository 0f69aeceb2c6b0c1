"""Smoke test of ``python -m lightning_dist.benchmarks.hetero`` and its verdicts."""

import json

import pytest

from lightning_dist.benchmarks.hetero import CAPPED, COST, GATED, judge, judge_accumulation, main, micro_batches_run

AUTO = "capped, auto: step time within 10% of uncapped's"
COST_TARGET = "one micro-batch: paired step time 1.00 +/- 0.02 of today's"


@pytest.mark.slow  # eight 2-rank fits of 1-2 epochs, ~35 s
@pytest.mark.benchmark
def test_quick_run_writes_json_table_and_plot(tmp_path):
    payload = main(["--quick", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "hetero.json").read_text())
    assert [(r["scenario"], r["mode"]) for r in saved["records"]] == [
        (GATED, "uniform"), (GATED, "balanced"), (GATED, "static"),
        (CAPPED, "uncapped"), (CAPPED, "capped, off"), (CAPPED, "capped, auto"),
        (COST, "today"), (COST, "one micro-batch")]
    for record in saved["records"]:
        assert "error" not in record, record.get("error")
        assert record["epoch_median_s"] > 0 and record["step_median_s"] > 0 and record["timed_steps"] >= 3
        assert sum(record["final_sizes"]) == 128
    balance, capped, cost = saved["records"][:3], saved["records"][3:6], saved["records"][6:]
    for record in balance:
        assert len(record["epoch_s"]) == 2 and 0 <= record["val_acc"] <= 1
    uniform, _, static = balance
    assert uniform["final_sizes"] == [64, 64] and static["final_sizes"] == [85, 43]  # speeds 1 : 0.5
    # the micro-batches each rank ran (its training_step calls): the cap moves samples (off) or cuts rank 0's share
    uncapped, off, auto = capped
    assert uncapped["final_sizes"] == [85, 43] and uncapped["micro_sizes"] == [[85], [43]]
    assert off["final_sizes"] == [29, 99] and off["micro_sizes"] == [[29], [99]]
    assert auto["final_sizes"] == [85, 43] and auto["micro_sizes"] == [[29, 28, 28], [43]]
    assert auto["micro_calls_per_step"][1] == 1 and auto["micro_calls_per_step"][0] > 2.5  # a short last batch: fewer
    assert [r["micro_sizes"] for r in cost] == [[[85], [43]]] * 2 and [r["round"] for r in cost] == [0, 0]
    assert all(r["val_acc"] is None for r in cost)  # cost runs do not validate
    assert {t["target"] for t in payload["targets"]} == {
        "speed-up / ideal >= 0.9", "compute-time spread after rebalancing <= 6%",
        "final accuracy as uniform's (within 1 point)", AUTO, COST_TARGET}
    text = (tmp_path / "hetero.txt").read_text()
    assert "speed-up" in text and "29/28/28 | 43" in text and "paired ratio [p25, p75]" in text
    assert (tmp_path / "hetero.png").read_bytes().startswith(b"\x89PNG")


def test_judge_compares_balanced_with_uniform_and_the_ideal():
    base = {"scenario": "2 ranks 1/0.5", "speeds": [1.0, 0.5]}
    records = [{**base, "mode": "uniform", "epoch_median_s": 3.0, "compute_spread": 0.9, "val_acc": 0.97},
               {**base, "mode": "balanced", "epoch_median_s": 2.1, "compute_spread": 0.04, "val_acc": 0.968}]
    verdicts = {t["target"]: t["met"] for t in judge(records)}
    assert verdicts == {"speed-up / ideal >= 0.9": True, "compute-time spread after rebalancing <= 6%": True,
                        "final accuracy as uniform's (within 1 point)": True}
    records[1]["epoch_median_s"] = 2.5  # 1.2x of an ideal 1.5x: 0.8
    assert not judge(records)[0]["met"]


def _capped(mode, step_s, round_index=0):
    return {"scenario": CAPPED, "mode": mode, "round": round_index, "step_median_s": step_s,
            "epoch_median_s": 12 * step_s, "timed_steps": 30}


def _cost(mode, round_index, step_s):
    return {"scenario": COST, "mode": mode, "round": round_index, "step_median_s": step_s,
            "epoch_median_s": 12 * step_s, "timed_steps": 30}


def test_judge_accumulation_holds_auto_to_uncapped_and_pairs_the_cost_by_round():
    records = [_capped("uncapped", 0.150), _capped("capped, off", 0.330), _capped("capped, auto", 0.160),
               # paired ratios 1.01, 0.99, 1.015 (median 1.01), though the arms' medians differ by 10%
               _cost("today", 0, 0.100), _cost("one micro-batch", 0, 0.101),
               _cost("today", 1, 0.110), _cost("one micro-batch", 1, 0.1089),
               _cost("today", 2, 0.120), _cost("one micro-batch", 2, 0.1218)]
    verdicts = {t["target"]: t for t in judge_accumulation(records)}
    assert set(verdicts) == {AUTO, COST_TARGET}
    assert verdicts[AUTO]["met"] and "1.067x" in verdicts[AUTO]["detail"] and "capped, off 2.20x" in \
        verdicts[AUTO]["detail"]
    assert verdicts[COST_TARGET]["met"] and "1.010x" in verdicts[COST_TARGET]["detail"]
    assert "3 round(s)" in verdicts[COST_TARGET]["detail"]

    records[2]["step_median_s"] = 0.170  # 1.133x uncapped's: missed
    records[4]["step_median_s"] = 0.104  # round 0 paired 1.04: the median becomes 1.015, still met
    verdicts = {t["target"]: t["met"] for t in judge_accumulation(records)}
    assert verdicts == {AUTO: False, COST_TARGET: True}
    records[8]["step_median_s"] = 0.1236  # round 2 paired 1.03: median 1.03, missed
    assert {t["target"]: t["met"] for t in judge_accumulation(records)}[COST_TARGET] is False
    records.append(_cost("today", 3, 0.050))  # an unpaired run (round 3's today) changes nothing
    assert {t["target"]: t["met"] for t in judge_accumulation(records)}[COST_TARGET] is False
    # a cost faster than today's by more than the tolerance misses too (something was skipped, or noise)
    faster = [_cost("today", 0, 0.100), _cost("one micro-batch", 0, 0.096)]
    assert judge_accumulation(faster)[0]["met"] is False


def test_judge_accumulation_leaves_out_targets_without_their_runs():
    assert judge_accumulation([]) == []
    failed = {"scenario": CAPPED, "mode": "capped, auto", "error": "rank 0 failed"}
    assert judge_accumulation([_capped("uncapped", 0.15), failed]) == []


def test_micro_batches_run_reads_the_most_frequent_pattern_per_step():
    calls = [(0, 0, 29), (0, 0, 28), (0, 0, 28), (0, 1, 29), (0, 1, 28), (0, 1, 28), (0, 2, 10)]
    assert micro_batches_run(calls) == {"sizes": [29, 28, 28], "calls_per_step": 7 / 3}
    assert micro_batches_run([]) == {"sizes": [], "calls_per_step": 0.0}
