"""One optimizer step's bookkeeping around the per-step exchange, in the order the strategy calls it.

1. :meth:`StepCycle.start_exchange_early`, from the comm hook of the step's last gradient bucket: the exchange travels
   beside that bucket when nothing in it can change any more (:mod:`.schedule`);
2. :meth:`StepCycle.complete_exchange`, once backward is done and before the optimizer steps: the exchange, if due,
   completes, so every rank holds every rank's measurements of the previous step (:mod:`.step_meter`); heterogeneous
   batching may rebalance from them (every rank alike: they are the same values);
3. :meth:`StepCycle.finish`, after the optimizer stepped or skipped on every rank together: the compressor's staged
   state kept or dropped (a compressor a sync driver replaced during the step too: :meth:`StepCycle.set_compressor`),
   this step's own measurements recorded for the next exchange.
"""

from __future__ import annotations

from typing import Optional

from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_dist.compression import Compressor
from lightning_dist.hetero import HeteroBatching
from lightning_dist.hetero.batching import describe_event
from lightning_dist.strategy.hook import RingHookState
from lightning_dist.strategy.schedule import ExchangeSchedule
from lightning_dist.strategy.step_meter import StepMeter


class StepCycle:
    """The strategy's per-step mechanisms, stepped together (the module's docstring)."""

    def __init__(self, meter: StepMeter, schedule: ExchangeSchedule, hook_state: RingHookState,
                 hetero: Optional[HeteroBatching]) -> None:
        self.meter, self.schedule, self.hook_state, self.hetero = meter, schedule, hook_state, hetero
        self.replaced: list[Compressor] = []  # compressors replaced since the last finish: they finish this step too

    def set_compressor(self, compressor: Compressor) -> None:
        """The comm hook's compressor from the next bucket on (``SyncContext.set_compressor``); the one it replaces
        keeps or drops what it staged in this step with the step's verdict, at :meth:`finish`, so the state its holder
        reads afterwards (a driver flushing its residuals) is the state of a finished step."""
        self.replaced.append(self.hook_state.compressor)
        self.hook_state.compressor = compressor

    def restart(self) -> None:
        """A new fit counts afresh (the same strategy object may fit twice)."""
        self.replaced.clear()
        self.meter.reset()
        self.schedule.step_finished()
        self.hook_state.reset_step()

    def start_exchange_early(self, automatic_optimization: bool) -> None:
        self.schedule.start_early(self.meter.step, self.meter.last_step, automatic_optimization)

    def complete_exchange(self, world_size: int, batches_per_epoch: int) -> None:
        meter = self.meter
        meter.backward_done()
        if not self.schedule.complete(meter.step, meter.last_step):
            return
        exchange = self.schedule.exchange
        meter.exchanged(exchange, world_size)
        hetero = self.hetero
        if hetero is None or not hetero.rebalance or not hetero.attached:
            return
        event = hetero.after_exchange(exchange.per_rank("rank_compute_s"), exchange.per_rank("rank_samples"),
                                      meter.step, batches_per_epoch)
        for line in describe_event(event) if event is not None else ():
            rank_zero_info(f"RingDDPStrategy: {line}")
        if meter.step_metrics:  # empty on the first step: no previous step to describe
            meter.step_metrics["hetero/rebalances"] = float(len(hetero.events))

    def finish(self, skipped: bool) -> None:
        state = self.hook_state
        for compressor in (*self.replaced, state.compressor):
            if skipped:
                compressor.discard()
            else:
                compressor.commit()
        self.replaced.clear()
        self.meter.step_finished(state.stats, state.exposed_s)
        state.reset_step()
        self.schedule.step_finished()
        if self.hetero is not None and self.hetero.attached:
            self.hetero.finish_step()
