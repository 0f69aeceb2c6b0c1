"""Smoke test of ``python -m lightning_dist.benchmarks.allreduce``: a tiny run writes every output file."""

import json

import pytest

from lightning_dist.benchmarks._common import parse_size, size_label
from lightning_dist.benchmarks.allreduce import MAIN_CASES, main, repeats_for


@pytest.mark.slow  # launches groups of ranks
@pytest.mark.benchmark
def test_quick_run_writes_json_table_and_plot(tmp_path):
    argv = ["--quick", "--sizes", "1K", "64K", "--repeats", "3", "--warmup", "1", "--out", str(tmp_path)]
    payload = main(argv)

    saved = json.loads((tmp_path / "allreduce.json").read_text())
    assert saved["records"] == payload["records"]
    labels = {c.label for c in MAIN_CASES}
    for nbytes in (1024, 65536):
        mine = {r["algorithm"]: r for r in saved["records"] if r["bytes"] == nbytes}
        assert set(mine) == labels
        assert all(r["world_size"] == 2 and r["repeats"] == 3 and r["median_s"] > 0 for r in mine.values())
        assert mine["native"]["busbw_ratio_vs_native"] == 1.0
        assert mine["auto"]["resolved_algorithm"] == "native"  # at 2 ranks the tree saves no round
    table = (tmp_path / "allreduce.txt").read_text()
    assert "64K" in table and "recommendation" in table
    assert (tmp_path / "allreduce.png").read_bytes().startswith(b"\x89PNG")


def test_sizes_and_repeats():
    assert [size_label(parse_size(s)) for s in ("1K", "64k", "4MiB", "1000")] == ["1K", "64K", "4M", "1000"]
    assert repeats_for(1 << 10, 40) == 40
    assert repeats_for(64 << 20, 40) == 10
    assert repeats_for(64 << 20, 8) == 5  # at least 5 for large messages ...
    assert repeats_for(64 << 20, 3) == 3  # ... unless fewer were asked for
