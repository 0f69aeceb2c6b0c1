"""The training DataLoader rebuilt around a :class:`~lightning_dist.hetero.sampler.HeteroBatchSampler`.

``RingDDPStrategy.process_dataloader`` calls :func:`hetero_dataloader` on the training loader only (after
Lightning has put its ``DistributedSampler`` in, whose ``shuffle``, ``seed`` and ``drop_last`` are taken
over); validation and test loaders keep their settings. The user's loader settings are kept: dataset,
``collate_fn``, ``num_workers``, ``pin_memory``, ``worker_init_fn``, ``prefetch_factor``,
``persistent_workers``, ``timeout``, ``multiprocessing_context``, ``generator``. A ``DataLoader`` subclass
is rebuilt as a plain :class:`HeteroDataLoader` (its extra behaviour, if any, is not carried over).

:class:`HeteroDataLoader` is *stateful* in Lightning's sense (``state_dict`` / ``load_state_dict``): a
checkpoint written mid-epoch resumes at the next batch of the same epoch, with the same plan of sizes.
"""

from __future__ import annotations

import os
from typing import Any, Optional, Protocol

from torch.utils.data import DataLoader, DistributedSampler, RandomSampler

from lightning_dist.hetero.plan import BatchPlan
from lightning_dist.hetero.sampler import HeteroBatchSampler


class PlanSource(Protocol):
    """What the loader needs of the batching settings (:class:`~lightning_dist.hetero.HeteroBatching` is one): the
    loader is the mechanism below that policy, so it names only these, never the class."""

    global_batch: int  # B, set by make_plan
    elastic: bool
    identities: Optional[list[str]]

    def make_plan(self, world_size: int, loader_batch_size: int) -> BatchPlan: ...


class HeteroDataLoader(DataLoader):
    """A DataLoader whose batch sampler splits stock DDP's global batches by the plan; resumable mid-epoch (and, with
    elastic batching, at another world size)."""

    identities: Optional[list[str]] = None  # every rank's node identity (elastic runs), saved with the plan
    # DiLoCo under elastic restarts: (first unsynced global batch, the old ranks whose workers were lost), set when
    # the strategy restored its sync; their pieces since then are trained again (HeteroBatchSampler.train_again)
    lost_workers: Optional[tuple[int, list[int]]] = None

    def state_dict(self) -> dict[str, Any]:
        # the batch after the last optimizer step that ended, not the last one started: an emergency checkpoint
        # written inside a step must redo that step's batch
        sampler: HeteroBatchSampler = self.batch_sampler  # type: ignore[assignment]
        epoch, next_batch = sampler.completed
        return {"epoch": epoch, "next_batch": next_batch, "plan": sampler.plan.state_dict(),
                "world_size": sampler.world_size, "identities": self.identities}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        sampler: HeteroBatchSampler = self.batch_sampler  # type: ignore[assignment]
        saved_world = int(state.get("world_size", sampler.world_size))
        if saved_world == sampler.world_size and state.get("identities") == self.identities:
            sampler.plan.load_state_dict(state["plan"])
        elif sampler.elastic:  # the world changed: who is left keeps its weight, a newcomer gets the mean
            lost = self._lost_pieces(state, saved_world) if self.lost_workers else {}
            sampler.plan.carry_over(state["plan"], state.get("identities"), self.identities)
            epoch, first = int(state["epoch"]), int(state["next_batch"])
            sampler.train_again(lost, epoch, first)
            sampler.lost_elsewhere = sorted(i for p, v in lost.items() if p not in sampler.lost for i in v)
        else:
            raise ValueError(f"this checkpoint's training loader ran on {saved_world} ranks, this run has "
                             f"{sampler.world_size}: resuming mid-epoch at another world size needs elastic batching "
                             "(hetero.elastic=true with a fixed hetero.global_batch_size)")
        sampler.resume_at(int(state["epoch"]), int(state["next_batch"]))
        sampler.completed = sampler.consumed = (int(state["epoch"]), int(state["next_batch"]))

    def _lost_pieces(self, state: dict[str, Any], saved_world: int) -> dict[int, list[int]]:
        """What the lost DiLoCo workers trained since the last sync, from the saved (old world's) plan."""
        sampler: HeteroBatchSampler = self.batch_sampler  # type: ignore[assignment]
        since, ranks = self.lost_workers  # type: ignore[misc]
        plan = BatchPlan(saved_world, [1.0] * saved_world, sampler.plan.min_size)
        plan.load_state_dict(state["plan"])
        until = int(state["epoch"]) * sampler.steps_per_epoch + int(state["next_batch"])
        return lost_pieces(sampler, plan, saved_world, ranks, since, until)


def lost_pieces(sampler: HeteroBatchSampler, plan: BatchPlan, old_world: int, lost_ranks: list[int], since: int,
                until: int) -> dict[int, list[int]]:
    """By position, the pieces the old world's ``lost_ranks`` drew for global batches ``since <= p < until``, under
    the old world's ``plan`` (elastic batching: the same blocks of each epoch's permutation at any world size)."""
    old = HeteroBatchSampler(sampler.dataset_size, old_world, 0, sampler.global_batch, plan, shuffle=sampler.shuffle,
                             seed=sampler.seed, drop_last_batch=sampler.drop_last_batch, elastic=True)
    out: dict[int, list[int]] = {}
    orders: dict[int, list[int]] = {}
    for position in range(max(0, since), until):
        epoch, index = divmod(position, old.steps_per_epoch)
        if epoch not in orders:
            old.set_epoch(epoch)
            orders[epoch] = old.global_order()
        sizes = old.sizes(epoch, index)
        out[position] = [i for r in sorted(lost_ranks) for i in old.piece(orders[epoch], sizes, index, r)]
    return out


def hetero_dataloader(dataloader: DataLoader, hetero: PlanSource, world_size: int, rank: int) -> HeteroDataLoader:
    """The training loader with per-rank batch sizes from ``hetero``'s plan."""
    if dataloader.batch_size is None:
        raise ValueError("heterogeneous batching needs a training DataLoader built with batch_size=... (it was given "
                         "a batch_sampler): the global batch is world size x that batch size")
    sampler = dataloader.sampler
    if isinstance(sampler, DistributedSampler):
        shuffle, seed, drop_last = sampler.shuffle, sampler.seed, sampler.drop_last
    else:  # use_distributed_sampler=False, or a single process
        shuffle, seed, drop_last = isinstance(sampler, RandomSampler), int(os.getenv("PL_GLOBAL_SEED", 0)), False
    plan = hetero.make_plan(world_size, dataloader.batch_size)
    batch_sampler = HeteroBatchSampler(len(dataloader.dataset), world_size, rank, hetero.global_batch, plan,
                                       shuffle=shuffle, seed=seed, drop_last=drop_last,
                                       drop_last_batch=dataloader.drop_last, elastic=hetero.elastic)
    kwargs: dict[str, Any] = {
        "num_workers": dataloader.num_workers, "collate_fn": dataloader.collate_fn,
        "pin_memory": dataloader.pin_memory, "timeout": dataloader.timeout,
        "worker_init_fn": dataloader.worker_init_fn, "multiprocessing_context": dataloader.multiprocessing_context,
        "generator": dataloader.generator, "persistent_workers": dataloader.persistent_workers,
        "pin_memory_device": dataloader.pin_memory_device,
    }
    if dataloader.num_workers > 0:
        kwargs["prefetch_factor"] = dataloader.prefetch_factor
    loader = HeteroDataLoader(dataloader.dataset, batch_sampler=batch_sampler, **kwargs)
    loader.identities = list(hetero.identities) if hetero.identities else None
    loader.lost_workers = getattr(hetero, "lost_workers", None)
    return loader


def prefetch_horizon(dataloader: DataLoader) -> int:
    """Batches a loader may have drawn from its sampler ahead of the one training uses: worker prefetch, plus
    the one Lightning's fetcher holds to know which batch is the last, plus one for safety."""
    workers = dataloader.num_workers * (dataloader.prefetch_factor or 2) if dataloader.num_workers > 0 else 0
    return workers + 2
