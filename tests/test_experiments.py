"""lightning_dist.experiments: the file-backed records that survive forked ranks, the two ways of running a job
(a RingDDPStrategy of one's own settings, and lightning-dist-train's Hydra configs), and the plots."""

import io
import json
import math

import numpy as np
import pytest
import torch
from lightning.fabric.utilities.rank_zero import rank_zero_only

from lightning_dist.benchmarks._common import figure_row
from lightning_dist.experiments import (
    JsonlLogger,
    Run,
    compose_config,
    epoch_times,
    fit_config,
    fit_digits,
    last,
    load_run,
    per_rank,
    plots,
    read_csv_metrics,
    read_jsonl,
    read_timeline,
    series,
    small_settings,
)

# ---- records, no training --------------------------------------------------------------------------------------

def test_jsonl_logger_appends_plain_numbers_and_starts_a_fresh_file(tmp_path):
    logger = JsonlLogger(tmp_path, name="m")
    logger.log_metrics({"loss": torch.tensor(0.5), "acc": np.float32(0.25), "n": 3}, step=7)
    logger.log_metrics({"loss": 0.25}, step=8)
    assert logger.records() == [{"step": 7, "loss": 0.5, "acc": 0.25, "n": 3}, {"step": 8, "loss": 0.25}]
    assert logger.save_dir == logger.log_dir == str(tmp_path) and logger.name == "m"
    JsonlLogger(tmp_path, name="m")  # a new logger in the launching process: a new run, an empty file
    assert read_jsonl(tmp_path / "m.jsonl") == []


def test_jsonl_logger_writes_and_truncates_on_rank_zero_only(tmp_path, monkeypatch):
    JsonlLogger(tmp_path).log_metrics({"a": 1.0}, step=0)
    monkeypatch.setattr(rank_zero_only, "rank", 1)
    other = JsonlLogger(tmp_path)  # a rank that popen or torchrun re-created: must not empty rank zero's file
    other.log_metrics({"a": 2.0}, step=1)
    assert other.records() == [{"step": 0, "a": 1.0}]


def test_read_jsonl_skips_a_cut_off_last_line_and_an_absent_file(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text('{"step": 1, "a": 1}\n{"step": 2, "a"')
    assert read_jsonl(path) == [{"step": 1, "a": 1}]
    assert read_jsonl(tmp_path / "absent.jsonl") == []


def test_read_csv_metrics_reads_lightnings_sparse_rows(tmp_path):
    path = tmp_path / "metrics.csv"
    path.write_text("dist/comm_ms,epoch,step,train/loss,val/acc\n1.5,0,3,,\n,0,3,2.25,\n,0,5,,0.75\n")
    records = read_csv_metrics(path)
    assert records == [{"dist/comm_ms": 1.5, "epoch": 0, "step": 3}, {"epoch": 0, "step": 3, "train/loss": 2.25},
                       {"epoch": 0, "step": 5, "val/acc": 0.75}]
    assert series(records, "train/loss") == ([3], [2.25])
    assert last(records, "val/acc") == 0.75 and last(records, "nope", -1.0) == -1.0


def _timeline_rows():
    """Two ranks, two epochs of two steps; rank 1 computes twice as long, rank 0 waits for it."""
    rows = []
    for step in range(4):
        t = 10.0 + step
        for rank, compute in ((0, 0.2), (1, 0.4)):
            rows.append({"rank": rank, "step": step, "epoch": step // 2, "batch_idx": step % 2,
                         "samples": 32, "loss": 1.0, "start": t, "compute_end": t + compute, "comm_end": t + 0.45,
                         "end": t + 0.5})
    return rows


def _write_timeline(directory):
    directory.mkdir(parents=True, exist_ok=True)
    for rank in (0, 1):
        with open(directory / f"timeline-rank{rank}.jsonl", "w") as fh:
            for row in _timeline_rows():
                if row["rank"] == rank:
                    fh.write(json.dumps(row) + "\n")
    return directory


def test_read_timeline_makes_times_relative_and_adds_the_intervals(tmp_path):
    rows = read_timeline(_write_timeline(tmp_path))
    assert len(rows) == 8 and rows[0]["start"] == 0.0
    by_rank = {r: [row for row in rows if row["rank"] == r] for r in (0, 1)}
    assert all(math.isclose(row["wait"], 0.25) for row in by_rank[0])
    assert all(math.isclose(row["wait"], 0.05) for row in by_rank[1])
    assert all(math.isclose(row["compute"] + row["wait"] + 0.05, row["duration"]) for row in rows)
    assert np.allclose(epoch_times(rows, rank=0), [1.5, 1.5])
    assert per_rank(rows, "samples") == {0: ([0, 1, 2, 3], [32] * 4), 1: ([0, 1, 2, 3], [32] * 4)}
    assert read_timeline(tmp_path / "nothing") == []


def test_small_settings_follows_the_environment(monkeypatch):
    monkeypatch.delenv("LIGHTNING_DIST_NB_SMALL", raising=False)
    assert not small_settings()
    for value, small in (("1", True), ("0", False), ("", False), ("yes", True)):
        monkeypatch.setenv("LIGHTNING_DIST_NB_SMALL", value)
        assert small_settings() is small


def test_compose_config_applies_overrides_and_checks_them():
    cfg = compose_config(["compression=topk", "compression.ratio=0.05", "trainer.max_epochs=1"])
    assert cfg.compression.name == "topk" and cfg.compression.ratio == 0.05 and cfg.trainer.max_epochs == 1
    with pytest.raises(ValueError, match="trainer.devices=0"):
        compose_config(["trainer.devices=0"])


# ---- plots, on a made-up run -----------------------------------------------------------------------------------

def _fake_run(directory, name="r", acc=0.9, sent=1024.0):
    metrics = [{"step": s, "train/loss": 2.0 - 0.1 * s, "dist/bytes_sent_per_rank": sent,
                "dist/dense_bytes_per_rank": 4096.0, "dist/rank0/compute_ms": 5.0, "dist/rank1/compute_ms": 9.0}
               for s in range(1, 4)] + [{"step": 3, "val/acc": acc, "epoch": 1}]
    summary = {"global_step": 4, "bytes_sent_rank0": 4 * sent, "dense_bytes_rank0": 4 * 4096.0,
               "compression_ratio": 4096.0 / sent, "compressor": "x", "metrics": {"val/acc": acc}}
    return Run(name, str(directory), metrics, read_timeline(_write_timeline(directory / name)), summary, 1.0)


def test_run_summarises_bytes_and_final_values(tmp_path):
    run = _fake_run(tmp_path, sent=1024.0)
    assert run.steps == 4 and run.bytes_per_step == 1024.0 and run.dense_bytes_per_step == 4096.0
    assert run.final("val/acc") == 0.9 and run.final("train/loss") == pytest.approx(1.7)
    row = run.row()
    assert row["KiB/step"] == 1.0 and row["ratio"] == 4.0 and row["val/acc"] == 0.9


def test_plots_draw_every_figure_the_notebooks_use(tmp_path):
    runs = [_fake_run(tmp_path, "dense", 0.97, 4096.0), _fake_run(tmp_path, "fp16", 0.96, 2048.0),
            _fake_run(tmp_path, "bf16", 0.96, 2048.0)]
    fig, (a, b, c, d, e, f, g) = figure_row(7, 6.4, 4.8)
    plots.plot_metric(a, runs, "train/loss", smooth=2)
    assert len(a.lines) == 3
    plots.plot_quality_vs_bytes(b, runs, reference="dense")
    assert len(b.texts) == 3 and b.get_xscale() == "log"
    assert b.texts[1].xyann != b.texts[2].xyann  # fp16 and bf16 at the same bytes: labels not on top of each other
    plots.plot_timeline(c, runs[0], steps=(2, 3))
    assert len(c.patches) == 2 * 2 * 3  # 2 steps x 2 ranks x (compute, wait, optimizer)
    plots.plot_per_rank(d, runs[0], "samples")
    plots.plot_rank_metrics(e, runs[0], "compute_ms")
    assert len(e.lines) == 2
    plots.plot_epoch_times(f, runs[:2])
    assert len(f.patches) == 2 * 2
    plots.plot_bytes(g, runs[1])
    assert g.lines[1].get_ydata()[-1] == pytest.approx(3 * 2048 / 2**20)
    fig.savefig(io.BytesIO(), format="png")
    text = plots.table([r.row() for r in runs], ["run", "val/acc", "KiB/step"])
    assert text.splitlines()[0].split() == ["run", "val/acc", "KiB/step"] and "fp16" in text


def test_moving_average_is_a_trailing_mean():
    assert np.allclose(plots.moving_average([1, 2, 3, 4], 2), [1, 1.5, 2.5, 3.5])
    assert np.allclose(plots.moving_average([1, 2, 3], 1), [1, 2, 3])
    assert len(plots.moving_average([], 5)) == 0


# ---- real runs on 2 forked ranks --------------------------------------------------------------------------------

@pytest.mark.slow  # one 2-rank fit of 2 x 3 batches, ~3 s
def test_fit_digits_brings_back_every_ranks_records(tmp_path):
    run = fit_digits("ring", tmp_path / "ring", algorithm="ring", epochs=2, limit_train_batches=3,
                     slowdown={1: 2.0})
    assert run.steps == 6 and 0 <= run.final("val/acc") <= 1
    steps, compute = run.series("dist/rank1/compute_ms")
    assert steps and all(c > 0 for c in compute)  # gathered from rank 1 to rank zero's logger
    assert run.series("train/loss")[0] and run.series("val/acc")[0]
    assert {r["rank"] for r in run.timeline} == {0, 1} and len(run.timeline) == 2 * 6
    for row in run.timeline:
        assert row["start"] <= row["compute_end"] <= row["comm_end"] <= row["end"]
        assert row["samples"] == 32 and row["loss"] > 0
    assert len(run.epoch_times()) == 2
    assert run.summary["compressor"] == "none" and run.bytes_per_step == pytest.approx(run.dense_bytes_per_step)
    assert load_run("again", tmp_path / "ring").metrics == run.metrics


@pytest.mark.slow  # one 2-rank fit of 2 batches, ~3 s
def test_fit_config_trains_as_lightning_dist_train_does(tmp_path):
    run = fit_config("int8", tmp_path / "int8", ["compression=int8", "trainer.max_epochs=1",
                                                 "trainer.limit_train_batches=3", "trainer.log_every_n_steps=1",
                                                 "callbacks=[dist_metrics]", "trainer.enable_progress_bar=false"])
    assert run.summary["compressor"].startswith("int8") and run.summary["config"]["compression"]["name"] == "int8"
    assert (tmp_path / "int8" / "csv" / "metrics.csv").exists()
    _, ratios = run.series("dist/compression_ratio")
    assert ratios and all(3.5 < r < 4.1 for r in ratios)
    assert {r["rank"] for r in run.timeline} == {0, 1}
    assert run.row()["ratio"] == pytest.approx(run.summary["compression_ratio"])
