"""The simulated-cluster benchmark: its summaries and target verdicts on hand-made records, and a smoke run."""

from __future__ import annotations

import json

import pytest

from lightning_dist import simcluster
from lightning_dist.benchmarks import cluster


def _raw(step_s: float, steps: int = 10, exposed_s: float = 0.5, bytes_sent: float = 1e6) -> dict:
    ends = [i * step_s for i in range(steps)]
    return {"last": {"params": 5_324_810}, "ends": ends, "epochs": [0] * steps,
            "steps": [{"exposed_s": exposed_s, "comm_s": 2 * exposed_s, "bytes_sent": bytes_sent,
                       "dense_bytes": 4 * bytes_sent} for _ in range(steps)]}


def _rec(hosts: int, rate: float, config: str, median_s: float) -> dict:
    return {"hosts": hosts, "rate_mbit": rate, "config": config, "median_s": median_s, "wall_s": 10.0,
            "exposed_median_s": 0.1, "comm_median_s": 0.2, "bytes_sent_per_step": 1e6, "error": None}


def test_run_record_drops_warmup_and_takes_medians():
    raw = _raw(0.2, steps=10)
    raw["ends"][1] = 5.0  # a slow first step, inside the warm-up: must not count
    rec = cluster.run_record(raw, warmup=3)
    assert rec["timed_steps"] == 7
    assert rec["median_s"] == pytest.approx(0.2)
    assert rec["exposed_median_s"] == pytest.approx(0.5)
    assert rec["bytes_sent_per_step"] == pytest.approx(1e6)
    assert rec["params"] == 5_324_810
    with pytest.raises(ValueError, match="no step left"):
        cluster.run_record(_raw(0.2, steps=3), warmup=5)


def test_speedups_are_per_hosts_and_rate():
    records = cluster.add_speedups([
        _rec(2, 100, "dense", 2.0), _rec(2, 100, "topk1%", 0.25),
        _rec(2, 1000, "dense", 0.4), _rec(2, 1000, "topk1%", 0.2),
        {**_rec(3, 100, "topk1%", 0.3)},  # no dense in this group
    ])
    assert records[0]["speedup_vs_dense"] == pytest.approx(1.0)
    assert records[1]["speedup_vs_dense"] == pytest.approx(8.0)
    assert records[3]["speedup_vs_dense"] == pytest.approx(2.0)
    assert records[4]["speedup_vs_dense"] is None


def test_busbw_record_follows_nccl_tests_convention():
    raw = {"bytes": 16 << 20, "times": {"ring": [2.0, 1.0, 3.0], "native": [1.0, 1.0, 1.0]}}
    rec = cluster.busbw_record(raw, hosts=4, rate_mbit=100)
    assert rec["native_busbw_GBps"] == pytest.approx(1.5 * (16 << 20) / 1e9)
    assert rec["ring_busbw_GBps"] == pytest.approx(0.75 * (16 << 20) / 1e9)
    assert rec["ring_vs_native"] == pytest.approx(0.5)
    assert rec["line_GBps"] == pytest.approx(0.0125)


@pytest.mark.parametrize("topk_s, ring_s, met", [(0.3, 1.0, (True, True)), (0.5, 1.2, (False, False))])
def test_targets_met_and_missed(topk_s, ring_s, met):
    records = cluster.add_speedups([_rec(2, 100, "dense", 2.0), _rec(2, 100, "topk1%", topk_s),
                                    _rec(2, 1000, "dense", 1.0), _rec(2, 1000, "topk1%", 0.01)])
    busbw = [cluster.busbw_record({"bytes": 1 << 20, "times": {"ring": [ring_s], "native": [1.0]}}, 2, 100),
             cluster.busbw_record({"bytes": 1 << 20, "times": {"ring": [0.1], "native": [1.0]}}, 2, 1000)]
    targets = cluster.check_targets(records, busbw)
    assert (targets["topk_speedup_vs_dense"]["met"], targets["ring_busbw_vs_native"]["met"]) == met
    lines = cluster.target_lines(targets)
    assert lines[0].endswith("MET" if met[0] else "MISSED")
    assert f"{2.0 / topk_s:.1f}x faster per step (target >= 5x)" in lines[0]
    assert f"{1 / ring_s:.2f}x (target >= 0.9x)" in lines[1]


def test_missing_measurements_are_missed_not_met():
    failed = {"hosts": 2, "rate_mbit": 100, "config": "topk1%", "median_s": None, "error": "timed out",
              "wall_s": 420.0}
    records = cluster.add_speedups([_rec(2, 100, "dense", 2.0), failed])
    targets = cluster.check_targets(records, [{"hosts": 2, "rate_mbit": 100, "error": "exit codes [1, 1]"}])
    assert targets == {}
    assert all(line.endswith("not measured: MISSED") for line in cluster.target_lines(targets))
    table = cluster.step_table(records)
    assert "FAILED" in table and "timed out" in table
    assert "FAILED" in cluster.busbw_table([{"hosts": 2, "rate_mbit": 100, "error": "exit codes [1, 1]"}])


def test_tables_show_every_record():
    records = cluster.add_speedups([_rec(2, 100, "dense", 2.0), _rec(2, 100, "topk1%", 0.25)])
    text = cluster.step_table(records)
    assert "2,000.0" in text and "250.0" in text and "8.00x" in text
    bus = cluster.busbw_record({"bytes": 16 << 20, "times": {"ring": [1.5], "native": [1.4]}}, 2, 100)
    assert "0.93x" in cluster.busbw_table([bus])


def test_advise_predictions_join_their_records():
    assert set(cluster.advise_candidates(list(cluster.CONFIGS))) == {"none", "fp16", "int8", "topk1%", "powersgd-r2"}
    records = [_rec(2, 100, "dense", 2.0), _rec(2, 100, "topk1%", 0.25), _rec(2, 100, "dense/ring", 2.0),
               _rec(2, 1000, "dense", 0.2)]
    advice = {(2, 100): {"compressors": {"none": {"predicted_step_s": 1.8}, "topk1%": {"predicted_step_s": 0.5}}}}
    dense, topk, ring, other = cluster.add_predictions(records, advice)
    assert dense["predicted_vs_measured"] == pytest.approx(0.9) and topk["predicted_vs_measured"] == 2.0
    assert ring["predicted_s"] is None and other["predicted_vs_measured"] is None
    assert "0.90x" in cluster.step_table(records)


def test_argument_checks():
    with pytest.raises(SystemExit):
        cluster._parse_args(["--hosts", "1"])
    with pytest.raises(SystemExit):
        cluster._parse_args(["--steps", "6"])
    args = cluster._parse_args(["--quick"])
    assert (args.hosts, args.rates, args.configs, args.steps) == ((2,), (100,), ("dense", "topk1%"), 10)


@pytest.mark.slow
def test_quick_run_on_a_simulated_cluster(tmp_path):
    reason = simcluster.unavailable()
    if reason is not None:
        pytest.skip(reason)
    # a run's own deadline well inside pytest's: a hung run is a FAILED record with its log's tail, not a timeout
    payload = cluster.main(["--quick", "--run-timeout", "150", "--out", str(tmp_path)])
    for name in ("cluster.json", "cluster.txt", "cluster.png"):
        assert (tmp_path / name).stat().st_size > 0
    assert json.loads((tmp_path / "cluster.json").read_text())["records"] == payload["records"]
    assert [r["config"] for r in payload["records"]] == ["dense", "topk1%"]
    for rec in payload["records"]:
        assert rec["error"] is None, rec["error"]
        assert rec["median_s"] > 0 and rec["params"] >= cluster.MIN_PARAMS
        assert rec["bytes_sent_per_step"] > 0
    dense, topk = payload["records"]
    assert topk["bytes_sent_per_step"] < dense["bytes_sent_per_step"] / 20
    (advice,) = payload["advise"]
    assert set(advice["compressors"]) == {"none", "topk1%"}
    for rec in payload["records"]:  # advise's prediction, within a factor of the measured step
        assert 0.25 < rec["predicted_vs_measured"] < 4.0, rec
    (bus,) = payload["allreduce"]
    assert bus["error"] is None and bus["ring_busbw_GBps"] > 0 and bus["native_busbw_GBps"] > 0
    assert set(payload["targets"]) == {"topk_speedup_vs_dense", "ring_busbw_vs_native"}
