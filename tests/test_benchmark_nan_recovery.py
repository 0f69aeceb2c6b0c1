"""Smoke test of ``python -m lightning_dist.benchmarks.nan_recovery`` and its summary."""

import json

import pytest

from lightning_dist.benchmarks.nan_recovery import main, summarize_runs


@pytest.mark.slow  # four short 2-rank fits, ~15 s
def test_quick_run_writes_json_table_and_plot(tmp_path):
    payload = main(["--quick", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "nan_recovery.json").read_text())
    assert [(r["workload"], r["config"]) for r in saved["runs"]] == [
        ("digits", "auto"), ("digits", "auto+NaNRecovery"), ("mlp", "auto"), ("mlp", "auto+NaNRecovery")]
    for run in saved["runs"]:
        guarded = run["config"].endswith("NaNRecovery")
        assert (run["hook_fraction"] > 0) == guarded and (run["decide_fraction"] > 0) == guarded
    for record in payload["records"]:
        assert record["paired_ratio"] > 0 and 0 < record["own_fraction"] < 0.5
    assert "guard work" in (tmp_path / "nan_recovery.txt").read_text()
    assert (tmp_path / "nan_recovery.png").read_bytes().startswith(b"\x89PNG")


def test_summary_pairs_rounds_and_adds_up_the_fractions():
    runs = []
    for k, (base, guarded) in enumerate([(10.0, 10.2), (12.0, 12.0), (11.0, 11.55)]):
        common = {"workload": "digits", "round": k, "hook_fraction": 0.0, "decide_fraction": 0.0,
                  "callback_fraction": 0.0}
        runs.append({**common, "config": "auto", "median_s": base})
        runs.append({**common, "config": "auto+NaNRecovery", "median_s": guarded, "hook_fraction": 0.004,
                     "decide_fraction": 0.002, "callback_fraction": 0.001})
    (record,) = summarize_runs(runs)
    assert record["paired_ratio"] == pytest.approx(1.02)  # the median of 1.02, 1.0, 1.05
    assert record["own_fraction"] == pytest.approx(0.007) and record["exposed_fraction"] == pytest.approx(0.003)
    assert record["rounds"] == 3
