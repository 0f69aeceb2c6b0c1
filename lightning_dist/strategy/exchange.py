"""Per-step values that every rank must agree on or see from every rank, exchanged together in one small collective.

Features register named slots once at set-up (the same names in the same order on every rank):

- *agreed* slots are summed over ranks: the number of samples the step used, a bad-step count (any rank
  with a non-finite gradient makes it non-zero), a stop request;
- *per-rank* slots are an all-gather written as a sum (each rank fills only its own row): what each rank
  measured (compute time, time in communication, bytes sent), so rank zero can log the straggler signal
  without a collective of its own.

The strategy exchanges on every step when any agreed slot is registered, and otherwise only on the steps a
feature asked for (:meth:`RingFeatures.request_exchange`: DistMetrics's logging steps, MemoryMonitor's
readings); both depend only on values every rank shares (the registered names, the step count, the
requested intervals), so all ranks exchange on the same steps.

One float64 vector carries both, reduced once per step: one collective per step, not one per feature.
float64 keeps sample counts and byte counts exact up to 2**53.

The vector is all-reduced asynchronously on a separate gloo group (so it cannot interleave with the
gradients' point-to-point traffic) and waited for after backward, before the optimizer steps. When every
value in it is final early, i.e. only per-rank measurements of the previous step travel, the strategy
starts it as DDP hands over the step's last gradient bucket, hidden behind that bucket's all-reduce (a
blocking exchange after backward is exposed in full: a small collective's latency, which a short step
notices). Agreed values may be set until backward ends, so with any agreed slot registered the exchange
starts after backward.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist


class StepExchange:
    """Named slots, filled locally, summed across ranks by :meth:`start` and :meth:`wait`."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size
        self._agreed: list[str] = []
        self._per_rank: list[str] = []
        self._local: dict[str, float] = {}
        self._result: Optional[torch.Tensor] = None
        self._pending: Optional[tuple[torch.Tensor, Optional[dist.Work]]] = None

    # -- set-up ---------------------------------------------------------------------------------------
    def register(self, name: str, per_rank: bool = False) -> None:
        """Add a slot (idempotent). Every rank must register the same names in the same order."""
        if name in self._agreed or name in self._per_rank:
            return
        self._refuse_in_flight(f"register {name!r}")
        (self._per_rank if per_rank else self._agreed).append(name)

    @property
    def has_agreed(self) -> bool:
        """Whether a feature registered a value that must be agreed every step (then every step exchanges)."""
        return bool(self._agreed)

    # -- each step ------------------------------------------------------------------------------------
    def set(self, name: str, value: float) -> None:
        """This rank's value for ``name`` in the coming exchange (0 when never set)."""
        if name not in self._agreed and name not in self._per_rank:
            raise KeyError(f"exchange slot {name!r} is not registered; registered: {self._agreed + self._per_rank}")
        self._refuse_in_flight(f"set {name!r}")
        self._local[name] = float(value)

    def add(self, name: str, value: float) -> None:
        self.set(name, self._local.get(name, 0.0) + float(value))

    def pack(self) -> torch.Tensor:
        """The vector this rank contributes: agreed slots, then a ``world_size x per-rank`` block."""
        n_agreed, n_rank = len(self._agreed), len(self._per_rank)
        vec = torch.zeros(n_agreed + self.world_size * n_rank, dtype=torch.float64)
        for i, name in enumerate(self._agreed):
            vec[i] = self._local.get(name, 0.0)
        row = n_agreed + self.rank * n_rank
        for j, name in enumerate(self._per_rank):
            vec[row + j] = self._local.get(name, 0.0)
        return vec

    def start(self, group: Optional[dist.ProcessGroup] = None) -> None:
        """Start summing every rank's vector (one asynchronous all-reduce); :meth:`wait` completes it.

        ``group`` must hold CPU tensors (gloo): the strategy makes a gloo group for this on every backend.
        """
        if self._pending is not None:
            raise RuntimeError("an exchange is already in flight: wait() for it before starting another")
        vec = self.pack()
        work = dist.all_reduce(vec, group=group, async_op=True) if self.world_size > 1 else None
        self._pending = (vec, work)
        self._local.clear()

    @property
    def in_flight(self) -> bool:
        return self._pending is not None

    def wait(self) -> None:
        """Finish the exchange started by :meth:`start` and make its result readable."""
        if self._pending is None:
            raise RuntimeError("no exchange in flight: call start() first")
        vec, work = self._pending
        if work is not None:
            work.wait()
        self._pending = None
        self._result = vec

    def load(self, reduced: torch.Tensor) -> None:
        """Adopt an already reduced vector (for tests and for a strategy that reduces it elsewhere)."""
        self._result = reduced
        self._local.clear()

    # -- reading the agreed result ----------------------------------------------------------------------
    def agreed(self, name: str) -> float:
        """The sum over ranks of ``name`` from the last exchange."""
        return float(self._require()[self._agreed.index(name)])

    def per_rank(self, name: str) -> list[float]:
        """Every rank's value of ``name`` from the last exchange, in rank order."""
        vec, n_agreed, n_rank = self._require(), len(self._agreed), len(self._per_rank)
        j = self._per_rank.index(name)
        return [float(vec[n_agreed + r * n_rank + j]) for r in range(self.world_size)]

    def _refuse_in_flight(self, what: str) -> None:
        # A value set now would silently travel with the next step's exchange instead of this one.
        if self._pending is not None:
            raise RuntimeError(
                f"cannot {what} while this step's exchange is in flight; set agreed values before backward "
                "ends (e.g. in training_step or a bucket check) and read them after it"
            )

    def _require(self) -> torch.Tensor:
        if self._result is None:
            raise RuntimeError("no exchange has completed yet this run: start() and wait() first")
        return self._result
