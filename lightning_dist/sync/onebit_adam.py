"""Compressed-momentum Adam (the 1-bit Adam family, Tang et al. 2021, arXiv 2102.02888) as a sync driver:
``RingDDPStrategy(sync=OneBitAdam(...))``. After a dense warm-up Adam's second moment ``v`` is frozen and every rank's
momentum travels compressed, with error feedback, and a refresh every ``refresh``-th step updates ``v`` from a
reduced gradient. How a step goes, what keeps it stable and what it measures: docs/onebit-adam.md.

:class:`OneBitAdam` is what users pass (its settings: :class:`~lightning_dist.sync.onebit_settings.OneBitAdamSettings`);
``bind`` makes the running :class:`OneBitAdamDriver`, which drives the steps around the user's Adam: its reduction
groups and buckets, the phase of each step (after the warm-up its ``before_forward`` says DDP reduces nothing: the
strategy then checks the gradients for NaNRecovery and agrees fp16 loss scaling's verdict), unused parameters,
checkpoints and reports.
The update itself (frozen denominators, the preconditioned momentum, the step from its sum) is
:mod:`lightning_dist.sync.onebit_update`'s.
"""

from __future__ import annotations

import copy
import math
import warnings
from typing import Any, Callable, Optional

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_dist.comm import destroy_groups, ring_bytes_sent
from lightning_dist.compression import Compressor, NoCompressor, Transport
from lightning_dist.sync.buckets import Bucket, cut_buckets, gather_to_rank_zero
from lightning_dist.sync.context import SyncContext
from lightning_dist.sync.driver import FitSettings, SyncDriver, SyncReport, SyncSettings
from lightning_dist.sync.onebit_settings import COMPRESSED, WARMUP, OneBitAdamSettings, phase
from lightning_dist.sync.onebit_update import FrozenAdam, apply_update, precondition

_DENSE = NoCompressor()  # what a compressor's first start_step steps send


class OneBitAdam(OneBitAdamSettings, SyncSettings):
    __doc__ = OneBitAdamSettings.__doc__
    name = "onebit_adam"

    def check(self, *, compressor: Any, hetero: Any, topology: str) -> None:
        if compressor.name != "none":
            raise ValueError(f"compressor={compressor.describe()} compresses every step's gradient; under "
                             "sync=OneBitAdam the warm-up's steps are plain Adam steps and after it the momentum "
                             f"travels compressed: OneBitAdam(compressor={compressor.name!r}) (on the command line "
                             f"sync.compressor={compressor.name}), and drop compressor=")

    def refuses(self, fit: FitSettings) -> Optional[str]:
        # accumulation and mixed precision: the warm-up is DDP's; after it the gradients accumulate before its own
        # reduction, and fp16 loss scaling's verdict is agreed by the strategy (docs/compatibility.md)
        if fit.manual_optimization:
            return ("sync=OneBitAdam steps the optimizer itself after the warm-up, which manual optimization "
                    "(automatic_optimization=False) does not let it do; use automatic optimization or drop sync=")
        if fit.gradient_clip_val:
            return (f"sync=OneBitAdam with gradient_clip_val={fit.gradient_clip_val}: after the warm-up no rank holds "
                    "the summed gradient (each rank's momentum travels compressed), so clipping would see this rank's "
                    f"share of it, a limit about {fit.world_size}x looser than under dense; drop gradient_clip_val "
                    "(OneBitAdam bounds each coordinate's update instead: bound=4.5 learning rates by default), or "
                    "train with sync=None")
        return None

    def bind(self, context: SyncContext) -> OneBitAdamDriver:
        driver = OneBitAdamDriver(self, context)
        driver.start()
        return driver


class OneBitAdamDriver(SyncDriver):
    """One rank's running OneBitAdam: its reduction groups and buckets, the phase of each step, the hooks."""

    def __init__(self, settings: OneBitAdamSettings, context: SyncContext) -> None:
        self.settings, self.context = settings, context
        self.compressor: Compressor = copy.deepcopy(settings.compressor)  # a fresh state per fit
        self.refresh_compressor: Compressor = copy.deepcopy(settings.refresh_compressor)
        # the warm-up in optimizer steps (a fraction of the fit's steps is resolved at set-up)
        self.warmup_steps: Optional[int] = settings.warmup if isinstance(settings.warmup, int) else None
        self.compressed_steps = 0
        self.refreshes = 0
        self.skipped = 0
        self.bytes_total = 0
        self.metrics: dict[str, float] = {}
        self._memory: Optional[dict[str, int]] = None  # the bytes it keeps, by device (fixed once bound)
        named = [(name, p) for name, p in context.module.named_parameters() if p.requires_grad]
        self._buckets = cut_buckets(named, lambda numel, p: torch.zeros(numel, dtype=p.dtype, device=p.device))
        self.adam = FrozenAdam({id(p): name for name, p in named}, self._buckets)
        self._reduction = context.reduction()  # groups of its own, flat or two-tier as the gradients' (collective)
        self._tiers = self._reduction.tiers
        self._topology = "two_tier" if self._tiers is not None else "flat"
        self._tier = "inter_host" if self._reduction.spans_hosts else "intra_host"
        # the flat path's transport, made once (its byte counts go into the strategy's step statistics)
        self._transport = (Transport(context.algorithm, self._reduction.group, context.stats.tier(self._tier))
                           if self._reduction.group is not None else None)
        rank_zero_info(f"RingDDPStrategy: {settings.describe()} over {context.world_size} ranks ({self._topology})")

    # -- set-up ---------------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Once Lightning's set-up is done (the fit's steps and its optimizers are known): the warm-up in steps, the
        loss scaler made one that agrees, the optimizers checked."""
        context = self.context
        total = context.estimated_steps
        if self.warmup_steps is None:
            if not math.isfinite(total):
                raise ValueError(f"OneBitAdam(warmup={self.settings.warmup}) is a fraction of the fit's steps, which "
                                 "this fit does not know (no max_steps, max_epochs or finite data): give warmup as "
                                 "an int of steps")
            self.warmup_steps = int(round(self.settings.warmup * total))
        self._check_warmup(total)
        # fp16 loss scaling decides per rank, and after the warm-up the ranks' gradients differ: the scaler must agree
        # (the strategy agrees it on the steps before_forward says DDP reduces nothing)
        context.agreeing_scaler()
        for optimizer in context.optimizers:
            self.adam.check(optimizer)

    def adopt_warmup(self, steps: int) -> None:
        """Bound after ``steps`` dense Adam steps of the fit (``sync="auto"`` switches to it there): they were its
        warm-up, which lasts at least as long, and Adam's ``v`` of each parameter has had as many updates as Adam's own
        step count says."""
        self.warmup_steps = max(self.warmup_steps or 0, steps)
        for optimizer in self.context.optimizers:
            self.adam.adam_stepped(optimizer)

    def _check_warmup(self, total: float) -> None:
        if math.isfinite(total) and not self.warmup_steps < total:
            raise ValueError(f"OneBitAdam(warmup={self.warmup_steps}) with a fit of {int(total)} optimizer steps: the "
                             f"warm-up must end before the fit does; use warmup < {int(total)} (or a fraction such "
                             "as 0.2)")

    # -- every step -----------------------------------------------------------------------------------------------
    def _phase(self) -> str:
        """What the step under way is (Lightning runs the training step inside ``optimizer_step``: every hook of a
        step reads this, not a flag an earlier hook set)."""
        return phase(self.context.global_step, self.warmup_steps or 0, self.settings.refresh)

    def before_forward(self) -> bool:
        # DDP's gradient all-reduce runs in the warm-up only: after it, the strategy turns DDP's synchronisation off
        # for the step (in the warm-up the flag stays Lightning's: under accumulate_grad_batches its no_sync window
        # turns it off for the window's earlier micro-batches), checks each rank's gradients for NaNRecovery and agrees
        # fp16 loss scaling's verdict among the ranks
        return self._phase() == WARMUP

    def optimizer_step(self, optimizer: Any, closure: Any, step: Any) -> Any:
        self.adam.check(optimizer)
        now = self._phase()
        if now == WARMUP:
            return self._adam_step(optimizer, lambda: step(closure))

        def update() -> None:  # in place of Adam's step, once Lightning's path ran (the closure, hooks, clipping)
            if now == COMPRESSED:
                self._compressed_update(optimizer)
            elif self._reduce_gradients():  # a refresh: Adam's own step on the reduced gradient
                self._adam_step(optimizer, lambda: type(optimizer).step(optimizer))

        return step(closure, update)

    def _adam_step(self, optimizer: Any, step: Callable[[], Any]) -> Any:
        """Adam's own step (a warm-up step, a refresh): ``v`` changes, counted, and is frozen afresh."""
        before = self.adam.step_counts(optimizer)
        output = step()
        self.adam.adam_stepped(optimizer, before)
        self._report(dense=True)
        return output

    def _compressed_update(self, optimizer: Any) -> None:
        """Every rank's preconditioned momentum summed through the compressor, then Adam's step from the sum (skipped
        on every rank when the sum is not finite)."""
        self.adam.check(optimizer)  # once per optimizer: it maps each parameter to its group
        unused = self._unused()
        plan = self.adam.plan(optimizer, unused)
        share = self.context.share()
        sent_before = self._bytes_across()
        finite = torch.ones((), dtype=torch.bool, device=self._buckets[0].flat.device) if self._buckets else None
        with torch.no_grad():
            for bucket, runs in zip(self._buckets, plan):
                if unused:
                    bucket.flat.zero_()  # an unused parameter's part sends nothing
                precondition(optimizer, runs, share)
                self._reduce(bucket, self.compressor)
                # a sum is finite where every element is (no preconditioned momentum, |u| ~ 1, overflows it): one
                # reduction instead of a finiteness pass
                finite &= torch.isfinite(bucket.flat.sum())
        sent = self._settle(self.compressor, sent_before, finite is None or bool(finite), "the reduced momentum")
        if sent is None:
            return
        apply_update(optimizer, plan, self.settings.bound)
        self.compressed_steps += 1
        self._report(dense=False, sent=sent)

    def _reduce_gradients(self) -> bool:
        """A refresh: every rank's weighted gradient summed through the refresh's compressor into ``.grad``; whether
        the sum is finite (else the step is skipped on every rank: they hold the same sum)."""
        unused = self._unused()
        sent_before = self._bytes_across()
        finite = torch.ones((), dtype=torch.bool)
        with torch.no_grad():
            for bucket in self._buckets:
                views = bucket.layout.views(bucket.flat)
                for p, g in zip(bucket.params, views):
                    g.copy_(p.grad) if p.grad is not None else g.zero_()
                self._reduce(bucket, self.refresh_compressor)
                finite &= torch.isfinite(bucket.flat).all().cpu()
                for p, g in zip(bucket.params, views):
                    if id(p) in unused:  # no gradient on any rank: Adam's own step skips it
                        continue
                    if p.grad is None:
                        p.grad = g.clone()
                    else:
                        p.grad.copy_(g)
        what = "the reduced gradient of a refresh"
        if self._settle(self.refresh_compressor, sent_before, bool(finite), what) is None:
            return False
        self.refreshes += 1
        return True

    def _settle(self, compressor: Compressor, sent_before: int, finite: bool, what: str) -> Optional[int]:
        """An exchange's end: its bytes counted, and its compressor's residuals kept (the bytes sent) or, when the
        sum is not finite, dropped with the step skipped (None): every rank holds the same sum, so the same verdict."""
        sent = self._bytes_across() - sent_before
        self.bytes_total += sent
        if not finite:
            compressor.discard()
            self._skip(what)
            return None
        compressor.commit()
        return sent

    def _unused(self) -> set[int]:
        """The parameters (``id``) that no rank's backward reached this step. Only with DDP's
        ``find_unused_parameters=True``, which says parameters may go unused; then one all-reduce of a flag per
        parameter (stock DDP learns the same in its reduction, which is off after the warm-up)."""
        if not self.context.find_unused:
            return set()
        params = [p for bucket in self._buckets for p in bucket.params]
        used = self.context.agree([p.grad is not None for p in params])
        return {id(p) for p, flag in zip(params, used) if not flag}

    def _bytes_across(self) -> int:
        """This step's bytes across workers so far (under two_tier the host's dense collectives are not counted)."""
        return self.context.stats.tier_bytes.get(self._tier, 0)

    def _skip(self, what: str) -> None:
        self.skipped += 1
        step = self.context.global_step
        warnings.warn(f"OneBitAdam skipped the update of global step {step}: {what} is not finite on every rank; "
                      "momentum, second moment and residuals stay as they were", stacklevel=4)
        self.context.record_skip(step, f"non-finite {what}: the update skipped on every rank")

    def _reduce(self, bucket: Bucket, compressor: Compressor) -> None:
        """The bucket summed over every rank through ``compressor`` (two-tier: dense inside the host first)."""
        flat, layout = bucket.flat, bucket.layout
        stats = self.context.stats
        stats.record_dense(ring_bytes_sent(flat.numel(), self.context.world_size, self.context.rank,
                                           flat.element_size()))
        codec = _DENSE if compressor.warming_up else compressor  # its start_step: sent dense first, as the comm hook
        if self._tiers is not None:
            self._tiers.reduce(flat, layout, codec)
        elif self._transport is not None:
            codec.reduce(flat, layout, self._transport)

    def _report(self, dense: bool, sent: int = 0) -> None:
        self.metrics = {"sync/compressed": 0.0 if dense else 1.0, "sync/compressed_steps": float(self.compressed_steps),
                        "sync/refreshes": float(self.refreshes), "sync/skipped": float(self.skipped),
                        "sync/bytes": float(sent), "sync/bytes_total": float(self.bytes_total),
                        # this rank's bytes per step after the warm-up (DiLoCo's key: what a sync costs per step)
                        "sync/bytes_per_step": self.bytes_total / max(1, self.compressed_steps + self.refreshes)}

    # -- checkpoints and reports ----------------------------------------------------------------------------------
    def state_dict(self, local: bool = False) -> dict[str, Any]:
        context = self.context
        ranks = gather_to_rank_zero(self.compressor.state_dict(), context.rank, context.world_size,
                                    context.exchange_group, local)
        return {"settings": self.settings.describe(), "warmup": self.warmup_steps, "world_size": context.world_size,
                "topology": self._topology, "ranks": ranks, "variance_updates": dict(self.adam.variance_updates),
                "compressed_steps": self.compressed_steps, "refreshes": self.refreshes, "skipped": self.skipped,
                "bytes_total": self.bytes_total}

    def load_state_dict(self, entry: Optional[dict[str, Any]]) -> None:
        if entry is None:
            return
        if entry.get("settings") != self.settings.describe():
            raise ValueError(f"the checkpoint was written with sync={entry.get('settings')}, this run has "
                             f"sync={self.settings.describe()}: resume with the same OneBitAdam settings")
        if not isinstance(self.settings.warmup, int):  # a fraction: the steps it resolved to in the first fit
            self.warmup_steps = entry["warmup"]
            if self.context.optimizers:  # (bound to a fit)
                self._check_warmup(self.context.estimated_steps)
        self.compressed_steps, self.refreshes = int(entry["compressed_steps"]), int(entry["refreshes"])
        if "variance_updates" in entry:
            self.adam.variance_updates = {k: int(v) for k, v in entry["variance_updates"].items()}
        else:  # written before v's updates were counted: Adam's step at v's last update, capped by the warm-up and
            # the refreshes (the updates of a parameter every step reached)
            most = (self.warmup_steps or 0) + self.refreshes
            self.adam.variance_updates = {k: min(int(v), most) for k, v in entry["variance_step"].items()}
        self.skipped, self.bytes_total = int(entry["skipped"]), int(entry["bytes_total"])
        ranks, rank = entry["ranks"], self.context.rank
        same = entry["world_size"] == self.context.world_size and entry["topology"] == self._topology
        if same and ranks[rank] is not None:
            self.compressor.load_state_dict(ranks[rank])
        else:  # another world size or layout: the residuals (each rank's debt on its own cut) restart at zero
            first = next((r for r in ranks if r is not None), None)
            if first is not None:
                self.compressor.load_state_dict(first, shared_only=True)
            rank_zero_info("RingDDPStrategy: OneBitAdam's error-feedback residuals restart at zero (the checkpoint "
                           f"was written by {entry['world_size']} ranks, {entry['topology']}); momentum, second "
                           "moment and step are Adam's own and restored")

    def report(self) -> SyncReport:
        if self._memory is None:
            self._memory = {self._buckets[0].flat.device.type if self._buckets else "cpu": self.memory_bytes()}
        return SyncReport(syncs=self.compressed_steps + self.refreshes + self.skipped, metrics=self.metrics,
                          memory=self._memory)

    def memory_bytes(self) -> int:
        """The frozen denominators and masks, the momentum's buckets and the compressor's state: beside the model."""
        numel = sum(b.flat.numel() for b in self._buckets)
        element = self._buckets[0].flat.element_size() if self._buckets else 4
        state = sum(self.compressor.state_bytes(b.layout, element) for b in self._buckets)
        return numel * (2 * element + 1) + state

    def close(self) -> None:
        destroy_groups(self._reduction.owned)
        self._reduction.owned = []
