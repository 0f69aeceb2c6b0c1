"""``LossScaler``: torch's ``GradScaler`` with hysteresis, a minimum scale, and a skip that others can drive.

torch's :class:`~torch.amp.GradScaler` halves the scale on every step with a non-finite gradient and doubles
it after ``growth_interval`` good steps. DeepSpeed's dynamic loss scaler adds two things this class adds too:

- **hysteresis**: the scale is cut only at the ``hysteresis``-th bad step since the scale last grew (or, with
  ``consecutive_hysteresis=True``, since the last good step); one stray overflow does not halve it;
- **a minimum scale**: the scale never drops below ``min_scale``; a bad step that would cut it further sets
  :attr:`exhausted`, which :class:`~lightning_dist.callbacks.NaNRecovery` turns into a stop on every rank.

And three for :class:`~lightning_dist.strategy.RingDDPStrategy`'s step-or-skip point, which decides before
Lightning's precision plugin runs:

- :meth:`unscale_` is idempotent within a step: the strategy unscales (one pass over the reduced, identical
  gradients: the check that every rank agrees on without a collective), the plugin's own call is then a no-op;
- :meth:`skip` records the skip in the scaler's counters exactly as ``step`` + ``update`` would;
- :meth:`agree` makes one rank's non-finite gradient every rank's bad step, where the ranks do not hold the same
  reduced gradient before the step (``sync=OneBitAdam`` after its warm-up): torch's scaler decides per rank, and a
  rank that skips the step while its peers enter the step's collectives hangs them. :meth:`plain` gives torch's
  GradScaler's behaviour in this class, for that.

The scale is kept as a Python float next to torch's tensor (updated where :meth:`update` already synchronises),
so the strategy can read it before each backward without a device synchronisation.

:meth:`state_dict` is GradScaler's with three extra keys; either class loads the other's (missing keys take
their defaults, extra keys are ignored).
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist
from torch.amp.grad_scaler import OptState


class LossScaler(torch.amp.GradScaler):
    """Dynamic loss scaling with hysteresis and a floor; a drop-in for ``torch.amp.GradScaler``.

    Args:
        device: ``"cuda"`` or ``"cpu"`` (as GradScaler).
        init_scale: the first scale, as GradScaler (2**16).
        growth_factor: the scale's factor after ``growth_interval`` good steps, as GradScaler (2).
        backoff_factor: the scale's factor when a bad step cuts it, as GradScaler (0.5).
        growth_interval: consecutive good steps before the scale grows, as GradScaler (2000).
        hysteresis: bad steps tolerated before the scale is cut (1: every bad step cuts it, as GradScaler).
        consecutive_hysteresis: restore the hysteresis after every good step (True) or only when the scale
            grows (False, DeepSpeed's default).
        min_scale: the scale's floor; a bad step at the floor sets :attr:`exhausted`.
        enabled: as GradScaler (``False``: every method passes through).
    """

    def __init__(self, device: str = "cuda", init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000, hysteresis: int = 2,
                 consecutive_hysteresis: bool = False, min_scale: float = 1.0, enabled: bool = True) -> None:
        problems = check_scaler_settings(init_scale=init_scale, growth_factor=growth_factor,
                                         backoff_factor=backoff_factor, growth_interval=growth_interval,
                                         hysteresis=hysteresis, min_scale=min_scale)
        if problems:
            raise ValueError("LossScaler: " + "; ".join(problems))
        super().__init__(device, init_scale=float(init_scale), growth_factor=float(growth_factor),
                         backoff_factor=float(backoff_factor), growth_interval=int(growth_interval), enabled=enabled)
        self.hysteresis = int(hysteresis)
        self.consecutive_hysteresis = bool(consecutive_hysteresis)
        self.min_scale = float(min_scale)
        self._hysteresis_left = self.hysteresis
        self._scale_value = _as_float32(init_scale)  # the scale as a Python float (no device sync to read)
        self._good_steps = 0  # consecutive good steps (GradScaler's growth tracker)
        self.exhausted = False  # set by a bad step that found the scale at min_scale already
        self.last_step_bad = False

    @classmethod
    def like(cls, scaler: torch.amp.GradScaler, **settings: Any) -> LossScaler:
        """A LossScaler for ``scaler``'s device with ``settings``, continuing ``scaler``'s current state."""
        new = cls(scaler._device, **settings)
        if scaler.is_enabled() and scaler._scale is not None:  # already used: carry its scale over
            new.load_state_dict({**scaler.state_dict(), "growth_factor": new._growth_factor,
                                 "backoff_factor": new._backoff_factor, "growth_interval": new._growth_interval})
        return new

    @classmethod
    def plain(cls, scaler: torch.amp.GradScaler) -> LossScaler:
        """A LossScaler that behaves as torch's GradScaler ``scaler`` (its settings and state; every bad step cuts the
        scale, no floor above float32's smallest normal number), for what needs :meth:`unscale_` idempotent or
        :meth:`agree`: a way of syncing whose ranks do not all hold the reduced gradient before the step."""
        return cls.like(scaler, init_scale=scaler.get_scale(), growth_factor=scaler.get_growth_factor(),
                        backoff_factor=scaler.get_backoff_factor(), growth_interval=scaler.get_growth_interval(),
                        hysteresis=1, min_scale=float(torch.finfo(torch.float32).tiny))

    @property
    def scale_value(self) -> float:
        """The current scale as a float, without a device synchronisation."""
        return self._scale_value if self._enabled else 1.0

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """GradScaler's, except that a second call in the same step is a no-op instead of an error."""
        if self._enabled and self._per_optimizer_states[id(optimizer)]["stage"] is OptState.UNSCALED:
            return
        super().unscale_(optimizer)

    def found_inf(self, optimizer: torch.optim.Optimizer) -> bool:
        """Unscale ``optimizer``'s gradients (once per step) and say whether any was non-finite."""
        if not self._enabled:
            return False
        self.unscale_(optimizer)
        return bool(sum(v.item() for v in self._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values()))

    def agree(self, optimizer: torch.optim.Optimizer, group: Optional[dist.ProcessGroup]) -> bool:
        """Unscale ``optimizer``'s gradients (once per step) and make the step bad on every rank of ``group`` where any
        rank found a non-finite gradient (one all-reduce of one number; every rank of ``group`` must call it). Where
        gradients are not reduced before the step, each rank's own check differs: a rank that skips ``step`` while
        its peers enter the collectives inside it would hang them. Returns whether the step is bad."""
        bad = self.found_inf(optimizer)
        if not self._enabled or not dist.is_initialized() or dist.get_world_size(group) == 1:
            return bad
        flag = torch.tensor([float(bad)])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        if flag.item() and not bad:
            self._mark_bad(self._per_optimizer_states[id(optimizer)])
        return bool(flag.item())

    def _mark_bad(self, state: dict[str, Any]) -> None:
        if not state["found_inf_per_device"]:  # nothing to unscale (no gradients): still a bad step
            assert self._scale is not None
            state["found_inf_per_device"] = {self._scale.device: torch.ones((), device=self._scale.device)}
        for found in state["found_inf_per_device"].values():
            found.fill_(1.0)

    def skip(self, optimizer: torch.optim.Optimizer) -> None:
        """Record a skipped step for ``optimizer`` (its gradients unscaled and found non-finite), as
        ``step`` would, without stepping; :meth:`update` then backs off."""
        if not self._enabled:
            return
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.READY:
            self.unscale_(optimizer)
        self._mark_bad(state)
        state["stage"] = OptState.STEPPED

    def update(self, new_scale: Optional[float | torch.Tensor] = None) -> None:
        if not self._enabled:
            return
        scale, tracker = self._check_scale_growth_tracker("update")
        if new_scale is not None:
            super().update(new_scale)
            self._scale_value = float(scale.item())
            return
        found = [f for state in self._per_optimizer_states.values() for f in state["found_inf_per_device"].values()]
        if not found:
            raise AssertionError("No inf checks were recorded prior to update.")
        bad = bool(sum(float(f.item()) for f in found))
        self.last_step_bad = bad
        value = self._scale_value
        if bad:
            self._good_steps = 0
            self._hysteresis_left = max(0, self._hysteresis_left - 1)
            if self._hysteresis_left == 0:
                if value <= self.min_scale:
                    self.exhausted = True
                value = max(value * self._backoff_factor, self.min_scale)
        else:
            self._good_steps += 1
            if self.consecutive_hysteresis:
                self._hysteresis_left = self.hysteresis
            if self._good_steps >= self._growth_interval:
                grown = value * self._growth_factor
                if grown < float("inf") and grown <= torch.finfo(torch.float32).max:
                    value = grown
                self._good_steps = 0
                self._hysteresis_left = self.hysteresis
        self._scale_value = _as_float32(value)  # what torch's float32 scale tensor holds
        scale.fill_(value)
        tracker.fill_(self._good_steps)
        self._per_optimizer_states.clear()

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        if state:
            state.update(hysteresis=self.hysteresis, _hysteresis_left=self._hysteresis_left, min_scale=self.min_scale)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        if not self._enabled:
            return
        self._scale_value = _as_float32(state_dict["scale"])
        self._good_steps = int(state_dict["_growth_tracker"])
        self.hysteresis = int(state_dict.get("hysteresis", self.hysteresis))
        self._hysteresis_left = int(state_dict.get("_hysteresis_left", self.hysteresis))
        self.min_scale = float(state_dict.get("min_scale", self.min_scale))
        self.exhausted = False


def _as_float32(value: float) -> float:
    return float(np.float32(value))


def check_scaler_settings(**settings: Any) -> list[str]:
    """What is wrong with LossScaler settings (an empty list: nothing), each with its fix."""
    problems = []

    def number(name: str) -> Optional[float]:
        value = settings.get(name)
        if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            problems.append(f"{name}={value!r} must be a number")
            return None
        return float(value)

    init, growth, backoff = number("init_scale"), number("growth_factor"), number("backoff_factor")
    floor = number("min_scale")
    if init is not None and not 0 < init < float("inf"):
        problems.append(f"init_scale={init!r} must be a positive finite number (torch's default is 2**16)")
    if growth is not None and not growth > 1:
        problems.append(f"growth_factor={growth!r} must be > 1 (the scale grows by it after good steps; 2.0)")
    if backoff is not None and not 0 < backoff < 1:
        problems.append(f"backoff_factor={backoff!r} must be in (0, 1) (the scale is cut by it; 0.5)")
    if floor is not None and not floor > 0:
        problems.append(f"min_scale={floor!r} must be > 0 (the scale's floor; 1.0)")
    if init is not None and floor is not None and floor > init:
        problems.append(f"min_scale={floor!r} is above init_scale={init!r}; lower min_scale")
    for name in ("growth_interval", "hysteresis"):
        value = settings.get(name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            problems.append(f"{name}={value!r} must be an integer >= 1")
    return problems
