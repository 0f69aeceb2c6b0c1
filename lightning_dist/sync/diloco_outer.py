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
        self.buffers: list[torch.Tensor] = []  # the averaged buffers, by buffer
        self.sgd: Optional[torch.optim.SGD] = None
        self.steps = 0  # outer steps taken (one per fragment sync)
        self.skipped = 0  # outer steps skipped (a non-finite pseudo-gradient)

    def attach(self, model: SyncedModel) -> None:
        """``theta_global`` and the averaged buffers start as the model's (every rank holds the same now)."""
        with torch.no_grad():
            self.theta = [host_copy(p) for p in model.params]
            self.buffers = [host_copy(b) for b in model.buffers]
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
                if exchange.averages:  # theta_global - mean(theta_global - theta_w): the workers' mean
                    self.theta[i].sub_(reduced)
                else:
                    self.theta[i].grad = reduced
        if not exchange.averages:
            self.sgd.step()
            self.sgd.zero_grad(set_to_none=True)
        self.steps += 1

    def land(self, exchange: Exchange, model: SyncedModel, skipped: bool) -> None:
        """The worker's parameters of the fragment from ``theta_global``: set to it (no delay, or a skip: every worker
        restarts from it), or ``p_now + mix (theta_global - p_at_s)`` (a delay), and the model's buffers from the
        averaged ones where the fragment carries them."""
        fragment = exchange.fragment
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


class GlobalSwap:
    """Validation of the global model (``DiLoCo(validate="global")``): ``theta_global`` swapped in, and the worker's
    parameters and buffers, kept in host memory meanwhile, put back bit for bit."""

    def __init__(self) -> None:
        self.worker: Optional[list[torch.Tensor]] = None  # the worker's tensors while theta_global is swapped in

    def swap_in(self, model: SyncedModel, outer: OuterStep) -> None:
        if self.worker is not None:
            return
        with torch.no_grad():
            self.worker = [host_copy(t) for t in model.tensors()]
        outer.copy_to(model)

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
