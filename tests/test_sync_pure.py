"""DiLoCo's settings, its refusals and its outer step on one process (no launched ranks)."""

from __future__ import annotations

import pytest
import torch

from lightning_dist import RingDDPStrategy
from lightning_dist.comm.topology import resolve_topology
from lightning_dist.memory.estimate import CommSetup, estimate_memory
from lightning_dist.sync import DiLoCo, as_sync
from lightning_dist.sync.diloco import DiLoCoSync, Workers, _buckets


@pytest.mark.parametrize("bad, words", [
    ({"every": 0}, "every=0"), ({"every": 2.5}, "every=2.5"), ({"every": True}, "every=True"),
    ({"outer_lr": 0}, "outer_lr=0"), ({"outer_lr": float("nan")}, "outer_lr=nan"),
    ({"outer_momentum": 1.0}, "outer_momentum=1.0"), ({"outer_momentum": -0.1}, "outer_momentum=-0.1"),
    ({"compressor": "zip"}, "zip"),
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
    assert tiers.ranks == ((0, 1), (2, 3)) and tiers.index == 1 and tiers.mine == (2, 3) and tiers.local_index == 1
    assert Workers.of(None, 1, 0).ranks == ((0,),)


def test_workers_weigh_by_the_samples_they_processed_since_the_sync():
    sync = DiLoCoSync(DiLoCo(every=2), Workers(((0, 1), (2, 3)), rank=2), "auto", None)
    sync.bind(torch.nn.Linear(2, 2))
    assert sync.weight() == 0.5  # nothing counted: even batches
    sync.count_samples([14, 6, 4, 8])
    sync.count_samples([14, 6, 4, 8])
    assert sync.samples == [40.0, 24.0] and sync.weight() == 24 / 64


def test_buckets_keep_the_modules_order_and_split_at_the_cap(monkeypatch):
    monkeypatch.setattr("lightning_dist.sync.diloco.BUCKET_BYTES", 4 * 300)
    model = torch.nn.Sequential(torch.nn.Linear(10, 20), torch.nn.Linear(20, 5))  # 220 and 105 parameters
    buckets = _buckets(list(model.named_parameters()), parts=1, local_index=0)
    assert [b.layout.names for b in buckets] == [("0.weight", "0.bias"), ("1.weight", "1.bias")]
    assert [b.index for b in buckets] == [[0, 1], [2, 3]]
    halves = _buckets(list(model.named_parameters()), parts=2, local_index=1)
    assert halves[0].plan.layout.names == ("0.weight#1/2", "0.bias#1/2")


def _bound(settings, module):
    sync = DiLoCoSync(settings, Workers(((0,),), rank=0), "auto", None)
    sync.bind(module)
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
            for r, p in zip(reference, model.parameters()):
                r.grad = r - p
        outer.step()
        result, = sync.after_step(step=cycle + 1)
        assert not result.skipped and result.bytes_sent == 0
        for r, p in zip(reference, model.parameters()):
            assert torch.equal(r, p)
    assert sync.metrics["sync/outer_steps"] == 3


def test_outer_lr_one_without_momentum_takes_the_workers_parameters():
    model = torch.nn.Linear(3, 2)
    sync = _bound(DiLoCo(every=1, outer_lr=1.0, outer_momentum=0.0), model)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(2.0)
    moved = [p.detach().clone() for p in model.parameters()]
    sync.after_step(step=1)
    assert all(torch.equal(a, b) for a, b in zip(moved, model.parameters()))


def test_a_non_finite_worker_skips_and_restarts_from_theta_global():
    model = torch.nn.Linear(3, 2)
    before = [p.detach().clone() for p in model.parameters()]
    sync = _bound(DiLoCo(every=1), model)
    with torch.no_grad():
        model.weight[1, 2] = float("nan")
    result, = sync.after_step(step=1)
    assert result.skipped and result.bad_workers == [0] and sync.skipped == 1 and sync.outer_steps == 0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_state_dict_round_trip_restores_theta_global_and_momentum():
    model = torch.nn.Linear(3, 2)
    sync = _bound(DiLoCo(every=1), model)
    with torch.no_grad():
        model.weight.add_(1.0)
    sync.after_step(step=1)
    state = sync.state_dict()
    assert set(state["momentum"]) == {"weight", "bias"}
    other_model = torch.nn.Linear(3, 2)
    other = _bound(DiLoCo(every=1), other_model)
    other.load_state_dict(state)
    assert other.outer_steps == 1
    assert torch.equal(other._global[0], sync._global[0])
    assert torch.equal(other._outer.state[other._global[0]]["momentum_buffer"],
                       sync._outer.state[sync._global[0]]["momentum_buffer"])
    with pytest.raises(ValueError, match="same DiLoCo settings"):
        _bound(DiLoCo(every=2), torch.nn.Linear(3, 2)).load_state_dict(state)


def test_memory_counts_two_parameter_copies_and_the_exchange():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8))
    sync = _bound(DiLoCo(every=1), model)
    params = sum(p.numel() * 4 for p in model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    assert sync.memory_bytes() == 3 * params + buffers  # theta_global, momentum, the flat bucket
    est = estimate_memory(model, [], CommSetup(sync_bytes=sync.memory_bytes()))
    assert est.parts["sync_state"] == sync.memory_bytes() and "theta_global" in est.notes["sync_state"]
    assert "sync_state" not in estimate_memory(model, [], CommSetup()).parts


def test_buffers_are_kept_and_restored_at_a_skip():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    sync = _bound(DiLoCo(every=1), model)
    model.train()
    model(torch.randn(8, 4))  # running statistics move
    moved = model[1].running_mean.clone()
    sync.after_step(step=1)  # one worker: the mean over workers is its own
    assert torch.equal(model[1].running_mean, moved)
    with torch.no_grad():
        model[0].weight[0, 0] = float("inf")
    model(torch.randn(8, 4))
    sync.after_step(step=2)  # skipped: the buffers of the last sync come back
    assert torch.equal(model[1].running_mean, moved)
