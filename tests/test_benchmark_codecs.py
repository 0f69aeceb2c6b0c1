"""Smoke test of ``python -m lightning_dist.benchmarks.codecs`` and its bucket layouts."""

import json

import pytest

from lightning_dist.benchmarks.codecs import QUICK_CODECS, bucket_layout, main


def test_buckets_are_the_issues_bucket_or_whole_rows_of_the_size_asked():
    assert bucket_layout("mlp").numel == 4_259_840 and len(bucket_layout("mlp").names) == 5
    assert bucket_layout("1M").numel == 2**18 and bucket_layout("25M").numel == 25 * 2**18
    with pytest.raises(ValueError, match="less than one 1024-wide row"):
        bucket_layout("1K")


def test_quick_run_writes_json_table_and_plot(tmp_path):
    payload = main(["--quick", "--rounds", "2", "--buckets", "1M", "--out", str(tmp_path)])
    records = json.loads((tmp_path / "codecs.json").read_text())["records"]
    assert [r["codec"] for r in records] == list(QUICK_CODECS) and records == payload["records"]
    for r in records:
        assert r["passes"] > 0 and r["ms"] > 0 and r["first_ms"] > 0 and r["pass_ms"] > 0
    topk = next(r for r in records if r["codec"] == "topk1%")
    assert topk["mass_kept"] == pytest.approx(1.0)  # the sampled selection is the exact top-k
    assert "passes [IQR]" in (tmp_path / "codecs.txt").read_text()
    assert (tmp_path / "codecs.png").read_bytes().startswith(b"\x89PNG")
