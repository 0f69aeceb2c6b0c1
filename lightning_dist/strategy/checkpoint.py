"""The compressor's entry in a checkpoint: its description and every rank's state, and how a run restores it.

A lossy compressor's state is per rank (error-feedback residuals, random generators) or shared (step count,
PowerSGD's factors). Lightning writes checkpoints from rank zero only, so :func:`gather_states` brings every
rank's state to rank zero first (one ``all_gather_object`` on the strategy's gloo group), and the entry keeps
them all under ``"lightning_dist"``. An emergency checkpoint, written by one rank while its peers may be gone,
holds that rank's state only (:func:`compressor_entry` with the others None).

On resume, :func:`restore_compressor` loads this rank's own state when the world size matches, and otherwise
the shared part only, with a warning saying what restarts at zero. In an elastic run the entry also names every
rank's node identity (:func:`lightning_dist.identities.node_identity`), and a rank takes the state of the old rank with
its identity at any world size (the elastic callback names what was lost, in one warning for the whole restart).
"""

from __future__ import annotations

import warnings
from typing import Any, Optional

import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_dist.compression import Compressor
from lightning_dist.identities import map_ranks

CHECKPOINT_KEY = "lightning_dist"  # the checkpoint's entry for every rank's compressor state


def compressor_entry(compressor: Compressor, world_size: int, ranks: list[Any],
                     identities: Optional[list[str]] = None, layout: str = "flat") -> dict[str, Any]:
    """What the checkpoint gains: the compressor's description and every rank's state (None: not saved), what that
    state is kept for (``layout``: :func:`lightning_dist.comm.topology.state_layout`), and in an elastic run every
    rank's node identity."""
    return {CHECKPOINT_KEY: {"compressor": {"describe": compressor.describe(), "world_size": world_size,
                                            "ranks": ranks, "identities": identities, "layout": layout}}}


def local_entry(compressor: Compressor, rank: int, world_size: int,
                identities: Optional[list[str]] = None, layout: str = "flat") -> dict[str, Any]:
    """The entry with this rank's state only, and no collective: for an emergency checkpoint. A run resumed from
    it restarts the other ranks' per-rank state (residuals, generators) at zero, unless (elastic runs) they find
    their own in the emergency checkpoints their ranks wrote at the same step."""
    ranks: list[Any] = [None] * world_size
    ranks[rank] = compressor.state_dict()
    return compressor_entry(compressor, world_size, ranks, identities, layout)


def gather_states(compressor: Compressor, world_size: int, group: Optional[dist.ProcessGroup]) -> list[Any]:
    """Every rank's compressor state, in rank order (a collective: every rank calls it)."""
    mine = compressor.state_dict()
    if world_size == 1 or not dist.is_initialized():
        return [mine]
    everyone: list[Any] = [None] * world_size
    dist.all_gather_object(everyone, mine, group=group)
    return everyone


def restore_compressor(compressor: Compressor, checkpoint: dict[str, Any], rank: int, world_size: int,
                       identities: Optional[list[str]] = None, layout: str = "flat") -> None:
    """This rank's compressor state from a checkpoint; what cannot apply starts afresh, with a warning (in an elastic
    run, ``identities`` given: the state of the old rank with this rank's identity, silently). Per-rank state applies
    only under the ``layout`` it was kept for (a two-tier rank's residuals are its host's debt on its part)."""
    saved = (checkpoint.get(CHECKPOINT_KEY) or {}).get("compressor")
    if saved is None:
        if compressor.lossy:
            rank_zero_warn(f"The checkpoint holds no compressor state (it was written by another strategy): "
                           f"{compressor.describe()} starts with zero residuals and fresh factors.")
        return
    if saved["describe"] != compressor.describe():
        rank_zero_warn(f"The checkpoint's compressor was {saved['describe']}, this run's is "
                       f"{compressor.describe()}: its state starts afresh.")
        return
    ranks = saved["ranks"]
    first = next(state for state in ranks if state is not None)  # shared state is the same on every rank
    saved_layout = saved.get("layout", "flat")
    if saved_layout != layout:
        if compressor.lossy:
            rank_zero_warn(f"The checkpoint's compressor state was kept for topology {saved_layout}, this run reduces "
                           f"as {layout}: per-rank state (error-feedback residuals, random generators, PowerSGD's "
                           "factors of part slices) starts afresh; the step count is restored.")
        compressor.load_state_dict(first, shared_only=True)
        return
    if identities is not None and saved.get("identities"):
        old = map_ranks(saved["identities"], identities)[rank]
        if old is not None and ranks[old] is not None:
            compressor.load_state_dict(ranks[old])
        else:
            compressor.load_state_dict(first, shared_only=True)
        return
    if saved["world_size"] == world_size and ranks[rank] is not None:
        compressor.load_state_dict(ranks[rank])
    elif saved["world_size"] == world_size:  # an emergency checkpoint: another rank's state only
        if compressor.lossy:
            warnings.warn(f"rank {rank}: the checkpoint holds another rank's compressor state only (an emergency "
                          "checkpoint): this rank's error-feedback residuals and generators restart at zero; shared "
                          "state (step count, PowerSGD factors) is restored.", stacklevel=3)
        compressor.load_state_dict(first, shared_only=True)
    else:
        rank_zero_warn(f"The checkpoint was written by {saved['world_size']} ranks, this run has {world_size}: "
                       "per-rank compressor state (error-feedback residuals, random generators) starts afresh; "
                       "shared state (step count, PowerSGD factors) is restored.")
        compressor.load_state_dict(first, shared_only=True)
