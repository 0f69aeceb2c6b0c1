"""The training loader's batch sampler under heterogeneous batching: stock DDP's global batches, split unevenly.

Stock DDP with Lightning's ``DistributedSampler`` draws one permutation per epoch (``seed + epoch``), pads it
to a multiple of the world size by repeating its head, deals position ``p`` to rank ``p mod N``, and each
rank's loader cuts batches of ``b``. Global batch ``i`` of an epoch is therefore the contiguous block
``order[i B : (i + 1) B]`` of the padded permutation (``B = N b``), whichever rank computes which sample.

:class:`HeteroBatchSampler` yields, on rank ``r``, the ``r``-th piece of that same block cut by the
:class:`~lightning_dist.hetero.plan.BatchPlan`'s sizes for the batch. So a heterogeneous run uses, step for
step, the same samples as a uniform stock-DDP run with the same seed: only who computes which sample, and
so the floating-point summation order, differ. Every rank yields the same number of batches per epoch (an
uneven count hangs DDP). The epoch's remainder is stock DDP's: the padding repeats up to ``N - 1`` samples
(or, with ``drop_last``, up to ``N - 1`` are left out), and the last global batch holds what is left (at
least ``N`` samples, split by the same weights).

Elastic runs (``elastic=True``, :mod:`lightning_dist.elastic`) must use the same global batch at every step whatever
the world size, and every sample of an epoch exactly once: the epoch's order is then the permutation itself, not
padded (the padding depends on ``N``), and its last global batch holds the ``len(dataset) mod B`` samples left.
Global batch ``i`` is ``order[i B : (i + 1) B]`` at any world size; only its split into pieces depends on ``N``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
from torch.utils.data import Sampler

from lightning_dist.hetero.plan import BatchPlan


class HeteroBatchSampler(Sampler[list[int]]):
    """This rank's batches of dataset indices, one per step, sizes from ``plan``.

    Args:
        dataset_size: samples in the dataset.
        world_size: ranks in the data-parallel group.
        rank: this rank's place in it.
        global_batch: ``B``, samples per step over all ranks.
        plan: the per-rank sizes per batch (shared by every rank's sampler and by the gradient weighting).
        shuffle: as ``DistributedSampler``'s (Lightning shuffles for training).
        seed: as ``DistributedSampler``'s (Lightning passes the run's seed).
        drop_last: as ``DistributedSampler``'s.
        drop_last_batch: drop the epoch's last, smaller global batch (the DataLoader's ``drop_last``).
        elastic: the same global batches at every world size, each sample once per epoch (the module docstring;
            ``drop_last`` does not apply).
    """

    def __init__(self, dataset_size: int, world_size: int, rank: int, global_batch: int, plan: BatchPlan,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False, drop_last_batch: bool = False,
                 elastic: bool = False) -> None:
        if dataset_size < world_size:
            raise ValueError(f"{dataset_size} samples cannot feed {world_size} ranks: every rank needs at least one "
                             "sample per step")
        if global_batch < world_size:
            raise ValueError(f"a global batch of {global_batch} cannot give each of {world_size} ranks a sample")
        self.dataset_size, self.world_size, self.rank = dataset_size, world_size, rank
        self.global_batch, self.plan = global_batch, plan
        self.shuffle, self.seed, self.drop_last, self.drop_last_batch = shuffle, seed, drop_last, drop_last_batch
        self.elastic = elastic
        if elastic:
            self.total_size = dataset_size
        else:
            per_rank = (math.ceil((dataset_size - world_size) / world_size) if drop_last and dataset_size % world_size
                        else math.ceil(dataset_size / world_size))  # DistributedSampler's num_samples
            self.total_size = per_rank * world_size
        steps = self.total_size / global_batch
        self.steps_per_epoch = math.floor(steps) if drop_last_batch else math.ceil(steps)
        last = self.total_size - (self.steps_per_epoch - 1) * global_batch
        if last < world_size:
            raise ValueError(f"the epoch's last global batch would hold {last} samples ({self.total_size} in the "
                             f"epoch, global batch {global_batch}), fewer than the {world_size} ranks: choose a global "
                             f"batch size B with {self.total_size} mod B = 0 or >= {world_size}, or drop the last "
                             "batch (the training DataLoader's drop_last=True)")
        self.epoch = 0
        self._resume: tuple[int, int] = (-1, 0)  # (epoch, first batch) of a run resumed mid-epoch
        self.consumed: tuple[int, int] = (0, 0)  # (epoch, next batch) after the last batch training used
        self.completed: tuple[int, int] = (0, 0)  # (epoch, next batch) after the last optimizer step that ended
        self.record_drawn = elastic  # keep what the loader draws, for take_drawn (elastic runs' sample ledger)
        self.drawn: dict[tuple[int, int], list[int]] = {}  # batches the loader drew and training has not taken
        # samples to train again (a lost DiLoCo worker's since the last sync), added to this epoch's batches:
        # (epoch, {batch index: dataset indices}); and what they replace, by position, for the ledger
        self.makeup: tuple[int, dict[int, list[int]]] = (-1, {})
        self.lost: dict[int, list[int]] = {}
        self.lost_elsewhere: list[int] = []  # lost samples of an earlier epoch, which cannot train in it again

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    @property
    def sampler(self) -> HeteroBatchSampler:
        """Lightning calls ``set_epoch`` on ``loader.batch_sampler.sampler``: that is this sampler itself."""
        return self

    def __len__(self) -> int:
        return self.steps_per_epoch

    def global_order(self) -> list[int]:
        """The epoch's padded order of sample indices, exactly as ``DistributedSampler`` builds it."""
        if self.shuffle:
            gen = torch.Generator()
            gen.manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.dataset_size, generator=gen).tolist()
        else:
            order = list(range(self.dataset_size))
        missing = self.total_size - len(order)
        if missing > 0:
            order += (order * math.ceil(missing / len(order)))[:missing]
        return order[: self.total_size]

    def batch_total(self, index: int) -> int:
        """Samples in global batch ``index`` of an epoch (the last one may hold fewer than ``B``)."""
        return min(self.global_batch, self.total_size - index * self.global_batch)

    def sizes(self, epoch: int, index: int) -> list[int]:
        """Every rank's share of global batch ``index`` of ``epoch`` (with the samples trained again there)."""
        extra = len(self.makeup[1].get(index, ())) if self.makeup[0] == epoch else 0
        return self.plan.sizes_at(epoch * self.steps_per_epoch + index, self.batch_total(index) + extra)

    def piece(self, order: list[int], sizes: list[int], index: int, rank: int, extra: list[int] = ()) -> list[int]:
        """Rank ``rank``'s piece of global batch ``index`` split by ``sizes`` (the global batch: its block of
        ``order``, then ``extra``)."""
        begin = index * self.global_batch
        block = order[begin : begin + self.batch_total(index)] + list(extra)
        start = sum(sizes[:rank])
        return block[start : start + sizes[rank]]

    def train_again(self, lost: dict[int, list[int]], epoch: int, first: int) -> None:
        """Samples that reached no model for good (``lost``: by position, what a lost DiLoCo worker trained since
        the last sync) are added to this epoch's batches from ``first`` on, spread over as many batches as were lost
        (fewer if the epoch ends sooner), so that every sample still trains once per epoch; the ledger is told which
        positions lost what. Lost samples of an earlier epoch cannot be trained in it again: they are dropped from
        ``lost`` here, and the caller warns."""
        mine = {p: list(v) for p, v in lost.items() if p // self.steps_per_epoch == epoch and v}
        left = self.steps_per_epoch - first
        if not mine or left <= 0:
            return
        flat = [i for p in sorted(mine) for i in mine[p]]
        batches = min(left, len(mine))
        extra = {first + k: flat[k * len(flat) // batches:(k + 1) * len(flat) // batches] for k in range(batches)}
        self.makeup, self.lost = (epoch, extra), mine

    def __iter__(self) -> Iterator[list[int]]:
        order, epoch = self.global_order(), self.epoch
        start = self._resume[1] if self._resume[0] == epoch else 0
        self._resume = (-1, 0)
        self.drawn = {}
        extra = self.makeup[1] if self.makeup[0] == epoch else {}
        for index in range(start, self.steps_per_epoch):
            piece = self.piece(order, self.sizes(epoch, index), index, self.rank, extra.get(index, ()))
            if self.record_drawn:
                self.drawn[(epoch, index)] = piece
            yield piece

    def take_drawn(self, epoch: int, index: int) -> list[int]:
        """The indices this rank's loader drew for batch ``index`` of ``epoch`` (forgotten once taken): what the
        sample ledger records, observed rather than recomputed."""
        return self.drawn.pop((epoch, index), [])

    def resume_at(self, epoch: int, index: int) -> None:
        """The next iteration over ``epoch`` starts at batch ``index`` (a run resumed mid-epoch)."""
        self._resume = (epoch, index) if index < self.steps_per_epoch else (-1, 0)

