"""``lightning-dist-advise``: the FIFO replay and the prediction (pure), the settings checked before any rank starts,
and advise on models of the user's own, outside the package: the command on 2 local ranks (fork, gloo) with a
``model._target_`` from a file in the working directory, run as a console script runs it; and ``Advisor()`` as a
callback in a Trainer of the test's own, on 2 in-process ranks. Bytes are checked against the parameter count: at 2
ranks a ring all-reduce sends each rank ``2 (N - 1) / N = 1`` times the gradient."""

import contextlib
import io
import json
import subprocess
import sys
import textwrap

import lightning.pytorch as pl
import pytest
import torch
from hydra import compose, initialize_config_module
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf, open_dict
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_dist import RingDDPStrategy, advise
from lightning_dist.advise import (
    SYNC_QUALITY,
    AdviseConf,
    Advisor,
    SyncAdvice,
    accuracy_cost,
    candidates,
    check,
    configured_sync,
    default_candidate,
    onebit_prediction,
    predictions,
    sync_predictions,
    table,
)
from lightning_dist.benchmarks.compression import CONFIGS, TABLE_ROWS
from lightning_dist.compression import COMPRESSORS, BucketLayout
from lightning_dist.config import own_class_overrides
from lightning_dist.sync import DiLoCo
from lightning_dist.sync.auto_measure import host_parts
from lightning_dist.sync.auto_rule import candidate_rows, decide, predict_step, replay
from lightning_dist.testing import launched_externally, quiet_trainer, run_ranks

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
    slow = {**report, "onebit": {**row, "speedup_vs_dense": 0.62}}  # a compressor pays, OneBitAdam itself does not
    assert "onebit_adam" in table(slow) and "sync=onebit_adam (predicted" not in table(slow)
    compressors["sign"]["speedup_vs_dense"] = compressors["int4"]["speedup_vs_dense"] = 1.0
    assert "sync=onebit_adam (predicted" not in table(report)  # nothing pays: no recommendation


def test_accuracy_costs_match_the_settings_they_were_measured_at():
    assert accuracy_cost({"name": "int8"}) == (0.09, "EF: 98.33%")
    assert accuracy_cost({"name": "topk", "ratio": 0.01, "error_feedback": False})[0] == -1.85
    assert accuracy_cost({"name": "topk"}) == (-5.0, "1%, EF: 93.24%")  # the conf's defaults fill in the rest
    cost, what = accuracy_cost({"name": "threshold", "threshold": 0.001})
    assert cost == -1.48 and "not these settings" in what
    assert {row[0] for row in advise.ACCURACY_COST} == set(COMPRESSORS)


def _effective(name, kwargs):
    """A compressor's settings as a benchmark configuration ran it: its conf defaults under the given ones, error
    feedback resolved as build_compressor resolves None (on for every compressor but the casts and none)."""
    settings = {**default_candidate(name), **kwargs}
    if settings.get("error_feedback") is None:
        settings["error_feedback"] = name not in ("none", "fp16", "bf16")
    return settings


def test_every_quoted_cost_names_every_setting_it_was_measured_at_that_is_not_a_default():
    # the benchmark configuration each row of the table advise quotes was measured with: a setting it ran at that
    # differs from the default (PowerSGD's 2 dense warm-up steps, start_step=2) must be in the row, or advise quotes
    # the row for the default configuration it was not measured at
    for label, (name, settings, _) in TABLE_ROWS.items():
        row = next(r for r in advise.ACCURACY_COST if r[0] == name and r[1] == settings)
        ran = _effective(name, {k: v for k, v in (CONFIGS[label].compressor or {"name": "none"}).items()
                                if k != "seed"})  # the seed follows each run's
        default = _effective(name, {})
        differs = {k: v for k, v in ran.items() if default.get(k) != v}
        assert {k: row[1].get(k) for k in differs} == differs, (label, row)
        assert all(ran.get(k) == v for k, v in row[1].items()), (label, row)


def test_powersgd_at_advises_defaults_is_quoted_as_measured_at_other_settings():
    # advise measures conf/compression/powersgd.yaml (start_step: 0); the digits figure was measured at start_step=2
    assert default_candidate("powersgd")["start_step"] == 0
    cost, what = accuracy_cost(default_candidate("powersgd"))
    assert what.startswith("measured at ") and what.endswith(", not these settings")
    assert accuracy_cost({**default_candidate("powersgd"), "start_step": 2})[1] == what.removeprefix(
        "measured at ").removesuffix(", not these settings")  # at the settings it was measured at: quoted as is


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


def test_advisor_measures_every_compressor_at_its_defaults_unless_told():
    every = Advisor()
    assert list(every.candidates) == ["none", *(n for n in COMPRESSORS if n != "none")]  # dense first: the base
    assert every.candidates["topk"] == default_candidate("topk") and every.settings == AdviseConf()
    assert every.path is None and every.sync == SyncAdvice() and every.report == {}
    assert list(Advisor(["topk", "int8"]).candidates) == ["none", "topk", "int8"]
    assert Advisor({"topk": {"name": "topk", "ratio": 0.05}}).candidates == {
        "none": default_candidate("none"), "topk": {"name": "topk", "ratio": 0.05}}
    with pytest.raises(ValueError, match=r"unknown compressor\(s\) \['topkk'\]"):
        Advisor(["topkk"])
    with pytest.raises(ValueError, match="advise.rounds=0: use 1 or more"):
        Advisor(settings=AdviseConf(rounds=0))
    with pytest.raises(ValueError, match="compressor topk"):
        Advisor({"topk": {"name": "topk", "ratio": 2.0}})


def test_a_target_of_ones_own_is_built_from_the_keys_given_with_it_alone():
    given = ["model._target_=my_pkg.MyModule", "model.width=64", "data._target_=my_pkg.MyData", "trainer.devices=2"]
    assert own_class_overrides(given) == ["~model", "~data", "+model._target_=my_pkg.MyModule", "+model.width=64",
                                          "+data._target_=my_pkg.MyData", "trainer.devices=2"]
    cfg = _compose(*own_class_overrides(given))
    assert dict(cfg.model) == {"_target_": "my_pkg.MyModule", "width": 64}  # none of the CNN's lr, channels...
    assert dict(cfg.data) == {"_target_": "my_pkg.MyData"}
    # '~data': no data module (advise.run fits the module's own loaders, datamodule=None)
    assert OmegaConf.is_missing(_compose(*own_class_overrides(["model._target_=my_pkg.MyModule", "~data"])), "data")
    for unchanged in (["model=lm", "model._target_=my_pkg.MyModule"],  # an option chosen: its keys, a class of yours
                      ["~model", "+model._target_=my_pkg.MyModule"],  # already in Hydra's words (a re-run rank)
                      ["model.lr=0.1"], ["trainer.devices=2"]):
        assert own_class_overrides(unchanged) == unchanged


def test_a_typo_in_the_advise_group_is_caught_by_the_schema():
    with pytest.raises(ConfigCompositionException, match="round"):
        _compose("advise.round=3")


# -- advise on models of one's own: the command, and the callback in one's own Trainer --------------------------------
# A module file in the working directory, as a user's own would be: not in the package, not installed. Its model takes
# a required width (the test gives it on the command line), and Adam (advise then adds OneBitAdam's row).
OWN_MODULE = """
    import lightning.pytorch as pl
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset


    class MyModule(pl.LightningModule):
        def __init__(self, width):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(32, width), nn.Tanh(), nn.Linear(width, 10))

        def training_step(self, batch, batch_idx):
            return nn.functional.cross_entropy(self.net(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-3)


    class MyData(pl.LightningDataModule):
        def __init__(self, batch_size):
            super().__init__()
            self.batch_size = batch_size

        def train_dataloader(self):
            x = torch.randn(512, 32, generator=torch.Generator().manual_seed(0))
            return DataLoader(TensorDataset(x, x[:, :10].argmax(1)), batch_size=self.batch_size)
"""
# what a console script (the entry point pip writes) runs: sys.path[0] is the script's directory, not the working
# directory, unlike python -m
CONSOLE_SCRIPT = "import sys\nfrom lightning_dist.advise import main\nsys.exit(main())\n"


@pytest.mark.slow  # the command on 2 ranks
@pytest.mark.timeout(120)
def test_advise_command_on_a_model_of_ones_own(tmp_path):
    work, scripts = tmp_path / "work", tmp_path / "bin"
    work.mkdir(), scripts.mkdir()
    (work / "my_models.py").write_text(textwrap.dedent(OWN_MODULE))
    (scripts / "lightning-dist-advise").write_text(CONSOLE_SCRIPT)
    width, every = 200, 20
    params = 32 * width + width + width * 10 + 10  # the two Linear layers' weights and biases
    # under sync=diloco: the dense step is still measured syncing every step (a DiLoCo step would hand DDP no bucket)
    proc = subprocess.run([sys.executable, str(scripts / "lightning-dist-advise"),
                           "model._target_=my_models.MyModule", f"model.width={width}",
                           "data._target_=my_models.MyData", "data.batch_size=16",
                           "trainer.devices=2", "strategy.start_method=fork", "advise.steps=3", "advise.rounds=2",
                           "sync=diloco", f"sync.every={every}", "sync.compressor=int8", f"hydra.run.dir={tmp_path}"],
                          cwd=work, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "advise.json").read_text())
    rows = report["compressors"]
    assert set(rows) == set(COMPRESSORS) and report["world_size"] == 2
    for name in COMPRESSORS:
        assert f"\n{name} " in proc.stdout  # the table, from rank zero only
    assert proc.stdout.count("measured dense step") == 1
    dense = rows["none"]["bytes_per_step"]
    assert dense == 4 * params  # every fp32 gradient once: the buckets hold the user's whole model
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
    # the model's optimizer is Adam: OneBitAdam's row, its momentum through sign every step
    assert report["onebit"]["bytes_per_step"] > rows["sign"]["bytes_per_step"] and "\nonebit_adam " in proc.stdout
    # DiLoCo's rows: the configured H, each from the codec's measured reduction of every bucket
    sync = report["sync"]
    assert (sync["every"], sync["configured"], sync["workers"], sync["worker"]) == (every, True, 2, "rank")
    assert list(sync["rows"]) == [f"diloco H={every}", f"diloco H={every} int8", f"diloco H={every} topk"]
    assert sync["rows"][f"diloco H={every}"]["bytes_per_step"] == 4 * params / every
    for label, r in sync["rows"].items():
        assert f"\n{label} " in proc.stdout
        codec = rows[r["compressor"]]
        assert r["bytes_per_step"] == pytest.approx(codec["bytes_per_step"] / every)
        sync_s = codec["coding_s"] + codec["wire_s"]
        assert r["predicted_step_s"] == pytest.approx(measured["compute_s"] + sync_s / every)
    assert "see docs/sync.md" in proc.stdout and "(sync.every)" in proc.stdout


class OutsideModel(pl.LightningModule):
    """A LightningModule of the test's own (SGD: advise adds no OneBitAdam row), with its own loader."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 48), nn.Tanh(), nn.Linear(48, 4))

    def training_step(self, batch, batch_idx):
        return nn.functional.cross_entropy(self.net(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self):
        x = torch.randn(256, 16, generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(x, x[:, :4].argmax(1)), batch_size=8)


FIT_STEPS = 12  # longer than Advisor's default 2 + 6 measured steps: the fit must go on, the table come at its end


def _fit_with_advisor(rank, world_size, path):
    advisor = Advisor(path=path)
    printed = io.StringIO()
    with launched_externally(rank, world_size), contextlib.redirect_stdout(printed):
        trainer = quiet_trainer(strategy=RingDDPStrategy(), devices=world_size, max_steps=FIT_STEPS,
                                callbacks=[advisor])
        trainer.fit(OutsideModel())
    return {"report": advisor.report, "printed": printed.getvalue(), "global_step": trainer.global_step,
            "params": sum(p.numel() for p in trainer.lightning_module.parameters())}


@pytest.fixture(scope="module")
def advised_fit(tmp_path_factory):
    path = tmp_path_factory.mktemp("advisor") / "advise.json"
    return run_ranks(_fit_with_advisor, 2, str(path), deadline_s=90), path


@pytest.mark.slow  # 2 launched ranks
def test_advisor_in_ones_own_trainer_times_the_first_steps_and_reports_at_the_end(advised_fit):
    ranks, path = advised_fit
    zero, one = ranks
    params = 16 * 48 + 48 + 48 * 4 + 4
    assert zero["params"] == params
    assert [r["global_step"] for r in ranks] == [FIT_STEPS, FIT_STEPS]  # the fit went on past the measured steps
    report = zero["report"]
    assert one["report"] == report  # every figure agreed over the ranks
    assert json.loads(path.read_text()) == report  # rank zero wrote what every rank holds
    assert report["measured"]["timed_steps"] == AdviseConf().steps  # only the first steps after the warm-up
    assert list(report["compressors"]) == ["none", *(n for n in COMPRESSORS if n != "none")]
    assert report["compressors"]["none"]["bytes_per_step"] == 4 * params
    assert report["onebit"] is None  # SGD: no OneBitAdam row
    rows = report["sync"]["rows"]
    assert list(rows) == [f"diloco H={DiLoCo.every}", f"diloco H={DiLoCo.every} int8", f"diloco H={DiLoCo.every} topk"]
    assert rows[f"diloco H={DiLoCo.every}"]["bytes_per_step"] == 4 * params / DiLoCo.every
    # what sync="auto" would decide: the same rule on the same agreed figures, its table printed below advise's
    rows = candidate_rows(report["measured"], {n: {k: v for k, v in c.items() if k != "kwargs"} for n, c in
                                               report["per_bucket"].items()}, "sgd",
                          compressors=[n for n in report["per_bucket"] if n != "none"])
    assert report["auto"] == decide(rows).as_dict()
    assert "sync='auto' would decide" in table(report) and f"auto chose {report['auto']['choice']}:" in table(report)
    assert zero["printed"] == table(report) + f"\nadvise: {path}\n"  # the table, printed by rank zero alone
    assert one["printed"] == ""
