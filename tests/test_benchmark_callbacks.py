"""Smoke test of ``python -m lightning_dist.benchmarks.callbacks`` and its pure summaries."""

import json

import pytest

from lightning_dist.benchmarks.callbacks import SUBJECTS, cost_fractions, main, summarize_runs


@pytest.mark.slow  # eight short 2-rank fits, ~20 s
@pytest.mark.benchmark
def test_quick_run_writes_json_table_and_plot(tmp_path):
    payload = main(["--quick", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "callbacks.json").read_text())
    guard, cost = saved["nan_recovery"], saved["memory_monitor"]
    assert [(r["workload"], r["config"]) for r in guard["runs"]] == [
        ("digits", "auto"), ("digits", "auto+NaNRecovery"), ("mlp", "auto"), ("mlp", "auto+NaNRecovery")]
    for run in guard["runs"]:
        guarded = run["config"].endswith("NaNRecovery")
        assert (run["hook_fraction"] > 0) == guarded and (run["decide_fraction"] > 0) == guarded
    for record in payload["nan_recovery"]["records"]:
        assert record["paired_ratio"] > 0 and 0 < record["own_fraction"] < 0.5
    assert {(r["strategy"], r["monitored"]) for r in cost["runs"]} == {
        (s, m) for s in ("ring_ddp", "ddp") for m in (False, True)}
    for run in cost["runs"]:
        assert (run["monitor_s"] > 0) == run["monitored"] and (run["readings"] > 0) == run["monitored"]
    for s in cost["records"]:
        assert s["paired_ratio"] > 0 and s["readings"] >= 2 and 0 < s["steady_fraction"] < 0.5
        assert s["one_off_s"] > 0
    text = (tmp_path / "callbacks.txt").read_text()
    assert "guard work" in text and "MemoryMonitor's cost" in text
    assert (tmp_path / "callbacks.png").read_bytes().startswith(b"\x89PNG")


def test_guard_summary_pairs_rounds_and_adds_up_the_fractions():
    runs = []
    for k, (base, guarded) in enumerate([(10.0, 10.2), (12.0, 12.0), (11.0, 11.55)]):
        common = {"workload": "digits", "strategy": "ring_ddp", "round": k, "hook_fraction": 0.0,
                  "decide_fraction": 0.0, "callback_fraction": 0.0}
        runs.append({**common, "config": "auto", "median_s": base})
        runs.append({**common, "config": "auto+NaNRecovery", "median_s": guarded, "hook_fraction": 0.004,
                     "decide_fraction": 0.002, "callback_fraction": 0.001})
    (record,) = summarize_runs(runs, SUBJECTS["NaNRecovery"])
    assert record["paired_ratio"] == pytest.approx(1.02)  # the median of 1.02, 1.0, 1.05
    assert record["own_fraction"] == pytest.approx(0.007) and record["exposed_fraction"] == pytest.approx(0.003)
    assert record["rounds"] == 3


def test_monitor_summary_pairs_rounds_and_separates_the_one_off():
    runs = []
    for k, (base, watched) in enumerate([(0.010, 0.0102), (0.012, 0.012), (0.011, 0.01155)]):
        common = {"workload": "digits", "strategy": "ring_ddp", "round": k, "steps": 101, "every": 50}
        runs.append({**common, "config": "auto", "monitored": False, "median_s": base, "monitor_s": 0.0,
                     "first_s": 0.0, "readings": 0})
        # 5 ms at the first step, then 10 us per step for the other 100
        runs.append({**common, "config": "auto+MemoryMonitor", "monitored": True, "median_s": watched,
                     "monitor_s": 0.006, "first_s": 0.005, "readings": 3})
    runs.append({"workload": "digits", "strategy": "ddp", "config": "ddp", "round": 0, "monitored": False,
                 "median_s": 0.01, "steps": 101})  # no pair
    (record,) = summarize_runs(runs, SUBJECTS["MemoryMonitor"])
    assert record["strategy"] == "ring_ddp" and record["rounds"] == 3
    assert record["paired_ratio"] == pytest.approx(1.02)  # the median of 1.02, 1.0, 1.05
    assert record["steady_per_step_s"] == pytest.approx(1e-5)
    assert record["one_off_s"] == pytest.approx(0.005)
    assert record["steady_fraction"] == pytest.approx(1e-5 / 0.01155)  # the median over rounds
    fractions = cost_fractions(runs[1])
    assert fractions["steady_fraction"] == pytest.approx(1e-5 / 0.0102)
    assert fractions["all_in_fraction"] == pytest.approx(0.006 / (101 * 0.0102))
