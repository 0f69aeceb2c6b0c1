"""``lightning-dist-advise``: the FIFO replay and the prediction (pure), the settings checked before any rank starts,
and one launched run on 2 local ranks (fork, gloo, the digits CNN, few rounds) whose table and JSON are sane."""

import json
import subprocess
import sys

import pytest
import torch
from hydra import compose, initialize_config_module
from hydra.errors import ConfigCompositionException
from omegaconf import open_dict

from lightning_dist import advise
from lightning_dist.advise import (
    SYNC_QUALITY,
    SyncAdvice,
    accuracy_cost,
    candidates,
    check,
    configured_sync,
    host_parts,
    onebit_prediction,
    predict_step,
    predictions,
    replay,
    sync_predictions,
    table,
)
from lightning_dist.compression import COMPRESSORS, BucketLayout
from lightning_dist.sync import DiLoCo

CLI = [sys.executable, "-m", "lightning_dist.advise"]


def _compose(*overrides):
    with initialize_config_module("lightning_dist.conf", version_base="1.3"):
        return compose("config", overrides=["+advise=default", *overrides])


# -- pure -------------------------------------------------------------------------------------------------------
def test_replay_is_a_fifo_queue_fed_at_the_ready_times():
    assert replay([], []) == 0.0
    assert replay([1.0, 2.0], [0.5, 0.5]) == 2.5  # idle between: each starts when handed over
    assert replay([1.0, 1.2], [1.0, 1.0]) == 3.0  # the second waits for the first
    assert replay([0.0, 5.0], [10.0, 1.0]) == 11.0
    with pytest.raises(ValueError, match="2 ready times for 1"):
        replay([0.0, 1.0], [1.0])


def test_prediction_adds_only_what_runs_past_backward():
    # backward ends at the last hand-over (3.0): a worker done by then costs nothing
    assert predict_step(10.0, [1.0, 2.0, 3.0], [0.1, 0.1, 0.0]) == 10.0
    assert predict_step(10.0, [1.0, 2.0, 3.0], [0.1, 0.1, 0.5]) == 10.5
    assert predict_step(10.0, [1.0, 2.0, 3.0], [3.0, 0.0, 0.0]) == pytest.approx(11.0)  # 1 + 3 = 4, past 3 by 1
    assert predict_step(4.0, [], []) == 4.0


def test_predictions_take_dense_as_the_base_and_quote_the_readme():
    measured = {"compute_s": 1.0, "ready_s": [0.2, 0.5]}
    codecs = {"none": {"coding_s": [0.0, 0.0], "wire_s": [0.4, 0.4], "bytes": [800, 800]},
              "topk": {"coding_s": [0.05, 0.05], "wire_s": [0.01, 0.01], "bytes": [12, 12],
                       "kwargs": {"name": "topk", "ratio": 0.01}}}
    out = predictions(measured, codecs)
    assert out["none"]["predicted_step_s"] == pytest.approx(1.0 + (0.2 + 0.8) - 0.5)  # FIFO: done at 1.0 + 0.2
    assert out["topk"]["predicted_step_s"] == pytest.approx(1.0 + 0.06)
    assert out["none"]["speedup_vs_dense"] == 1.0
    assert out["topk"]["speedup_vs_dense"] == pytest.approx(1.5 / 1.06)
    assert out["topk"]["bytes_per_step"] == 24
    assert out["topk"]["accuracy_cost_pt"] == -5.0  # the benchmark's table: topk 1% with EF (the default)
    assert out["none"]["accuracy_cost_pt"] == 0.0


def test_onebit_adam_row_sends_sign_every_step_and_int4_every_refresh_and_is_recommended_where_compression_pays():
    measured = {"compute_s": 1.0, "ready_s": [0.2, 0.5]}
    codecs = {"sign": {"coding_s": [0.1, 0.1], "wire_s": [0.05, 0.05], "bytes": [30, 30]},
              "int4": {"coding_s": [0.25, 0.25], "wire_s": [0.25, 0.25], "bytes": [100, 100]}}
    row = onebit_prediction(measured, codecs, dense_step_s=2.0, refresh=25)
    assert row["predicted_step_s"] == pytest.approx(1.0 + 0.3 + 1.0 / 25)  # after backward: nothing overlaps it
    assert row["bytes_per_step"] == pytest.approx(60 + 200 / 25)
    assert row["speedup_vs_dense"] == pytest.approx(2.0 / 1.34)
    assert onebit_prediction(measured, {"sign": codecs["sign"]}, 2.0) is None
    compressors = predictions(measured, {"none": {"coding_s": [0, 0], "wire_s": [0.5, 0.5], "bytes": [800, 800]},
                                         **codecs})
    report = {"measured": {**measured, "step_s": 2.0, "exposed_s": 1.0}, "world_size": 2, "compressors": compressors,
              "onebit": row}
    text = table(report)
    assert "onebit_adam" in text and "sync=onebit_adam (predicted 1340.0 ms" in text  # sign pays here (1.2x)
    compressors["sign"]["speedup_vs_dense"] = compressors["int4"]["speedup_vs_dense"] = 1.0
    assert "sync=onebit_adam (predicted" not in table(report)  # nothing pays: no recommendation


def test_accuracy_costs_match_the_settings_they_were_measured_at():
    assert accuracy_cost({"name": "int8"}) == (0.09, "EF: 98.33%")
    assert accuracy_cost({"name": "topk", "ratio": 0.01, "error_feedback": False})[0] == -1.85
    assert accuracy_cost({"name": "powersgd", "rank": 2})[0] == -0.55
    cost, what = accuracy_cost({"name": "threshold", "threshold": 0.001})
    assert cost == -1.48 and "not these settings" in what
    assert {row[0] for row in advise.ACCURACY_COST} == set(COMPRESSORS)


def test_diloco_rows_spread_one_sync_of_the_whole_model_over_h_steps():
    measured = {"compute_s": 1.0, "ready_s": [0.2, 0.5]}
    codecs = {"none": {"coding_s": [0.0, 0.0], "wire_s": [0.4, 0.4], "bytes": [800, 800]},
              "int8": {"coding_s": [0.1, 0.1], "wire_s": [0.1, 0.1], "bytes": [200, 200]}}
    dense = predictions(measured, codecs)["none"]["predicted_step_s"]  # 1.5: every step waits 0.5 for the wire
    rows = sync_predictions(measured, codecs, SyncAdvice(every=10, codecs=["none", "int8", "topk"]), dense)
    assert list(rows) == ["diloco H=10", "diloco H=10 int8"]  # topk was not measured: no row
    plain, int8 = rows["diloco H=10"], rows["diloco H=10 int8"]
    # a step: compute only (no exchange between workers); the sync: every bucket once, after the step, every 10 steps
    assert plain["sync_s"] == pytest.approx(0.8) and plain["sync_bytes"] == 1600
    assert plain["predicted_step_s"] == pytest.approx(1.0 + 0.8 / 10)
    assert plain["bytes_per_step"] == pytest.approx(160)
    assert (plain["coding_s"], plain["wire_s"]) == (pytest.approx(0.0), pytest.approx(0.08))
    assert plain["speedup_vs_dense"] == pytest.approx(1.5 / 1.08)
    assert int8["predicted_step_s"] == pytest.approx(1.04) and int8["bytes_per_step"] == pytest.approx(40)
    assert int8["coding_s"] == pytest.approx(0.02) and int8["wire_s"] == pytest.approx(0.02)
    # DiLoCo changes the optimisation: no per-step accuracy cost, a pointer to where its quality is measured
    assert all(r["quality"] == SYNC_QUALITY and "docs/sync.md" in r["quality"] and "accuracy_cost_pt" not in r
               for r in rows.values())
    # under two_tier a worker is a host: each of its ranks carries a part across hosts
    hosts = sync_predictions(measured, codecs, SyncAdvice(every=10, codecs=["none"]), dense, bytes_scale=2)
    assert hosts["diloco H=10"]["bytes_per_step"] == pytest.approx(320)
    assert hosts["diloco H=10"]["predicted_step_s"] == pytest.approx(1.08)
    assert sync_predictions(measured, codecs, SyncAdvice(every=1), None)["diloco H=1"]["speedup_vs_dense"] is None


def test_diloco_rows_in_the_table_say_where_h_comes_from():
    measured = {"compute_s": 0.01, "step_s": 0.012, "exposed_s": 0.002, "ready_s": [0.005]}
    codecs = {"none": {"coding_s": [0.0], "wire_s": [0.002], "bytes": [4000]}}
    compressors = predictions(measured, codecs)
    default = SyncAdvice()
    report = {"measured": measured, "world_size": 2, "compressors": compressors,
              "sync": {"workers": 2, "worker": "rank", "rows": sync_predictions(
                  measured, codecs, default, compressors["none"]["predicted_step_s"])}}
    text = table(report)
    assert default.every == DiLoCo.every
    assert f"\ndiloco H={DiLoCo.every} " in text and "DiLoCo's default" in text and "see docs/sync.md" in text
    assert "2 workers (ranks)" in text
    assert "\nnone " in text  # the compressors' rows unchanged above
    assert "DiLoCo" not in table({**report, "sync": {}})  # a report without the rows (an older advise.json)


def test_host_parts_are_what_each_rank_of_a_host_carries_across_hosts():
    layout = BucketLayout.of([("w", torch.Size([4, 3])), ("b", torch.Size([3]))])
    flat = torch.arange(15, dtype=torch.float32)
    parts = [host_parts([(layout, flat)], 2, i) for i in range(2)]
    assert [len(p) for p in parts] == [1, 1]
    joined = torch.cat([p[0][1] for p in parts])
    assert sorted(joined.tolist()) == flat.tolist()  # the parts cover the bucket once
    assert parts[0][0][1].tolist() == [0, 1, 2, 3, 4, 5, 12, 13]  # rows 0-1 of w, then b's first two elements
    assert parts[0][0][0].numel == 8
    assert host_parts([(layout, flat)], 1, 0)[0][1].tolist() == flat.tolist()


# -- settings ---------------------------------------------------------------------------------------------------
def test_candidates_take_the_configs_defaults_and_the_configured_compressor():
    chosen = candidates(_compose("advise.compressors=[topk,int8]", "compression=topk", "compression.ratio=0.001"))
    assert list(chosen) == ["none", "topk", "int8"]  # dense first: the base of every speed-up
    assert chosen["topk"]["ratio"] == 0.001 and chosen["int8"]["chunk"] == 512
    assert set(candidates(_compose())) == set(COMPRESSORS)


def test_the_sync_group_sets_h_and_adds_its_pseudo_gradient_codec():
    cfg = _compose("advise.compressors=[int8]")
    assert configured_sync(cfg) == (SyncAdvice(), None)  # sync=every_step: DiLoCo's default H, shown for comparison
    cfg = _compose("advise.compressors=[int8]", "sync=diloco", "sync.every=20", "sync.compressor=powersgd")
    sync, pseudo = configured_sync(cfg)
    assert (sync.every, sync.configured, sync.codecs) == (20, True, ["none", "int8", "topk", "powersgd"])
    assert "sync.every" in sync.origin() and pseudo["name"] == "powersgd" and pseudo["rank"] == 2
    assert list(candidates(cfg)) == ["none", "int8", "powersgd"]  # measured although advise.compressors omits it
    cfg = _compose("advise.compressors=[int8]", "sync=diloco", "sync.compressor={name:int8,chunk:128}")
    assert candidates(cfg)["int8"]["chunk"] == 128  # the sync's settings, not the default's
    cfg = _compose("advise.compressors=[int8]", "sync=diloco")
    assert configured_sync(cfg)[1] is None and list(candidates(cfg)) == ["none", "int8"]
    assert configured_sync(cfg)[0].every == DiLoCo.every  # conf/sync/diloco.yaml's H
    with open_dict(cfg):  # a config composed without the sync group (an older conf/) has DiLoCo's default rows
        del cfg["sync"]
    assert configured_sync(cfg) == (SyncAdvice(), None)


@pytest.mark.parametrize("overrides,match", [
    (["advise.compressors=[int8,topkk]"], r"unknown \['topkk'\]; choose from"),
    (["advise.rounds=0"], "advise.rounds=0: use 1 or more"),
    (["advise.warmup_steps=0"], "advise.warmup_steps=0"),
    (["trainer.devices=1"], "one rank has no links to measure"),
    (["strategy=ddp"], "strategy=ring_ddp"),
    (["compression=topk", "compression.ratio=2.0"], "compressor topk"),
])
def test_bad_settings_fail_naming_the_value(overrides, match):
    with pytest.raises(ValueError, match=match):
        check(_compose(*overrides))


@pytest.mark.slow  # a subprocess of the command
def test_the_command_refuses_bad_input_before_any_rank(tmp_path):
    proc = subprocess.run(CLI + ["advise.compressors=[nope]", f"hydra.run.dir={tmp_path}"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "advise.compressors: unknown ['nope']" in proc.stderr
    assert "Initializing distributed" not in proc.stdout + proc.stderr


def test_a_typo_in_the_advise_group_is_caught_by_the_schema():
    with pytest.raises(ConfigCompositionException, match="round"):
        _compose("advise.round=3")


# -- one launched run -------------------------------------------------------------------------------------------
@pytest.mark.slow  # the command on 2 ranks
@pytest.mark.timeout(120)
def test_advise_on_two_local_ranks(tmp_path):
    # under sync=diloco: the dense step is still measured syncing every step (a DiLoCo step would hand DDP no bucket)
    proc = subprocess.run(CLI + ["trainer.devices=2", "strategy.start_method=fork", "advise.steps=3",
                                 "advise.rounds=2", "sync=diloco", "sync.every=20", "sync.compressor=int8",
                                 f"hydra.run.dir={tmp_path}"],
                          capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "advise.json").read_text())
    rows = report["compressors"]
    assert set(rows) == set(COMPRESSORS) and report["world_size"] == 2
    for name in COMPRESSORS:
        assert f"\n{name} " in proc.stdout  # the table, from rank zero only
    dense = rows["none"]["bytes_per_step"]
    assert dense > 0
    assert rows["fp16"]["bytes_per_step"] == pytest.approx(dense / 2, rel=0.01)
    assert rows["int8"]["bytes_per_step"] < dense / 3
    assert rows["topk"]["bytes_per_step"] < dense / 30
    assert rows["powersgd"]["bytes_per_step"] < dense / 3
    assert rows["none"]["speedup_vs_dense"] == 1.0
    measured = report["measured"]
    assert measured["timed_steps"] == 3 and len(measured["ready_s"]) >= 1
    # the replay with the dense all-reduce timed on its own comes within a factor of the dense step it models
    assert 0.33 < rows["none"]["predicted_step_s"] / measured["step_s"] < 3.0
    assert all(r["predicted_step_s"] > 0 and r["accuracy_cost_pt"] is not None for r in rows.values())
    # DiLoCo's rows: the configured H, each from the codec's measured reduction of every bucket
    sync, every = report["sync"], 20
    assert (sync["every"], sync["configured"], sync["workers"], sync["worker"]) == (every, True, 2, "rank")
    assert list(sync["rows"]) == [f"diloco H={every}", f"diloco H={every} int8", f"diloco H={every} topk"]
    for label, r in sync["rows"].items():
        assert f"\n{label} " in proc.stdout
        codec = rows[r["compressor"]]
        assert r["bytes_per_step"] == pytest.approx(codec["bytes_per_step"] / every)
        sync_s = codec["coding_s"] + codec["wire_s"]
        assert r["predicted_step_s"] == pytest.approx(measured["compute_s"] + sync_s / every)
    assert "see docs/sync.md" in proc.stdout and "(sync.every)" in proc.stdout
