"""Smoke test of ``python -m lightning_dist.benchmarks.memory`` and its pure summaries."""

import json
import math

import pytest

from lightning_dist.benchmarks.memory import (
    QUICK_ESTIMATE_CONFIGS,
    cost_fractions,
    estimate_table,
    main,
    summarize_cost,
    summarize_estimates,
)


@pytest.mark.slow  # one 2-rank group fitting a 50 M-parameter model twice, then four short digits fits: ~20 s
def test_quick_run_writes_json_table_and_plots(tmp_path):
    payload = main(["--quick", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "memory.json").read_text())
    records = saved["estimate"]["records"]
    assert [r["config"] for r in records] == list(QUICK_ESTIMATE_CONFIGS)
    assert {(r["config"], r["rank"]) for r in saved["estimate"]["runs"]} == {
        (c, rank) for c in QUICK_ESTIMATE_CONFIGS for rank in (0, 1)}
    for r in records:
        assert r["params"] >= 50_000_000 and r["estimate_mib"] > 0 and r["grown_mib"] > 0
        assert all(math.isfinite(e) for e in r["errors_pct"]) and r["met"] in (True, False)
        assert r["parts_mib"]["weights"] == pytest.approx(r["params"] * 4 / 2**20)
    assert "ddp_buckets" in records[0]["parts_mib"] and "optimizer_state" in records[1]["parts_mib"]
    cost = payload["cost"]
    assert {(r["strategy"], r["monitored"]) for r in cost["runs"]} == {
        (s, m) for s in ("ring_ddp", "ddp") for m in (False, True)}
    for run in cost["runs"]:
        assert (run["monitor_s"] > 0) == run["monitored"] and (run["readings"] > 0) == run["monitored"]
    for s in cost["records"]:
        assert s["paired_ratio"] > 0 and s["readings"] >= 2 and 0 < s["steady_fraction"] < 0.5
        assert s["one_off_s"] > 0
    text = (tmp_path / "memory.txt").read_text()
    assert "part A" in text and "part B" in text and "ring/sgd-momentum" in text
    for name in ("memory.png", "memory_cost.png"):
        assert (tmp_path / name).read_bytes().startswith(b"\x89PNG")


def _estimate(config, rank, params, estimate, grown):
    return {"config": config, "rank": rank, "description": config, "params": params,
            "parts_mib": {"weights": estimate / 2, "activations": estimate / 2}, "estimate_mib": estimate,
            "grown_mib": grown, "monitor_measured_mib": grown}


def test_estimate_summary_takes_rank_zero_and_the_worst_rank():
    records = [
        _estimate("big", 1, 60_000_000, 1000.0, 700.0),  # rank 1 first: the summary must still show rank 0's
        _estimate("big", 0, 60_000_000, 1000.0, 900.0),
        _estimate("short", 0, 60_000_000, 500.0, 1000.0),
        _estimate("short", 1, 60_000_000, 800.0, 1000.0),
        _estimate("small", 0, 1_000, 50.0, 100.0),
        _estimate("small", 1, 1_000, 50.0, 100.0),
    ]
    big, short, small = summarize_estimates(records)
    assert big["config"] == "big" and big["grown_mib"] == 900.0
    assert big["error_pct"] == pytest.approx(100 * 100 / 900)
    assert big["max_abs_error_pct"] == pytest.approx(100 * 300 / 700)  # rank 1's 42.9% is over 30%
    assert big["met"] is False
    assert short["errors_pct"] == pytest.approx([-50.0, -20.0]) and short["max_abs_error_pct"] == pytest.approx(50.0)
    assert short["met"] is False
    assert small["met"] is None and not small["target_applies"]  # below 50 M parameters: not judged
    within = summarize_estimates([_estimate("ok", r, 60_000_000, 1100.0, 1000.0) for r in (0, 1)])
    assert within[0]["met"] is True and within[0]["max_abs_error_pct"] == pytest.approx(10.0)
    text = estimate_table([big, short, small])
    assert "MISSED" in text and "n/a" in text and "-50.0%" in text


def test_cost_summary_pairs_rounds_and_separates_the_one_off():
    runs = []
    for k, (base, watched) in enumerate([(0.010, 0.0102), (0.012, 0.012), (0.011, 0.01155)]):
        common = {"strategy": "ring_ddp", "round": k, "steps": 101, "every": 50}
        runs.append({**common, "monitored": False, "median_s": base, "monitor_s": 0.0, "first_s": 0.0,
                     "readings": 0})
        # 5 ms at the first step, then 10 us per step for the other 100
        runs.append({**common, "monitored": True, "median_s": watched, "monitor_s": 0.006, "first_s": 0.005,
                     "readings": 3})
    runs.append({"strategy": "ddp", "round": 0, "monitored": False, "median_s": 0.01, "steps": 101})  # no pair
    (record,) = summarize_cost(runs)
    assert record["strategy"] == "ring_ddp" and record["rounds"] == 3
    assert record["paired_ratio"] == pytest.approx(1.02)  # the median of 1.02, 1.0, 1.05
    assert record["steady_per_step_s"] == pytest.approx(1e-5)
    assert record["one_off_s"] == pytest.approx(0.005)
    assert record["steady_fraction"] == pytest.approx(1e-5 / 0.01155)  # the median over rounds
    fractions = cost_fractions(runs[1])
    assert fractions["steady_fraction"] == pytest.approx(1e-5 / 0.0102)
    assert fractions["all_in_fraction"] == pytest.approx(0.006 / (101 * 0.0102))
