"""The simulated-cluster benchmark: its summaries and target verdicts on hand-made records, and a smoke run."""

from __future__ import annotations

import json

import pytest

from lightning_dist import simcluster
from lightning_dist.benchmarks import cluster, tiers
from lightning_dist.benchmarks._cluster import run_record


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
    rec = run_record(raw, warmup=3)
    assert rec["timed_steps"] == 7
    assert rec["median_s"] == pytest.approx(0.2)
    assert rec["exposed_median_s"] == pytest.approx(0.5)
    assert rec["bytes_sent_per_step"] == pytest.approx(1e6)
    assert rec["params"] == 5_324_810
    with pytest.raises(ValueError, match="no step left"):
        run_record(_raw(0.2, steps=3), warmup=5)


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
    assert f"{'MET' if met[0] else 'MISSED'} ({2.0 / topk_s:.1f}x)" in lines[0] and ">= 5x faster per step" in lines[0]
    assert f"{'MET' if met[1] else 'MISSED'} ({1 / ring_s:.2f}x)" in lines[1] and ">= 0.9x native's" in lines[1]


def test_missing_measurements_are_missed_not_met():
    failed = {"hosts": 2, "rate_mbit": 100, "config": "topk1%", "median_s": None, "error": "timed out",
              "wall_s": 420.0}
    records = cluster.add_speedups([_rec(2, 100, "dense", 2.0), failed])
    targets = cluster.check_targets(records, [{"hosts": 2, "rate_mbit": 100, "error": "exit codes [1, 1]"}])
    assert targets == {}
    assert all(line.endswith("MISSED (not measured)") for line in cluster.target_lines(targets))
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
@pytest.mark.benchmark
def test_quick_run_on_a_simulated_cluster(tmp_path):
    reason = simcluster.unavailable()
    if reason is not None:
        pytest.skip(reason)
    # a run's own deadline well inside pytest's: a hung run is a FAILED record with its log's tail, not a timeout.
    # Fewer steps and rounds than --quick's own: 3 timed steps of each configuration after 2 of warm-up, one timed
    # all-reduce per algorithm, advise on 2 dense steps and 1 round; at 1 Gbit/s, not the targets' 100 Mbit/s (a dense
    # step there is ~1.8 s: the run took 59 s, at 1 Gbit/s 30 s), so the targets are left unjudged: their verdicts are
    # test_targets_met_and_missed's
    payload = cluster.main(["--quick", "--rates", "1000", "--steps", "5", "--warmup", "2", "--iterations", "1",
                            "--advise-steps", "2", "--advise-rounds", "1", "--run-timeout", "150", "--out",
                            str(tmp_path)])
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
    verdicts = [line for line in (tmp_path / "cluster.txt").read_text().splitlines() if line.startswith("target")]
    assert payload["targets"] == {} and len(verdicts) == 2
    assert all(line.endswith("MISSED (not measured)") for line in verdicts)


# -- the two-tier part (--two-tier, lightning_dist.benchmarks.tiers): summaries and verdicts on hand-made records --
def _tier_rec(per_host, rate, config, topology, median_s, link):
    return {"per_host": per_host, "rate_mbit": rate, "config": config, "topology": topology, "median_s": median_s,
            "link_bytes_per_step": link, "inter_host_bytes_per_step": link, "intra_host_bytes_per_step": 0.0,
            "wall_s": 30.0, "error": None}


def test_two_tier_records_ratios_and_targets():
    raw = {"bytes": 16 << 20, "times": {"flat": [3.0, 2.0, 2.5], "two_tier": [1.0, 1.5, 1.25]},
           "link_sent": {"flat": 29e6, "two_tier": 17e6}}
    bus = tiers.allreduce_record(raw, per_host=4, rate_mbit=100)
    assert bus["speedup"] == pytest.approx(2.0) and bus["flat_link_bytes"] == 29e6
    records = tiers.add_ratios([
        _tier_rec(4, 100, "topk1%", "flat", 0.2, 2.2e6), _tier_rec(4, 100, "topk1%", "two_tier", 0.25, 0.32e6),
        _tier_rec(2, 100, "dense", "flat", 3.0, 32e6), _tier_rec(2, 100, "dense", "two_tier", 2.0, 21e6),
        _tier_rec(2, 100, "topk1%", "flat", 0.17, 1e6), _tier_rec(2, 100, "topk1%", "two_tier", 0.33, 0.33e6),
    ])
    assert records[1]["link_vs_flat"] == pytest.approx(0.32 / 2.2) and records[0]["flat_over_two_tier"] is None
    assert records[3]["flat_over_two_tier"] == pytest.approx(1.5)
    targets = tiers.check_targets([bus], records)
    assert targets["allreduce_speedup"]["met"] and not targets["topk_link_bytes"]["met"]
    assert targets["no_slower/dense@100"]["met"] and not targets["no_slower/topk1%@100"]["met"]
    lines = tiers.target_lines(targets, ["dense", "topk1%", "int8"], [100])
    assert lines[0].startswith("target") and "MET (2.00x)" in lines[0]
    assert "MISSED (0.145 (1/6.9))" in lines[1]
    assert lines[-1].endswith("MISSED (not measured)")  # int8 never ran
    assert "2.00x" in tiers.allreduce_table([bus]) and "1.50x" in tiers.step_table(records)
    assert "FAILED" in tiers.step_table([{**records[0], "error": "timed out"}])
    assert tiers.plot([bus], records, params=5_324_810) is not None


def test_two_tier_byte_formulas_match_the_issues_table():
    s, p = 1.0, 1.0
    assert tiers.host_bytes("dense_flat", 4, 2, s, p) == pytest.approx(1.75)  # 2 (N - 1) / N
    assert tiers.host_bytes("dense_two_tier", 4, 2, s, p) == pytest.approx(1.0)  # 2 (H - 1) / H
    assert tiers.host_bytes("topk_flat_direct", 8, 2, s, p) == 64  # L (N - L): the issue's 64x at 2 hosts of 8
    assert tiers.host_bytes("topk_flat_ring", 4, 2, s, p) == 7  # gloo's ring all-gather relays: N - 1
    assert tiers.host_bytes("topk_two_tier", 4, 2, s, p) == 1  # H - 1


def test_two_tier_arguments():
    args = cluster._parse_args(["--two-tier", "--quick"])
    assert (args.hosts, args.ranks_per_host, args.rates, args.configs) == ((2,), (2,), (100,), ("dense", "topk1%"))
    args = cluster._parse_args(["--two-tier"])
    assert args.ranks_per_host == (2, 4) and args.rates == (100, 1000) and args.steps == tiers.DEFAULT_STEPS
    assert args.configs == ("dense", "int8", "topk1%", "powersgd-r2")
