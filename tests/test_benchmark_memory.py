"""Smoke test of ``python -m lightning_dist.benchmarks.memory`` and its pure summaries."""

import json
import math

import pytest

from lightning_dist.benchmarks.memory import QUICK_ESTIMATE_CONFIGS, estimate_table, main, summarize_estimates


@pytest.mark.slow  # one 2-rank group fitting a 50 M-parameter model twice: ~10 s
@pytest.mark.benchmark
def test_quick_run_writes_json_table_and_plot(tmp_path):
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
    assert payload["estimate"]["records"] == records
    text = (tmp_path / "memory.txt").read_text()
    assert "the estimate against the measured growth" in text and "ring/sgd-momentum" in text
    assert (tmp_path / "memory.png").read_bytes().startswith(b"\x89PNG")


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
