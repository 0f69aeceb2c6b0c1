"""Every random generator a rank draws from, captured and restored, so a resumed run draws what an
uninterrupted one would have (Lightning saves none of them). Python's, NumPy's and torch's CPU and CUDA
generators; NumPy's state is kept as a tensor so checkpoints still load with ``weights_only=True``.

CUDA: a rank's state is its own device's generator only (``torch.cuda.current_device()``, which the strategy sets to
the rank's local device), never every visible GPU's: after an elastic restart the mapped rank may sit on another
local device, or see fewer GPUs, and restoring "all" would hand it a neighbour's generator (or raise IndexError).

A checkpoint holds every rank's (:func:`checkpoint_entry`, under :data:`RNG_KEY`), and each rank restores its own
(:func:`restore_entry`): Lightning writes a checkpoint from rank zero only.
"""

from __future__ import annotations

import random
import warnings
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist

from lightning_dist.identities import map_ranks

RNG_KEY = "lightning_dist_rng"  # the checkpoint's entry: {"world_size": N, "ranks": [state or None per rank]}


def capture() -> dict[str, Any]:
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    version, internal, gauss = random.getstate()
    state = {
        "python": [version, list(internal), gauss],
        "numpy": [kind, torch.from_numpy(np.asarray(keys, dtype=np.int64)), int(pos), int(has_gauss), float(cached)],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()  # the current device's (this rank's) generator only
    return state


def restore(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        saved = state["cuda"]
        if isinstance(saved, (list, tuple)):  # written before: every visible device's; this rank's is its device's
            index = torch.cuda.current_device()
            if index >= len(saved):
                return
            saved = saved[index]
        torch.cuda.set_rng_state(saved)  # onto the current device (this rank's), wherever it was saved


def checkpoint_entry(rank: int, world_size: int, gather: bool, group: Optional[dist.ProcessGroup] = None,
                     identities: Optional[list[str]] = None) -> dict:
    """The checkpoint's :data:`RNG_KEY` entry: every rank's generators, gathered over ``group`` (every rank is dumping
    the same checkpoint), or with ``gather=False`` this rank's alone (an emergency write, or one rank); in an elastic
    run with every rank's node identity."""
    mine = capture()
    ranks: list[Any] = [None] * world_size
    if gather:
        dist.all_gather_object(ranks, mine, group=group)
    else:
        ranks[rank] = mine
    return {"world_size": world_size, "ranks": ranks, "identities": identities}


def restore_entry(entry: dict, rank: int, world_size: int, identities: Optional[list[str]] = None) -> bool:
    """Restore this rank's generators from a :func:`checkpoint_entry`; False, with a warning, when it has none (in an
    elastic run, ``identities`` given: the generators of the old rank with this rank's identity, silently; the
    elastic callback says what was lost)."""
    if identities is not None and entry.get("identities"):
        old = map_ranks(entry["identities"], identities)[rank]
        if old is None or entry["ranks"][old] is None:
            return False
        restore(entry["ranks"][old])
        return True
    if entry["world_size"] != world_size or entry["ranks"][rank] is None:
        warnings.warn(f"rank {rank}: the checkpoint holds no random-generator state for this rank (written by "
                      f"{entry['world_size']} ranks, or an emergency checkpoint of another rank): its generators "
                      "continue from the seed, so the run is not bit-identical to an uninterrupted one", stacklevel=3)
        return False
    restore(entry["ranks"][rank])
    return True
