"""DiLoCo's outer step: ``theta_global``, the averaged buffers, the outer Nesterov SGD, and the worker's landing.

The part of :class:`~lightning_dist.sync.diloco.DiLoCoSync` that holds the global model, in host memory: docs/sync.md
("How it works") has the algorithm.
"""

from __future__ import annotations

from typing import Optional

import torch

from lightning_dist.sync.buckets import host_copy
from lightning_dist.sync.diloco_exchange import Exchange
from lightning_dist.sync.diloco_fragments import SyncedModel
from lightning_dist.sync.diloco_settings import DiLoCoSettings


class OuterStep:
    """``theta_global`` (one host tensor per parameter), the averaged buffers and the outer
    ``torch.optim.SGD(theta_global, lr=outer_lr, momentum=outer_momentum, nesterov=True)``; the count of outer steps
    taken and skipped."""

    def __init__(self, settings: DiLoCoSettings) -> None:
        self.settings = settings
        self.theta: list[torch.Tensor] = []  # theta_global, by parameter
        # validate="mean": the workers' weighted mean at each parameter's last sync (theta_global before that outer
        # step minus the mean pseudo-gradient), the model a fit stopping there leaves; else empty
        self.mean: list[torch.Tensor] = []
        self.buffers: list[torch.Tensor] = []  # the averaged buffers, by buffer
        self.sgd: Optional[torch.optim.SGD] = None
        self.steps = 0  # outer steps taken (one per fragment sync)
        self.skipped = 0  # outer steps skipped (a non-finite pseudo-gradient)
        self.rates: dict[int, float] = {}  # per fragment, the mean inner rate of its last outer step's pseudo-gradient
        self.peak_rate = 0.0  # the highest such mean rate so far

    def attach(self, model: SyncedModel) -> None:
        """``theta_global`` and the averaged buffers start as the model's (every rank holds the same now)."""
        with torch.no_grad():
            self.theta = [host_copy(p) for p in model.params]
            self.buffers = [host_copy(b) for b in model.buffers]
            self.mean = [host_copy(p) for p in model.params] if self.settings.validate == "mean" else []
        momentum = self.settings.outer_momentum
        self.sgd = torch.optim.SGD(self.theta, lr=self.settings.outer_lr, momentum=momentum, nesterov=momentum > 0)

    def momentum(self, theta: torch.Tensor) -> Optional[torch.Tensor]:
        """The outer momentum of ``theta`` (one of :attr:`theta`), None before its first outer step."""
        return self.sgd.state.get(theta, {}).get("momentum_buffer") if self.sgd is not None else None

    def momenta(self) -> list[torch.Tensor]:
        return [s["momentum_buffer"] for s in self.sgd.state.values() if "momentum_buffer" in s] if self.sgd else []

    def step(self, exchange: Exchange) -> None:
        """The fragment's reduced mean pseudo-gradient (a finite one) applied to ``theta_global``: the outer step, or
        (``exchange.averages``) ``theta_global`` minus it, the workers' weighted mean, momentum untouched."""
        for bucket in exchange.fragment.buckets:
            for i, (start, end) in zip(bucket.index, bucket.spans):
                reduced = bucket.flat[start:end].view(self.theta[i].shape)
                if self.mean:
                    torch.sub(self.theta[i], reduced, out=self.mean[i])
                if exchange.averages:  # theta_global - mean(theta_global - theta_w): the workers' mean
                    self.theta[i].sub_(reduced)
                else:
                    self.theta[i].grad = reduced
        if not exchange.averages:
            self._answer_inner_rate(exchange)
            self.sgd.step()
            self.sgd.zero_grad(set_to_none=True)
        self.steps += 1

    def _answer_inner_rate(self, exchange: Exchange) -> None:
        """The outer step's answer to the inner learning rate (``settings.inner_rate``): from the mean inner rate of
        the steps the pseudo-gradient carries (``exchange.rate``), against the fragment's previous one and the highest
        so far. ``"rise"`` (the default) raises the outer rate as the inner rate falls, ``outer_lr / r``, up to 1
        (never below ``outer_lr``; ``r`` = this rate over the highest); ``"none"`` leaves the outer SGD as it is set
        (a pseudo-gradient shrinks with the inner rate by itself); ``"normalised"`` scales the fragment's momentum by
        the ratio of this rate to the previous (the momentum then holds LR-normalised pseudo-gradients at the current
        rate, as 0/1 Adam does); ``"follow"`` multiplies the outer rate by ``r``; ``"anneal"`` moves the outer step
        towards plain averaging as the rate falls (outer rate ``1 - (1 - outer_lr) r``, momentum
        ``outer_momentum r``). docs/sync.md measures them."""
        rule, rate = self.settings.inner_rate, exchange.rate
        group = self.sgd.param_groups[0]
        group["lr"], group["momentum"] = self.settings.outer_lr, self.settings.outer_momentum
        if rule == "none" or rate <= 0:  # (0: no optimizer's rate was read)
            return
        index = exchange.fragment.index
        previous = self.rates.get(index, 0.0)
        self.rates[index] = rate
        self.peak_rate = max(self.peak_rate, rate)
        ratio = rate / self.peak_rate
        if rule == "normalised" and previous > 0:
            for i in exchange.fragment.params:
                buf = self.momentum(self.theta[i])
                if buf is not None:
                    buf.mul_(rate / previous)
        elif rule == "follow":
            group["lr"] = self.settings.outer_lr * ratio
        elif rule == "anneal":
            group["lr"] = 1.0 - (1.0 - self.settings.outer_lr) * ratio
            group["momentum"] = self.settings.outer_momentum * ratio
        elif rule == "rise":
            group["lr"] = max(self.settings.outer_lr, min(1.0, self.settings.outer_lr / ratio))

    def land(self, exchange: Exchange, model: SyncedModel, skipped: bool) -> None:
        """The worker's parameters of the fragment from ``theta_global``: set to it (no delay, or a skip: every worker
        restarts from it), or ``p_now + mix (theta_global - p_at_s)`` (a delay), and the model's buffers from the
        averaged ones where the fragment carries them."""
        fragment = exchange.fragment
        if skipped and self.mean:  # every worker restarts from theta_global: their mean is it
            for i in fragment.params:
                self.mean[i].copy_(self.theta[i])
        if exchange.snapshot is None or skipped:
            for i in fragment.params:
                model.params[i].copy_(self.theta[i])
        else:  # the difference taken on the host and streamed over
            for i, at_start in zip(fragment.params, exchange.snapshot):
                model.params[i].add_((self.theta[i] - at_start).to(model.params[i].device), alpha=self.settings.mix)
        if fragment.buffers:
            for buf, g in zip(model.buffers, self.buffers):
                buf.copy_(g)

    def copy_to(self, model: SyncedModel) -> None:
        """Every parameter and buffer of ``model`` set to ``theta_global`` and the averaged buffers."""
        with torch.no_grad():
            for t, g in zip(model.tensors(), self.tensors()):
                t.copy_(g)

    def tensors(self) -> list[torch.Tensor]:
        """``theta_global`` and the averaged buffers, in the order of :meth:`SyncedModel.tensors`."""
        return [*self.theta, *self.buffers]

    def validated(self) -> list[torch.Tensor]:
        """The model validation runs on, in the order of :meth:`SyncedModel.tensors`: the workers' mean at the last
        sync (``validate="mean"``) or ``theta_global`` (``"global"``), with the averaged buffers."""
        return [*(self.mean or self.theta), *self.buffers]


class GlobalSwap:
    """Validation of an agreed model (``DiLoCo(validate="mean")`` or ``"global"``: :meth:`OuterStep.validated`) swapped
    in, and the worker's parameters and buffers, kept in host memory meanwhile, put back bit for bit."""

    def __init__(self) -> None:
        self.worker: Optional[list[torch.Tensor]] = None  # the worker's tensors while theta_global is swapped in

    def swap_in(self, model: SyncedModel, outer: OuterStep) -> None:
        if self.worker is not None:
            return
        with torch.no_grad():
            self.worker = [host_copy(t) for t in model.tensors()]
            for t, g in zip(model.tensors(), outer.validated()):
                t.copy_(g)

    def swap_back(self, model: SyncedModel) -> None:
        if self.worker is None:
            return
        with torch.no_grad():
            for t, kept in zip(model.tensors(), self.worker):
                t.copy_(kept)
        self.worker = None

    def worker_tensors(self, model: SyncedModel) -> dict[str, torch.Tensor]:
        """While swapped in: the worker's parameters and buffers by name; else {}."""
        return dict(zip(model.tensor_names(), self.worker)) if self.worker is not None else {}
