"""Pure parts of lightning_dist.comm: no process group needed."""

from itertools import pairwise

import pytest
import torch

from lightning_dist.comm import (
    ALGORITHMS,
    AUTO_TREE_MAX_BYTES,
    CommStats,
    check_algorithm,
    choose_algorithm,
    ring_allreduce_,
    ring_bytes_sent,
)
from lightning_dist.comm._common import check_op, chunk_bounds
from lightning_dist.comm.stats import CallRecord


@pytest.mark.parametrize("numel,parts", [(0, 3), (1, 4), (2, 5), (10, 3), (13, 4), (1024, 4), (7, 1)])
def test_chunk_bounds_cover_range_evenly(numel, parts):
    bounds = chunk_bounds(numel, parts)
    assert len(bounds) == parts
    assert bounds[0][0] == 0 and bounds[-1][1] == numel
    assert all(a[1] == b[0] for a, b in pairwise(bounds))
    sizes = [e - s for s, e in bounds]
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)  # the longest chunk is first: staging buffers rely on it


@pytest.mark.parametrize("world_size", [2, 3, 4, 5, 8])
def test_ring_bytes_is_2_n_minus_1_over_n_when_divisible(world_size):
    numel = 840 * world_size
    for rank in range(world_size):
        assert ring_bytes_sent(numel, world_size, rank, 4) == 2 * (world_size - 1) * numel * 4 // world_size


def test_ring_bytes_uneven_chunks_and_trivial_groups():
    # 10 elements over 4 ranks: chunks 3,3,2,2; rank r skips chunks r+1 and r+2
    assert [ring_bytes_sent(10, 4, r, 1) for r in range(4)] == [20 - 5, 20 - 4, 20 - 5, 20 - 6]
    assert ring_bytes_sent(123, 1, 0, 4) == 0
    assert ring_bytes_sent(0, 3, 1, 4) == 0


def test_check_op_rejects_avg_on_integers_and_unknown_ops():
    assert check_op("avg", torch.float16) == "avg"
    with pytest.raises(ValueError, match=r"op='avg'.*torch.int64.*op='sum'"):
        check_op("avg", torch.int64)
    with pytest.raises(ValueError, match="'max'.*one of"):
        check_op("max", torch.float32)


def test_bad_arguments_fail_before_any_process_group():
    # argument errors come first, so a bad call raises the same way on every rank instead of deadlocking
    with pytest.raises(ValueError, match="int32"):
        ring_allreduce_(torch.ones(3, dtype=torch.int32), op="avg")
    with pytest.raises(ValueError, match="segment_bytes"):
        ring_allreduce_(torch.ones(3), segment_bytes=0)
    with pytest.raises(RuntimeError, match="init_process_group"):
        ring_allreduce_(torch.ones(3))


def test_choose_algorithm_depends_only_on_size_backend_and_world_size():
    assert check_algorithm("auto") == "auto"
    with pytest.raises(ValueError, match="'rings'.*'auto'"):
        check_algorithm("rings")
    assert set(ALGORITHMS) == {"ring", "tree", "native", "auto"}
    for world_size in (3, 4, 5, 64):  # the latency-optimal tree for small messages, gloo's own ring above
        assert choose_algorithm(1024, "gloo", world_size) == "tree"
        assert choose_algorithm(AUTO_TREE_MAX_BYTES - 1, "gloo", world_size) == "tree"
        assert choose_algorithm(AUTO_TREE_MAX_BYTES, "gloo", world_size) == "native"
        assert choose_algorithm(64 << 20, "gloo", world_size) == "native"
        assert choose_algorithm(4096, "gloo", world_size, tree_max_bytes=1024) == "native"
    # at 1 and 2 ranks the tree saves no round over the backend's all-reduce
    for world_size in (1, 2):
        assert choose_algorithm(1024, "gloo", world_size) == "native"
        assert choose_algorithm(64 << 20, "gloo", world_size) == "native"
    # on NCCL the experimental point-to-point paths are never auto-selected
    assert choose_algorithm(1024, "nccl", 4) == "native"
    assert choose_algorithm(64 << 20, "nccl", 2) == "native"


def test_comm_stats_totals_and_reset():
    stats = CommStats()
    stats.record(CallRecord("ring", 10, 40, 40, 0.5))
    stats.tier("inter_host").record(CallRecord("tree", 2, 8, 8, 0.25))  # a view: counted in both
    stats.tier("intra_host").record(CallRecord("native", 1, 4, 4, 0.0))
    stats.record_dense(80)
    stats.tier("intra_host").record_codec(0.125)
    assert stats.as_dict() == {"calls": 3, "bytes_sent": 52, "bytes_received": 52, "seconds": 0.75,
                               "dense_bytes": 80, "codec_seconds": 0.125, "bytes_intra_host": 4.0,
                               "bytes_inter_host": 8.0}
    assert [r.algorithm for r in stats.records] == ["ring", "tree", "native"]
    with pytest.raises(ValueError, match="tier='host'"):
        stats.tier("host")
    stats.reset()
    assert stats.calls == 0 and stats.records == [] and stats.dense_bytes == 0 and stats.codec_seconds == 0
    assert stats.tier_bytes == {}


@pytest.mark.parametrize("world_size", [2, 3])
def test_ring_posts_its_first_two_steps_receives_before_it_sends(monkeypatch, world_size):
    """A gloo send waits for the receiver's ready notice, which queues behind data already sent on the same
    connection: at 2 ranks a receive posted after our first send made the two directions take turns."""
    import torch.distributed as dist

    from lightning_dist.comm._common import GroupView
    from lightning_dist.comm.ring import _pipelined_ring

    calls: list[str] = []

    class Done:
        def wait(self) -> bool:
            return True

    def isend(tensor, dst, group=None):
        calls.append("send")
        return Done()

    def irecv(tensor, src, group=None):
        calls.append("recv")
        return Done()

    monkeypatch.setattr(dist, "isend", isend)
    monkeypatch.setattr(dist, "irecv", irecv)
    numel, segment = 12 * world_size, 4  # three segments per chunk
    _pipelined_ring(torch.zeros(numel), GroupView(None, 0, world_size, tuple(range(world_size))), segment)
    per_step = numel // world_size // segment
    steps = 2 * (world_size - 1)
    assert calls.count("recv") == calls.count("send") == steps * per_step
    assert calls[: 2 * per_step] == ["recv"] * (2 * per_step)
