"""Smoke test of ``python -m lightning_dist.benchmarks.step``: a quick run writes all its outputs."""

import json

import pytest

from lightning_dist.benchmarks._common import step_times
from lightning_dist.benchmarks.step import WORKLOADS, judge, main


@pytest.mark.slow  # four 2-rank Lightning runs, ~20 s
@pytest.mark.benchmark
def test_quick_run_writes_json_table_and_plot(tmp_path):
    payload = main(["--quick", "--out", str(tmp_path)])

    saved = json.loads((tmp_path / "step.json").read_text())
    assert saved["records"] == payload["records"]
    assert [(r["workload"], r["config"]) for r in saved["records"]] == [
        ("digits", "ddp"), ("digits", "auto"), ("mlp", "ddp"), ("mlp", "auto")]
    for run in saved["runs"]:
        assert run["timed_steps"] > 0 and run["median_s"] > 0
        assert run["max_abs_weight_diff_vs_ddp"] < 1e-5  # same seed: ring_ddp trains the same weights as DDP
        if run["config"] == "ddp":
            assert run["comm_median_s"] is None and run["exposed_median_s"] is None
        else:  # the overlapped hook: time inside the transport, and the part backward waited for
            assert run["comm_median_s"] > 0 and 0 <= run["exposed_median_s"] < run["median_s"]
    ddp = [r for r in saved["records"] if r["config"] == "ddp"]
    assert all(r["ratio_vs_ddp"] == 1.0 for r in ddp)
    assert {(t["workload"], t["config"]) for t in saved["targets"]} == {("digits", "auto"), ("mlp", "auto")}
    assert all(isinstance(t["met"], bool) for t in saved["targets"])
    table = (tmp_path / "step.txt").read_text()
    assert "exposed comm ms" in table and "target mlp auto" in table
    assert (tmp_path / "step.png").read_bytes().startswith(b"\x89PNG")


def test_step_times_drop_warmup_and_epoch_boundaries():
    ends = [0.0, 1.0, 3.0, 6.0, 10.0, 15.0]
    epochs = [0, 0, 0, 1, 1, 1]
    assert step_times(ends, epochs, warmup=0) == [1.0, 2.0, 4.0, 5.0]  # 3.0 spans the epoch boundary
    assert step_times(ends, epochs, warmup=2) == [2.0, 4.0, 5.0]


def test_workloads_and_targets():
    mlp = WORKLOADS["mlp"]
    assert mlp.targets == ("auto", "native") and mlp.target_ratio == 1.02
    labels = [c.label for c in mlp.configs]
    for algorithm in ("auto", "native", "ring", "tree"):  # overlapped and blocking, per algorithm
        assert algorithm in labels and f"{algorithm}/blocking" in labels
    rows = [{"config": "auto", "paired_ratio_vs_ddp": 1.01, "ratio_vs_ddp": 1.03},
            {"config": "native", "paired_ratio_vs_ddp": 1.03, "ratio_vs_ddp": 1.0}]
    assert [t["met"] for t in judge(mlp, rows)] == [True, False]  # judged on the paired ratio
