"""Compressor state that survives DDP's bucket rebuilds and can be rolled back by one step.

:class:`ParamState` holds one tensor per parameter, keyed by the parameter's name (DDP renumbers and
regroups its buckets after the first step and in every new process, so anything keyed by bucket would land
on the wrong gradients). Writes during a step are *staged*; :meth:`ParamState.commit` makes them the state,
:meth:`ParamState.discard` drops them. Reads see the latest value: a step's own staged write, else the
committed one.

:class:`StagedGenerator` is a ``torch.Generator`` seeded per rank whose position is rolled back with the
step it was drawn in, and saved with the checkpoint.

:class:`Scratch` keeps a codec's working buffers from one step to the next: a fresh bucket-sized temporary
costs about one pass over the bucket in page faults on the CPU, more than some codecs' whole arithmetic.
"""

from __future__ import annotations

from typing import Any, Optional

import torch


class ParamState:
    """Per-parameter tensors (residuals, factors), staged per step.

    A staged write may carry a condition (``keep_if``: a 0-dim bool tensor, e.g. "this bucket was finite") that is
    read only at :meth:`commit`: a write whose condition is false is dropped there, and the committed tensor stays.
    The codecs decide finiteness on the communication worker, where reading a device flag would wait for every
    kernel queued so far (and so for backward): the flags are read together, once per step, between steps."""

    def __init__(self) -> None:
        self._committed: dict[str, torch.Tensor] = {}
        self._staged: dict[str, torch.Tensor] = {}
        self._conditions: dict[str, torch.Tensor] = {}  # name -> keep_if of its staged write

    def get(self, name: str) -> Optional[torch.Tensor]:
        """The latest tensor for ``name`` (this step's staged one, else the committed one), or None."""
        value = self._staged.get(name)
        return self._committed.get(name) if value is None else value

    def committed(self, name: str) -> Optional[torch.Tensor]:
        return self._committed.get(name)

    def stage(self, name: str, value: torch.Tensor, keep_if: Optional[torch.Tensor] = None) -> None:
        """Stage ``value`` for ``name``; with ``keep_if``, :meth:`commit` keeps it only where that flag is true."""
        self._staged[name] = value
        if keep_if is None:
            self._conditions.pop(name, None)
        else:
            self._conditions[name] = keep_if

    def unstage(self, name: str) -> None:
        self._staged.pop(name, None)
        self._conditions.pop(name, None)

    def commit(self) -> None:
        if self._conditions:  # every flag of the step in one read (one host sync per step, on the calling thread)
            flags = {id(c): c for c in self._conditions.values()}
            kept = dict(zip(flags, torch.stack([c.detach().reshape(()).to("cpu", torch.bool)
                                                for c in flags.values()]).tolist()))
            for name, condition in self._conditions.items():
                if not kept[id(condition)]:
                    self._staged.pop(name, None)
            self._conditions.clear()
        self._committed.update(self._staged)
        self._staged.clear()

    def discard(self) -> None:
        self._staged.clear()
        self._conditions.clear()

    def scale_(self, factor: float) -> None:
        """Multiply every tensor, committed and staged, by ``factor`` in place."""
        for t in {id(t): t for t in (*self._committed.values(), *self._staged.values())}.values():
            t.mul_(factor)

    def __len__(self) -> int:
        return len(set(self._committed) | set(self._staged))

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The committed tensors (a checkpoint is written between steps), copied to the CPU, contiguous."""
        return {name: t.detach().to("cpu", copy=True).contiguous() for name, t in self._committed.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self._committed = {name: t.clone() for name, t in state.items()}
        self._staged.clear()
        self._conditions.clear()

    def to(self, device: torch.device) -> None:
        """Move the committed tensors next to the gradients (a checkpoint loads them on the CPU)."""
        for name, t in self._committed.items():
            if t.device != device:
                self._committed[name] = t.to(device)


class StagedGenerator:
    """A random generator seeded with ``(seed, rank)``, rolled back by :meth:`discard`.

    Ranks draw independent streams (different ranks' rounding noise must not be correlated). The seed is
    taken at the first draw, when the rank is known.
    """

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self._gen: Optional[torch.Generator] = None
        self._at_step_start: Optional[torch.Tensor] = None
        self._loaded: Optional[tuple[torch.Tensor, str]] = None  # (state, device type) from a checkpoint

    def get(self, rank: int, device: torch.device) -> torch.Generator:
        if self._gen is None or self._gen.device != device:
            gen = torch.Generator(device=device)
            if self._loaded is not None and self._loaded[1] == device.type:  # a CPU state fits CPU generators only
                gen.set_state(self._loaded[0])
            else:
                gen.manual_seed(self.seed * 1_000_003 + rank)
            self._gen, self._loaded = gen, None
        if self._at_step_start is None:
            self._at_step_start = self._gen.get_state()
        return self._gen

    def commit(self) -> None:
        self._at_step_start = None

    def discard(self) -> None:
        if self._at_step_start is not None and self._gen is not None:
            self._gen.set_state(self._at_step_start)
        self._at_step_start = None

    def state_dict(self) -> dict[str, Any]:
        if self._gen is None:
            return {} if self._loaded is None else {"rng": self._loaded[0].clone(), "rng_device": self._loaded[1]}
        return {"rng": self._gen.get_state().clone(), "rng_device": self._gen.device.type}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._gen, self._at_step_start = None, None
        self._loaded = (state["rng"], state.get("rng_device", "cpu")) if "rng" in state else None


class Scratch:
    """Working buffers reused across steps, one per ``key``: :meth:`get` returns the same tensor while the
    size, dtype and device asked for stay the same (its contents are whatever the last user left)."""

    def __init__(self) -> None:
        self._buffers: dict[Any, torch.Tensor] = {}

    def get(self, key: Any, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        buf = self._buffers.get(key)
        if buf is None or buf.numel() != numel or buf.dtype != dtype or buf.device != device:
            buf = self._buffers[key] = torch.empty(numel, dtype=dtype, device=device)
        return buf

    def keep_only(self, keys: set) -> None:
        """Drop every buffer whose key is not in ``keys`` (a bucket layout DDP has since rebuilt)."""
        for key in set(self._buffers) - keys:
            del self._buffers[key]
