"""When the per-step exchange travels: the features' requests, the decision every rank makes alike, start and wait.

The exchange (:class:`~lightning_dist.strategy.exchange.StepExchange`) carries every rank's measurements of the
previous step and the values features registered. It travels

- on every step when a feature registered an agreed slot (a skip or stop decision) or hetero batching
  rebalances from measured speed;
- otherwise only on the steps some feature asked for (:meth:`ExchangeSchedule.request`: DistMetrics's
  logging steps, MemoryMonitor's readings), so a run that logs every 50 steps pays one exchange per 50 steps.

Both depend only on what every rank shares (the registered names, the step count, the intervals), so every rank
exchanges on the same steps. When every value in the vector is final early (only measurements of the previous
step travel) the exchange starts as DDP hands over the step's last gradient bucket, hidden behind that bucket's
all-reduce; agreed values may be set until backward ends, so with any agreed slot (or under manual optimization,
where a backward need not be followed by a step) it starts after backward. Either way it is complete before the
optimizer steps, and happens at most once per step (LBFGS evaluates its closure several times).
"""

from __future__ import annotations

from typing import Optional

import torch.distributed as dist

from lightning_dist.strategy.exchange import StepExchange
from lightning_dist.strategy.step_meter import PER_RANK_SLOTS


class ExchangeSchedule:
    """The strategy's exchange, its gloo group, and the intervals features asked for."""

    def __init__(self) -> None:
        self._exchange: Optional[StepExchange] = None
        self.group: Optional[dist.ProcessGroup] = None  # gloo, made with the comm group (None with one rank)
        self.every_step = False  # hetero batching that rebalances needs every step's measurements
        self._every: dict[str, int] = {}  # feature -> every how many optimizer steps it needs the exchange
        self._done_this_step = False

    @property
    def exchange(self) -> StepExchange:
        """The exchange, made on first use (inside ``fit``: features register their slots in ``setup``, before
        the strategy wraps the model)."""
        if self._exchange is None:
            if not dist.is_initialized():
                raise RuntimeError("the step exchange exists once the processes have started (inside Trainer.fit)")
            self._exchange = StepExchange(dist.get_rank(), dist.get_world_size())
            for name in PER_RANK_SLOTS:
                self._exchange.register(f"rank_{name}", per_rank=True)
        return self._exchange

    def request(self, every_n_steps: int, name: str) -> None:
        """Feature ``name`` needs the exchange every ``every_n_steps`` optimizer steps (0 withdraws it)."""
        if isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int) or every_n_steps < 0:
            raise ValueError(f"every_n_steps={every_n_steps!r} must be an int >= 1, or 0 to withdraw {name!r}")
        if every_n_steps:
            self._every[name] = every_n_steps
        else:
            self._every.pop(name, None)

    @staticmethod
    def due_every(every_n_steps: int, step: int) -> bool:
        """Whether optimizer step ``step`` is one of ``every_n_steps``'s."""
        return every_n_steps > 0 and step % every_n_steps == 0

    def due(self, step: int) -> bool:
        """Whether step ``step`` exchanges: the same answer on every rank."""
        if self.every_step or self.exchange.has_agreed:
            return True
        return any(self.due_every(every, step) for every in self._every.values())

    def start(self, step: int, measurements: dict[str, float]) -> None:
        """Start this step's exchange if it is due and not started yet, carrying this rank's ``measurements``
        (of the previous step, so already final)."""
        exchange = self.exchange
        if exchange.in_flight or self._done_this_step or not self.due(step):
            return
        for name, value in measurements.items():
            exchange.set(f"rank_{name}", value)
        exchange.start(self.group)

    def start_early(self, step: int, measurements: dict[str, float], automatic_optimization: bool) -> None:
        """From the last bucket's hook: start only if nothing in the vector can still change."""
        if automatic_optimization and not self.exchange.has_agreed:
            self.start(step, measurements)

    def complete(self, step: int, measurements: dict[str, float]) -> bool:
        """After backward: start the exchange if due, and wait for it. True when it completed just now (once per
        step: a closure evaluated twice exchanges once)."""
        if self._done_this_step:
            return False
        self.start(step, measurements)
        if not self.exchange.in_flight:
            return False
        self.exchange.wait()
        self._done_this_step = True
        return True

    def step_finished(self) -> None:
        self._done_this_step = False

    def drain(self) -> None:
        """At the end of a fit: finish an exchange every rank started."""
        if self._exchange is not None and self._exchange.in_flight:
            self._exchange.wait()
