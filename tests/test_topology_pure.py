"""Two-tier grouping without ranks (issue 24's first piece): which ranks form which groups for a range of hosts x
ranks per host, in any rank order, and what "auto" chooses; uneven hosts refused with the counts."""

from __future__ import annotations

import pytest

from lightning_dist.comm.topology import resolve_topology


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
