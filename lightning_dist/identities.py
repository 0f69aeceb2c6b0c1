"""Node identities: a process's place in the cluster, stable across torchrun's restarts, and ranks mapped by them.

torchrun renumbers ranks at every restart, so a rank of the new world finds which rank of the old one it was by a
name that survives the restart (``<node>/<local rank>``). Pure functions on names, imported by every layer that keeps
per-rank state (compressor residuals, random generators, per-rank batch weights) and by
:mod:`lightning_dist.elastic`, which re-exports them beside the rest of elastic training's mechanisms.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping, Sequence
from typing import Optional

NODE_ENV = "LIGHTNING_DIST_NODE"  # a node's name where the host name does not tell nodes apart (containers)


def node_identity(environ: Optional[Mapping[str, str]] = None) -> str:
    """This process's place in the cluster, stable across torchrun's restarts: ``<node>/<local rank>``, the node
    being ``$LIGHTNING_DIST_NODE`` where set, else the host name."""
    env = os.environ if environ is None else environ
    node = env.get(NODE_ENV) or socket.gethostname()
    return f"{node}/{env.get('LOCAL_RANK', '0')}"


def map_ranks(old: Optional[Sequence[str]], new: Sequence[str]) -> list[Optional[int]]:
    """For each rank of the new world, the rank it was in the old one (None: a newcomer, or no identities saved)."""
    if not old:
        return [None] * len(new)
    where = {identity: rank for rank, identity in enumerate(old)}
    return [where.get(identity) for identity in new]
