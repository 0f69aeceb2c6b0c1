"""Which ranks share a host, and the groups a two-tier reduction runs in (pure logic, no process group).

A cluster is two-tier when several ranks share a host (fast local links) and hosts are joined by a slower network.
The hosts are the launcher's nodes: every rank knows its own node rank (torchrun's ``GROUP_RANK``, SLURM's
``SLURM_NODEID``, Lightning's ``node_rank``) and gathers everyone's. From that list :func:`resolve_topology` makes
the same decision on every rank:

- ``"flat"``: every rank alike (today's paths);
- ``"two_tier"``: a reduce-scatter inside each host, a reduction of each part between the ranks of the same local
  index on the other hosts (:meth:`Topology.inter_groups`), an all-gather inside the host
  (:meth:`Topology.intra_groups`). It needs at least 2 hosts and the same number of ranks on each (every local
  index must have a peer on every host); otherwise it is refused, naming the counts;
- ``"auto"``: two_tier where there are at least 2 hosts with at least 2 ranks each and the hosts are even, else
  flat (and why, in :attr:`Topology.reason`).

Ranks need not be numbered host by host: groups are built from the node ranks each rank reports, in rank order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch.distributed as dist

TOPOLOGIES = ("auto", "flat", "two_tier")


@dataclass(frozen=True)
class Topology:
    """The decision, and the groups it implies (global ranks, each list in rank order)."""

    kind: str  # "flat" or "two_tier"
    hosts: tuple[tuple[int, ...], ...]  # the ranks on each host, hosts in order of their node rank
    reason: str = ""  # why "auto" chose what it chose

    @property
    def ranks_per_host(self) -> int:
        return len(self.hosts[0]) if self.hosts else 0

    def intra_groups(self) -> list[list[int]]:
        """One group per host: its ranks (the reduce-scatter and the all-gather inside the host)."""
        return [list(ranks) for ranks in self.hosts]

    def inter_groups(self) -> list[list[int]]:
        """One group per local index ``i``: the ``i``-th rank of every host (the reduction of part ``i``)."""
        if self.kind != "two_tier":
            return []
        return [[ranks[i] for ranks in self.hosts] for i in range(self.ranks_per_host)]

    def local_index(self, rank: int) -> int:
        """``rank``'s place on its host (the part it reduces across hosts)."""
        for ranks in self.hosts:
            if rank in ranks:
                return ranks.index(rank)
        raise ValueError(f"rank {rank} is on no host of {self.hosts}")


def state_layout(topology: Optional[Topology]) -> str:
    """What a compressor's per-rank state is kept for: whole buckets (``"flat"``; also with one rank, ``None``) or one
    of ``L`` parts of each (``"two_tier/L"``). A checkpoint's per-rank state applies only under the same layout."""
    return "flat" if topology is None or topology.kind == "flat" else f"two_tier/{topology.ranks_per_host}"


def agree_topology(requested: str, node_rank: int, world_size: int, group: Optional[dist.ProcessGroup]) -> Topology:
    """Every rank's node rank, gathered over ``group`` (a collective: every rank calls it), and the topology they
    imply (:func:`resolve_topology`): the same decision on every rank."""
    nodes: list[Any] = [None] * world_size
    dist.all_gather_object(nodes, node_rank, group=group)
    return resolve_topology(requested, nodes)


def resolve_topology(requested: str, node_ranks: Sequence[int]) -> Topology:
    """The topology for ranks whose node ranks are ``node_ranks`` (``node_ranks[r]``: rank ``r``'s host)."""
    if requested not in TOPOLOGIES:
        raise ValueError(f"topology={requested!r}: use one of {', '.join(TOPOLOGIES)}")
    if not node_ranks:
        raise ValueError("resolve_topology needs every rank's node rank (an empty list was given)")
    members: dict[int, list[int]] = {}
    for rank, node in enumerate(node_ranks):
        members.setdefault(int(node), []).append(rank)
    hosts = tuple(tuple(members[node]) for node in sorted(members))
    counts = [len(ranks) for ranks in hosts]
    even = len(set(counts)) == 1
    if requested == "flat":
        return Topology("flat", hosts, "asked for")
    if requested == "two_tier":
        if len(hosts) < 2:
            raise ValueError(f"topology=two_tier needs at least 2 hosts; all {len(node_ranks)} ranks are on one: use "
                             "topology=flat (or auto)")
        if not even:
            raise ValueError(f"topology=two_tier needs the same number of ranks on every host; the hosts have "
                             f"{counts} ranks: give each host as many, or use topology=flat (or auto)")
        return Topology("two_tier", hosts, "asked for")
    if len(hosts) < 2:
        return Topology("flat", hosts, "one host")
    if not even:
        return Topology("flat", hosts, f"uneven hosts ({counts} ranks)")
    if counts[0] < 2:
        return Topology("flat", hosts, "one rank per host: nothing to sum inside a host")
    return Topology("two_tier", hosts, f"{len(hosts)} hosts of {counts[0]} ranks")
