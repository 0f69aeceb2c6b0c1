"""Smoke test of ``python -m lightning_dist.benchmarks.hetero`` and its verdicts."""

import json

import pytest

from lightning_dist.benchmarks.hetero import judge, main


@pytest.mark.slow  # three 2-rank fits of 2 epochs, ~20 s
def test_quick_run_writes_json_table_and_plot(tmp_path):
    payload = main(["--quick", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "hetero.json").read_text())
    assert [r["mode"] for r in saved["records"]] == ["uniform", "balanced", "static"]
    for record in saved["records"]:
        assert "error" not in record, record.get("error")
        assert len(record["epoch_s"]) == 2 and record["epoch_median_s"] > 0 and 0 <= record["val_acc"] <= 1
        assert sum(record["final_sizes"]) == 128
    uniform, _, static = saved["records"]
    assert uniform["final_sizes"] == [64, 64] and static["final_sizes"] == [85, 43]  # speeds 1 : 0.5
    assert {t["target"] for t in payload["targets"]} == {
        "speed-up / ideal >= 0.9", "compute-time spread after rebalancing <= 6%",
        "final accuracy as uniform's (within 1 point)"}
    assert "speed-up" in (tmp_path / "hetero.txt").read_text()
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
