"""DiLoCo's settings (:class:`DiLoCoSettings`), checked when the object is built, before any process starts.

:class:`~lightning_dist.sync.DiLoCo` (:mod:`lightning_dist.sync.diloco_driver`) is these settings as sync settings, the
object users pass to ``RingDDPStrategy(sync=...)``; the outer loop (:mod:`lightning_dist.sync.diloco`) reads them. What
each setting costs and buys, measured, is on docs/sync.md."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Union

from lightning_dist.compression import Compressor, as_compressor

BALANCES = ("batches", "steps")  # how workers of different speeds meet at a sync (DiLoCo(balance=...))
VALIDATES = ("mean", "global", "worker")  # which model validation runs on (DiLoCo(validate=...))
INNER_RATES = ("none", "normalised", "follow", "anneal", "rise")  # how the outer step answers the inner learning rate


@dataclass
class DiLoCoSettings:
    """Synchronise the workers every ``every`` optimizer steps instead of every step (DiLoCo, Douillard et al. 2023).

    A *worker* is a host under ``topology="two_tier"`` (its ranks all-reduce their gradients every step over the links
    inside the host) and a rank under ``"flat"``. Between syncs each worker trains alone: the user's optimizer (the
    *inner* optimizer) steps on the worker's own gradient. After every ``every``-th optimizer step (``global_step`` a
    multiple of ``every``) the workers' mean pseudo-gradient ``theta_global - theta_worker`` is the gradient of an outer
    ``torch.optim.SGD([theta_global], lr=outer_lr, momentum=outer_momentum, nesterov=True)`` step, and every rank
    continues from the new ``theta_global`` (:mod:`lightning_dist.sync.diloco`).

    Args:
        every: inner steps between syncs (``H``), at least 1.
        outer_lr: the outer SGD's learning rate (0.7 in the paper; 1.0 with ``outer_momentum=0`` averages the
            workers' parameters).
        outer_momentum: the outer SGD's Nesterov momentum, in ``[0, 1)``. 0.8 by default, under the paper's 0.9 (a
            run of thousands of inner steps from a pretrained model): on runs of 10-32 syncs from scratch 0.9
            overshoots (measured on docs/sync.md).
        compressor: how the pseudo-gradient travels between workers: None (dense, by the strategy's algorithm), a
            compressor name (``"int8"``, ``"topk"``, ...: :func:`~lightning_dist.compression.build_compressor` with
            its defaults, error feedback included where it has it), a dict of ``build_compressor``'s arguments, or a
            :class:`~lightning_dist.compression.Compressor`. Its error feedback is kept per worker across syncs (and
            per fragment: each fragment has a copy of its own).
        fragments: ``F``, the number of fragments the parameters are cut into (Streaming DiLoCo, Douillard et al.
            2025): whole parameters, in the module's ``named_parameters`` order, about ``1 / F`` of the elements each.
            Fragment ``f`` syncs after the optimizer steps where ``global_step % every == f * every / F``, so every
            parameter still syncs once per ``every`` steps and the link carries ``1 / F`` of the model at a time.
            ``F`` divides ``every``; 1 (the default) syncs the whole model at once.
        delay: ``tau``, the inner steps a fragment's exchange overlaps: it starts after the fragment's sync step ``s``
            on a communication thread of its own, while steps ``s + 1 ... s + tau`` compute, and is applied after step
            ``s + tau``. 0 (the default) syncs in the step, as without fragments. Below ``every``: a fragment's exchange
            lands before its own next sync (with ``tau > every / F`` several fragments' exchanges are in flight at
            once, one after another on the thread).
        mix: ``alpha``, how a delayed fragment lands: its parameters become ``p_now + alpha * (theta_global_new -
            p_at_s)``, i.e. ``alpha`` of the way from the worker's own value to ``theta_global_new`` plus the worker's
            progress since ``s`` (1 takes that global value whole; Streaming DiLoCo's 0.5 is the default). Unused when
            ``delay`` is 0: the worker restarts from ``theta_global_new``, as part 1 does.
        balance: how workers of different speeds meet at a sync. ``"batches"`` (the default): every worker runs the
            same inner steps, and heterogeneous batching (``HeteroBatching``) makes a faster worker's batch larger;
            pseudo-gradients are weighted by samples. ``"steps"``: every worker keeps the same batch size, and a faster
            worker runs more inner steps between syncs (from the measured speeds, agreed by every rank); its
            pseudo-gradient is weighted by the samples it processed.
        final_sync: when the fit ends (``max_steps``, the last batch of ``max_epochs``, or a stop every rank agreed on,
            such as FaultTolerance's) every worker meets once more: exchanges in flight land, then every fragment with
            steps since its last sync averages the workers over them (``theta_global`` minus the mean pseudo-gradient,
            workers weighted by their samples as at every sync; no outer step, whose Nesterov extrapolation validates
            worse), in place of the sync due in a last step known as such, and every rank leaves ``fit`` holding
            ``theta_global``: the fit's last validation and the checkpoint written at its end hold the one global
            model (docs/sync.md measures it against an outer step there). ``False``: each worker keeps its own
            parameters (a fit to be resumed as if never stopped). A fault (a peer gone) skips it, with a warning.
        warmup: the fit's first ``warmup`` optimizer steps sync after every step, by plain averaging: every fragment
            at once, in the step, the workers' parameters averaged (weighted by samples, as at every sync: an outer
            step of learning rate 1 without momentum, through ``compressor`` as every pseudo-gradient). The syncs every
            ``every`` steps, with their outer momentum, start after it. Each warm-up step sends one model's worth
            across workers, as a sync does. 0 (the default) starts syncing every ``every`` steps from the first step.
            What it buys, measured, is on docs/sync.md ("The warm-up").
        validate: which model validation runs on: ``"mean"`` (the default): the workers' weighted mean at the last
            sync (``theta_global`` before that outer step minus the mean pseudo-gradient, kept in host memory: one
            more copy of the parameters), the model a fit ending at that sync leaves, since its final sync averages
            instead of stepping; ``"global"``: ``theta_global``, the outer step's model after the last sync that
            landed (its Nesterov extrapolation validates higher mid-run: docs/sync.md); ``"worker"``: each rank's own
            worker's parameters (mid-cycle the workers differ, and ``sync_dist`` metrics average over them). With
            ``"mean"`` and ``"global"`` the model is swapped in with the averaged buffers for the validation loop and
            each rank's own parameters are restored afterwards, bit for bit. The metrics ``sync/validated_mean`` and
            ``sync/validated_global`` (1 or 0) name the model validated.
        inner_rate: how the outer step answers the inner optimizer's learning rate (its parameter groups' ``lr`` at
            each step, as the user's schedule sets it), read as the mean rate of the steps each pseudo-gradient
            carries, ``r`` = that rate over the highest such rate so far. ``"rise"`` (the default): the outer rate
            rises to ``outer_lr / r`` as the inner rate falls, up to 1 (plain averaging's rate; never below
            ``outer_lr``), the momentum kept; under a constant rate (``r`` = 1, and during a warm-up, whose rate
            rises) it is ``"none"``. ``"none"``: the outer SGD stays as set; the pseudo-gradient, a sum of inner
            steps, shrinks with the inner rate by itself (the default before ``"rise"`` was measured).
            ``"normalised"``: the outer momentum is rescaled by the ratio of the rate to the previous sync's, so it
            holds pseudo-gradients as if taken at the current rate (0/1 Adam's learning-rate-normalised update).
            ``"follow"``: the outer rate is multiplied by ``r``. ``"anneal"``: as the rate falls to ``r`` of its
            highest, the outer rate moves to ``1 - (1 - outer_lr) r`` and the momentum to ``outer_momentum r``,
            towards plain averaging. Under warm-up and cosine ``"rise"`` ended closest to dense and the other three
            further than ``"none"``; under WSD, and with an int8 pseudo-gradient under cosine, ``"rise"`` ended
            closer than ``"none"`` too (docs/sync.md, "Under a decaying learning rate").
    """

    every: int = 50
    outer_lr: float = 0.7
    outer_momentum: float = 0.8
    compressor: Union[Compressor, str, dict, None] = None
    fragments: int = 1
    delay: int = 0
    mix: float = 0.5
    balance: str = "batches"
    final_sync: bool = True
    validate: str = "mean"
    warmup: int = 0
    inner_rate: str = "rise"

    def __post_init__(self) -> None:
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1:
            raise ValueError(f"DiLoCo(every={self.every!r}): the inner steps between syncs must be an int >= 1 "
                             "(1 syncs after every step; DiLoCo's paper uses 500, 10-100 suit small models)")
        if not _finite_number(self.outer_lr) or self.outer_lr <= 0:
            raise ValueError(f"DiLoCo(outer_lr={self.outer_lr!r}) must be a positive number (0.7 in the paper; 1.0 "
                             "with outer_momentum=0 averages the workers' parameters)")
        if not _finite_number(self.outer_momentum) or not 0 <= self.outer_momentum < 1:
            raise ValueError(f"DiLoCo(outer_momentum={self.outer_momentum!r}) must be in [0, 1) (0.9 in the paper)")
        self.outer_lr, self.outer_momentum = float(self.outer_lr), float(self.outer_momentum)
        if not _positive_int(self.fragments) or self.every % self.fragments:
            divisors = [d for d in range(1, self.every + 1) if self.every % d == 0]
            raise ValueError(f"DiLoCo(fragments={self.fragments!r}) with every={self.every}: the fragments must be an "
                             f"int >= 1 that divides every (fragment f syncs at step f * every / fragments); pick one "
                             f"of {divisors[:12]}{' ...' if len(divisors) > 12 else ''}"
                             f"{_hint(self.every, self.fragments)}")
        if isinstance(self.delay, bool) or not isinstance(self.delay, int) or not 0 <= self.delay < self.every:
            raise ValueError(f"DiLoCo(delay={self.delay!r}) with every={self.every}: the delay must be an int in [0, "
                             f"every - 1 = {self.every - 1}] (a fragment's exchange lands before its next sync "
                             "starts); raise every for a longer delay")
        if not _finite_number(self.mix) or not 0 < self.mix <= 1:
            raise ValueError(f"DiLoCo(mix={self.mix!r}) must be in (0, 1] (1 takes theta_global plus the worker's "
                             "progress during the delay; 0.5, Streaming DiLoCo's, is the default)")
        self.mix = float(self.mix)
        if self.balance not in BALANCES:
            raise ValueError(f"DiLoCo(balance={self.balance!r}); use 'batches' (a faster worker takes a larger batch: "
                             "HeteroBatching) or 'steps' (a faster worker runs more inner steps between syncs)")
        if not isinstance(self.final_sync, bool):
            raise ValueError(f"DiLoCo(final_sync={self.final_sync!r}) must be True (every worker meets once more when "
                             "the fit ends, and every rank leaves fit holding theta_global) or False (each worker "
                             "keeps its own parameters); on the command line sync.final_sync=true or false")
        if self.validate not in VALIDATES:
            raise ValueError(f"DiLoCo(validate={self.validate!r}); use 'mean' (validation runs on the workers' mean at "
                             "the last sync, the model a fit ending there leaves), 'global' (theta_global, the outer "
                             "step's model) or 'worker' (each rank validates its own worker's parameters); on the "
                             "command line sync.validate=mean, global or worker")
        if isinstance(self.warmup, bool) or not isinstance(self.warmup, int) or self.warmup < 0:
            raise ValueError(f"DiLoCo(warmup={self.warmup!r}): the first optimizer steps that average the workers "
                             "after every step must be an int >= 0 (0: none; e.g. warmup=100 with every=50); on the "
                             "command line sync.warmup=100")
        if self.inner_rate not in INNER_RATES:
            raise ValueError(f"DiLoCo(inner_rate={self.inner_rate!r}); use 'rise' (the default: the outer rate "
                             "rises as the inner rate falls, up to 1), 'none' (the outer step as set: the "
                             "pseudo-gradient shrinks with the inner rate by itself), 'normalised', 'follow' or "
                             "'anneal' (docs/sync.md measures each under a decaying rate); on the command line "
                             "sync.inner_rate=none")
        # a name or a dict is built now, so a bad compressor fails here, before any process starts
        try:
            self.compressor = as_compressor(getattr(self.compressor, "value", self.compressor))
        except ValueError as err:  # its message speaks of the per-step compression= group; say where this one goes
            raise ValueError(f"DiLoCo(compressor=...), the pseudo-gradient's: {str(err).split(' (e.g.')[0]} "
                             "(e.g. DiLoCo(compressor='int8'), on the command line sync.compressor=int8 or "
                             "sync.compressor={name:topk,ratio:0.01})") from err

    @property
    def streaming(self) -> bool:
        """Whether fragments or a delay are set (Streaming DiLoCo); without them the sync is part 1's."""
        return self.fragments > 1 or self.delay > 0

    def offset(self, fragment: int) -> int:
        """The step, modulo ``every``, after which ``fragment`` syncs."""
        return fragment * (self.every // self.fragments)

    def describe(self) -> str:
        """The settings in one line, for logs and for matching a checkpoint's state (part 1's line unchanged when
        no streaming setting is used). ``final_sync`` and ``validate`` are left out on purpose: neither changes the
        state a resume continues from (one acts after the last step, the other restores the workers bit for bit), so
        a checkpoint resumes under either value of both."""
        extra = ""
        if self.streaming:
            extra += f", fragments={self.fragments}, delay={self.delay}"
            extra += f", mix={self.mix:g}" if self.delay else ""
        if self.balance != "batches":
            extra += f", balance={self.balance}"
        if self.warmup:
            extra += f", warmup={self.warmup}"
        if self.inner_rate != DiLoCoSettings.inner_rate:  # the default's line unchanged
            extra += f", inner_rate={self.inner_rate}"
        return (f"DiLoCo(every={self.every}, outer_lr={self.outer_lr:g}, outer_momentum={self.outer_momentum:g}, "
                f"compressor={self.compressor.describe()}{extra})")


def _hint(every: int, fragments: Any) -> str:
    """For the error: the multiple of ``fragments`` nearest ``every``."""
    if not _positive_int(fragments):
        return ""
    return f", or an every that {fragments} divides, e.g. every={max(fragments, round(every / fragments) * fragments)}"


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _finite_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
