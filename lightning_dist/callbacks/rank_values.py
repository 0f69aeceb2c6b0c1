"""Every rank's values to every rank, every N optimizer steps, for a callback: on RingDDPStrategy's per-rank exchange
slots (no collective of their own: they ride the step's exchange, which starts beside the last gradient
bucket), under any other strategy one small all-gather. MemoryMonitor (memory readings) and FaultTolerance
(stop requests) share it.

At their defaults both ask for the steps where the workers meet (``when_workers_meet``): every step's (or every N
steps') exchange when syncing every step; under a sync driver that syncs every H steps (DiLoCo) only on its sync
steps, so no collective of every rank holds the workers together between syncs (an interval's exchange waits for its
first sync step; see :meth:`~lightning_dist.strategy.features.RingFeatures.workers_meet`). Under any other strategy
the workers meet on every step.

The callback drives it from three hooks, the same on every rank, so every rank holds the same rows at the same
step:

- ``on_train_batch_start``: :meth:`RankValues.fill` (ring_ddp, when the coming step exchanges: this rank's values
  go into its slots before backward hands over the last bucket);
- ``on_before_optimizer_step``: :meth:`RankValues.capture` (ring_ddp: copy the rows as soon as that step's exchange
  completed, before a second optimizer step in the same batch replaces them);
- ``on_train_batch_end``: :meth:`RankValues.collect` returns the rows once per interval (other strategies gather
  here, on the first batch end of an interval; ``global_step`` may advance by more than one per batch).
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import lightning.pytorch as pl
import torch
import torch.distributed as dist

from lightning_dist.strategy.features import RingFeatures, features_of


class RankValues:
    """Named per-rank values of one callback, gathered every ``every`` optimizer steps (see the module docstring)."""

    def __init__(self, feature: str, names: Sequence[str]) -> None:
        self.feature, self.names = feature, tuple(names)
        self.every = 0
        self._ring: Optional[RingFeatures] = None  # the strategy's feature seam under ring_ddp
        self._filled_at = -1  # the strategy step whose exchange carries our values (ring_ddp)
        self._captured: Optional[list[list[float]]] = None
        self._last_global_step = 0

    def setup(self, trainer: pl.Trainer, every: int, when_workers_meet: bool = False) -> None:
        """From the callback's ``setup``, on every rank: the same names, in the same order. ``when_workers_meet``: each
        interval's rows wait for its first step where the workers meet (ring_ddp under a sync driver)."""
        self.every = every
        self._ring = features_of(trainer.strategy)
        if self._ring is not None:
            for name in self.names:
                self._ring.exchange.register(self._slot(name), per_rank=True)
            self._ring.request_exchange(every, self.feature, when_workers_meet)
        self._filled_at, self._captured, self._last_global_step = -1, None, trainer.global_step

    def teardown(self, trainer: pl.Trainer) -> None:
        if self._ring is not None:
            self._ring.request_exchange(0, self.feature)
            self._ring = None

    def _slot(self, name: str) -> str:
        return f"{self.feature}_{name}"

    def fill(self, trainer: pl.Trainer, read: Callable[[], Sequence[float]]) -> None:
        """ring_ddp: when the coming step exchanges (and once per step), this rank's values into its slots."""
        ring = self._ring
        if ring is None or not ring.exchange_due_for(self.feature):
            return
        step = ring.step
        if self._filled_at == step:
            return
        for name, value in zip(self.names, read()):
            ring.exchange.set(self._slot(name), float(value))
        self._filled_at = step

    def capture(self, trainer: pl.Trainer) -> None:
        """ring_ddp: keep every rank's values once the exchange of the step we filled has completed."""
        ring = self._ring
        if ring is None or self._filled_at < 0 or ring.exchange_step != self._filled_at:
            return
        columns = [ring.exchange.per_rank(self._slot(name)) for name in self.names]
        self._captured = [list(row) for row in zip(*columns)]
        self._filled_at = -1

    def collect(self, trainer: pl.Trainer, read: Callable[[], Sequence[float]]) -> Optional[list[list[float]]]:
        """Every rank's values (``rows[r]`` is rank ``r``'s) on the batch end that completes an interval, else None.
        ``read`` is called only where this rank's values are gathered now (not under ring_ddp)."""
        if self._ring is not None:
            self.capture(trainer)  # a skipped step (NaNRecovery) has no on_before_optimizer_step
            rows, self._captured = self._captured, None
            if self._filled_at >= 0 and self._ring.step > self._filled_at:
                self._filled_at = -1  # that step's exchange was overwritten by a later one: this reading is lost
            return rows
        if trainer.global_step // self.every == self._last_global_step // self.every:
            return None  # no optimizer step into a new interval (an accumulation batch, or not yet due)
        self._last_global_step = trainer.global_step
        return gather(trainer, list(read()))


def gather(trainer: pl.Trainer, values: list[float]) -> list[list[float]]:
    """Every rank's ``values``, in rank order, on every rank: one collective (ring_ddp's gloo exchange group, else
    the strategy's own all-gather on its device)."""
    strategy, world = trainer.strategy, trainer.world_size
    if world <= 1 or not dist.is_available() or not dist.is_initialized():
        return [values]
    vec = torch.tensor(values, dtype=torch.float64)
    features = features_of(strategy)
    group = features.exchange_group if features is not None else None
    if group is not None:  # CPU tensors on every backend
        out = [torch.empty_like(vec) for _ in range(world)]
        dist.all_gather(out, vec, group=group)
        return [t.tolist() for t in out]
    gathered: Any = strategy.all_gather(vec.to(strategy.root_device))
    return gathered.reshape(world, -1).cpu().tolist()
