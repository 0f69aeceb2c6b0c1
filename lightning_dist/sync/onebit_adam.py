"""Compressed-momentum Adam (the 1-bit Adam family) as a sync driver: ``RingDDPStrategy(sync=OneBitAdam(...))``.

Error feedback assumes an update that is linear in what is compressed; Adam's is not (the second moment divides it).
1-bit Adam (Tang et al. 2021, arXiv 2102.02888) makes it linear again: run Adam dense for a warm-up, then freeze the
second moment ``v``; from then on every worker's momentum is what travels, compressed, with error feedback on the
workers and on the reduction. Here, per optimizer step ``t`` (counted by Lightning's ``global_step``):

- **the warm-up**, the first ``warmup`` steps: today's ring_ddp step bit for bit (DDP's gradient all-reduce through
  the strategy's comm hook, then the user's ``torch.optim.Adam``/``AdamW``).
- **refreshes**, every ``refresh``-th step after it: DDP's synchronisation is off, every rank's weighted gradient is
  summed through ``refresh_compressor`` (int4 without error feedback by default) into ``.grad``, and the user's Adam
  steps on it, updating ``v``. After a warm-up step or a refresh, ``v`` is frozen as it is: the denominator ``d =
  sqrt(v / (1 - beta2^k)) + eps`` (``k`` the number of updates ``v`` has had: warm-up steps plus refreshes, not Adam's
  step count, which the compressed steps advance too; with Adam's count the step would be larger than Adam's on the
  same ``v`` by ``sqrt((1 - beta2^t) / (1 - beta2^k))``, 1.44x by step 400 of the sync benchmark at beta2 = 0.999)
  and the mask ``v > 0``. A refresh's own step is torch's, whose bias correction uses Adam's count ``t``: on that one
  step in ``refresh`` the learning rate is larger by the same factor (1.0 at beta2 = 0.95 after ~100 updates).
- **compressed steps**, the others: each rank ``r`` (share ``a_r`` of the step's samples, ``1 / N`` with even
  batches; its gradient ``g_r`` already carries it) sends ``x_r = mask (a_r beta1 m + (1 - beta1) g_r) / d``, the
  *preconditioned* momentum, through the compressor (``sign`` by default: 1 bit and a scale per 512 elements, error
  feedback on the rank and on each region's owner). Every rank gets the same sum ``u``, the new momentum over ``d``;
  then ``m = mask u d``, ``p -= lr clamp(mask u / (1 - beta1^t), -bound, bound)``, with AdamW's decoupled decay first
  (Adam's L2 term joins ``g_r`` as ``a_r wd p``).

Both exchanges are flat or two-tier as the gradients' are (dense inside a host, the compressor across hosts: the
strategy's :class:`~lightning_dist.strategy.tiers.GradientGroups`, made through :attr:`SyncContext.reduction`). The
optimizer's ``state`` keeps Adam's keys (``step``, ``exp_avg``, ``exp_avg_sq``), so a checkpoint resumes under plain
ring_ddp or stock DDP.

What keeps it stable (docs/onebit-adam.md has the measurements): compressing ``m / d`` rather than ``m`` (a chunk's
scale then never meets a ``d`` near 0, which blew up coordinates the warm-up never saw); the mask (coordinates
whose ``v`` is 0, gradients that were exactly 0 through the warm-up, such as embeddings of tokens never seen, get no
momentum and no update until a refresh sees them); the bound on the update (``|update| <= bound lr`` per coordinate);
and the refreshes.

A non-finite gradient on any rank: under NaNRecovery the step is skipped on every rank (each rank checks its own
gradients, the verdict is agreed by all), before anything is compressed; without it, a non-finite reduced momentum
(every rank sees the same) skips the update on every rank, warns, and leaves the compressor's residuals, ``m`` and
``v`` as they were.
"""

from __future__ import annotations

import copy
import math
import warnings
from dataclasses import dataclass
from typing import Any, ClassVar, Optional, Union

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_dist.comm import destroy_groups, ring_bytes_sent
from lightning_dist.compression import BucketLayout, Compressor, NoCompressor, Transport, as_compressor
from lightning_dist.loss_scaler import LossScaler
from lightning_dist.sync.driver import SyncContext, SyncDriver

BUCKET_BYTES = 25 << 20  # the momentum's buckets: DDP's default bucket size
_DENSE = NoCompressor()  # what a compressor's first start_step steps send


@dataclass
class OneBitAdam(SyncDriver):
    """Adam with its momentum compressed after a dense warm-up (the module's docstring). The user keeps
    ``torch.optim.Adam`` or ``AdamW`` in ``configure_optimizers``.

    Args:
        warmup: dense Adam steps first: an int of optimizer steps, or a fraction in ``[0, 1)`` of the fit's estimated
            steps (``trainer.estimated_stepping_batches``). 1-bit Adam's runs used 15-25%; 20% by default (on the
            sync benchmark's LM at 400 steps, 3 seeds: +0.59% to +0.68% above dense, against -0.38% to +1.14% at 15%).
        compressor: how the momentum travels: a compressor's name (``"sign"``, the default; ``"int4"``, ``"int8"``,
            ``"topk"``, ...: :func:`~lightning_dist.compression.build_compressor` with its defaults, error feedback
            included), a dict of its arguments, or a :class:`~lightning_dist.compression.Compressor`. ``"none"``
            sends it dense (Adam with a frozen second moment: the ablation).
        refresh: every ``refresh``-th step after the warm-up's end is a *refresh*: the gradient itself travels
            (through ``refresh_compressor``) and the user's Adam steps on it, updating ``v``. 0: never.
        refresh_compressor: how a refresh's gradient travels: a compressor's name (``"int4"``, the default, built
            without error feedback: a refresh is rare, and its rounding is unbiased), a dict of
            ``build_compressor``'s arguments, or a Compressor; ``"none"`` sends it dense.
        bound: the largest update per coordinate, in units of the learning rate (Adam's own is about 1); None: none.
    """

    warmup: Union[int, float] = 0.2
    compressor: Union[Compressor, str, dict, None] = "sign"
    refresh: int = 25
    refresh_compressor: Union[Compressor, str, dict, None] = "int4"
    bound: Optional[float] = 4.5
    name: ClassVar[str] = "onebit_adam"

    def __post_init__(self) -> None:
        warmup = self.warmup
        if isinstance(warmup, bool) or not isinstance(warmup, (int, float)) or not (
                (isinstance(warmup, int) and warmup >= 0) or (isinstance(warmup, float) and 0 <= warmup < 1)):
            raise ValueError(f"OneBitAdam(warmup={warmup!r}): the dense Adam steps first, an int >= 0 of optimizer "
                             "steps or a fraction in [0, 1) of the fit's steps (0.2: 20%)")
        if isinstance(self.refresh, bool) or not isinstance(self.refresh, int) or self.refresh < 0:
            raise ValueError(f"OneBitAdam(refresh={self.refresh!r}): the steps between refreshes of Adam's second "
                             "moment after the warm-up, an int >= 0 (0: never; 25 is the default)")
        if self.bound is not None and (isinstance(self.bound, bool) or not isinstance(self.bound, (int, float))
                                       or not 0 < self.bound < math.inf):
            raise ValueError(f"OneBitAdam(bound={self.bound!r}): the largest update per coordinate in units of the "
                             "learning rate, a number > 0 (4.5 is the default), or None for none")
        for key, example in (("compressor", "int4"), ("refresh_compressor", "none")):
            value = getattr(self, key)
            value = getattr(value, "value", value)
            if isinstance(value, str) and key == "refresh_compressor":
                value = {"name": value, "error_feedback": False} if value != "none" else value
            try:
                setattr(self, key, as_compressor(value))
            except ValueError as err:
                raise ValueError(f"OneBitAdam({key}=...): {str(err).split(' (e.g.')[0]} (e.g. on the command line "
                                 f"sync.{key}={example})") from err

    def describe(self) -> str:
        bound = "None" if self.bound is None else f"{self.bound:g}"
        return (f"OneBitAdam(warmup={self.warmup!r}, compressor={self.compressor.describe()}, refresh={self.refresh}, "
                f"refresh_compressor={self.refresh_compressor.describe()}, bound={bound})")

    def check(self, *, compressor: Any, hetero: Any, topology: str) -> None:
        if compressor.name != "none":
            raise ValueError(f"compressor={compressor.describe()} compresses every step's gradient; under "
                             "sync=OneBitAdam the warm-up's steps are plain Adam steps and after it the momentum "
                             f"travels compressed: OneBitAdam(compressor={compressor.name!r}) (on the command line "
                             f"sync.compressor={compressor.name}), and drop compressor=")

    def bind(self, context: SyncContext) -> OneBitAdamDriver:
        return OneBitAdamDriver(self, context)


WARMUP, REFRESH, COMPRESSED = "warmup", "refresh", "compressed"  # what a step is


def phase(index: int, warmup: int, refresh: int) -> str:
    """What optimizer step ``index`` (0-based: ``global_step`` before it) is: a warm-up step (``index < warmup``), a
    refresh (every ``refresh``-th step after the warm-up's end) or a compressed step."""
    if index < warmup:
        return WARMUP
    since = index - warmup
    return REFRESH if refresh > 0 and since > 0 and since % refresh == 0 else COMPRESSED


_Run = tuple[dict[str, Any], list[torch.Tensor], list[torch.Tensor]]  # a param group, its parameters, their views
_Frozen = tuple[list[torch.Tensor], list[torch.Tensor]]  # a run's denominators d and masks v > 0


@dataclass
class _Bucket:
    params: list[torch.Tensor]
    layout: BucketLayout
    flat: torch.Tensor


class OneBitAdamDriver(SyncDriver):
    """One rank's running OneBitAdam: its reduction groups and buckets, the frozen denominators, the hooks."""

    def __init__(self, settings: OneBitAdam, context: SyncContext) -> None:
        self.settings, self.context = settings, context
        self.compressor: Compressor = copy.deepcopy(settings.compressor)  # a fresh state per fit
        self.refresh_compressor: Compressor = copy.deepcopy(settings.refresh_compressor)
        self.warmup: Optional[int] = settings.warmup if isinstance(settings.warmup, int) else None
        self.compressed_steps = 0
        self.refreshes = 0
        self.skipped = 0
        self.bytes_total = 0
        self.metrics: dict[str, float] = {}
        self._trainer: Any = None
        # optimizers already checked (id), with their param groups (ids): loading a state dict replaces the groups
        self._checked: dict[int, list[int]] = {}
        module = context.module
        named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        self._names = {id(p): name for name, p in named}
        self._buckets = _buckets(named)
        self._denoms: Optional[list[list[_Frozen]]] = None  # per bucket and run of _runs(): (ds, masks)
        self._variance_updates: dict[str, int] = {}  # name -> how many updates v has had (warm-up steps, refreshes)
        self._reduction = context.reduction()  # groups of its own, flat or two-tier as the gradients' (collective)
        self._tiers = self._reduction.tiers
        self._tier = "inter_host" if self._reduction.spans_hosts else "intra_host"
        # the flat path's transport, made once (its byte counts go into the strategy's step statistics)
        self._transport = (Transport(context.algorithm, self._reduction.group, context.stats.tier(self._tier))
                           if self._reduction.group is not None else None)
        self._groups: dict[int, dict[str, Any]] = {}  # id(parameter) -> its param group, from the checked optimizer
        self._plan: Optional[list[list[_Run]]] = None
        self._scaler: Optional[LossScaler] = None  # fp16 loss scaling's, which this driver makes agree (setup)
        self._agreed_at = -1  # the global step whose scaler verdict was agreed
        self._restore(context.checkpoint)
        rank_zero_info(f"RingDDPStrategy: {settings.describe()} over {context.world_size} ranks "
                       f"({'two_tier' if self._tiers is not None else 'flat'})")

    # -- set-up ---------------------------------------------------------------------------------------------------
    def setup(self, trainer: Any) -> None:
        self._trainer = trainer
        if not trainer.lightning_module.automatic_optimization:
            raise ValueError("sync=OneBitAdam steps the optimizer itself after the warm-up, which manual optimization "
                             "(automatic_optimization=False) does not let it do; use automatic optimization or drop "
                             "sync=")
        total = trainer.estimated_stepping_batches
        if self.warmup is None:
            if not math.isfinite(total):
                raise ValueError(f"OneBitAdam(warmup={self.settings.warmup}) is a fraction of the fit's steps, which "
                                 "this fit does not know (no max_steps, max_epochs or finite data): give warmup as "
                                 "an int of steps")
            self.warmup = int(round(self.settings.warmup * total))
        if math.isfinite(total) and not self.warmup < total:
            raise ValueError(f"OneBitAdam(warmup={self.warmup}) with a fit of {int(total)} optimizer steps: the "
                             f"warm-up must end before the fit does; use warmup < {int(total)} (or a fraction such "
                             "as 0.2)")
        clip = trainer.gradient_clip_val
        if clip:
            raise ValueError(f"sync=OneBitAdam with gradient_clip_val={clip}: after the warm-up no rank holds the "
                             "summed gradient (each rank's momentum travels compressed), so clipping would see this "
                             f"rank's share of it, a limit about {self.context.world_size}x looser than under dense; "
                             "drop gradient_clip_val (OneBitAdam bounds each coordinate's update instead: bound=4.5 "
                             "learning rates by default), or train with sync=None")
        plugin = trainer.precision_plugin
        scaler = getattr(plugin, "scaler", None)
        if isinstance(scaler, torch.amp.GradScaler) and scaler.is_enabled() and not isinstance(scaler, LossScaler):
            # fp16 loss scaling decides per rank, and after the warm-up the ranks' gradients differ: the scaler must
            # agree (LossScaler.agree), which torch's GradScaler cannot; this one behaves as it does
            plugin.scaler = LossScaler.plain(scaler)
        self._scaler = plugin.scaler if isinstance(getattr(plugin, "scaler", None), LossScaler) else None
        for optimizer in trainer.optimizers:
            self._check_optimizer(optimizer)

    # -- every step -----------------------------------------------------------------------------------------------
    def _phase(self) -> str:
        """What the step under way is (Lightning runs the training step inside ``optimizer_step``: every hook of a
        step reads this, not a flag an earlier hook set)."""
        index = self._trainer.global_step if self._trainer is not None else 0
        return phase(index, self.warmup or 0, self.settings.refresh)

    def before_forward(self) -> None:
        # DDP's gradient all-reduce runs in the warm-up only (the flag is read by its forward). In the warm-up the flag
        # stays Lightning's: under accumulate_grad_batches its no_sync window turns it off for the window's earlier
        # micro-batches, whose gradients must not be reduced (and summed again) before the window's last one.
        if self._phase() != WARMUP:
            self.context.ddp.require_backward_grad_sync = False

    def verdict_group(self) -> None:
        """After the warm-up no gradient goes through the comm hook, whose reduced sentinels let the ranks agree
        in-band: each rank checks its own gradients, and one all-reduce of one number tells every rank whether any
        was not finite (only with NaNRecovery armed, the only caller). The verdict is then every rank's."""
        if self._phase() == WARMUP:
            return None
        if self._scaler is not None:  # the scaler's verdict, made every rank's (the strategy's decision reads it)
            self._agree_scale(self._trainer.optimizers[0])
            return None
        guard, sentinels = self.context.guard, []
        for bucket in self._buckets:
            for p in bucket.params:
                if p.grad is not None and p.grad.numel():
                    flat = p.grad.view(-1)
                    guard.check_local(flat)  # NaN in the first element when not finite; who saw it, for the message
                    sentinels.append(flat[:1].float())
        # one read of every parameter's sentinel (on a GPU: one synchronisation)
        bad = (~torch.isfinite(torch.cat(sentinels))).any().float().cpu().view(1) if sentinels else torch.zeros(1)
        if self.context.world_size > 1:
            dist.all_reduce(bad, group=self.context.exchange_group)
        guard.check_reduced(torch.full((1,), math.nan if bad.item() else 0.0))
        return None

    def optimizer_step(self, optimizer: Any, closure: Any, step: Any) -> Any:
        self._check_optimizer(optimizer)
        now = self._phase()
        if now == WARMUP:
            before = self._steps(optimizer)
            output = step(closure)
            self._after_adam(optimizer, before)
            return output

        def agreed() -> Any:  # backward, then (fp16) every rank's scaler holds the same verdict
            output = closure()
            if self._scaler is not None:
                self._agree_scale(optimizer)
            return output

        def ours(closure: Any = None) -> Any:  # Lightning's path runs (hooks, clipping), then this step
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            if now == COMPRESSED:
                self._compressed_update(optimizer)
            elif self._reduce_gradients():  # a refresh: Adam's own step on the reduced gradient
                before = self._steps(optimizer)
                type(optimizer).step(optimizer)
                self._after_adam(optimizer, before)
            return loss

        own = optimizer.__dict__.get("step")
        optimizer.step = ours
        try:
            return step(agreed)
        finally:
            if own is None:
                del optimizer.step
            else:
                optimizer.step = own

    def _agree_scale(self, optimizer: Any) -> None:
        """fp16 loss scaling after the warm-up: one rank's non-finite gradient is every rank's skipped step (once a
        step: the verdict's group and the optimizer step both ask)."""
        step = self._trainer.global_step
        if self._agreed_at != step:
            self._agreed_at = step
            self._scaler.agree(optimizer, self.context.exchange_group)

    def _steps(self, optimizer: Any) -> dict[int, int]:
        """Adam's step count of every parameter that has one, before Adam's own step (which ones it then moved)."""
        return {id(p): int(state["step"]) for group in optimizer.param_groups for p in group["params"]
                if id(p) in self._names and (state := optimizer.state.get(p)) and "step" in state}

    def _after_adam(self, optimizer: Any, before: Optional[dict[int, int]] = None) -> None:
        """Adam stepped (warm-up, refresh): v changed where Adam stepped a parameter (one more update of it; without
        ``before``, :meth:`_steps` before the step, every parameter with a state), and the denominators and the mask
        are taken afresh."""
        self._denoms = None
        for group in optimizer.param_groups:
            for p in group["params"]:
                state = optimizer.state.get(p)
                if not (state and "step" in state and id(p) in self._names):
                    continue
                name = self._names[id(p)]
                then = before.get(id(p), 0) if before is not None else int(state["step"]) - 1
                if int(state["step"]) != then:  # a state with no count of ours is plain Adam's: its step is v's count
                    self._variance_updates[name] = self._variance_updates.get(name, then) + 1
        self._report(dense=True)

    def _frozen(self, optimizer: Any) -> list[list[_Frozen]]:
        """Per bucket and run of :meth:`_runs`, its parameters' ``d = sqrt(v / (1 - beta2^k)) + eps`` (``k``: v's
        updates) and masks ``v > 0``, from the optimizer's state (taken once after each step of Adam's own)."""
        if self._denoms is None:
            self._denoms = [[self._denominators(optimizer, group, params) for group, params, _ in runs]
                            for runs in self._runs()]
        return self._denoms

    def _denominators(self, optimizer: Any, group: dict[str, Any], params: list[torch.Tensor]) -> _Frozen:
        beta2, eps = group["betas"][1], group["eps"]
        ds, masks = [], []
        for p in params:
            state = optimizer.state[p]
            name = self._names.get(id(p), "")
            if "exp_avg_sq" not in state:  # never stepped: no v, no update until a refresh sees it
                _init_state(state, p)
                self._variance_updates[name] = 0
            # v's updates; a state of plain Adam's (a resume from stock DDP): its step count is v's
            k = self._variance_updates.get(name, int(state["step"]))
            v = state["exp_avg_sq"]
            correction = math.sqrt(1 - beta2 ** k) if k > 0 else 1.0
            ds.append((v.sqrt() / correction).add_(eps))
            masks.append(v > 0)
        return ds, masks

    def _compressed_update(self, optimizer: Any) -> None:
        self._check_optimizer(optimizer)  # once per optimizer: it maps each parameter to its group
        unused = self._unused()
        frozen = self._frozen(optimizer)
        runs_of = self._runs()
        if unused:  # a parameter no rank used this step is left as torch's Adam leaves it: untouched
            frozen = [[_keep(denoms, params, unused) for (_, params, _), denoms in zip(runs, bucket)]
                      for runs, bucket in zip(runs_of, frozen)]
            runs_of = [[(group, *_keep((params, xs), params, unused)) for group, params, xs in runs]
                       for runs in runs_of]
        share = self.context.share()
        decoupled = _decoupled(optimizer)
        sent_before = self._across()
        finite = torch.ones((), dtype=torch.bool, device=self._buckets[0].flat.device) if self._buckets else None
        with torch.no_grad():  # one foreach call per group and operation (a loop over parameters costs ~2x)
            for bucket, runs, denoms in zip(self._buckets, runs_of, frozen):
                if unused:
                    bucket.flat.zero_()  # an unused parameter's part sends nothing
                for (group, params, xs), (ds, masks) in zip(runs, denoms):
                    if not params:
                        continue
                    beta1, wd = group["betas"][0], group["weight_decay"]
                    torch._foreach_copy_(xs, [optimizer.state[p]["exp_avg"] for p in params])
                    torch._foreach_mul_(xs, share * beta1)
                    with_grad = [(x, p.grad) for x, p in zip(xs, params) if p.grad is not None]
                    if with_grad:
                        torch._foreach_add_(*map(list, zip(*with_grad)), alpha=1 - beta1)
                    if wd and not decoupled:  # Adam's L2 term, this rank's share of it
                        torch._foreach_add_(xs, params, alpha=(1 - beta1) * share * wd)
                    torch._foreach_div_(xs, ds)
                    torch._foreach_mul_(xs, masks)
                self._reduce(bucket, self.compressor)
                # a sum is finite where every element is (no preconditioned momentum, |u| ~ 1, overflows it): one
                # reduction instead of a finiteness pass
                finite &= torch.isfinite(bucket.flat.sum())
        sent = self._across() - sent_before
        self.bytes_total += sent
        if finite is not None and not bool(finite):  # the same verdict on every rank: they hold the same sum
            self.compressor.discard()
            self._skip("the reduced momentum")
            return
        self.compressor.commit()
        bound = self.settings.bound
        with torch.no_grad():
            for runs, denoms in zip(runs_of, frozen):
                for (group, params, us), (ds, masks) in zip(runs, denoms):
                    if not params:
                        continue
                    beta1, lr, wd = group["betas"][0], float(group["lr"]), group["weight_decay"]
                    states = [optimizer.state[p] for p in params]
                    torch._foreach_mul_(us, masks)
                    momenta = [state["exp_avg"] for state in states]
                    torch._foreach_copy_(momenta, us)
                    torch._foreach_mul_(momenta, ds)  # m = mask u d
                    steps = [state["step"] for state in states]
                    torch._foreach_add_(steps, 1)
                    if wd and decoupled:
                        torch._foreach_mul_(params, 1 - lr * wd)
                    torch._foreach_div_(us, [1 - beta1 ** float(t) for t in steps])
                    if bound is not None:
                        torch._foreach_clamp_min_(us, -bound)
                        torch._foreach_clamp_max_(us, bound)
                    torch._foreach_add_(params, us, alpha=-lr)
        self.compressed_steps += 1
        self._report(dense=False, sent=sent)

    def _runs(self) -> list[list[_Run]]:
        """Per bucket, its parameters in runs of one param group: ``(group, parameters, their views of the bucket)``
        (made once, after the optimizer's check has mapped every parameter to its group)."""
        if self._plan is None:
            self._plan = []
            for bucket in self._buckets:
                runs: list[_Run] = []
                for p, x in zip(bucket.params, bucket.layout.views(bucket.flat)):
                    group = self._groups[id(p)]
                    if not runs or runs[-1][0] is not group:
                        runs.append((group, [], []))
                    runs[-1][1].append(p)
                    runs[-1][2].append(x)
                self._plan.append(runs)
        return self._plan

    def _reduce_gradients(self) -> bool:
        """A refresh: every rank's weighted gradient summed through the refresh's compressor into ``.grad``; whether
        the sum is finite (else the step is skipped on every rank: they hold the same sum)."""
        unused = self._unused()
        sent_before = self._across()
        finite = torch.ones((), dtype=torch.bool)
        with torch.no_grad():
            for bucket in self._buckets:
                for p, g in zip(bucket.params, bucket.layout.views(bucket.flat)):
                    g.copy_(p.grad) if p.grad is not None else g.zero_()
                self._reduce(bucket, self.refresh_compressor)
                finite &= torch.isfinite(bucket.flat).all().cpu()
                for p, g in zip(bucket.params, bucket.layout.views(bucket.flat)):
                    if id(p) in unused:  # no gradient on any rank: Adam's own step skips it
                        continue
                    if p.grad is None:
                        p.grad = g.clone()
                    else:
                        p.grad.copy_(g)
        sent = self._across() - sent_before
        self.bytes_total += sent
        if not bool(finite):
            self.refresh_compressor.discard()
            self._skip("the reduced gradient of a refresh")
            return False
        self.refresh_compressor.commit()
        self.refreshes += 1
        return True

    def _unused(self) -> set[int]:
        """The parameters (``id``) that no rank's backward reached this step. Only with DDP's
        ``find_unused_parameters=True``, which says parameters may go unused; then one all-reduce of a flag per
        parameter (stock DDP learns the same in its reduction, which is off after the warm-up)."""
        if not self.context.ddp.find_unused_parameters:
            return set()
        params = [p for bucket in self._buckets for p in bucket.params]
        used = torch.tensor([p.grad is not None for p in params], dtype=torch.uint8)
        if self.context.world_size > 1:
            dist.all_reduce(used, op=dist.ReduceOp.MAX, group=self.context.exchange_group)
        return {id(p) for p, flag in zip(params, used.tolist()) if not flag}

    def _across(self) -> int:
        """This step's bytes across workers so far (under two_tier the host's dense collectives are not counted)."""
        return self.context.stats.tier_bytes.get(self._tier, 0)

    def _skip(self, what: str) -> None:
        self.skipped += 1
        step = self._trainer.global_step if self._trainer is not None else 0
        warnings.warn(f"OneBitAdam skipped the update of global step {step}: {what} is not finite on every rank; "
                      "momentum, second moment and residuals stay as they were", stacklevel=3)
        self.context.record_skip(step, f"non-finite {what}: the update skipped on every rank")

    def _reduce(self, bucket: _Bucket, compressor: Compressor) -> None:
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

    def _check_optimizer(self, optimizer: Any) -> None:
        if self._checked.get(id(optimizer)) == [id(group) for group in optimizer.param_groups]:
            return
        if not isinstance(optimizer, torch.optim.Adam):  # AdamW is an Adam (torch >= 2.6)
            raise ValueError(f"sync=OneBitAdam compresses Adam's momentum, and configure_optimizers returned a "
                             f"{type(optimizer).__name__}: return torch.optim.Adam or AdamW, or drop sync=")
        for group in optimizer.param_groups:
            refused = [key for key in ("amsgrad", "maximize", "fused", "capturable") if group.get(key)]
            if refused:
                raise ValueError(f"sync=OneBitAdam with Adam({refused[0]}=True): the compressed steps follow plain "
                                 f"Adam's rule with foreach kernels and Adam's step count on the CPU; set "
                                 f"{refused[0]}=False")
            unknown = [p for p in group["params"] if p.requires_grad and id(p) not in self._names]
            if unknown:
                raise ValueError("sync=OneBitAdam: the optimizer steps parameters that are not the module's trainable "
                                 "parameters; give configure_optimizers the module's own parameters")
        self._groups.update({id(p): group for group in optimizer.param_groups for p in group["params"]})
        self._plan = self._denoms = None  # the runs follow the groups, the denominators the runs
        self._checked[id(optimizer)] = [id(group) for group in optimizer.param_groups]

    # -- checkpoints and reports ----------------------------------------------------------------------------------
    def checkpoint_entry(self, local: bool = False) -> dict[str, Any]:
        context = self.context
        mine = _to_cpu(self.compressor.state_dict())
        ranks: list[Any] = [None] * context.world_size
        if local or context.world_size == 1 or not dist.is_initialized():
            ranks[context.rank] = mine
        else:
            dist.gather_object(mine, ranks if context.rank == 0 else None, dst=0, group=context.exchange_group)
        return {"settings": self.settings.describe(), "warmup": self.warmup, "world_size": context.world_size,
                "topology": "two_tier" if self._tiers is not None else "flat", "ranks": ranks,
                "variance_updates": dict(self._variance_updates), "compressed_steps": self.compressed_steps,
                "refreshes": self.refreshes, "skipped": self.skipped, "bytes_total": self.bytes_total}

    def _restore(self, checkpoint: Optional[dict[str, Any]]) -> None:
        entry = (checkpoint or {}).get("sync")
        if checkpoint is None or entry is None:
            return
        if entry.get("settings") != self.settings.describe():
            raise ValueError(f"the checkpoint was written with sync={entry.get('settings')}, this run has "
                             f"sync={self.settings.describe()}: resume with the same OneBitAdam settings")
        self.warmup = entry["warmup"] if self.warmup is None else self.warmup
        self.compressed_steps, self.refreshes = int(entry["compressed_steps"]), int(entry["refreshes"])
        if "variance_updates" in entry:
            self._variance_updates = {k: int(v) for k, v in entry["variance_updates"].items()}
        else:  # written before v's updates were counted: Adam's step at v's last update, capped by the warm-up and
            # the refreshes (the updates of a parameter every step reached)
            most = (self.warmup or 0) + self.refreshes
            self._variance_updates = {k: min(int(v), most) for k, v in entry["variance_step"].items()}
        self.skipped, self.bytes_total = int(entry["skipped"]), int(entry["bytes_total"])
        ranks, rank = entry["ranks"], self.context.rank
        layout = "two_tier" if self._tiers is not None else "flat"
        same = entry["world_size"] == self.context.world_size and entry["topology"] == layout
        if same and ranks[rank] is not None:
            self.compressor.load_state_dict(ranks[rank])
        else:  # another world size or layout: the residuals (each rank's debt on its own cut) restart at zero
            first = next((r for r in ranks if r is not None), None)
            if first is not None:
                self.compressor.load_state_dict(first, shared_only=True)
            rank_zero_info("RingDDPStrategy: OneBitAdam's error-feedback residuals restart at zero (the checkpoint "
                           f"was written by {entry['world_size']} ranks, {entry['topology']}); momentum, second "
                           "moment and step are Adam's own and restored")

    @property
    def syncs(self) -> int:
        return self.compressed_steps + self.refreshes + self.skipped

    def memory_bytes(self) -> int:
        """The frozen denominators and masks, the momentum's buckets and the compressor's state."""
        numel = sum(b.flat.numel() for b in self._buckets)
        element = self._buckets[0].flat.element_size() if self._buckets else 4
        state = sum(self.compressor.state_bytes(b.layout, element) for b in self._buckets)
        return numel * (2 * element + 1) + state

    def close(self) -> None:
        destroy_groups(self._reduction.owned)
        self._reduction.owned = []


def _buckets(named: list[tuple[str, torch.Tensor]]) -> list[_Bucket]:
    """The parameters in the module's order, in runs of one dtype and device of at most :data:`BUCKET_BYTES`."""
    runs: list[list[tuple[str, torch.Tensor]]] = []
    size = 0
    for name, p in named:
        nbytes = p.numel() * p.element_size()
        if not runs or p.dtype != runs[-1][0][1].dtype or p.device != runs[-1][0][1].device \
                or size + nbytes > BUCKET_BYTES:
            runs.append([])
            size = 0
        runs[-1].append((name, p))
        size += nbytes
    return [_Bucket([p for _, p in run], BucketLayout.of([(name, p.shape) for name, p in run]),
                    torch.zeros(sum(p.numel() for _, p in run), dtype=run[0][1].dtype, device=run[0][1].device))
            for run in runs]


def _keep(lists: tuple[list, ...], params: list[torch.Tensor], unused: set[int]) -> tuple[list, ...]:
    """``lists`` (parallel to ``params``) without the entries of the ``unused`` parameters."""
    return tuple([item for item, p in zip(items, params) if id(p) not in unused] for items in lists)


def _decoupled(optimizer: torch.optim.Adam) -> bool:
    """AdamW's decoupled weight decay (torch >= 2.6 keeps it as a group setting of Adam; AdamW sets it)."""
    group = optimizer.param_groups[0]
    return bool(group.get("decoupled_weight_decay", isinstance(optimizer, torch.optim.AdamW)))


def _init_state(state: dict[str, Any], p: torch.Tensor) -> None:
    """Adam's state for a parameter it never stepped, as its first step makes it."""
    state["step"] = torch.tensor(0.0)
    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def _to_cpu(tree: Any) -> Any:
    """Tensors moved to the CPU before any gather (rank zero would otherwise unpickle every rank's onto its GPU)."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().cpu()
    if isinstance(tree, dict):
        return {k: _to_cpu(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_to_cpu(v) for v in tree)
    return tree
