"""DiLoCo's settings, its refusals and its outer step on one process (no launched ranks)."""

from __future__ import annotations

import pytest
import torch

from lightning_dist import RingDDPStrategy
from lightning_dist.comm.topology import resolve_topology
from lightning_dist.hetero import HeteroBatching
from lightning_dist.memory.estimate import CommSetup, estimate_memory
from lightning_dist.sync import DiLoCo, as_sync
from lightning_dist.sync.diloco import DiLoCoSync
from lightning_dist.sync.diloco_fragments import Workers, fragment_cut, inner_steps
from lightning_dist.sync.diloco_fragments import fragment_buckets as _buckets


@pytest.mark.parametrize("bad, words", [
    ({"every": 0}, "every=0"), ({"every": 2.5}, "every=2.5"), ({"every": True}, "every=True"),
    ({"outer_lr": 0}, "outer_lr=0"), ({"outer_lr": float("nan")}, "outer_lr=nan"),
    ({"outer_momentum": 1.0}, "outer_momentum=1.0"), ({"outer_momentum": -0.1}, "outer_momentum=-0.1"),
    ({"compressor": "zip"}, "zip"),
    ({"final_sync": "yes"}, "final_sync='yes'"), ({"final_sync": 1}, "sync.final_sync=true or false"),
    ({"validate": "best"}, "validate='best'"), ({"validate": None}, "sync.validate=mean, global or worker"),
    ({"warmup": -1}, "warmup=-1"), ({"warmup": 0.2}, "sync.warmup=100"), ({"warmup": True}, "warmup=True"),
])
def test_bad_settings_are_refused_naming_the_value(bad, words):
    with pytest.raises(ValueError, match=words.replace(".", r"\.").replace("(", r"\(")):
        DiLoCo(**bad)


def test_sync_takes_none_a_name_a_dict_or_settings():
    assert as_sync(None) is None and as_sync("every_step") is None
    assert as_sync({"name": "every_step"}) is None
    assert as_sync("diloco").describe() == DiLoCo().describe()
    made = as_sync({"name": "diloco", "every": 50, "compressor": "int8"})
    assert made.every == 50 and made.compressor.describe().startswith("int8")
    assert as_sync({"every": 7}).every == 7
    settings = DiLoCo(every=3)
    assert as_sync(settings) is settings


@pytest.mark.parametrize("bad, words", [
    ("sometimes", "sync='sometimes'"), ({"name": "every_step", "every": 5}, "pick sync=diloco"),
    ({"every": 5, "outer": 1}, r"no setting\(s\) \['outer'\]"), ({"name": "local_sgd"}, "name must be one of"),
    (3, "sync=3"),
])
def test_bad_sync_is_refused_naming_the_fix(bad, words):
    with pytest.raises(ValueError, match=words):
        as_sync(bad)


def test_a_per_step_compressor_beside_diloco_is_refused_naming_sync_compressor():
    with pytest.raises(ValueError, match="sync.compressor=topk"):
        RingDDPStrategy(sync=DiLoCo(every=5), compressor="topk")
    assert RingDDPStrategy(sync={"every": 5}, compressor=None).sync.every == 5
    assert RingDDPStrategy().sync is None and RingDDPStrategy(sync="every_step").sync is None


def test_workers_are_ranks_under_flat_and_hosts_under_two_tier():
    flat = Workers.of(resolve_topology("flat", [0, 0, 1, 1]), 4, 2)
    assert flat.ranks == ((0,), (1,), (2,), (3,)) and flat.index == 2 and flat.local_size == 1
    tiers = Workers.of(resolve_topology("two_tier", [0, 0, 1, 1]), 4, 3)
    assert tiers.ranks == ((0, 1), (2, 3)) and tiers.index == 1
    assert tiers.local_ranks == (2, 3) and tiers.local_index == 1
    assert Workers.of(None, 1, 0).ranks == ((0,),)


def test_workers_weigh_by_the_samples_they_processed_since_the_sync():
    sync = DiLoCoSync(DiLoCo(every=2), Workers(((0, 1), (2, 3)), rank=2), "auto", None)
    sync.attach(torch.nn.Linear(2, 2))
    assert sync.weight() == 0.5  # nothing counted: even batches
    sync.count_samples([14, 6, 4, 8])
    sync.count_samples([14, 6, 4, 8])
    assert sync.samples == [40.0, 24.0] and sync.weight() == 24 / 64


def test_buckets_keep_the_modules_order_and_split_at_the_cap(monkeypatch):
    monkeypatch.setattr("lightning_dist.sync.buckets.BUCKET_BYTES", 4 * 300)
    model = torch.nn.Sequential(torch.nn.Linear(10, 20), torch.nn.Linear(20, 5))  # 220 and 105 parameters
    buckets = _buckets(list(model.named_parameters()), parts=1, local_index=0)
    assert [b.layout.names for b in buckets] == [("0.weight", "0.bias"), ("1.weight", "1.bias")]
    assert [b.index for b in buckets] == [[0, 1], [2, 3]]
    halves = _buckets(list(model.named_parameters()), parts=2, local_index=1)
    assert halves[0].plan.layout.names == ("0.weight#1/2", "0.bias#1/2")


def _bound(settings, module):
    sync = DiLoCoSync(settings, Workers(((0,),), rank=0), "auto", None)
    sync.attach(module)
    return sync


def test_one_worker_outer_step_is_nesterov_sgd_on_the_pseudo_gradient():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    start = [p.detach().clone() for p in model.parameters()]
    sync = _bound(DiLoCo(every=1, outer_lr=0.7, outer_momentum=0.9), model)
    reference = [s.clone() for s in start]
    outer = torch.optim.SGD(reference, lr=0.7, momentum=0.9, nesterov=True)
    for cycle in range(3):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.1 * (cycle + 1))  # the worker's inner progress
            for r, p in zip(reference, model.parameters(), strict=True):
                r.grad = r - p
        outer.step()
        result, = sync.sync_after(step=cycle + 1)
        assert not result.skipped and result.bytes_sent == 0
        for r, p in zip(reference, model.parameters(), strict=True):
            assert torch.equal(r, p)
    assert sync.metrics["sync/outer_steps"] == 3


# after two syncs theta_global = start + c1 p1 + c2 p2 (p: the workers' progress in each cycle); by hand with
# m = momentum: c1 = lr (1 + m) + lr m^2, c2 = lr (1 + m); 0.7 and 0.9: 1.33 + 0.567 = 1.897 and 1.33
@pytest.mark.parametrize("lr, momentum, c1, c2", [(0.7, 0.9, 1.897, 1.33), (0.5, 0.0, 0.5, 0.5)])
def test_two_outer_steps_match_nesterov_sgd_written_out_by_hand(lr, momentum, c1, c2):
    # The outer step written out here, not through torch.optim (which the sync uses): g = theta_global - theta_w,
    # buf = momentum * buf + g (buf = g at the first step), theta_global -= lr * (g + momentum * buf); without
    # momentum plain SGD, lr * g. The workers' progress differs per element and turns back between the syncs, so
    # a sync that does nothing, that takes the workers' parameters or that keeps no momentum lands elsewhere.
    model = torch.nn.Linear(2, 1)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.0, -2.0]]))
        model.bias.fill_(0.5)
    sync = _bound(DiLoCo(every=1, outer_lr=lr, outer_momentum=momentum), model)
    start = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)  # weight then bias, as named_parameters gives them
    progress = [torch.tensor([0.5, -0.25, 1.0], dtype=torch.float64), torch.tensor([-0.25, 0.75, -0.5],
                                                                                    dtype=torch.float64)]
    theta, buf = start.clone(), None
    for step, moved in enumerate(progress, start=1):
        with torch.no_grad():  # the worker's inner steps since the last sync
            model.weight.add_(moved[:2].view(1, 2).float())
            model.bias.add_(moved[2:].float())
        worker = theta + moved
        g = theta - worker
        buf = g if buf is None else momentum * buf + g
        theta = theta - lr * (g + momentum * buf)
        result, = sync.sync_after(step=step)
        assert not result.skipped and sync.outer_steps == step
        got = torch.cat([model.weight.detach().view(-1), model.bias.detach()]).double()
        held = torch.cat([t.view(-1) for t in sync.outer.theta]).double()
        # float32 parameters against float64 arithmetic: a few ulps of values near 1
        assert torch.allclose(got, theta, rtol=0, atol=1e-6), (step, got, theta)
        assert torch.equal(got, held)  # the worker restarts from theta_global
    p1, p2 = progress
    assert torch.allclose(theta, start + c1 * p1 + c2 * p2, rtol=0, atol=1e-12)
    assert not torch.allclose(theta, start + p1 + p2, atol=1e-3)  # not the workers' own parameters


def test_a_non_finite_worker_skips_and_restarts_from_theta_global():
    model = torch.nn.Linear(3, 2)
    before = [p.detach().clone() for p in model.parameters()]
    sync = _bound(DiLoCo(every=1), model)
    with torch.no_grad():
        model.weight[1, 2] = float("nan")
    result, = sync.sync_after(step=1)
    assert result.skipped and result.bad_workers == [0] and sync.skipped == 1 and sync.outer_steps == 0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_state_dict_round_trip_restores_theta_global_and_momentum():
    model = torch.nn.Linear(3, 2)
    sync = _bound(DiLoCo(every=1), model)
    with torch.no_grad():
        model.weight.add_(1.0)
    sync.sync_after(step=1)
    state = sync.state_dict()
    assert set(state["momentum"]) == {"weight", "bias"}
    other_model = torch.nn.Linear(3, 2)
    other = _bound(DiLoCo(every=1), other_model)
    other.load_state_dict(state)
    assert other.outer_steps == 1
    assert torch.equal(other.outer.theta[0], sync.outer.theta[0])
    assert torch.equal(other.outer.sgd.state[other.outer.theta[0]]["momentum_buffer"],
                       sync.outer.sgd.state[sync.outer.theta[0]]["momentum_buffer"])
    with pytest.raises(ValueError, match="same DiLoCo settings"):
        _bound(DiLoCo(every=2), torch.nn.Linear(3, 2)).load_state_dict(state)


def test_memory_counts_the_parameter_copies_and_the_exchange():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8))
    params = sum(p.numel() * 4 for p in model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    # theta_global, momentum, the flat bucket; validate="mean" (the default) also keeps the workers' mean
    assert _bound(DiLoCo(every=1, validate="global"), model).memory_bytes() == 3 * params + buffers
    sync = _bound(DiLoCo(every=1), model)
    assert sync.memory_bytes() == 4 * params + buffers
    est = estimate_memory(model, [], CommSetup(sync_bytes=sync.memory_bytes()))
    assert est.parts["sync_state"] == sync.memory_bytes() and "theta_global" in est.notes["sync_state"]
    assert "sync_state" not in estimate_memory(model, [], CommSetup()).parts


def test_buffers_are_kept_and_restored_at_a_skip():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    sync = _bound(DiLoCo(every=1), model)
    model.train()
    model(torch.randn(8, 4))  # running statistics move
    moved = model[1].running_mean.clone()
    sync.sync_after(step=1)  # one worker: the mean over workers is its own
    assert torch.equal(model[1].running_mean, moved)
    with torch.no_grad():
        model[0].weight[0, 0] = float("inf")
    model(torch.randn(8, 4))
    sync.sync_after(step=2)  # skipped: the buffers of the last sync come back
    assert torch.equal(model[1].running_mean, moved)


# -- streaming (issue 32): fragments, delay, mix, balance ------------------------------------------------------------
@pytest.mark.parametrize("settings,match", [
    ({"every": 50, "fragments": 4}, r"fragments=4\) with every=50.*divides every.*every=48"),
    ({"every": 10, "fragments": 0}, "int >= 1 that divides every"),
    ({"every": 10, "delay": 10}, r"delay=10\) with every=10: .*\[0, every - 1 = 9\]"),
    ({"every": 10, "delay": -1}, "delay=-1"),
    ({"every": 10, "delay": True}, "delay=True"),
    ({"every": 10, "mix": 0}, r"mix=0\) must be in \(0, 1\]"),
    ({"every": 10, "mix": 1.5}, "mix=1.5"),
    ({"every": 10, "balance": "speed"}, "balance='speed'.*'batches'.*'steps'"),
])
def test_streaming_settings_are_refused_naming_the_fix(settings, match):
    with pytest.raises(ValueError, match=match):
        DiLoCo(**settings)


def test_streaming_settings_describe_themselves_and_part_one_is_unchanged():
    assert DiLoCo(every=50).describe() == "DiLoCo(every=50, outer_lr=0.7, outer_momentum=0.8, compressor=none)"
    assert DiLoCo(every=40, fragments=4, delay=1).describe().endswith("fragments=4, delay=1, mix=0.5)")
    assert DiLoCo(every=40, fragments=4).describe().endswith("fragments=4, delay=0)")  # mix unused without a delay
    assert "balance=steps" in DiLoCo(every=4, balance="steps").describe()
    assert as_sync({"every": 8, "fragments": 2, "delay": 3, "mix": 1.0}).delay == 3
    with pytest.raises(ValueError, match="its settings are every, outer_lr, outer_momentum, compressor, fragments"):
        as_sync({"every": 8, "stagger": 2})
    assert [DiLoCo(every=40, fragments=4).offset(f) for f in range(4)] == [0, 10, 20, 30]


def test_fragments_are_runs_of_whole_parameters_of_about_equal_size_by_name_order():
    sizes = [("embed", 32768), ("b0.qkv", 49152), ("b0.out", 16384), ("b0.up", 65536), ("b0.down", 65536),
             ("b1.qkv", 49152), ("b1.out", 16384), ("b1.up", 65536), ("b1.down", 65536), ("head", 32768)]
    assert fragment_cut(sizes, 1) == [list(range(10))]
    assert fragment_cut(sizes, 2) == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]
    four = fragment_cut(sizes, 4)
    assert [sum(sizes[i][1] for i in f) for f in four] == [98304, 131072, 131072, 98304]
    assert fragment_cut(sizes, 10) == [[i] for i in range(10)]
    # every parameter in exactly one fragment, in order, none empty, whatever F
    for fragments in range(1, 11):
        cut = fragment_cut(sizes, fragments)
        assert [i for f in cut for i in f] == list(range(10)) and all(cut)
    # one huge parameter first: the others still spread over the later fragments
    assert fragment_cut([("big", 1000), ("a", 1), ("b", 1), ("c", 1)], 3) == [[0], [1], [2, 3]]
    with pytest.raises(ValueError, match="fragments <= 4"):
        fragment_cut(sizes[:4], 5)


def test_fragments_follow_the_parameter_names_not_the_bucket_order():
    # the same module built twice: the same cut; buckets (DDP's, rebuilt after the first step) play no part
    module = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 16), torch.nn.Linear(16, 4))
    a = DiLoCoSync(DiLoCo(every=4, fragments=2), Workers(((0,), (1,)), rank=0), "auto", None)
    a.attach(module)
    names = [[a.model.names[i] for i in f.params] for f in a.fragments]
    # 128 + 16 elements, then 256 + 16 + 64 + 4: 1.weight lies mostly past the half (242) and starts the second
    assert names == [["0.weight", "0.bias"], ["1.weight", "1.bias", "2.weight", "2.bias"]]
    assert [f.offset for f in a.fragments] == [0, 2]
    assert a.fragments[1].compressor is not a.fragments[0].compressor  # residuals per fragment
    # which fragment starts after which step: every parameter once per H steps
    starts = {step: a.schedule.starting(step).index for step in range(1, 13) if a.schedule.starting(step) is not None}
    assert starts == {2: 1, 4: 0, 6: 1, 8: 0, 10: 1, 12: 0}


def test_one_worker_delayed_landing_mixes_theta_global_with_the_progress_since_the_start():
    torch.manual_seed(0)
    module = torch.nn.Linear(3, 2)
    sync = DiLoCoSync(DiLoCo(every=2, outer_lr=0.5, outer_momentum=0.0, delay=1, mix=0.5),
                      Workers(((0,),), rank=0), "auto", None)
    sync.attach(module)
    start = [p.detach().clone() for p in module.parameters()]
    with torch.no_grad():
        for p in module.parameters():
            p.add_(1.0)  # the inner steps up to the sync step
    assert sync.sync_after(step=2) == [] and len(sync.inflight) == 1  # started, in flight
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.5)  # the inner step the exchange overlaps
    result, = sync.sync_after(step=3)
    assert not result.skipped and not sync.inflight
    # one worker, outer lr 0.5, no momentum: theta_global moves half way to the worker's value at the start
    # (start + 0.5); the landing: p_now + 0.5 (theta_global - p_at_s) = (start + 1.5) + 0.5 (-0.5) = start + 1.25
    for i, (p, s) in enumerate(zip(module.parameters(), start, strict=True)):
        assert torch.allclose(sync.outer.theta[i], s + 0.5)
        assert torch.allclose(p, s + 1.25)
    sync.close()


def test_inner_steps_follow_the_shares():
    assert inner_steps([8, 8, 8, 4]) == [2, 2, 2, 1]
    assert inner_steps([10, 10]) == [1, 1]
    assert inner_steps([15, 10, 5]) == [3, 2, 1]
    assert inner_steps([14, 10]) == [1, 1]  # 1.4: rounded
    with pytest.raises(ValueError, match="at least one sample"):
        inner_steps([4, 0])


def test_balance_steps_needs_hetero_batching_a_flat_topology_and_no_caps():
    steps = DiLoCo(every=4, balance="steps")
    with pytest.raises(ValueError, match="hetero=HeteroBatching"):
        RingDDPStrategy(sync=steps)
    with pytest.raises(ValueError, match="topology='flat'"):
        RingDDPStrategy(sync=steps, hetero=HeteroBatching(), topology="two_tier")
    with pytest.raises(ValueError, match="memory_caps, max_batch_size"):
        RingDDPStrategy(sync=steps, hetero=HeteroBatching(max_batch_size=8))
    assert RingDDPStrategy(sync=steps, hetero=HeteroBatching()).sync.balance == "steps"


def test_memory_counts_the_snapshots_of_exchanges_in_flight():
    module = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    plain = DiLoCoSync(DiLoCo(every=4, fragments=2), Workers(((0,), (1,)), rank=0), "auto", None)
    plain.attach(module)
    delayed = DiLoCoSync(DiLoCo(every=4, fragments=2, delay=3), Workers(((0,), (1,)), rank=0), "auto", None)
    delayed.attach(module)
    largest = max(sum(delayed.model.params[i].numel() * 4 for i in f.params) for f in delayed.fragments)
    # spacing 2, delay 3: two exchanges in flight at once
    assert delayed.memory_bytes() - plain.memory_bytes() == 2 * largest


def test_the_step_meter_counts_the_inner_steps_after_the_exchange_as_compute(monkeypatch):
    # balance="steps": a faster worker's further inner steps run after the step's exchange; its speed (samples over
    # compute) must cover them, or the plan gives it ever more samples (a runaway measured in the hetero benchmark)
    from lightning_dist.comm import CommStats
    from lightning_dist.strategy.step_meter import StepMeter

    clock = iter([10.0, 11.0, 15.0])  # batch start, first inner step's backward done, step finished
    monkeypatch.setattr("lightning_dist.strategy.step_meter.time.perf_counter", lambda: next(clock))
    meter = StepMeter()
    meter.batch_started(torch.zeros(16, 3))
    meter.backward_done()
    meter.add_compute(1.5)  # the second inner step; the 2.5 s left are the exchange's wait
    meter.step_finished(CommStats(), exposed_s=0.0)
    assert meter.last_step["samples"] == 16 and meter.last_step["compute_s"] == 2.5


def test_the_workers_meet_on_the_loops_thread_only_where_a_sync_runs_in_the_step():
    module = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    steps = range(1, 13)
    synchronous = DiLoCoSync(DiLoCo(every=4, fragments=2), Workers(((0,), (1,)), rank=0), "auto", None)
    synchronous.attach(module)
    assert [s for s in steps if synchronous.meets(s)] == [2, 4, 6, 8, 10, 12]  # every fragment's sync
    delayed = DiLoCoSync(DiLoCo(every=4, fragments=2, delay=1), Workers(((0,), (1,)), rank=0), "auto", None)
    delayed.attach(module)
    assert [s for s in steps if delayed.meets(s)] == [4, 8, 12]  # once per H: the first fragment's start


def test_the_warm_up_averages_every_fragment_after_each_step_then_the_outer_steps_start():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    sync = _bound(DiLoCo(every=4, fragments=2, warmup=3, outer_lr=0.7, outer_momentum=0.9), model)
    assert [s for s in range(1, 13) if sync.due(s)] == [1, 2, 3, 4, 6, 8, 10, 12]  # warm-up, then fragments' offsets
    assert [s for s in range(1, 13) if sync.meets(s)] == [1, 2, 3, 4, 6, 8, 10, 12]
    for step in range(1, 7):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.1 * step)  # the worker's inner progress
            moved = [p.detach().clone() for p in model.parameters()]
        results = sync.sync_after(step=step)
        if step <= 3:  # one worker: its parameters are the mean, taken whole, and no momentum is built
            assert [r.fragment for r in results] == [0, 1] and not sync.outer.sgd.state
            assert all(torch.equal(m, p) for m, p in zip(moved, model.parameters(), strict=True))
            reference = [m.clone() for m in moved]
            outer = torch.optim.SGD(reference, lr=0.7, momentum=0.9, nesterov=True)
        elif step in (4, 6):  # fragment 0 (offset 0), then fragment 1 (offset 2), each on its partial cycle
            (result,) = results
            index = sync.fragments[result.fragment].params
            with torch.no_grad():
                for i, (r, m) in enumerate(zip(reference, moved, strict=True)):
                    r.grad = (r - m) if i in index else None
            outer.step()
            for i, (r, p) in enumerate(zip(reference, model.parameters(), strict=True)):
                assert torch.equal(r, p) if i in index else not torch.equal(r, p)
        else:
            assert results == []
    assert [sync.fragments[0].params, sync.fragments[1].params] == [[0], [1, 2, 3]]  # both checked above
    assert sync.outer_steps == 3 * 2 + 2
    # with a delay the warm-up syncs in its steps all the same, and the first exchange in flight starts after it
    delayed = _bound(DiLoCo(every=4, fragments=2, delay=1, warmup=3), model)
    assert [s for s in range(1, 13) if delayed.meets(s)] == [1, 2, 3, 4, 8, 12]
    assert [len(delayed.sync_after(step=s)) for s in range(1, 8)] == [2, 2, 2, 0, 1, 0, 1]
    assert [ex.lands for ex in delayed.inflight] == [] and delayed.outer_steps == 8


def test_a_fit_that_ends_in_its_warm_up_has_nothing_left_to_sync():
    model = torch.nn.Linear(3, 2)
    sync = _bound(DiLoCo(every=4, warmup=5), model)
    with torch.no_grad():
        model.weight.add_(1.0)
    assert len(sync.sync_after(step=2)) == 1
    assert sync.final_sync(step=2) == [] and sync.outer_steps == 1


def test_warm_up_describes_itself():
    assert DiLoCo(every=50, warmup=100).describe().endswith("compressor=none, warmup=100)")
    assert "warmup" not in DiLoCo(every=50).describe()


# -- the end of a fit and validation (issue 43) ----------------------------------------------------------------------
def test_the_final_sync_averages_the_workers_over_the_partial_cycle_and_leaves_theta_global():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    sync = _bound(DiLoCo(every=4, outer_lr=0.7, outer_momentum=0.9), model)
    model.train()
    model(torch.randn(8, 4))  # the buffers move
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1)  # three steps of a cycle of four
    moved = [t.detach().clone() for t in (*model.parameters(), *model.buffers())]
    result, = sync.final_sync(step=3)
    assert not result.skipped and sync.outer_steps == 1 and not sync.outer.sgd.state  # no outer step: no momentum
    # one worker: the mean is its own model (an outer step at 0.7 / 0.9 would have gone 1.33x the pseudo-gradient)
    assert all(torch.equal(m, t) for m, t in zip(moved, (*model.parameters(), *model.buffers()), strict=True))
    assert all(torch.equal(p, g) for p, g in zip(model.parameters(), sync.outer.theta, strict=True))
    # a last step whose sync ran before the fit's end was known (a stop a callback sets): nothing more to sync
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1)
    assert len(sync.sync_after(step=4)) == 1 and sync.final_sync(step=4) == [] and sync.outer_steps == 2


def test_validating_the_global_model_restores_the_workers_own_bit_for_bit():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    sync = _bound(DiLoCo(every=4, validate="global"), model)
    model.train()
    model(torch.randn(8, 4))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) / 3)
    own = [t.clone() for t in (*model.parameters(), *model.buffers())]
    sync.swap_in_validated()
    assert all(torch.equal(p, g) for p, g in zip(model.parameters(), sync.outer.theta, strict=True))
    assert torch.equal(model[1].running_mean, torch.zeros(3))  # the averaged buffers: the start's
    assert set(sync.worker_tensors()) == {"0.weight", "0.bias", "1.weight", "1.bias", "1.running_mean", "1.running_var",
                                     "1.num_batches_tracked"}
    sync.swap_back()
    assert all(torch.equal(a, b) for a, b in zip(own, (*model.parameters(), *model.buffers()), strict=True))
    assert sync.worker_tensors() == {}


def test_validate_mean_keeps_the_workers_mean_at_each_sync_not_the_outer_steps_model():
    model = torch.nn.Linear(4, 3)
    sync = _bound(DiLoCo(every=2), model)  # one worker: the workers' mean is its own parameters at the sync
    assert all(torch.equal(m, p) for m, p in zip(sync.outer.mean, model.parameters(), strict=True))  # before any
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.25)
    at_sync = [p.detach().clone() for p in model.parameters()]
    sync.sync_after(step=2)  # an outer step of lr 0.7 and Nesterov momentum 0.8: 0.7 * 1.8 of the way, not 1
    assert all(torch.allclose(m, a) for m, a in zip(sync.outer.mean, at_sync, strict=True))
    assert all(torch.allclose(g - (a - 0.25), 1.26 * 0.25 * torch.ones_like(g))
               for g, a in zip(sync.outer.theta, at_sync, strict=True))
    sync.swap_in_validated()
    assert all(torch.equal(p, m) for p, m in zip(model.parameters(), sync.outer.mean, strict=True))
    sync.swap_back()
    assert all(torch.equal(p, g) for p, g in zip(model.parameters(), sync.outer.theta, strict=True))


# -- DiLoCo(inner_rate=...): the outer step's answer to the inner learning rate ---------------------------------------
def test_the_inner_rate_is_read_from_the_optimizers_groups_weighted_by_their_elements():
    from lightning_dist.sync.diloco_driver import inner_rate

    big, small = torch.nn.Linear(8, 8), torch.nn.Linear(2, 1)  # 72 and 3 elements
    optimizer = torch.optim.AdamW([{"params": big.parameters(), "lr": 1e-3},
                                   {"params": small.parameters(), "lr": 4e-3}])
    assert inner_rate([optimizer]) == pytest.approx((72 * 1e-3 + 3 * 4e-3) / 75)
    assert inner_rate([]) == 0.0
    # a schedule the user writes in configure_optimizers sets the groups' lr, which is all it reads
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5 ** step)
    optimizer.step()
    scheduler.step()
    assert inner_rate([optimizer]) == pytest.approx((72 * 0.5e-3 + 3 * 2e-3) / 75)


def test_rise_is_the_default_and_the_settings_line_names_another_rule():
    assert DiLoCo().inner_rate == "rise"
    assert DiLoCo(every=50).describe() == DiLoCo(every=50, inner_rate="rise").describe()
    assert "inner_rate" not in DiLoCo(every=50).describe()  # the default's line as before
    assert DiLoCo(every=50, inner_rate="none").describe().endswith("compressor=none, inner_rate=none)")


def _two_syncs(rule, rates=(2e-3, 1e-3)):
    """A worker of one rank moved by 0.25, then by 0.1, each cycle of 2 steps at ``rates``' rate; the outer
    optimizer's group after each sync and theta_global at the end."""
    model = torch.nn.Linear(3, 1)
    start = [p.detach().clone() for p in model.parameters()]
    sync = _bound(DiLoCo(every=2, inner_rate=rule), model)
    seen = []
    for move, rate, step in zip((0.25, 0.1), rates, (2, 4), strict=True):
        with torch.no_grad():
            for p in model.parameters():
                p.sub_(move)
        sync.count_rate(rate)
        sync.count_rate(rate)
        sync.sync_after(step=step)
        group = sync.outer.sgd.param_groups[0]
        seen.append((group["lr"], group["momentum"]))
    return seen, [g - s for g, s in zip(sync.outer.theta, start, strict=True)], sync


def test_each_inner_rate_rule_against_its_arithmetic():
    # Nesterov SGD by hand: b1 = d1, step1 = lr (d1 + m b1); b2 = m b1 + d2, step2 = lr (d2 + m b2); d = the
    # pseudo-gradient (0.25, then 0.1 of the way back)
    def moved(lrs, momenta, scale=1.0):
        b1 = 0.25
        first = lrs[0] * (0.25 + momenta[0] * b1)
        b2 = momenta[1] * b1 * scale + 0.1
        return -(first + lrs[1] * (0.1 + momenta[1] * b2))

    cases = {"none": ((0.7, 0.7), (0.8, 0.8), 1.0), "normalised": ((0.7, 0.7), (0.8, 0.8), 0.5),
             "follow": ((0.7, 0.35), (0.8, 0.8), 1.0), "anneal": ((0.7, 0.85), (0.8, 0.4), 1.0),
             "rise": ((0.7, 1.0), (0.8, 0.8), 1.0)}  # 0.7 / 0.5 = 1.4, at most 1
    for rule, (lrs, momenta, scale) in cases.items():
        seen, moves, _ = _two_syncs(rule)
        assert [lr for lr, _ in seen] == pytest.approx(list(lrs)), rule
        assert [m for _, m in seen] == pytest.approx(list(momenta)), rule
        assert all(torch.allclose(d, torch.full_like(d, moved(lrs, momenta, scale))) for d in moves), rule
    # a rate that rises (a warm-up) leaves every rule at its set outer rate and momentum
    for rule in cases:
        seen, moves, _ = _two_syncs(rule, rates=(1e-3, 2e-3))
        assert seen == [(0.7, 0.8), (0.7, 0.8)], rule


def test_the_inner_rates_are_kept_in_the_checkpoint():
    _, _, sync = _two_syncs("normalised")
    sync.count_rate(5e-4)
    state = sync.state_dict()
    other = _bound(DiLoCo(every=2, inner_rate="normalised"), torch.nn.Linear(3, 1))
    other.load_state_dict(state)
    assert (other.outer.rates, other.outer.peak_rate) == ({0: 1e-3}, 2e-3)
    assert (other.fragments[0].rate_sum, other.fragments[0].rate_steps) == (5e-4, 1)
    with pytest.raises(ValueError, match="same DiLoCo settings"):  # the rule is part of the settings a resume matches
        _bound(DiLoCo(every=2), torch.nn.Linear(3, 1)).load_state_dict(state)
    with pytest.raises(ValueError, match="sync.inner_rate=none"):
        DiLoCo(inner_rate="cosine")


def test_an_exchange_never_waits_longer_than_it_takes():
    """``sync/waited_s`` <= ``sync/seconds``: a delayed exchange whose reduction took 0.1 ms on the sync's thread, but
    whose end the training loop saw 50 ms into its wait (a thread that started late), counts the wait in its seconds
    (the clean-clone CI once logged a wait 6 us longer than the exchange)."""
    from concurrent.futures import Future
    from threading import Timer
    from types import SimpleNamespace

    from lightning_dist.sync.diloco_exchange import Exchange, Exchanges

    fragment = SimpleNamespace(buckets=[], index=0, compressor=SimpleNamespace(commit=lambda: None))
    exchange = Exchange(fragment=fragment, step=2, lands=3, samples=[])
    exchange.seconds = exchange.waited = 1e-3  # the main thread's part
    exchange.future = Future()

    def reduced() -> None:
        exchange.seconds += 1e-4  # what the sync's thread measured of its reduction
        exchange.future.set_result(None)

    exchanges = Exchanges.__new__(Exchanges)  # (settle reads reduced_at alone)
    exchanges.reduced_at = [0]
    Timer(0.05, reduced).start()
    exchanges.settle(exchange)
    assert exchange.waited >= 0.05 and exchange.seconds == exchange.waited
    assert exchange.settled and exchanges.reduced_at == [2]
