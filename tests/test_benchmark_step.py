"""Smoke test of ``python -m lightning_dist.benchmarks.step``: a quick run writes all its outputs."""

import json

import pytest

from lightning_dist.benchmarks.step import QUICK_CONFIGS, main, step_times


@pytest.mark.slow  # two 2-rank Lightning runs, ~10 s
def test_quick_run_writes_json_table_and_plot(tmp_path):
    payload = main(["--quick", "--out", str(tmp_path)])

    saved = json.loads((tmp_path / "step.json").read_text())
    assert saved["records"] == payload["records"]
    assert [r["config"] for r in saved["records"]] == [c.label for c in QUICK_CONFIGS]
    for run in saved["runs"]:
        assert run["timed_steps"] > 0 and run["median_s"] > 0
        assert run["max_abs_weight_diff_vs_ddp"] < 1e-5  # same seed: ring_ddp trains the same weights as DDP
    assert saved["records"][0]["ratio_vs_ddp"] == 1.0
    assert isinstance(saved["target"]["met"], bool)
    table = (tmp_path / "step.txt").read_text()
    assert "ring_ddp/auto" in table and "target" in table
    assert (tmp_path / "step.png").read_bytes().startswith(b"\x89PNG")


def test_step_times_drop_warmup_and_epoch_boundaries():
    ends = [0.0, 1.0, 3.0, 6.0, 10.0, 15.0]
    epochs = [0, 0, 0, 1, 1, 1]
    assert step_times(ends, epochs, warmup=0) == [1.0, 2.0, 4.0, 5.0]  # 3.0 spans the epoch boundary
    assert step_times(ends, epochs, warmup=2) == [2.0, 4.0, 5.0]
