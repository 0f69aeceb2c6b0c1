"""Heterogeneous batching without a process group: sizes, the sampler's samples, weights, rebalancing."""

from __future__ import annotations

import pytest
from torch.utils.data import DistributedSampler

from lightning_dist.hetero import BatchPlan, HeteroBatching, HeteroBatchSampler, micro_batch_sizes, split_batch
from lightning_dist.hetero.batching import as_hetero

# ---- sizes --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("total,weights", [(64, [1, 0.5]), (64, [3, 1]), (10, [1, 1, 1]), (64, [1, 1, 0.33]),
                                           (7, [5, 1, 1, 1, 1, 1, 1]), (1000, [0.1, 9.9])])
def test_split_adds_up_and_follows_the_weights(total, weights):
    sizes = split_batch(total, weights)
    assert sum(sizes) == total and min(sizes) >= 1
    ideal = [total * w / sum(weights) for w in weights]
    if all(x >= 1 for x in ideal):
        assert all(abs(s - x) < 1 for s, x in zip(sizes, ideal, strict=True)), (sizes, ideal)


def test_split_respects_bounds_and_is_deterministic():
    assert split_batch(64, [1, 0.5]) == [43, 21]
    assert split_batch(64, [3, 1]) == [48, 16]
    assert split_batch(64, [10, 1], min_size=8) == [56, 8]
    assert split_batch(64, [1, 1], max_sizes=[20, 100]) == [20, 44]  # a memory cap binds
    with pytest.raises(ValueError, match="fewer than the global batch"):
        split_batch(64, [1, 1], max_sizes=[20, 20])
    with pytest.raises(ValueError, match="at least 4"):
        split_batch(6, [1, 1], min_size=4)
    with pytest.raises(ValueError, match="must be a finite number > 0"):
        split_batch(64, [1, 0])


def test_a_plan_change_applies_from_its_step_only():
    plan = BatchPlan(2, [1, 1])
    plan.change(10, [3, 1])
    assert plan.sizes_at(9, 64) == [32, 32] and plan.sizes_at(10, 64) == [48, 16]
    with pytest.raises(ValueError, match="rewrite steps already planned"):
        plan.change(5, [1, 1])
    restored = BatchPlan(2, [1, 1])
    restored.load_state_dict(plan.state_dict())
    assert restored.sizes_at(11, 64) == [48, 16]


# ---- the sampler: stock DDP's global batches, split ------------------------------------------------------------

def _stock_global_batches(n, world, batch, epoch, shuffle=True, drop_last=False, seed=3):
    per_rank = []
    for rank in range(world):
        sampler = DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=shuffle, seed=seed,
                                     drop_last=drop_last)
        sampler.set_epoch(epoch)
        order = list(sampler)
        per_rank.append([order[i:i + batch] for i in range(0, len(order), batch)])
    return [sorted(sum((per_rank[r][s] for r in range(world)), [])) for s in range(len(per_rank[0]))]


@pytest.mark.parametrize("n,world,batch,weights,shuffle,drop_last", [
    (100, 2, 8, [3, 1], True, False), (101, 3, 5, [1, 1, 0.33], True, False), (97, 2, 16, [1, 0.5], False, False),
    (101, 3, 4, [2, 1, 1], True, True),
])
def test_every_step_uses_stock_ddps_samples(n, world, batch, weights, shuffle, drop_last):
    plan = BatchPlan(world, weights)
    samplers = [HeteroBatchSampler(n, world, r, world * batch, plan, shuffle=shuffle, seed=3, drop_last=drop_last)
                for r in range(world)]
    for epoch in (0, 1):
        for s in samplers:
            s.set_epoch(epoch)
        mine = [list(s) for s in samplers]
        assert len({len(m) for m in mine}) == 1  # every rank runs the same number of steps
        ours = [sorted(sum((mine[r][i] for r in range(world)), [])) for i in range(len(mine[0]))]
        assert ours == _stock_global_batches(n, world, batch, epoch, shuffle, drop_last)
        first = [len(mine[r][0]) for r in range(world)]
        assert first == plan.sizes_at(0, world * batch)


def test_resuming_mid_epoch_continues_with_the_next_batch():
    plan = BatchPlan(2, [3, 1])
    sampler = HeteroBatchSampler(100, 2, 0, 16, plan, seed=1)
    sampler.set_epoch(2)
    whole = list(sampler)
    sampler.resume_at(2, 4)
    assert list(sampler) == whole[4:]
    assert list(sampler) == whole  # only the one iteration resumes
    with pytest.raises(ValueError, match="cannot feed 4 ranks"):
        HeteroBatchSampler(3, 4, 0, 8, BatchPlan(4, [1] * 4))


# ---- weights -----------------------------------------------------------------------------------------------

class _Sampler:
    def sizes(self, epoch, index):
        return [[30, 10], [21, 7], [3, 1]][index]


def test_each_rank_is_weighted_by_its_share_of_the_global_batch():
    hetero = HeteroBatching(batch_sizes=[3, 1])
    hetero.sampler = _Sampler()
    assert hetero.share(0, 0, 0) == 0.75 and hetero.share(0, 0, 1) == 0.25
    assert hetero.share(0, 1, 0) + hetero.share(0, 1, 1) == 1.0
    assert hetero.share(0, 2, 1) == 0.25


# ---- rebalancing --------------------------------------------------------------------------------------------

def test_rebalancing_follows_measured_throughput_with_hysteresis():
    hetero = HeteroBatching(window=3, threshold=0.05)
    hetero.make_plan(2, 32)
    assert hetero.rebalance and hetero.global_batch == 64
    for _ in range(2):
        hetero.observe([0.10, 0.20], [32, 32])  # rank 1 is half as fast
    assert hetero.maybe_rebalance(1, 3) is None  # the window is not full
    hetero.observe([0.10, 0.20], [32, 32])
    event = hetero.maybe_rebalance(2, 3)
    assert event["new"] == [43, 21] and event["old"] == [32, 32]
    assert hetero.plan.sizes_at(3, 64) == [43, 21] and hetero.plan.sizes_at(2, 64) == [32, 32]
    assert hetero.maybe_rebalance(3, 5) is None  # the window starts afresh after a change
    for _ in range(3):
        hetero.observe([0.1333, 0.1312], [43, 21])  # balanced now: spread under the threshold
    assert hetero.maybe_rebalance(6, 8) is None


def test_static_settings_do_not_rebalance_and_bad_input_is_named():
    assert HeteroBatching(speeds=[3, 1]).rebalance is False
    assert as_hetero({"enabled": False, "speeds": None}) is None
    assert as_hetero({"speeds": [2, 1]}).speeds == [2, 1]
    for kwargs, match in (({"speeds": [1, 0]}, r"speeds=\[1, 0\]"), ({"batch_sizes": [0, 4]}, "batch_sizes"),
                          ({"speeds": [1], "batch_sizes": [1]}, "not both"), ({"window": 0}, "window=0"),
                          ({"threshold": -1}, "threshold=-1")):
        with pytest.raises(ValueError, match=match):
            HeteroBatching(**kwargs)
    with pytest.raises(ValueError, match="has 3 entries for 2 ranks"):
        HeteroBatching(speeds=[1, 1, 1]).check_world(2)
    with pytest.raises(ValueError, match="add up to 40, not the global batch 64"):
        HeteroBatching(batch_sizes=[30, 10]).make_plan(2, 32)
    with pytest.raises(ValueError, match="fewer than the global batch"):
        HeteroBatching(memory_caps=[10, 10], accumulate="off").make_plan(2, 32)
    HeteroBatching(memory_caps=[10, 10]).make_plan(2, 32)  # accumulate="auto": micro-batches hold any share
    with pytest.raises(ValueError, match="unexpected keyword"):
        as_hetero({"sped": [1, 2]})


def test_a_time_model_equalises_compute_time_where_steps_have_a_fixed_cost():
    # rank 0: 50 ms + 1 ms per sample; rank 1: twice that; proportional sizes alone would not balance them
    def times(sizes):
        return [0.05 + 0.001 * sizes[0], 2 * (0.05 + 0.001 * sizes[1])]

    hetero = HeteroBatching(window=2, threshold=0.05)
    hetero.make_plan(2, 32)
    sizes = [32, 32]
    for decision in range(2):
        for _ in range(2):
            hetero.observe(times(sizes), sizes)
        event = hetero.maybe_rebalance(10 * decision, 10 * decision + 1)
        sizes = event["new"]
    assert sizes == [59, 5]  # equal time: 50 + 59 = 109 ms against 2 x (50 + 5) = 110 ms
    for _ in range(2):
        hetero.observe(times(sizes), sizes)
    assert hetero.spread() < 0.05 and hetero.maybe_rebalance(30, 31) is None


def test_a_binding_memory_cap_is_reported_with_the_step_time_it_costs():
    hetero = HeteroBatching(window=1, memory_caps=[40, 64], accumulate="off")
    hetero.make_plan(2, 32)
    hetero.observe([0.10, 0.20], [32, 32])  # rank 0 twice as fast, but capped at 40 of 64
    event = hetero.maybe_rebalance(0, 1)
    assert event["new"] == [40, 24] and event["capped"]["without_caps"] == [43, 21]
    # rank 1 now sets the pace: 24 samples at half speed against 43 at full speed without the cap
    assert abs(event["capped"]["step_time_lost"] - ((24 / (64 / 3)) / (43 / (128 / 3)) - 1)) < 1e-9


# ---- per-rank gradient accumulation: the micro-batch plan -----------------------------------------------------

@pytest.mark.parametrize("share,cap,count,expected", [
    (48, 16, None, [16, 16, 16]), (40, 14, None, [14, 13, 13]), (85, 29, None, [29, 28, 28]), (16, 64, None, [16]),
    (7, None, None, [7]), (5, None, 3, [2, 2, 1]), (2, None, 4, [1, 1]), (12, 5, 2, [6, 6]),  # a count wins over a cap
])
def test_a_share_is_cut_into_near_equal_micro_batches_within_its_cap(share, cap, count, expected):
    sizes = micro_batch_sizes(share, cap=cap, count=count)
    assert sizes == expected and sum(sizes) == share and max(sizes) - min(sizes) <= 1
    with pytest.raises(ValueError, match="a share of 0 samples"):
        micro_batch_sizes(0, cap=4)


def _attached(hetero, world=2, loader_batch=32):
    plan = hetero.make_plan(world, loader_batch)
    hetero.sampler = HeteroBatchSampler(640, world, 0, hetero.global_batch, plan)
    return hetero


def test_accumulate_auto_lets_shares_follow_speed_and_caps_set_the_micro_batches():
    auto = _attached(HeteroBatching(speeds=[3, 1], memory_caps=[16, 64]))
    assert auto.accumulate == "auto" and auto.accumulates
    assert auto.sizes_of(0, 0) == [48, 16]  # the cap does not move samples
    assert auto.micro_sizes(0, 0, 0) == [16, 16, 16] and auto.micro_sizes(0, 0, 1) == [16]
    off = _attached(HeteroBatching(speeds=[3, 1], memory_caps=[16, 64], accumulate="off"))
    assert off.sizes_of(0, 0) == [16, 48] and off.micro_sizes(0, 0, 0) == [16]  # today's: the cap moves samples
    counts = _attached(HeteroBatching(speeds=[3, 1], memory_caps=[12, 64], accumulate=[2, 1]))
    assert counts.sizes_of(0, 0) == [24, 40]  # at most count x cap: 2 x 12
    assert counts.micro_sizes(0, 0, 0) == [12, 12] and counts.micro_sizes(0, 0, 1) == [40]
    free = _attached(HeteroBatching(batch_sizes=[48, 16], accumulate=[4, 1]))
    assert free.micro_sizes(0, 0, 0) == [12, 12, 12, 12]
    assert HeteroBatching().accumulate == "off" and not HeteroBatching().accumulates  # no cap: nothing to cut
    assert HeteroBatching(max_batch_size=32).accumulate == "auto"


def test_bad_accumulate_settings_are_named_before_any_rank_starts():
    for kwargs, match in (({"accumulate": [1, 0]}, r"accumulate=\[1, 0\]: every per-rank count"),
                          ({"accumulate": "sometimes"}, r"accumulate='sometimes': use 'auto'"),
                          ({"accumulate": [1.5, 1]}, "must be an int >= 1"),
                          ({"accumulate": [1, 2], "elastic": True, "global_batch_size": 64}, "accumulate"),):
        with pytest.raises(ValueError, match=match):
            HeteroBatching(**kwargs)
    with pytest.raises(ValueError, match=r"hetero.accumulate=\[1, 3\] has 2 entries for 3 ranks"):
        HeteroBatching(accumulate=[1, 3]).check_world(3)


def test_manual_optimization_turns_auto_off_and_refuses_counts():
    auto = HeteroBatching(memory_caps=[16, 64])
    assert "becomes 'off'" in auto.without_micro_batches() and auto.accumulate == "off"
    assert HeteroBatching().without_micro_batches() is None  # nothing to change
    with pytest.raises(ValueError, match=r"accumulate=\[1, 3\] needs automatic optimization"):
        HeteroBatching(accumulate=[1, 3]).without_micro_batches()
