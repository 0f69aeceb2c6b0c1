"""Two-tier reduction without ranks: which ranks form which groups for a range of hosts x ranks per host, in any
rank order, and what "auto" chooses (uneven hosts refused with the counts); how a bucket is cut into a host's parts
and put back; the strategy's refusals before any process starts."""

from __future__ import annotations

from itertools import pairwise

import lightning.pytorch as pl
import pytest
import torch

from lightning_dist import RingDDPStrategy
from lightning_dist.comm.topology import resolve_topology, state_layout
from lightning_dist.compression import BucketLayout
from lightning_dist.compression.parts import PartPlan

LAYOUT = BucketLayout.of([("fc2.bias", (5,)), ("fc2.weight", (5, 32)), ("scale", ()), ("fc1.weight", (32, 3, 3)),
                          ("emb", (2, 100))])


@pytest.mark.parametrize("hosts,per_host", [(2, 2), (2, 4), (3, 2), (4, 8), (2, 1), (1, 4)])
def test_groups_cover_every_rank_once_per_tier(hosts, per_host):
    node_ranks = [r // per_host for r in range(hosts * per_host)]
    topology = resolve_topology("auto", node_ranks)
    intra = topology.intra_groups()
    assert intra == [list(range(h * per_host, (h + 1) * per_host)) for h in range(hosts)]
    if hosts >= 2 and per_host >= 2:
        assert topology.kind == "two_tier"
        inter = topology.inter_groups()
        assert inter == [[h * per_host + i for h in range(hosts)] for i in range(per_host)]
        assert sorted(r for group in inter for r in group) == list(range(hosts * per_host))
        assert all(topology.local_index(r) == r % per_host for r in range(hosts * per_host))
    else:
        assert topology.kind == "flat" and topology.inter_groups() == []


def test_ranks_numbered_across_hosts_still_group_by_host():
    topology = resolve_topology("two_tier", [0, 1, 0, 1])  # round-robin numbering
    assert topology.intra_groups() == [[0, 2], [1, 3]]
    assert topology.inter_groups() == [[0, 1], [2, 3]]


def test_uneven_or_single_hosts_are_refused_for_two_tier_and_flat_under_auto():
    with pytest.raises(ValueError, match=r"hosts have \[2, 1\] ranks"):
        resolve_topology("two_tier", [0, 0, 1])
    with pytest.raises(ValueError, match="at least 2 hosts"):
        resolve_topology("two_tier", [0, 0])
    auto = resolve_topology("auto", [0, 0, 1])
    assert auto.kind == "flat" and "uneven" in auto.reason
    assert resolve_topology("flat", [0, 0, 1, 1]).kind == "flat"
    with pytest.raises(ValueError, match="topology='ring'"):
        resolve_topology("ring", [0, 1])


@pytest.mark.parametrize("parts", [1, 2, 3, 4, 8])
def test_split_cuts_every_parameter_by_rows_and_names_slices_by_parameter(parts):
    split = LAYOUT.split(parts)
    covered = sorted(span for _, spans in split for span in spans)
    assert covered[0][0] == 0 and covered[-1][1] == LAYOUT.numel
    assert all(a[1] == b[0] for a, b in pairwise(covered))  # every element once
    for i, (layout, spans) in enumerate(split):
        assert all(name.endswith(f"#{i}/{parts}") for name in layout.names)
        assert [b - a for a, b in spans] == layout.sizes()
        for name, shape in zip(layout.names, layout.shapes, strict=True):
            full = dict(zip(LAYOUT.names, LAYOUT.shapes, strict=True))[name.split("#")[0]]
            if len(full) >= 1 and full[0] >= parts:  # a row block: PowerSGD still sees a matrix
                assert tuple(shape[1:]) == tuple(full[1:])
            else:
                assert len(shape) == 1
    lengths = [layout.numel for layout, _ in split]
    assert max(lengths) - min(lengths) <= 5 * 32  # at most a row of each parameter apart


def test_split_does_not_depend_on_the_buckets_order():
    reordered = BucketLayout.of([(n, s) for n, s in reversed(list(zip(LAYOUT.names, LAYOUT.shapes, strict=True)))])
    for (a, _), (b, _) in zip(LAYOUT.split(3), reordered.split(3), strict=True):
        assert dict(zip(a.names, a.shapes, strict=True)) == dict(zip(b.names, b.shapes, strict=True))


@pytest.mark.parametrize("parts", [2, 3, 4])
def test_a_plan_rearranges_the_bucket_part_by_part_and_back(parts):
    bucket = torch.arange(LAYOUT.numel, dtype=torch.float32)
    plans = [PartPlan.of(LAYOUT, parts, i) for i in range(parts)]
    plan = plans[0]
    zeros = torch.zeros(plan.pad)
    arranged = torch.cat([bucket[a:b] if a >= 0 else zeros[:b] for a, b in plan.gather])
    assert arranged.numel() == plan.width * parts
    for i, (layout, spans) in enumerate(LAYOUT.split(parts)):
        mine = arranged[i * plan.width: (i + 1) * plan.width]
        assert plans[i].layout == layout and plans[i].length == layout.numel
        assert torch.equal(mine[: layout.numel], torch.cat([bucket[a:b] for a, b in spans]))
        assert not mine[layout.numel:].any()  # padding
    back = torch.cat([arranged[a:b] for a, b in plan.scatter])
    assert torch.equal(back, bucket)


def test_state_layout_names_what_per_rank_state_belongs_to():
    assert state_layout(None) == "flat"
    assert state_layout(resolve_topology("flat", [0, 0, 1, 1])) == "flat"
    assert state_layout(resolve_topology("auto", [0, 0, 0, 1, 1, 1])) == "two_tier/3"


def test_the_strategy_refuses_a_bad_topology_before_any_process_starts():
    with pytest.raises(ValueError, match="topology='ring'; use one of auto, flat, two_tier"):
        RingDDPStrategy(topology="ring")
    with pytest.raises(ValueError, match=r"topology='two_tier' needs at least 2 nodes, and Trainer\(num_nodes=1\)"):
        pl.Trainer(accelerator="cpu", devices=2, strategy=RingDDPStrategy(topology="two_tier", start_method="fork"),
                   logger=False)
