"""Ring, tree, native and auto all-reduce on 1 to 5 gloo ranks, checked against ``dist.all_reduce``.

One group of ranks is launched per world size and runs every case; the tests below assert on its results.
"""

import hashlib
import math
import os
import time

import pytest
import torch
import torch.distributed as dist

from lightning_dist.comm import (
    ALGORITHMS,
    AUTO_TREE_MAX_BYTES,
    CommStats,
    allreduce_,
    allreduce_async,
    ring_allreduce_,
    ring_bytes_sent,
)
from lightning_dist.comm._common import scratch
from lightning_dist.testing import RanksFailed, run_ranks

pytestmark = pytest.mark.slow  # every test launches ranks

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int32, torch.int64]
# 0, 1, fewer than N, primes, and one larger than several 1 MiB pipeline segments
SIZES = [0, 1, 2, 3, 13, 1021, 65537, (1 << 20) + 7]
# (rtol, atol) against dist.all_reduce; atol is scaled by the result's largest magnitude, because float16's
# avg divides every term before summing (each term rounds at its own scale). Integer-valued sums must be exact.
TOLERANCE = {
    torch.float16: (1e-2, 5e-3),
    torch.bfloat16: (3e-2, 2e-2),
    torch.float32: (1e-5, 1e-5),
    torch.float64: (1e-12, 1e-12),
}


def _inputs(rank: int, numel: int, dtype: torch.dtype, integer_valued: bool) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * rank + numel)
    if integer_valued or not dtype.is_floating_point:
        return torch.randint(-50, 50, (numel,), generator=gen).to(dtype)
    return torch.randn(numel, generator=gen, dtype=torch.float64).to(dtype)


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha1(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _compare(ours: torch.Tensor, ref: torch.Tensor, exact: bool) -> float:
    """Max violation of the tolerance (<= 0 means within it)."""
    if ours.numel() == 0:
        return 0.0
    if exact:
        return float((ours != ref).sum())
    rtol, atol = TOLERANCE[ours.dtype]
    o, r = ours.double(), ref.double()
    scale = max(1.0, float(r.abs().max()))
    return float(((o - r).abs() - (atol * scale + rtol * r.abs())).max())


def _all_cases(rank, world_size):
    """Every (algorithm, dtype, size, op) case; returns a list of result dicts."""
    out = []
    for dtype in DTYPES:
        for numel in SIZES:
            for integer_valued in ([True, False] if dtype.is_floating_point else [True]):
                # one input and one reference sum serve every algorithm and op: the inputs depend on neither
                inputs = _inputs(rank, numel, dtype, integer_valued)
                total = inputs.clone()
                dist.all_reduce(total)
                for algorithm in ALGORITHMS:
                    for op in (["sum", "avg"] if dtype.is_floating_point else ["sum"]):
                        x = inputs.clone()
                        ref = (total.double() / world_size).to(dtype) if op == "avg" else total
                        stats = CommStats()
                        allreduce_(x, algorithm, op=op, stats=stats)
                        exact = integer_valued and op == "sum"
                        rec = stats.records[0]
                        out.append(dict(
                            case=(algorithm, str(dtype), numel, op, integer_valued),
                            violation=_compare(x, ref, exact),
                            ran=rec.algorithm, bytes_sent=rec.bytes_sent, estimated=rec.estimated,
                            seconds=rec.seconds, digest=_digest(x),
                        ))
    return out


def _special_cases(rank, world_size):
    """Subgroups, non-contiguous input, float16 overflow under avg, avg on ints, results of ``auto``."""
    res = {}
    # float16 avg of values whose sum overflows 65504: divided before summing, so finite and exact
    for algorithm in ("ring", "tree", "native"):
        x = torch.full((37,), 40000.0, dtype=torch.float16)
        allreduce_(x, algorithm, op="avg")
        res[f"fp16_avg_{algorithm}"] = (bool(torch.isfinite(x).all()), float(x.double().mean()))
    # avg on integers is rejected on every rank before any message moves (so nobody deadlocks)
    try:
        ring_allreduce_(torch.ones(4, dtype=torch.int64), op="avg")
        res["int_avg"] = "no error"
    except ValueError as err:
        res["int_avg"] = str(err)
    # a non-contiguous tensor is reduced in place all the same
    base = _inputs(rank, 6 * 5, torch.float32, True).view(6, 5)
    x, ref = base.t(), base.t().contiguous()
    dist.all_reduce(ref)
    ring_allreduce_(x)
    res["non_contiguous"] = bool(torch.equal(x, ref))
    # a subgroup of odd ranks (new_group must be called by every rank)
    members = list(range(1, world_size, 2))
    sub = dist.new_group(members) if members else None
    if rank in members:
        for algorithm in ("ring", "tree", "auto"):
            for numel in (1, 5, 1000, 100003):
                x = _inputs(rank, numel, torch.float32, True)
                ref = x.clone()
                dist.all_reduce(ref, group=sub)
                allreduce_(x, algorithm, group=sub)
                res[f"sub_{algorithm}_{numel}"] = bool(torch.equal(x, ref))
    # a tensor that is itself a view of the pooled scratch buffer must not be used as its own staging area
    for algorithm in ("ring", "tree"):
        x = scratch(1000, torch.ones(1))
        x.fill_(2.0**rank)
        allreduce_(x, algorithm)
        res[f"scratch_alias_{algorithm}"] = bool((x == 2.0**world_size - 1).all())
    # auto picks by size only: record what ran for sizes on both sides of the threshold
    stats = CommStats()
    threshold = AUTO_TREE_MAX_BYTES // 4  # in float32 elements
    for numel in (1, 100, 4000, threshold - 1, threshold, threshold + 1, 3 * threshold):
        allreduce_(torch.ones(numel), "auto", stats=stats)
    res["auto_choices"] = [r.algorithm for r in stats.records]
    # the Future form (the communication worker's): same results, also non-contiguous and avg; several
    # native calls in flight at once complete in order of issue with the right sums
    for algorithm in ALGORITHMS:
        base = _inputs(rank, 40 * 30, torch.float32, True).view(40, 30)
        x, ref = base.t(), base.t().contiguous()
        dist.all_reduce(ref)
        ref /= world_size
        stats = CommStats()
        futures = [allreduce_async(x, algorithm, op="avg", stats=stats)]
        extra = [torch.full((5000,), float(rank + i)) for i in range(3)]
        futures += [allreduce_async(t, algorithm, stats=stats) for t in extra[:2]]
        futures.append(allreduce_async(extra[2], algorithm, stats=stats, then=lambda t: t.mul_(2)))  # one callback
        results = [f.wait() for f in futures]
        extra[2].div_(2)
        res[f"async_{algorithm}"] = (
            results[0] is x and bool(torch.allclose(x, ref, atol=1e-6)),
            [float(t[0]) for t in extra],
            stats.calls,
        )
    return res


def _run(rank, world_size):
    return {"cases": _all_cases(rank, world_size), "special": _special_cases(rank, world_size)}


@pytest.fixture(scope="module", params=[1, 2, 3, 4, 5], ids=lambda n: f"world{n}")
def group_results(request):
    world_size = request.param
    return world_size, run_ranks(_run, world_size, deadline_s=150)


def test_every_case_matches_dist_all_reduce(group_results):
    _, per_rank = group_results
    bad = [(c["case"], c["violation"]) for rank in per_rank for c in rank["cases"] if c["violation"] > 0]
    assert not bad, f"{len(bad)} cases outside tolerance, first ones: {bad[:5]}"


def test_results_are_bit_identical_across_ranks(group_results):
    _, per_rank = group_results
    for i, case in enumerate(per_rank[0]["cases"]):
        digests = {rank["cases"][i]["digest"] for rank in per_rank}
        assert len(digests) == 1, f"ranks disagree on {case['case']}"


def test_ring_sends_exactly_its_chunks(group_results):
    world_size, per_rank = group_results
    for rank, results in enumerate(per_rank):
        for c in results["cases"]:
            if c["ran"] == "ring":
                algorithm, dtype, numel, _, _ = c["case"]
                esize = torch.empty(0, dtype=getattr(torch, dtype.split(".")[1])).element_size()
                assert c["bytes_sent"] == ring_bytes_sent(numel, world_size, rank, esize), c["case"]
                if numel % world_size == 0:
                    assert c["bytes_sent"] == 2 * (world_size - 1) * numel * esize // world_size


def test_tree_sends_log2_rounds_plus_fold(group_results):
    world_size, per_rank = group_results
    pow2 = 1 << (world_size.bit_length() - 1)
    rem = world_size - pow2
    for rank, results in enumerate(per_rank):
        folded_out = rank < 2 * rem and rank % 2 == 0
        messages = 1 if folded_out else int(math.log2(pow2)) + (1 if rank < 2 * rem else 0)
        for c in results["cases"]:
            if c["ran"] == "tree":
                _, dtype, numel, _, _ = c["case"]
                esize = torch.empty(0, dtype=getattr(torch, dtype.split(".")[1])).element_size()
                expected = messages * numel * esize if world_size > 1 else 0
                assert c["bytes_sent"] == expected, (rank, c["case"])


def test_native_bytes_are_marked_estimated(group_results):
    _, per_rank = group_results
    native = [c for c in per_rank[0]["cases"] if c["ran"] == "native"]
    assert native and all(c["estimated"] for c in native)
    assert all(not c["estimated"] for c in per_rank[0]["cases"] if c["ran"] != "native")


def test_auto_makes_the_same_size_based_choice_on_every_rank(group_results):
    world_size, per_rank = group_results
    choices = [r["special"]["auto_choices"] for r in per_rank]
    assert all(c == choices[0] for c in choices)
    if world_size >= 3:  # the tree below AUTO_TREE_MAX_BYTES, native above
        assert choices[0] == ["tree"] * 4 + ["native"] * 3
    else:  # at 2 ranks the tree saves no round
        assert choices[0] == ["native"] * 7


def test_async_form_matches_dist_all_reduce(group_results):
    world_size, per_rank = group_results
    expected = [float(sum(r + i for r in range(world_size))) for i in range(3)]
    for algorithm in ALGORITHMS:
        ok, sums, calls = per_rank[0]["special"][f"async_{algorithm}"]
        assert ok, algorithm
        assert sums == expected, algorithm
        assert calls == 4, algorithm


def test_float16_avg_cannot_overflow(group_results):
    _, per_rank = group_results
    for algorithm in ("ring", "tree", "native"):
        finite, mean = per_rank[0]["special"][f"fp16_avg_{algorithm}"]
        assert finite and mean == 40000.0, algorithm


def test_avg_on_integers_raises_a_clear_error(group_results):
    _, per_rank = group_results
    for r in per_rank:
        assert "op='avg'" in r["special"]["int_avg"] and "op='sum'" in r["special"]["int_avg"]


def test_reducing_a_view_of_the_scratch_pool_is_still_correct(group_results):
    _, per_rank = group_results
    for r in per_rank:
        assert r["special"]["scratch_alias_ring"] and r["special"]["scratch_alias_tree"]


def test_non_contiguous_and_subgroups(group_results):
    world_size, per_rank = group_results
    for rank, r in enumerate(per_rank):
        special = r["special"]
        assert special["non_contiguous"]
        sub = {k: v for k, v in special.items() if k.startswith("sub_")}
        if rank % 2 == 1:
            assert sub and all(sub.values()), sub
        else:
            assert not sub


def _raise_on_rank_one(rank, world_size):
    if rank == 1:
        raise RuntimeError("boom on purpose")
    x = torch.ones(10)
    ring_allreduce_(x)  # rank 0 blocks here until the harness kills it
    return x


def test_a_failing_rank_fails_fast_and_never_hangs():
    with pytest.raises(RanksFailed, match="boom on purpose"):
        run_ranks(_raise_on_rank_one, 2, deadline_s=60)


def _stall_on_rank_one(rank, world_size):
    print(f"rank {rank} reduces", flush=True)
    if rank == 1:
        time.sleep(120)  # a stalled peer: no error, no exit
    ring_allreduce_(torch.ones(10))


def test_a_stalled_rank_is_killed_at_the_deadline_and_every_stuck_ranks_output_and_stack_is_reported():
    started = time.monotonic()
    with pytest.raises(RanksFailed, match="deadline of 4s passed") as failed:
        run_ranks(_stall_on_rank_one, 2, deadline_s=4)
    assert time.monotonic() - started < 30
    # both ranks were still running: each one's output, then its Python stack at the deadline (faulthandler)
    report = str(failed.value).split("--- rank 1 ---")
    assert "rank 0 was still running" in report[0] and "rank 1 was still running" in report[1], failed.value
    assert "rank 0 reduces" in report[0] and "rank 1 reduces" in report[1]
    # rank 0 waits in the ring for rank 1's chunk (or, its group's timeout being the deadline, has just given up)
    assert "most recent call first" in report[0] and "in _child" in report[0]
    assert "in _stall_on_rank_one" in report[1] and "in _pipelined_ring" not in report[1]  # asleep before the ring


def _die_on_rank_one(rank, world_size):
    if rank == 1:
        os._exit(3)  # killed without a word, as by the OOM killer
    ring_allreduce_(torch.ones(10))


def test_a_rank_that_dies_silently_is_reported():
    with pytest.raises(RanksFailed, match="rank 1 exited with code 3"):
        run_ranks(_die_on_rank_one, 2, deadline_s=60)


def _grouped_paths(rank, world_size):
    # The NCCL (CUDA) path of the ring groups each step's send and receive; gloo runs grouped ops too, so
    # the path's logic is checked here on CPU tensors (the NCCL transport itself needs two GPUs).
    from lightning_dist.comm._common import group_view
    from lightning_dist.comm.ring import _grouped_ring

    view = group_view(None)
    out = {}
    for numel in (1, world_size - 1, 7, 1000):
        x = _inputs(rank, numel, torch.float32, True)
        ref = x.clone()
        dist.all_reduce(ref)
        sent, _ = _grouped_ring(x, view)
        out[numel] = (bool(torch.equal(x, ref)), sent == ring_bytes_sent(numel, world_size, rank, 4))
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_grouped_ring_for_nccl_matches_on_gloo(world_size):
    for rank, results in enumerate(run_ranks(_grouped_paths, world_size, deadline_s=60)):
        assert all(ok and count for ok, count in results.values()), (rank, results)
