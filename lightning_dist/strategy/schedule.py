"""When the per-step exchange travels: the features' requests, the decision every rank makes alike, start and wait.

The exchange (:class:`~lightning_dist.strategy.exchange.StepExchange`) carries every rank's measurements of the
previous step and the values features registered. It travels

- on every step when a feature registered an agreed slot (a skip or stop decision) or hetero batching
  rebalances from measured speed;
- otherwise only on the steps some feature asked for (:meth:`ExchangeSchedule.request`: DistMetrics's
  logging steps, MemoryMonitor's readings), so a run that logs every 50 steps pays one exchange per 50 steps.
  A request can ask for the steps where the workers meet (``when_workers_meet``: FaultTolerance's stop requests and
  MemoryMonitor's readings at their defaults): every step when syncing every step; under a sync driver that syncs
  every H steps only its sync steps (:attr:`ExchangeSchedule.meets`), where a collective of every rank costs no wait
  of its own, an interval's exchange then put off to the first such step of it.

Both depend only on what every rank shares (the registered names, the step count, the intervals, the driver's sync
steps), so every rank exchanges on the same steps. When every value in the vector is final early (only measurements
of the previous step travel) the exchange starts as DDP hands over the step's last gradient bucket, hidden behind
that bucket's all-reduce; agreed values may be set until backward ends, so with any agreed slot (or under manual
optimization, where a backward need not be followed by a step) it starts after backward. Either way it is complete
before the optimizer steps, and happens at most once per step (LBFGS evaluates its closure several times).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch.distributed as dist

from lightning_dist.strategy.exchange import StepExchange
from lightning_dist.strategy.step_meter import PER_RANK_SLOTS


class ExchangeSchedule:
    """The strategy's exchange, its gloo group, and the intervals features asked for."""

    def __init__(self) -> None:
        self._exchange: Optional[StepExchange] = None
        self.group: Optional[dist.ProcessGroup] = None  # gloo, made with the comm group (None with one rank)
        self.every_step = False  # hetero batching that rebalances needs every step's measurements
        # whether the workers meet in the optimizer step in progress (the feature seam sets it: the sync driver's sync
        # steps; every step without a driver); the same answer on every rank
        self.meets: Callable[[], bool] = lambda: True
        # feature -> (every how many optimizer steps it needs the exchange, only on steps where the workers meet)
        self._every: dict[str, tuple[int, bool]] = {}
        self._met: dict[str, int] = {}  # a when_workers_meet feature -> the last step it exchanged on (-1: none)
        self._meeting: tuple[int, frozenset[str]] = (-1, frozenset())  # the step asked about last, its due features
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

    def request(self, every_n_steps: int, name: str, when_workers_meet: bool = False) -> None:
        """Feature ``name`` needs the exchange every ``every_n_steps`` optimizer steps (0 withdraws it); with
        ``when_workers_meet`` each interval's exchange is put off to its first step where the workers meet."""
        if isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int) or every_n_steps < 0:
            raise ValueError(f"every_n_steps={every_n_steps!r} must be an int >= 1, or 0 to withdraw {name!r}")
        self._commit()  # (between steps: a request comes from a callback's setup or on_train_start)
        self._met.pop(name, None)
        if every_n_steps:
            self._every[name] = (every_n_steps, when_workers_meet)
        else:
            self._every.pop(name, None)

    @staticmethod
    def due_every(every_n_steps: int, step: int) -> bool:
        """Whether optimizer step ``step`` is one of ``every_n_steps``'s."""
        return every_n_steps > 0 and step % every_n_steps == 0

    def due_for(self, name: str, step: int) -> bool:
        """Whether step ``step`` exchanges for feature ``name``'s request (False without one)."""
        if name not in self._every:
            return False
        every, when_workers_meet = self._every[name]
        return name in self._meeting_due(step) if when_workers_meet else self.due_every(every, step)

    def _meeting_due(self, step: int) -> frozenset[str]:
        """The ``when_workers_meet`` features step ``step`` exchanges for: a step where the workers meet, in an interval
        none of its earlier steps exchanged in. Decided the first time the step is asked about (before its optimizer
        step, while :attr:`meets` describes it), kept until it ends (:meth:`step_finished`)."""
        asked, due = self._meeting
        if step == asked:
            return due
        meets = any(at for _, at in self._every.values()) and self.meets()
        due = frozenset(name for name, (every, at) in self._every.items()
                        if at and meets and step // every > self._last_met(name, step) // every)
        self._meeting = (step, due)
        return due

    def _last_met(self, name: str, step: int) -> int:
        last = self._met.get(name, -1)
        return last if last < step else -1  # a step of an earlier fit (a new fit counts from 0 again)

    def due(self, step: int) -> bool:
        """Whether step ``step`` exchanges: the same answer on every rank."""
        if self.every_step or self.exchange.has_agreed:
            return True
        return any(self.due_for(name, step) for name in self._every)

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
        """After every optimizer step (and before a fit's first)."""
        self._commit()
        self._done_this_step = False

    def _commit(self) -> None:
        """The step asked about last has ended: it exchanged for the ``when_workers_meet`` features due on it."""
        asked, due = self._meeting
        for name in due:
            self._met[name] = asked
        self._meeting = (-1, frozenset())

    def drain(self) -> None:
        """At the end of a fit: finish an exchange every rank started."""
        if self._exchange is not None and self._exchange.in_flight:
            self._exchange.wait()
