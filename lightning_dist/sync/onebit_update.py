"""Adam's step with its second moment frozen, as OneBitAdam runs it after the warm-up: what each rank sends (its
preconditioned momentum), the update from the reduced sum, and the frozen denominators and masks both divide by.
The rule and why each part is there: docs/onebit-adam.md ("How a step goes", "What keeps it stable")."""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Optional

import torch

from lightning_dist.sync.buckets import Bucket


class Run(NamedTuple):
    """A bucket's parameters of one param group, in the bucket's order, with their views of the bucket."""

    group: dict[str, Any]
    params: list[torch.Tensor]
    views: list[torch.Tensor]


class Frozen(NamedTuple):
    """A run's denominators ``d = sqrt(v / (1 - beta2^k)) + eps`` (``k``: v's updates) and masks ``v > 0``."""

    denoms: list[torch.Tensor]
    masks: list[torch.Tensor]


Plan = list[list[tuple[Run, Frozen]]]  # per bucket, its runs with their frozen denominators


class FrozenAdam:
    """The user's Adam as the compressed steps see it: each parameter's param group, the buckets cut in runs of one
    group, how many updates each parameter's ``v`` has had (warm-up steps and refreshes: Adam's own step count also
    counts the compressed steps) and the denominators frozen from ``v`` after each of Adam's own steps."""

    def __init__(self, names: dict[int, str], buckets: list[Bucket]) -> None:
        self.names = names  # id(parameter) -> its name, for the module's trainable parameters
        self.buckets = buckets
        self.variance_updates: dict[str, int] = {}  # name -> how many updates v has had
        self._groups: dict[int, dict[str, Any]] = {}  # id(parameter) -> its param group, from a checked optimizer
        # optimizers already checked (id), with their param groups (ids): loading a state dict replaces the groups
        self._checked: dict[int, list[int]] = {}
        self._runs: Optional[list[list[Run]]] = None
        self._frozen: Optional[list[list[Frozen]]] = None  # per bucket and run; None: taken afresh when next asked

    def check(self, optimizer: Any) -> None:
        """Refuse what the compressed steps cannot follow; map each parameter to its group (once per optimizer)."""
        groups = [id(group) for group in optimizer.param_groups]
        if self._checked.get(id(optimizer)) == groups:
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
            unknown = [p for p in group["params"] if p.requires_grad and id(p) not in self.names]
            if unknown:
                raise ValueError("sync=OneBitAdam: the optimizer steps parameters that are not the module's trainable "
                                 "parameters; give configure_optimizers the module's own parameters")
        self._groups.update({id(p): group for group in optimizer.param_groups for p in group["params"]})
        self._runs = self._frozen = None  # the runs follow the groups, the denominators the runs
        self._checked[id(optimizer)] = groups

    def runs(self) -> list[list[Run]]:
        """Per bucket, its parameters in runs of one param group (made once, after :meth:`check`)."""
        if self._runs is None:
            self._runs = []
            for bucket in self.buckets:
                runs: list[Run] = []
                for p, x in zip(bucket.params, bucket.layout.views(bucket.flat)):
                    group = self._groups[id(p)]
                    if not runs or runs[-1].group is not group:
                        runs.append(Run(group, [], []))
                    runs[-1].params.append(p)
                    runs[-1].views.append(x)
                self._runs.append(runs)
        return self._runs

    def step_counts(self, optimizer: Any) -> dict[int, int]:
        """Adam's step count of every parameter that has one, before Adam's own step (which ones it then moved)."""
        return {id(p): int(state["step"]) for group in optimizer.param_groups for p in group["params"]
                if id(p) in self.names and (state := optimizer.state.get(p)) and "step" in state}

    def adam_stepped(self, optimizer: Any, before: Optional[dict[int, int]] = None) -> None:
        """Adam stepped (warm-up, refresh): v changed where Adam stepped a parameter (one more update of it; without
        ``before``, :meth:`step_counts` before the step, every parameter with a state), and the denominators and the
        masks are taken afresh."""
        self._frozen = None
        for group in optimizer.param_groups:
            for p in group["params"]:
                state = optimizer.state.get(p)
                if not (state and "step" in state and id(p) in self.names):
                    continue
                name = self.names[id(p)]
                then = before.get(id(p), 0) if before is not None else int(state["step"]) - 1
                if int(state["step"]) != then:  # a state with no count of ours is plain Adam's: its step is v's count
                    self.variance_updates[name] = self.variance_updates.get(name, then) + 1

    def frozen(self, optimizer: Any) -> list[list[Frozen]]:
        """Per bucket and run of :meth:`runs`, its denominators and masks, from the optimizer's state (taken once
        after each of Adam's own steps)."""
        if self._frozen is None:
            self._frozen = [[self._freeze(optimizer, run) for run in runs] for runs in self.runs()]
        return self._frozen

    def plan(self, optimizer: Any, unused: set[int]) -> Plan:
        """Per bucket, its runs with their frozen denominators, without the ``unused`` parameters (``id``): one no
        rank used this step is left as torch's Adam leaves it, untouched."""
        frozen = self.frozen(optimizer)
        if not unused:
            return [list(zip(runs, bucket)) for runs, bucket in zip(self.runs(), frozen)]
        return [[(Run(run.group, *_keep((run.params, run.views), run.params, unused)),
                  Frozen(*_keep(denoms, run.params, unused))) for run, denoms in zip(runs, bucket)]
                for runs, bucket in zip(self.runs(), frozen)]

    def _freeze(self, optimizer: Any, run: Run) -> Frozen:
        beta2, eps = run.group["betas"][1], run.group["eps"]
        ds, masks = [], []
        for p in run.params:
            state = optimizer.state[p]
            name = self.names.get(id(p), "")
            if "exp_avg_sq" not in state:  # never stepped: no v, no update until a refresh sees it
                _init_state(state, p)
                self.variance_updates[name] = 0
            # v's updates; a state of plain Adam's (a resume from stock DDP): its step count is v's
            k = self.variance_updates.get(name, int(state["step"]))
            v = state["exp_avg_sq"]
            correction = math.sqrt(1 - beta2 ** k) if k > 0 else 1.0
            ds.append((v.sqrt() / correction).add_(eps))
            masks.append(v > 0)
        return Frozen(ds, masks)


@torch.no_grad()
def precondition(optimizer: Any, runs: list[tuple[Run, Frozen]], share: float) -> None:
    """One bucket's views set to this rank's preconditioned momentum ``x_r = mask (a_r beta1 m + (1 - beta1) g_r) /
    d`` (``share``: ``a_r``, this rank's share of the step's samples; Adam's L2 term joins ``g_r`` as ``a_r wd p``).
    One foreach call per run and operation (a loop over parameters costs about twice as much)."""
    decoupled = _decoupled(optimizer)
    for (group, params, xs), (ds, masks) in runs:
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


@torch.no_grad()
def apply_update(optimizer: Any, plan: Plan, bound: Optional[float]) -> None:
    """Adam's step from the reduced sum ``u`` in the buckets' views (the new momentum over ``d``): ``m = mask u d``,
    Adam's step count advanced, AdamW's decoupled decay, then ``p -= lr clamp(mask u / (1 - beta1^t), -bound,
    bound)``."""
    decoupled = _decoupled(optimizer)
    for runs in plan:
        for (group, params, us), (ds, masks) in runs:
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
