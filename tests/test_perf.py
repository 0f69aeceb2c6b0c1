"""Unit tests for lightning_dist.perf: what apply_perf sets, which environments warn, bad values."""

from __future__ import annotations

import pytest
import torch

from lightning_dist import perf
from lightning_dist.perf import PerfConfig, apply_perf, preflight_warnings, run_preflight


@pytest.fixture(autouse=True)
def restore_torch_settings(monkeypatch):
    """apply_perf changes process-wide settings: put them back after each test."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    saved = torch.get_float32_matmul_precision(), torch.backends.cudnn.benchmark, torch.get_num_threads()
    yield
    torch.set_float32_matmul_precision(saved[0])
    torch.backends.cudnn.benchmark = saved[1]
    torch.set_num_threads(saved[2])


def test_apply_returns_and_sets_explicit_values():
    cfg = PerfConfig(float32_matmul_precision="medium", cudnn_benchmark=False, intra_op_threads=1)
    applied = apply_perf(cfg)
    assert applied["float32_matmul_precision"] == "medium" == torch.get_float32_matmul_precision()
    assert applied["cudnn_benchmark"] is False and torch.backends.cudnn.benchmark is False
    assert applied["intra_op_threads"] == 1 == torch.get_num_threads()
    assert applied["inter_op_threads"] is None and applied["skipped"] == {}


def test_auto_threads_divide_cores_among_local_ranks(monkeypatch):
    monkeypatch.setattr(perf, "available_cores", lambda: 8)
    assert apply_perf(PerfConfig(), local_world_size=4)["intra_op_threads"] == 2
    assert apply_perf(PerfConfig(), local_world_size=16)["intra_op_threads"] == 1  # at least one
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # an explicit setting wins
    assert apply_perf(PerfConfig(), local_world_size=4)["intra_op_threads"] == 3


def test_inter_op_threads_refused_is_reported_not_raised():
    # torch accepts one inter-op size per process, before any inter-op work: the second call at the latest is
    # refused. Asking for the current size keeps the test process unchanged whichever call torch accepts.
    current = torch.get_num_interop_threads()
    cfg = PerfConfig(inter_op_threads=current, intra_op_threads=1)
    apply_perf(cfg)
    applied = apply_perf(cfg)
    assert "inter_op_threads" in applied["skipped"] and "refused" in applied["skipped"]["inter_op_threads"]
    assert applied["inter_op_threads"] == current


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"float32_matmul_precision": "fast"}, "highest"),
        ({"cudnn_benchmark": "yes"}, "cudnn_benchmark"),
        ({"intra_op_threads": 0}, "intra_op_threads"),
        ({"inter_op_threads": True}, "inter_op_threads"),
    ],
)
def test_bad_config_raises(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PerfConfig(**kwargs)


@pytest.mark.parametrize("local_world_size", [0, 1.0, None])
def test_bad_local_world_size_raises(local_world_size):
    with pytest.raises(ValueError, match="local_world_size"):
        apply_perf(PerfConfig(), local_world_size=local_world_size)
    with pytest.raises(ValueError, match="local_world_size"):
        preflight_warnings({}, local_world_size=local_world_size)


def test_clean_environment_has_no_warnings():
    assert preflight_warnings({}, cores=2) == []
    assert preflight_warnings({"TORCH_DISTRIBUTED_DEBUG": "OFF", "NCCL_DEBUG": "WARN",
                               "CUDA_LAUNCH_BLOCKING": "0", "OMP_NUM_THREADS": "1"},
                              local_world_size=2, cores=2) == []


@pytest.mark.parametrize(
    "env, needle",
    [
        ({"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}, "TORCH_DISTRIBUTED_DEBUG=DETAIL"),
        ({"TORCH_DISTRIBUTED_DEBUG": "info"}, "TORCH_DISTRIBUTED_DEBUG=INFO"),
        ({"NCCL_DEBUG": "INFO"}, "NCCL_DEBUG=INFO"),
        ({"NCCL_DEBUG": "TRACE"}, "NCCL_DEBUG=TRACE"),
        ({"TORCH_CPP_LOG_LEVEL": "INFO"}, "TORCH_CPP_LOG_LEVEL=INFO"),
        ({"CUDA_LAUNCH_BLOCKING": "1"}, "CUDA_LAUNCH_BLOCKING=1"),
        ({"NCCL_ALGO": "Ring"}, "small"),
        ({"OMP_NUM_THREADS": "two"}, "not a positive integer"),
    ],
)
def test_each_slow_setting_warns(env, needle):
    warnings = preflight_warnings(env, cores=64)
    assert len(warnings) == 1 and needle in warnings[0], warnings


def test_thread_oversubscription_warns_with_a_fix():
    assert preflight_warnings({"OMP_NUM_THREADS": "2"}, local_world_size=1, cores=2) == []
    (warning,) = preflight_warnings({"OMP_NUM_THREADS": "2"}, local_world_size=2, cores=2)
    assert "4 threads on 2 cores" in warning and "OMP_NUM_THREADS=1" in warning


def test_run_preflight_logs_and_returns(monkeypatch, caplog):
    monkeypatch.setenv("CUDA_LAUNCH_BLOCKING", "1")
    with pytest.warns(UserWarning, match="CUDA_LAUNCH_BLOCKING"):
        applied, warnings = run_preflight(PerfConfig(intra_op_threads=1), local_world_size=1)
    assert applied["intra_op_threads"] == 1 and len(warnings) == 1
    applied, warnings = run_preflight(PerfConfig(intra_op_threads=1, warn=False))
    assert warnings == []
