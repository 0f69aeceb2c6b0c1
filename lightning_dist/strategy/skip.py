"""The step-or-skip decision: every rank skips a step with a non-finite loss or gradient on any rank, together.

Armed by :class:`~lightning_dist.callbacks.NaNRecovery` (which holds the policy: loss scale, rollback, stop);
:class:`~lightning_dist.strategy.RingDDPStrategy` holds the mechanism and calls this module at three points.

How the ranks agree without a collective on a good step (in-band, as DDP with torch's GradScaler agrees):

1. **The loss.** Before backward, a non-finite local loss poisons this rank's gradient: the strategy's hook on
   the loss gradient multiplies it by ``NaN`` instead of by the rank's share (``torch.where`` on the device,
   no synchronisation). A loss can be NaN while its gradient is finite (``loss + nan``); this makes the
   gradient say so.
2. **The local gradient**, in the comm hook, before compression can hide anything: one float32 sum of the
   bucket (a NaN or Inf anywhere makes it non-finite; so would a sum beyond 3.4e38, i.e. elements near 1e32,
   a step worth skipping anyway). A non-finite sum writes NaN into the bucket's first element, the
   *sentinel*, on the device, without a synchronisation.
3. **The reduced gradient.** Every compressor carries a NaN at a position to the same position of every
   rank's result (their tests check it), so after the all-reduce the sentinel is NaN on every rank as soon as
   it was on one. Each rank reads one element per bucket, and all read the same bit-identical values.
   Compressors whose wire format can overflow by itself (``fp16``: 65504 is its largest value) get every
   element of the reduced bucket checked instead (another sum).
4. **The decision**, after backward, before the optimizer: one synchronisation to read the sentinels. Under
   fp16 loss scaling the :class:`~lightning_dist.loss_scaler.LossScaler` unscales the gradients and reports
   ``found_inf`` from them instead (the pass Lightning would make anyway; it also sees overflow in the
   reduction).

The cost is the local sum: one read of the gradients (on the communication worker, overlapped with backward
except for the last bucket). ``torch.isfinite(t).all()`` says the same at many times the cost on a CPU, and so
does a float64 sum, which is not vectorised there (docs/benchmarks.md, ``callbacks``, gives the figures).

Only on a bad step (rare) do the ranks talk: one tiny all-gather tells every rank which ranks had a
non-finite loss or local gradient, so the error and the logs can say who saw it first.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from lightning_dist.loss_scaler import LossScaler


@dataclass
class StepVerdict:
    """One optimizer step's outcome, identical on every rank."""

    step: int  # the trainer's global step this optimizer step had (the same on every rank)
    skipped: bool
    bad_loss_ranks: list[int] = field(default_factory=list)  # ranks whose loss was non-finite
    bad_grad_ranks: list[int] = field(default_factory=list)  # ranks whose local gradient was non-finite
    scale: float = 1.0  # the loss scale the step's gradients carried (1.0 without fp16 scaling)
    reason: str = ""  # what was skipped when it was not the optimizer step (DiLoCo's outer step)

    def describe(self) -> str:
        if not self.skipped:
            return f"global step {self.step}: finite"
        if self.reason:
            return f"global step {self.step}: {self.reason}"
        parts = []
        if self.bad_loss_ranks:
            parts.append(f"non-finite loss on rank(s) {self.bad_loss_ranks}")
        grads_only = [r for r in self.bad_grad_ranks if r not in self.bad_loss_ranks]
        if grads_only:
            parts.append(f"non-finite local gradient on rank(s) {grads_only}")
        if not parts:
            parts.append("every local loss and gradient finite, the reduced gradient not (an overflow in the "
                         "all-reduce or the compressor)")
        scaled = f" at loss scale {self.scale:g}" if self.scale != 1.0 else ""
        return f"global step {self.step}: " + "; ".join(parts) + scaled


class StepGuard:
    """Per-step finiteness bookkeeping for the hook and the strategy (inactive until :meth:`arm`)."""

    def __init__(self) -> None:
        self.armed = False
        self.steps = 0  # optimizer steps decided (skipped ones included)
        # CPU time (time.thread_time: the thread's own work, not time it waited or was descheduled)
        self.seconds = 0.0  # in this guard's decision, on the training thread
        self.hook_seconds = 0.0  # in the hook's checks (on the worker and the backend's completion thread)
        self._lock = threading.Lock()
        self._verdicts: list[StepVerdict] = []
        self.reset_step()

    def __getstate__(self) -> dict:  # the strategy travels to spawned ranks: a lock does not pickle
        state = self.__dict__.copy()
        del state["_lock"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def arm(self) -> None:
        self.armed = True

    def disarm(self) -> None:
        self.armed = False
        self.reset_step()

    def reset_step(self) -> None:
        self._losses: list[torch.Tensor] = []  # this step's local losses (several under gradient accumulation)
        self._local: list[torch.Tensor] = []  # per bucket: the local gradient's sum
        self._reduced: list[torch.Tensor] = []  # per bucket: the reduced sentinel (or sum)

    # -- inputs, during backward (each a handful of tensor ops and no synchronisation) -----------------------------
    def loss_factor(self, loss: torch.Tensor, share: float) -> torch.Tensor:
        """What the loss gradient is multiplied by: this rank's ``share`` for a finite loss, NaN otherwise (on the
        device).
        ``loss - loss`` is 0 for a finite loss and NaN for NaN or +-Inf, so no branch is needed."""
        loss = loss.detach()
        self._losses.append(loss)
        return (loss - loss).add_(share)

    def check_local(self, bucket: torch.Tensor) -> None:
        """From the hook, before compression: this rank's own gradient; a non-finite one sets the sentinel.
        Subtracting ``total - total`` (0 or NaN) from the first element leaves it bit for bit as it was when the
        sum is finite (``x - 0.0 == x`` for every float, -0.0 included) and makes it NaN when it is not."""
        started = time.thread_time()
        # half-precision buckets are summed in float32: 100 000 finite fp16 values can add up past 65504
        total = bucket.sum(dtype=torch.float32) if bucket.element_size() < 4 else bucket.sum()
        if bucket.numel():
            bucket[:1].sub_(total - total)
        self._local.append(total)
        self._add_seconds(time.thread_time() - started)

    def check_reduced(self, bucket: torch.Tensor, every_element: bool = False) -> None:
        """From the hook, after the all-reduce: the sentinel (or every element) of what every rank holds alike."""
        started = time.thread_time()
        if bucket.numel():
            self._reduced.append(bucket.sum() if every_element else bucket[0])  # a view: read at the decision
        self._add_seconds(time.thread_time() - started)

    def _add_seconds(self, seconds: float) -> None:
        with self._lock:  # the worker and the backend's completion thread both run checks
            self.hook_seconds += seconds

    # -- the decision, after backward -------------------------------------------------------------------------
    def decide(self, optimizer: torch.optim.Optimizer, scaler: Optional[LossScaler],
               group: Optional[dist.ProcessGroup], rank: int, world_size: int, step: int) -> StepVerdict:
        """Whether this step is skipped; the same answer on every rank. Must be called on every rank."""
        started = time.thread_time()
        scale = scaler.scale_value if scaler is not None and scaler.is_enabled() else 1.0
        if scaler is not None and scaler.is_enabled():
            bad = scaler.found_inf(optimizer)
        else:
            bad = not _all_finite(self._reduced)  # one host sync per step, after backward (never per bucket)
        verdict = StepVerdict(step=step, skipped=bad, scale=scale)
        if bad:  # rare: say who saw it (one small collective, every rank takes this branch together)
            loss_bad = not math.isfinite(sum(float(v) for v in self._losses))
            grad_bad = not math.isfinite(sum(float(v) for v in self._local))
            flags = _gather_flags([float(loss_bad), float(grad_bad)], group, rank, world_size)
            verdict.bad_loss_ranks = [r for r in range(world_size) if flags[r][0]]
            verdict.bad_grad_ranks = [r for r in range(world_size) if flags[r][1]]
        self._verdicts.append(verdict)
        self.steps += 1
        self.reset_step()
        self.seconds += time.thread_time() - started
        return verdict

    def record(self, verdict: StepVerdict) -> None:
        """A verdict reached outside :meth:`decide`, on every rank alike (DiLoCo's skipped outer step), for the policy
        to read with the others."""
        self._verdicts.append(verdict)

    def pop_verdicts(self) -> list[StepVerdict]:
        """The verdicts since the last call (one per optimizer step), oldest first."""
        verdicts, self._verdicts = self._verdicts, []
        return verdicts


def _all_finite(values: list[torch.Tensor]) -> bool:
    """Whether every one of ``values`` (0-dim tensors: the buckets' sentinels or sums) is finite, read with one host
    sync: a ``float()`` per bucket would wait for the device once per bucket."""
    if not values:
        return True
    return bool(torch.isfinite(torch.stack([v.detach().float().reshape(()) for v in values])).all())


def _gather_flags(values: list[float], group: Optional[dist.ProcessGroup], rank: int,
                  world_size: int) -> list[list[float]]:
    """Every rank's ``values`` (a short list of floats), on every rank: one all-reduce of a world-size block."""
    block = torch.zeros(world_size, len(values), dtype=torch.float64)
    block[rank] = torch.tensor(values, dtype=torch.float64)
    if world_size > 1 and dist.is_initialized():
        dist.all_reduce(block, group=group)
    return block.tolist()
