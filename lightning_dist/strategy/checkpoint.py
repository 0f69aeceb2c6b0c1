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
from lightning_dist.sync.diloco import DiLoCoSync

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


def worker_state(strategy: Any) -> dict[str, Any]:
    """A rank's (so its DiLoCo worker's) parameters, buffers and inner optimizer states, as Lightning saves rank
    zero's."""
    return {"module": strategy.lightning_module.state_dict(),
            "optimizers": [strategy.optimizer_state(optimizer) for optimizer in strategy.optimizers]}


def sync_entry(diloco: DiLoCoSync, worker_state: Optional[dict[str, Any]], rank: int, world_size: int,
               group: Optional[dist.ProcessGroup], local: bool = False,
               identities: Optional[list[str]] = None) -> dict[str, Any]:
    """DiLoCo's part of the checkpoint (under ``"lightning_dist"``, key ``"sync"``): what every rank holds alike
    (``theta_global``, the outer momentum, the averaged buffers, the reduced sums of exchanges in flight), and per rank
    its compressors' state and, from a worker's first rank, the worker's own parameters, inner optimizer state and
    parameters at the start of each exchange in flight (``worker_state``): mid-cycle, the workers differ, and
    Lightning saves rank zero's alone. A collective on ``group`` (every rank's part goes to rank zero), unless
    ``local`` (an emergency checkpoint: this rank's part only, and exchanges in flight are not waited for). In an
    elastic run ``identities`` (every rank's node identity) let a restart at another size find each survivor's own
    worker (:func:`restore_sync`)."""
    state = diloco.state_dict(settle=not local)  # first: what is in flight is settled (or dropped) here
    if worker_state is not None:
        worker_state = {**worker_state, "inflight": diloco.worker_state()}
    mine = {"rank": diloco.rank_state(), "worker": worker_state}
    ranks: list[Any] = [None] * world_size
    if local or world_size == 1 or not dist.is_initialized():
        ranks[rank] = mine
    else:
        dist.gather_object(mine, ranks if rank == 0 else None, dst=0, group=group)
    return {"state": state, "world_size": world_size, "ranks": ranks, "identities": identities}


def restore_sync(diloco: DiLoCoSync, module: Any, entry: dict[str, Any], rank: int, world_size: int,
                 identities: Optional[list[str]] = None) -> Optional[list[Any]]:
    """This rank's DiLoCo state from :func:`sync_entry`'s output, once the sync is bound: ``theta_global`` and the
    outer momentum, this rank's compressor state and its worker's own parameters; returns the worker's inner
    optimizer states for Lightning to load (None: they are not in the checkpoint, and the worker restarts from
    ``theta_global``, losing its progress since the last sync, with a warning).

    In an elastic run (``identities`` given, and saved in the entry) a worker of one rank takes the state of the old
    rank with its node identity at any world size: a survivor goes on from the inner state it reached, and a newcomer
    starts from ``theta_global`` (silently: it had no progress to lose)."""
    diloco.load_state_dict(entry["state"])
    ranks = entry["ranks"]
    same = entry["world_size"] == world_size and entry["state"]["workers"] == diloco.workers.count
    own: Optional[int] = rank if same else None
    mapped = identities is not None and entry.get("identities") and diloco.workers.local_size == 1
    if mapped:
        own = map_ranks(entry["identities"], identities)[rank]
    if own is not None and ranks[own] is not None:
        diloco.load_rank_state(_rank_part(ranks[own]))
    else:
        first = next((r for r in ranks if r is not None), None)
        diloco.load_rank_state(_rank_part(first), shared_only=True)
    # this rank's own entry (an emergency checkpoint's, or its old rank's), else its worker's first rank's
    candidates = (own,) if mapped else ((rank, diloco.workers.mine[0]) if same else ())
    found = [ranks[r]["worker"] for r in candidates if r is not None and ranks[r] is not None]
    worker = next((w for w in found if w is not None), None)
    if mapped:  # the old ranks whose workers are gone with their progress since the last sync
        new = set(identities or ())
        diloco.lost_workers = [r for r, identity in enumerate(entry["identities"])
                               if identity not in new or ranks[r] is None or ranks[r].get("worker") is None]
    if worker is None and mapped and own is None:  # a newcomer: theta_global is where it starts
        diloco.restart_from_global()
        return None
    if worker is None:
        warnings.warn(f"rank {rank}: the checkpoint holds no parameters of this rank's DiLoCo worker (written by "
                      f"{entry['world_size']} ranks, or an emergency checkpoint of another rank): it restarts from "
                      "theta_global, and its inner progress since the last sync is lost", stacklevel=3)
        diloco.restart_from_global()
        return None
    module.load_state_dict(worker["module"])
    diloco.load_worker_state(worker.get("inflight"))
    return worker["optimizers"]


def _rank_part(saved: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """A rank's entry's own part (:meth:`DiLoCoSync.rank_state`); a checkpoint written before fragments held the one
    compressor's state under ``"compressor"``."""
    if saved is None:
        return None
    return saved["rank"] if "rank" in saved else {"compressors": [saved["compressor"]], "finite": []}
