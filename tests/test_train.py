"""The Hydra configs and ``lightning-dist-train``: every group composes and instantiates, each option is typed by its
own schema, bad overrides fail before any rank starts naming the fix (DiLoCo's included), one short end-to-end run
plus a resume, and the LM with DiLoCo from the command (tests/test_wheel.py runs the installed wheel)."""

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_module
from hydra.errors import ConfigCompositionException
from hydra.utils import instantiate
from omegaconf import OmegaConf

import lightning_dist.train  # noqa: F401 - registers the schema
from lightning_dist.compression import COMPRESSORS
from lightning_dist.config import OPTION_SCHEMAS, complete_overrides, validate
from lightning_dist.sync import SYNCS, DiLoCo, as_sync
from lightning_dist.testing import free_port, side_by_side
from lightning_dist.train import build

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "lightning_dist" / "conf"
GROUPS = {g.name: sorted(p.stem for p in g.glob("*.yaml")) for g in CONF.iterdir() if g.is_dir()}
CLI = [sys.executable, "-m", "lightning_dist.train"]


def _compose(*overrides):
    with initialize_config_module("lightning_dist.conf", version_base="1.3"):
        return compose("config", overrides=list(overrides))


def test_every_group_has_options():
    assert set(GROUPS) == {"trainer", "strategy", "compression", "hetero", "sync", "model", "data", "perf",
                           "callbacks"}
    assert set(GROUPS["compression"]) == set(COMPRESSORS)
    assert set(GROUPS["sync"]) == set(SYNCS)
    assert all(GROUPS.values())
    for group, schemas in OPTION_SCHEMAS.items():  # every option of a typed group has its schema, and lists it
        assert set(schemas) == set(GROUPS[group]), group
        for option in schemas:
            assert f"- {option}_schema" in (CONF / group / f"{option}.yaml").read_text(), (group, option)


@pytest.mark.parametrize("group,option", [(g, o) for g, opts in GROUPS.items() for o in opts])
def test_every_config_option_composes_and_instantiates(group, option):
    override = f"{group}=[{option}]" if group == "callbacks" else f"{group}={option}"
    extra = {("trainer", "gpu"): ["strategy.start_method=popen"],
             ("hetero", "elastic"): ["hetero.global_batch_size=96"],  # required: the run's fixed global batch
             # what an elastic run needs besides the callback (the command refuses it alone, naming each)
             ("callbacks", "elastic"): ["+callbacks.fault_tolerance._target_=lightning_dist.callbacks.FaultTolerance",
                                        "hetero=elastic", "hetero.global_batch_size=96", "resume=auto"],
             ("model", "lm"): ["data=stdlib"], ("data", "stdlib"): ["model=lm"],  # the LM and its byte windows
             }.get((group, option), [])
    cfg = _compose(override, *extra)
    validate(cfg)
    plain = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    if group == "trainer":
        assert plain["trainer"]["devices"] >= 1  # building a GPU Trainer needs a GPU: composing is the check
    elif group == "callbacks":
        node = plain["callbacks"][option]
        if "dirpath" in node:
            node["dirpath"] = "unused"
        assert instantiate(node) is not None
    elif group == "sync":  # DiLoCo's arguments for the strategy (no _target_: the strategy builds it)
        assert (as_sync(plain["sync"]) is None) == (option == "every_step")
    else:
        assert instantiate(plain[group]) is not None


def test_callbacks_take_a_list():
    cfg = _compose("callbacks=[dist_metrics,lr_monitor,checkpoint]")
    assert set(cfg.callbacks) == {"dist_metrics", "lr_monitor", "checkpoint"}
    assert dict(_compose("callbacks=[]").callbacks) == {}


@pytest.mark.parametrize(
    "override,error,match",
    [
        ("trainer.max_epoch=3", ConfigCompositionException, "max_epoch"),
        ("strategy.algorithm=rings", ConfigCompositionException, "rings"),
        ("strategy.overlap=maybe", ConfigCompositionException, "maybe"),
        ("strategy.topology=two_tiers", ConfigCompositionException, "two_tiers"),
        ("strategy.topology=two_tier", ValueError, "strategy.topology=two_tier on 1 node"),
        ("trainer.devices=two", ValueError, "trainer.devices='two'"),
        ("trainer.devices=-1", ValueError, "trainer.devices=-1 on CPU"),
        ("trainer.num_nodes=2", ValueError, "num_nodes=2 needs a launcher"),
        ("strategy=ringddp", ConfigCompositionException, "ringddp"),
        ("trainer.devices=0", ValueError, "trainer.devices=0"),
        ("strategy.timeout=-1", ValueError, "strategy.timeout=-1"),
        ("trainer.limit_train_batches=1.5", ValueError, "limit_train_batches=1.5"),
        ("trainer.val_check_interval=0", ValueError, "val_check_interval=0"),
        ("trainer.val_check_interval=1.5", ValueError, "val_check_interval=1.5"),
        ("trainer.check_val_every_n_epoch=0", ValueError, "check_val_every_n_epoch=0"),
        ("trainer=gpu", ValueError, "start_method=popen"),
        ("model.chanels=8", ConfigCompositionException, "chanels"),
        ("model.channels=eight", ConfigCompositionException, "eight"),
        ("data.batch_size=many", ConfigCompositionException, "many"),
        ("model=lm", ValueError, "model=lm with data=digits: .* use model=lm data=stdlib"),
        ("data=stdlib", ValueError, "model=cnn with data=stdlib: .* use model=lm data=stdlib"),
    ],
)
def test_bad_overrides_fail_with_the_value_named(override, error, match):
    with pytest.raises(error, match=match):
        validate(_compose(override))


def test_limit_batches_keep_their_int_or_float_meaning():
    cfg = _compose("trainer.limit_train_batches=1", "trainer.limit_val_batches=0.5")
    validate(cfg)
    assert cfg.trainer.limit_train_batches == 1 and isinstance(cfg.trainer.limit_train_batches, int)  # 1 batch
    assert cfg.trainer.limit_val_batches == 0.5


LM_SHORTER = ["sync.every=2", "trainer.max_steps=4", "trainer.val_check_interval=3", "trainer.limit_val_batches=2",
              "trainer.enable_progress_bar=false"]  # the documented LM command, shortened (its test below)
SHORT = ["trainer.limit_train_batches=6", "trainer.limit_val_batches=2", "trainer.log_every_n_steps=1",
         "trainer.enable_model_summary=false"]


def _launcher_args(start_method):
    # popen re-runs the command per rank (Lightning passes Hydra the run directory); spawn pickles the job
    # spawn also pickles NaNRecovery and MemoryMonitor into the ranks
    extra = ["callbacks=[dist_metrics,nan_recovery,memory_monitor]"] if start_method == "spawn" else []
    return extra + [f"strategy.start_method={start_method}", "trainer.max_epochs=1", "trainer.limit_train_batches=3",
                    "trainer.limit_val_batches=1", "trainer.enable_progress_bar=false"]


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """Every command this module launches, two at a time (:func:`~lightning_dist.testing.side_by_side`: a launch
    spends seconds importing on one core), the longest first: name -> (the finished process, its run directory)."""
    tmp = tmp_path_factory.mktemp("cli")

    def run(name, args, timeout=300, env=None, sweep=False):
        out = tmp / name
        where = f"hydra.{'sweep' if sweep else 'run'}.dir={out}"
        # a port of its own: two jobs each finding a free one at once can pick the same (testing.free_port)
        env = {**os.environ, "MASTER_PORT": str(free_port()), **(env or {})}
        return subprocess.run(CLI + args + [where], capture_output=True, text=True, timeout=timeout, env=env), out

    def short_then_resumed():  # one epoch of 6 steps, then a second epoch resumed from its checkpoint
        first, out = run("first", SHORT + ["trainer.max_epochs=1"], timeout=240,
                         env={"TORCH_DISTRIBUTED_DEBUG": "INFO"})
        ckpt = out / "checkpoints" / "last.ckpt"
        second = run("second", SHORT + ["trainer.max_epochs=2", f"ckpt_path={ckpt}"], timeout=240)
        return (first, out), second

    def own_sync():  # the feature-seam page's worked driver, from a package of the user's, named by _target_
        package, conf = tmp / "user_code", tmp / "user_conf"
        (conf / "sync").mkdir(parents=True)
        package.mkdir()
        (package / "param_avg.py").write_text(_seam_example())
        (conf / "sync" / "param_avg.yaml").write_text("_target_: param_avg.ParameterAveraging\nevery: 10\n")
        path = os.pathsep.join(filter(None, [str(package), os.environ.get("PYTHONPATH")]))
        return run("own_sync", ["--config-dir", str(conf), "sync=param_avg", "sync.every=3", "trainer.max_epochs=1",
                                "trainer.limit_train_batches=6", "trainer.limit_val_batches=1",
                                "trainer.log_every_n_steps=1", "trainer.enable_progress_bar=false"],
                   env={"PYTHONPATH": path})

    jobs = {
        # the README's main job (its first command), unchanged but for the output directory and a quiet progress bar
        "default": lambda: run("default", ["trainer.enable_progress_bar=false"]),
        "short": short_then_resumed,
        "spawn": lambda: run("spawn", _launcher_args("spawn")),
        "popen": lambda: run("popen", _launcher_args("popen")),
        "lm": lambda: run("lm", _documented_lm_command() + LM_SHORTER, timeout=240),
        "multirun": lambda: run("multirun", ["-m", "strategy.algorithm=ring,native", "trainer.max_epochs=1",
                                             "trainer.limit_train_batches=3", "trainer.limit_val_batches=1",
                                             "trainer.enable_progress_bar=false"], sweep=True),
        "own_sync": own_sync,
        # sync=auto from the command line: 4 measuring steps, a decision, its section in summary.json
        "auto": lambda: run("auto", ["sync=auto", "trainer.max_epochs=1", "trainer.limit_train_batches=8",
                                     "trainer.limit_val_batches=1", "trainer.log_every_n_steps=1",
                                     "trainer.enable_progress_bar=false"]),
        "typo": lambda: run("typo", ["trainer.max_epoch=3"], timeout=120),
    }
    return dict(zip(jobs, side_by_side(*jobs.values()), strict=True))


@pytest.mark.slow  # the command on 2 ranks
def test_sync_auto_from_the_command_decides_and_reports_in_the_summary(launched):
    proc, out = launched["auto"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["sync"].startswith("Auto(measure=1+3") and summary["global_step"] == 8
    auto = summary["auto"]
    (decision,) = auto["decisions"]  # one decision, after the measuring steps, on this unchanged cluster
    # all 1 + 3 measuring steps, or 1 + 1 where a loaded machine's first timed step took over long_s (its reason)
    assert decision["step"] == (2 if decision["reason"].startswith("the first timed step") else 4)
    assert decision["choice"] == auto["choice"]
    assert {row["label"] for row in decision["rows"]} >= {"dense", "onebit_adam", "diloco50"}
    assert auto["cluster"] == {"world_size": 2, "hosts": 1}
    logged = [float(row["sync/auto_decisions"]) for row in csv.DictReader(open(out / "csv" / "metrics.csv"))
              if row.get("sync/auto_decisions")]
    assert logged and set(logged) == {1.0}


def _seam_example() -> str:
    """The worked sync driver of docs/contributing/feature-seam.md, as written (tests/test_sync_driver.py runs it
    against DiLoCo)."""
    page = (REPO / "docs" / "contributing" / "feature-seam.md").read_text()
    section = page.split("## A way of syncing of your own")[1]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


@pytest.mark.slow  # the command on 2 ranks
def test_a_sync_driver_of_the_users_own_trains_from_the_command_by_target(launched):
    """A driver outside the package, in the user's own module and config directory (``conf/sync/param_avg.yaml`` with
    its ``_target_``), chosen and set from the command line like the built-in ones: its syncs are logged."""
    proc, out = launched["own_sync"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["sync"] == "ParameterAveraging(every=3)" and summary["global_step"] == 6
    averaged = [float(row["sync/averaged"]) for row in csv.DictReader(open(out / "csv" / "metrics.csv"))
                if row.get("sync/averaged")]
    assert averaged == [1.0, 2.0]  # after steps 3 and 6


@pytest.mark.slow  # a subprocess of the command
def test_cli_rejects_a_typo_before_starting_any_rank(launched):
    proc, _ = launched["typo"]
    assert proc.returncode != 0
    assert "max_epoch" in proc.stderr
    assert "Initializing distributed" not in proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def short_run(launched):
    (first, out), (second, _) = launched["short"]
    assert first.returncode == 0, first.stderr[-3000:]
    assert second.returncode == 0, second.stderr[-3000:]
    return out.parent, first, second


@pytest.mark.slow  # the command on 2 ranks, and a resume
def test_end_to_end_run_writes_summary_and_metrics(short_run):
    out, first, _ = short_run
    summary = json.loads((out / "first" / "summary.json").read_text())
    assert summary["global_step"] == 6 and summary["world_size"] == 2
    assert summary["strategy"] == "RingDDPStrategy" and summary["algorithm"] == "auto"
    assert summary["bytes_sent_rank0"] > 0 and summary["wall_time_s"] > 0
    assert "val/acc" in summary["metrics"]
    assert summary["config"]["strategy"]["algorithm"] == "auto"  # the resolved config, plain types
    header = (out / "first" / "csv" / "metrics.csv").read_text().splitlines()[0]
    assert "dist/rank1/samples_per_s" in header and "dist/comm_ms" in header
    log = first.stdout + first.stderr
    assert "lightning_dist.perf applied" in log and "TORCH_DISTRIBUTED_DEBUG" in log  # the pre-flight check


@pytest.mark.slow  # the command on 2 ranks, and a resume
def test_checkpoint_holds_plain_types_and_resume_continues(short_run):
    out, _, second = short_run
    ckpt = torch.load(out / "first" / "checkpoints" / "last.ckpt", weights_only=True)  # no DictConfig inside
    assert ckpt["global_step"] == 6
    summary = json.loads((out / "second" / "summary.json").read_text())
    assert summary["global_step"] == 12 and summary["epochs"] == 2  # resumed after epoch 1 at step 6


@pytest.mark.slow  # the command's default job, 10 epochs on 2 ranks
def test_the_default_job_reaches_97_percent(launched):
    proc, out = launched["default"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["metrics"]["val/acc"] >= 0.97, summary["metrics"]
    assert summary["epochs"] == 10 and summary["world_size"] == 2


@pytest.mark.slow  # two runs of the command
def test_multirun_runs_each_job(launched):
    proc, out = launched["multirun"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    algorithms = [json.loads((out / str(job) / "summary.json").read_text())["algorithm"] for job in (0, 1)]
    assert algorithms == ["ring", "native"]


@pytest.mark.slow  # the command on 2 ranks
@pytest.mark.parametrize("start_method", ["popen", "spawn"])
def test_other_launchers_run_the_command(launched, start_method):
    proc, out = launched[start_method]
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["global_step"] == 3 and summary["config"]["strategy"]["start_method"] == start_method
    if start_method == "spawn":  # MemoryMonitor's estimate and peaks in summary.json
        memory = summary["memory_monitor"]
        assert memory["estimate_total_mib"] > 0 and memory["capacity_mib"] > 0
        assert memory["estimate_mib"]["activations"] > 0 and memory["peaks"]["memory/rss_mib_max"] > 0


def test_stock_ddp_refuses_ring_ddp_only_keys():
    from lightning_dist.config import stock_ddp_strategy

    with pytest.raises(ValueError, match="strategy.overlap=False"):
        stock_ddp_strategy(timeout=60.0, overlap=False)
    with pytest.raises(ValueError, match="strategy.algorithm='ring'"):
        stock_ddp_strategy(timeout=60.0, algorithm="ring")
    with pytest.raises(ValueError, match="strategy.topology='flat'"):
        stock_ddp_strategy(timeout=60.0, topology="flat")
    plain = OmegaConf.to_container(_compose("strategy=ddp"), resolve=True, enum_to_str=True)
    assert instantiate(plain["strategy"]).__class__.__name__ == "DDPStrategy"


def test_the_compression_group_builds_the_strategys_compressor(tmp_path):
    cfg = _compose("compression=topk", "compression.ratio=0.02", "compression.start_step=5")
    trainer, _, _ = build(cfg, str(tmp_path), 0.0)
    compressor = trainer.strategy.features.compressor
    assert compressor.describe() == "topk(ratio=0.02, values=bf16)+ef" and compressor.start_step == 5
    cfg = _compose("compression=powersgd", "compression.rank=1", "compression.error_feedback=false")
    assert build(cfg, str(tmp_path), 0.0)[0].strategy.features.compressor.describe() == "powersgd(rank=1)"
    with pytest.raises(Exception, match="needs strategy=ring_ddp"):  # Hydra wraps the ValueError
        build(_compose("strategy=ddp", "compression=int8"), str(tmp_path), 0.0)
    # a bad argument fails in the build, before the Trainer launches any rank (the command's path: the typo's test)
    with pytest.raises(Exception, match=r"ratio=0 must be in \(0, 1\]"):
        build(_compose("compression=topk", "compression.ratio=0"), str(tmp_path), 0.0)


def test_the_hetero_group_builds_the_strategys_batching_and_checks_it_before_any_rank(tmp_path):
    cfg = _compose("hetero=balanced", "hetero.speeds=[3,1]")
    trainer, _, _ = build(cfg, str(tmp_path), 0.0)
    assert trainer.strategy._hetero.speeds == [3, 1] and trainer.strategy._hetero.rebalance is False
    assert build(_compose(), str(tmp_path), 0.0)[0].strategy._hetero is None  # hetero=none: off
    for overrides, match in ((["hetero.batch_sizes=[40,16]"], r"add up to 56, not the global batch 64"),
                             (["hetero.speeds=[1,1,1]"], "3 entries for 2 ranks"),
                             (["hetero.speeds=[1,0]"], r"speeds=\[1, 0\]")):
        with pytest.raises(ValueError, match=match):
            validate(_compose("hetero=balanced", *overrides))
    validate(_compose("hetero=balanced", "hetero.batch_sizes=[48,16]"))
    with pytest.raises(Exception, match="needs strategy=ring_ddp"):
        build(_compose("strategy=ddp", "hetero=balanced"), str(tmp_path), 0.0)


def test_hetero_accumulate_reaches_the_strategy_as_given_and_is_checked_before_any_rank(tmp_path):
    # Hydra's override grammar reads off as the string "off" (a YAML file would read an unquoted off as false)
    assert _compose("hetero=balanced", "hetero.accumulate=off").hetero.accumulate == "off"
    for value, accumulate, accumulates in (("off", "off", False), ("auto", "auto", True), ("[1,3]", [1, 3], True)):
        cfg = _compose("hetero=balanced", f"hetero.accumulate={value}", "hetero.memory_caps=[64,24]")
        hetero = build(cfg, str(tmp_path), 0.0)[0].strategy._hetero
        assert hetero.accumulate == accumulate and hetero.accumulates is accumulates, value
    # null (the file's default): auto with a cap, off without; hetero=elastic takes auto and off with max_batch_size
    assert build(_compose("hetero=balanced", "hetero.max_batch_size=16"), str(tmp_path), 0.0)[0] \
        .strategy._hetero.accumulate == "auto"
    assert build(_compose("hetero=balanced"), str(tmp_path), 0.0)[0].strategy._hetero.accumulate == "off"
    validate(_compose("hetero=elastic", "hetero.global_batch_size=96", "hetero.max_batch_size=16",
                      "hetero.accumulate=auto"))
    validate(_compose("hetero=balanced", "hetero.accumulate=[4,4]", "hetero.memory_caps=[8,8]"))  # 4 x 8 x 2 = 64
    for overrides, match in (
        (["hetero.accumulate=[1,2,3]"], r"hetero.accumulate=\[1, 2, 3\] has 3 entries for 2 ranks"),
        (["hetero.accumulate=[0,1]"], r"accumulate=\[0, 1\]: every per-rank count of micro-batches must be an int"),
        (["hetero.accumulate=sometimes"], r"accumulate='sometimes': use 'auto'"),
        (["hetero.accumulate=false"], r"hetero.accumulate=False: .* quote it, accumulate: 'off'"),
        # the caps must hold the global batch of 64: 8 + 8 a pass with off, 8 + 2 x 8 with counts [1, 2]
        (["hetero.accumulate=off", "hetero.memory_caps=[8,8]"],
         r"hetero.accumulate=off with caps of \[8, 8\] .* holds 16 samples a step, fewer than the global batch 64: "
         r"use hetero.accumulate=auto .* hetero.accumulate=\[4,4\]"),
        (["hetero.accumulate=[1,2]", "hetero.memory_caps=[8,8]"], r"holds 24 samples a step"),
    ):
        with pytest.raises(ValueError, match=match):
            validate(_compose("hetero=balanced", *overrides))
    with pytest.raises(ValueError, match="elastic=true with per-rank lists"):
        validate(_compose("hetero=elastic", "hetero.global_batch_size=96", "hetero.accumulate=[1,2]"))
    # a setting alone selects hetero=balanced; under hetero=none it is refused, naming the options that have it
    assert complete_overrides(["hetero.accumulate=auto"]) == ["hetero=balanced", "hetero.accumulate=auto"]
    with pytest.raises(ValueError, match=r"hetero.accumulate=auto: hetero=none has no setting 'accumulate'; it is a "
                                         r"setting of hetero=balanced, elastic: choose one, e.g. hetero=balanced "
                                         r"hetero.accumulate=auto"):
        complete_overrides(["hetero=none", "hetero.accumulate=auto"])


def test_a_setting_without_its_group_selects_hetero_or_names_the_compressor(monkeypatch, capsys):
    # hetero.speeds alone means hetero=balanced (hetero is off by default); the explicit form is left as it is
    assert complete_overrides(["hetero.speeds=[3,1]", "trainer.devices=2"]) == [
        "hetero=balanced", "hetero.speeds=[3,1]", "trainer.devices=2"]
    assert complete_overrides(["hetero=balanced", "hetero.speeds=[3,1]"]) == ["hetero=balanced", "hetero.speeds=[3,1]"]
    assert complete_overrides(["+hetero=balanced", "hetero.speeds=[3,1]"]) == ["+hetero=balanced",
                                                                               "hetero.speeds=[3,1]"]
    # a glob sweep is Hydra's to expand (it needs the config loader): its settings are left to Hydra
    assert complete_overrides(["compression=glob(*)", "compression.ratio=0.01"]) == [
        "compression=glob(*)", "compression.ratio=0.01"]
    cfg = _compose(*complete_overrides(["hetero.batch_sizes=[48,16]"]))
    validate(cfg)
    assert cfg.hetero.enabled and list(cfg.hetero.batch_sizes) == [48, 16]
    assert not _compose(*complete_overrides([])).hetero.enabled
    for overrides, match in (
        (["compression.ratio=0.01"], r"compression.ratio=0.01: compression=none \(the default\) has no setting "
                                     r"'ratio'; it is a setting of compression=topk: use compression=topk "
                                     r"compression.ratio=0.01"),
        (["compression=fp16", "compression.rank=4"], "use compression=powersgd compression.rank=4"),
        (["compression.clip_norm=1"], r"compression=int4, int8, powersgd, sign, threshold, topk: choose one"),
        (["compression=topk", "compression.ration=0.1"], r"no compression option has it; compression=topk's settings"),
        (["hetero=none", "hetero.speeds=[3,1]"], "use hetero=balanced hetero.speeds=\\[3,1\\]"),
    ):
        with pytest.raises(ValueError, match=match):
            complete_overrides(overrides)
    # the command does the same before Hydra composes (--cfg job prints the config and runs nothing)

    monkeypatch.setattr(sys, "argv", ["lightning-dist-train", "hetero.speeds=[3,1]", "--cfg", "job"])
    lightning_dist.train.main()
    assert "hetero:\n  enabled: true\n  speeds:\n  - 3\n  - 1\n" in capsys.readouterr().out
    monkeypatch.setattr(sys, "argv", ["lightning-dist-train", "compression.ratio=0.01"])
    with pytest.raises(SystemExit, match="use compression=topk compression.ratio=0.01"):
        lightning_dist.train.main()
    # under a config of the user's own (--config-name/-path/-dir) the command completes nothing: Hydra decides
    completed = []
    monkeypatch.setattr(lightning_dist.train, "complete_overrides", completed.append)
    monkeypatch.setattr(lightning_dist.train, "_train", lambda: None)
    monkeypatch.setattr(sys, "argv", ["lightning-dist-train", "--config-name", "mine", "compression.ratio=0.01"])
    lightning_dist.train.main()
    assert completed == []


def test_nan_recovery_is_checked_before_any_rank():
    validate(_compose("callbacks=[nan_recovery]"))
    for overrides, match in ((["callbacks.nan_recovery.lr_factor=2"], "callbacks.nan_recovery: lr_factor=2"),
                             (["callbacks.nan_recovery.on_drift=ignore"], "on_drift='ignore'"),
                             (["callbacks.nan_recovery.min_scale=0"], "min_scale=0"),
                             (["strategy=ddp"], "nan_recovery needs strategy=ring_ddp")):
        with pytest.raises(ValueError, match=match):
            validate(_compose("callbacks=[nan_recovery]", *overrides))


def test_memory_monitor_is_checked_before_any_rank():
    validate(_compose("callbacks=[memory_monitor]"))
    validate(_compose("callbacks=[memory_monitor]", "strategy=ddp"))  # any strategy
    for overrides, match in ((["callbacks.memory_monitor.stop_at=2"], "callbacks.memory_monitor: stop_at=2"),
                             (["callbacks.memory_monitor.preflight=maybe"], "preflight='maybe'"),
                             (["callbacks.memory_monitor.every_n_steps=0"], "every_n_steps=0"),
                             (["callbacks.memory_monitor.capacity_gib=-1"], "capacity_gib=-1")):
        with pytest.raises(ValueError, match=match):
            validate(_compose("callbacks=[memory_monitor]", *overrides))


def test_fault_tolerance_and_resume_are_checked_before_any_rank():
    validate(_compose("callbacks=[checkpoint,fault_tolerance]", "resume=auto"))
    for overrides, match in ((["callbacks.fault_tolerance.timeout_s=0"], "callbacks.fault_tolerance: timeout_s=0"),
                             (["callbacks.fault_tolerance.poll_s=40"], "poll_s=40 must be at most half"),
                             (["resume=sometimes"], "resume='sometimes'")):
        with pytest.raises(ValueError, match=match):
            validate(_compose("callbacks=[checkpoint,fault_tolerance]", *overrides))


def test_build_adds_a_python_callers_callbacks_before_the_run_summary(tmp_path):
    from lightning.pytorch.callbacks import Callback

    from lightning_dist.train import RunSummaryCallback

    extra = Callback()
    callbacks = build(_compose(), str(tmp_path), 0.0, extra_callbacks=[extra])[0].callbacks
    summary = next(i for i, cb in enumerate(callbacks) if isinstance(cb, RunSummaryCallback))
    assert extra in callbacks and callbacks.index(extra) < summary


@pytest.mark.parametrize("started", [False, True], ids=["never_started", "started_at_the_end"])
def test_a_resumed_finished_run_keeps_its_summary(tmp_path, started):
    """An elastic restart as the job ends resumes a finished run: no step trains, and summary.json stays the one the
    run left (whether the fit loop started training, from a mid-epoch checkpoint, or skipped it, from the last
    epoch's end)."""
    from types import SimpleNamespace

    from lightning_dist.train import RunSummaryCallback

    path = tmp_path / "summary.json"
    path.write_text('{"metrics": {"val/acc": 0.97}}')
    trainer = SimpleNamespace(is_global_zero=True, global_step=30)
    callback = RunSummaryCallback(str(path), {}, started=0.0)
    if started:
        callback.on_train_start(trainer, None)
    callback.on_fit_end(trainer, None)
    assert json.loads(path.read_text()) == {"metrics": {"val/acc": 0.97}}


@pytest.mark.parametrize("overrides,match", [
    (["model=lm", "data=stdlib", "model.channels=8"], "channels"),  # cnn's key is not lm's
    (["model=lm", "data=stdlib", "model.width=wide"], "wide"),
    (["model=lm", "data=stdlib", "data.context=long"], "long"),
    (["model=lm", "data=stdlib", "data.val_fration=0.2"], "val_fration"),
    (["sync=diloco", "sync.every=often"], "often"),
    (["sync=diloco", "sync.evry=5"], "evry"),  # (the command's complete_overrides names the settings first)
])
def test_each_option_is_typed_by_its_own_schema(overrides, match):
    with pytest.raises(ConfigCompositionException, match=match):
        _compose(*overrides)


def test_the_lm_workload_composes_and_builds(tmp_path):
    cfg = _compose("model=lm", "data=stdlib", "model.depth=2", "data.max_train_bytes=4096")
    validate(cfg)
    trainer, model, data = build(cfg, str(tmp_path), 0.0)
    assert type(model).__name__ == "ByteLM" and model.hparams["depth"] == 2
    assert type(data).__name__ == "StdlibText" and data.max_train_bytes == 4096 and data.batch_size == 16
    assert trainer.strategy.sync is None  # sync=every_step: the default, today's behaviour
    with pytest.raises(ValueError, match="data.context=256 is longer than model.context=128 .*; set model.context=256"):
        validate(_compose("model=lm", "data=stdlib", "data.context=256"))
    validate(_compose("model=lm", "data=stdlib", "data.context=64"))  # a shorter window is fine


def test_the_sync_group_gives_the_strategy_a_diloco(tmp_path):
    cfg = _compose(*complete_overrides(["model=lm", "data=stdlib", "sync=diloco", "sync.every=50",
                                        "sync.compressor=int8"]))
    validate(cfg)
    sync = build(cfg, str(tmp_path), 0.0)[0].strategy.sync
    assert isinstance(sync, DiLoCo) and (sync.every, sync.outer_lr, sync.outer_momentum) == (50, 0.7, 0.8)
    assert sync.compressor.describe() == "int8(chunk=512)+ef"
    # the file's defaults; a dict of build_compressor's arguments; and every_step's none
    sync = build(_compose("sync=diloco"), str(tmp_path), 0.0)[0].strategy.sync
    assert sync.describe() == "DiLoCo(every=50, outer_lr=0.7, outer_momentum=0.8, compressor=none)"
    cfg = _compose("sync=diloco", "sync.every=5", "sync.outer_lr=1.0", "sync.outer_momentum=0",
                   "sync.compressor={name:topk,ratio:0.02}", "sync.warmup=10")
    sync = build(cfg, str(tmp_path), 0.0)[0].strategy.sync
    assert (sync.every, sync.outer_lr, sync.outer_momentum, sync.warmup) == (5, 1.0, 0.0, 10)
    assert sync.compressor.describe() == "topk(ratio=0.02, values=bf16)+ef"
    assert build(_compose("sync=every_step"), str(tmp_path), 0.0)[0].strategy.sync is None


def test_the_sync_group_streams_fragments_and_balances_steps(tmp_path):
    cfg = _compose(*complete_overrides(["model=lm", "data=stdlib", "sync=diloco", "sync.every=40", "sync.fragments=4",
                                        "sync.delay=1", "sync.mix=1.0", "sync.compressor=int4"]))
    validate(cfg)
    sync = build(cfg, str(tmp_path), 0.0)[0].strategy.sync
    assert (sync.fragments, sync.delay, sync.mix, sync.balance) == (4, 1, 1.0, "batches")
    assert sync.compressor.describe() == "int4(chunk=64)+ef"
    with pytest.raises(ValueError, match=r"fragments=4\) with every=50.*every=48"):
        validate(_compose("sync=diloco", "sync.fragments=4"))
    with pytest.raises(ValueError, match="sync.balance=steps .*add hetero=balanced"):
        validate(_compose("sync=diloco", "sync.balance=steps"))
    cfg = _compose(*complete_overrides(["sync=diloco", "sync.every=4", "sync.balance=steps", "hetero=balanced"]))
    validate(cfg)
    assert build(cfg, str(tmp_path), 0.0)[0].strategy.sync.balance == "steps"


def test_a_diloco_setting_without_the_group_names_it(monkeypatch):
    for override in ("sync.every=5", "sync.outer_lr=1.0"):
        fix = f"it is a setting of sync=diloco: use sync=diloco {override}"
        with pytest.raises(ValueError, match=r"sync=every_step \(the default\) has no setting .*; " + fix):
            complete_overrides([override])
    with pytest.raises(ValueError, match="it is a setting of sync=diloco, onebit_adam: choose one, e.g. sync=diloco "
                                         "sync.compressor=int8"):
        complete_overrides(["sync.compressor=int8"])
    with pytest.raises(ValueError, match="it is a setting of sync=onebit_adam: use sync=onebit_adam sync.refresh=25"):
        complete_overrides(["sync.refresh=25"])
    with pytest.raises(ValueError, match="it is a setting of sync=diloco, onebit_adam: choose one, e.g. sync=diloco "
                                         "sync.warmup=100"):
        complete_overrides(["sync.warmup=100"])
    with pytest.raises(ValueError, match="use sync=diloco sync.every=5"):
        complete_overrides(["sync=every_step", "sync.every=5"])
    with pytest.raises(ValueError, match="no sync option has it; sync=diloco's settings are balance, compressor, "
                                         "delay, every, final_sync, fragments, inner_rate, mix, name"):
        complete_overrides(["sync=diloco", "sync.evry=5"])
    assert complete_overrides(["sync=diloco", "sync.every=5"]) == ["sync=diloco", "sync.every=5"]
    monkeypatch.setattr(sys, "argv", ["lightning-dist-train", "sync.every=5"])
    with pytest.raises(SystemExit, match="use sync=diloco sync.every=5"):
        lightning_dist.train.main()


@pytest.mark.parametrize("overrides,match", [
    (["sync.every=0"], r"DiLoCo\(every=0\): the inner steps between syncs must be an int >= 1"),
    (["+sync.evry=5"], r"DiLoCo has no setting\(s\) \['evry'\]"),  # `+` adds past any schema: DiLoCo refuses it
    (["sync.outer_momentum=1.0"], r"outer_momentum=1.0\) must be in \[0, 1\)"),
    (["sync.compressor=int9"], r"compressor='int9' is unknown.*on the command line sync.compressor=int8"),
    (["sync.warmup=-1"], r"DiLoCo\(warmup=-1\): .* an int >= 0"),
    (["sync.warmup=200", "trainer.max_steps=200"], "sync.warmup=200 with trainer.max_steps=200: the warm-up must end "
                                                   "before the fit does; use sync.warmup < 200$"),
    (["compression=int8"], "sync=diloco with compression=int8: .*compress the pseudo-gradient instead: "
                           r"sync.compressor=int8 \(and drop compression=\)"),
    (["strategy=ddp"], "sync=diloco needs strategy=ring_ddp .*; drop sync= or use strategy=ring_ddp"),
    (["strategy.topology=two_tier"], "strategy.topology=two_tier on 1 node: it needs 2 or more hosts "
                                     r"\(with sync=diloco a worker is a host: one worker, nothing to sync\); use "
                                     "strategy.topology=auto"),
])
def test_diloco_refusals_name_the_fix_before_any_rank(overrides, match):
    with pytest.raises(ValueError, match=match):
        validate(_compose("sync=diloco", *overrides))


def test_stock_ddp_refuses_diloco():
    from lightning_dist.config import stock_ddp_strategy

    with pytest.raises(ValueError, match="sync=diloco needs strategy=ring_ddp"):
        stock_ddp_strategy(timeout=60.0, sync={"name": "diloco", "every": 5})
    with pytest.raises(ValueError, match="sync=diloco needs strategy=ring_ddp"):
        stock_ddp_strategy(timeout=60.0, sync=DiLoCo(every=5))
    for sync in (None, "every_step", {"name": "every_step"}):
        assert type(stock_ddp_strategy(timeout=60.0, sync=sync)).__name__ == "DDPStrategy"


def _documented_lm_command() -> list[str]:
    """The overrides of the LM command docs/sync.md shows (its code block's line, without the comment)."""
    (line,) = [line for line in (REPO / "docs" / "sync.md").read_text().splitlines()
               if line.startswith("lightning-dist-train model=lm data=stdlib")]
    return line.split("#")[0].split()[1:]


def test_the_documented_lm_command_runs_500_steps_under_one_pass():
    """The sync page's LM command: the model=lm option sets its run (500 steps, validated every 100 and after the
    last), the data is every training file, so 500 steps at 2 ranks read a fifth of it and no window twice, and the
    page states the steps and syncs the config gives. The command line still wins over the option's trainer keys."""
    overrides = _documented_lm_command()
    assert overrides == ["model=lm", "data=stdlib", "sync=diloco", "sync.every=50", "sync.compressor=int8"]
    cfg = _compose(*complete_overrides(overrides))
    validate(cfg)
    t = cfg.trainer
    assert (t.max_steps, t.val_check_interval, t.check_val_every_n_epoch, t.devices) == (500, 100, None, 2)
    assert (cfg.model.width, cfg.model.depth, cfg.model.context, cfg.data.batch_size) == (128, 4, 128, 16)
    assert cfg.data.max_train_bytes is None and cfg.data.max_val_bytes == 2**17
    trainer, model, data = build(cfg, "unused", 0.0, summary=False)
    data.setup("fit")
    read = t.max_steps * t.devices * cfg.data.batch_size  # windows the run reads
    assert read < len(data.train_set) / 2  # under half a pass (a fifth on Python 3.11)
    assert sum(p.numel() for p in model.parameters()) == 875_520
    page = " ".join((REPO / "docs" / "sync.md").read_text().split())  # its lines joined
    assert f"{t.max_steps} steps" in page and f"{t.max_steps // cfg.sync.every} syncs" in page
    assert _compose("model=lm", "data=stdlib", "trainer.max_steps=7").trainer.max_steps == 7
    gpu = _compose("model=lm", "data=stdlib", "trainer=gpu", "strategy.start_method=popen").trainer
    assert gpu.max_steps == 500 and gpu.accelerator == "gpu"  # the option's run length over either trainer
    assert _compose().trainer.max_steps == -1  # the digits job is untouched


def test_the_summary_asks_for_a_validation_after_the_last_step():
    """max_steps stopping a fit mid-epoch: at the last step the summary callback asks Lightning to stop (Lightning then
    validates, as after early stopping); validations are recorded by step; the train loss is averaged."""
    from types import SimpleNamespace

    from lightning_dist.train import TRAIN_LOSS_WINDOW, RunSummaryCallback, describe_result

    callback = RunSummaryCallback("unused", {}, started=0.0)
    trainer = SimpleNamespace(is_global_zero=True, max_steps=120, global_step=0, should_stop=False,
                              sanity_checking=False, callback_metrics={})
    for step in range(1, 121):
        trainer.global_step, trainer.callback_metrics = step, {"train/loss": torch.tensor(float(step))}
        callback.on_train_batch_end(trainer, None, None, None, step - 1)
        assert trainer.should_stop == (step == 120)
        if step in (100, 120):
            callback.on_validation_end(trainer, None)
    assert callback._validated_step == 120
    assert list(callback._train_losses) == [float(s) for s in range(121 - TRAIN_LOSS_WINDOW, 121)]
    trainer = SimpleNamespace(is_global_zero=True, max_steps=-1, global_step=7, should_stop=False,
                              callback_metrics={})
    callback.on_train_batch_end(trainer, None, None, None, 6)
    assert not trainer.should_stop  # a fit by epochs validates at each epoch's end already
    assert describe_result({"metrics": {"val/loss": 1.5, "train/loss": 1.2}, "global_step": 600,
                            "validated_at_step": 600, "train_loss": {"mean": 1.4, "steps": 50}}) == (
        "val/loss=1.5000 (validated after step 600 of 600)  train/loss=1.4000 (mean of the last 50 steps)")


@pytest.mark.slow  # the command on 2 ranks
def test_the_lm_trains_with_diloco_from_the_command(launched):
    """The sync page's LM command, as documented but for 4 steps (syncs every 2): the summary holds the validation of
    the model the run ends with (a validation every 3 steps would leave step 4 unvalidated; the final one runs after
    step 4), and the run's configuration is the documented command's."""
    proc, tmp_path = launched["lm"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["global_step"] == 4 and summary["world_size"] == 2
    assert summary["validated_at_step"] == 4  # the final model's, not step 3's
    assert 0 < summary["metrics"]["val/loss"] < 6.0  # nats per byte, from ln 256 = 5.55 down
    assert 0 <= summary["metrics"]["val/acc"] <= 1  # next-byte accuracy: what the checkpoint callback monitors
    assert summary["train_loss"]["steps"] == 4 and 0 < summary["train_loss"]["mean"] < 6.0
    rows = [row for row in csv.DictReader(open(tmp_path / "csv" / "metrics.csv")) if row.get("val/loss")]
    assert [int(row["step"]) for row in rows] == [2, 3]  # Lightning's logging step is the step index: 3 and 4 trained
    assert float(rows[-1]["val/loss"]) == pytest.approx(summary["metrics"]["val/loss"])
    assert "validated after step 4 of 4" in proc.stdout and "train/loss=" in proc.stdout
    # the documented command's configuration, with only the test's shortenings changed
    documented = _compose(*complete_overrides(_documented_lm_command() + LM_SHORTER))
    expected = OmegaConf.to_container(documented, resolve=True, enum_to_str=True)
    expected["callbacks"]["checkpoint"]["dirpath"] = str(tmp_path / "checkpoints")
    assert summary["config"] == expected
    assert summary["config"]["sync"] == {"name": "diloco", "every": 2, "outer_lr": 0.7, "outer_momentum": 0.8,
                                         "compressor": "int8", "fragments": 1, "delay": 0, "mix": 0.5,
                                         "balance": "batches", "final_sync": True, "validate": "mean", "warmup": 0,
                                         "inner_rate": "rise"}
    assert summary["sync"].startswith("DiLoCo(every=2, ") and "int8" in summary["sync"]


@pytest.mark.parametrize("model", ["cnn", "lm"])
def test_the_schedule_comes_from_the_command_and_a_bad_one_fails_at_composition(model, tmp_path):
    extra = ["data=stdlib"] if model == "lm" else []
    cfg = _compose(f"model={model}", "model.schedule=cosine", "model.warmup_steps=3", *extra)
    validate(cfg)
    _, built, _ = build(cfg, str(tmp_path), 0.0)
    assert built.hparams["schedule"] == "cosine" and built.hparams["warmup_steps"] == 3
    with pytest.raises(ConfigCompositionException, match="cosin"):
        _compose(f"model={model}", "model.schedule=cosin", *extra)


def test_the_digits_cnn_trains_under_sgd_from_the_command_and_a_bad_optimizer_fails_at_composition(tmp_path):
    cfg = _compose("model.optimizer=sgd", "model.lr=2e-3")
    validate(cfg)
    _, built, _ = build(cfg, str(tmp_path), 0.0)
    assert built.hparams["optimizer"] == "sgd" and type(built.configure_optimizers()) is torch.optim.SGD
    with pytest.raises(ConfigCompositionException, match="adamw"):
        _compose("model.optimizer=adamw")
