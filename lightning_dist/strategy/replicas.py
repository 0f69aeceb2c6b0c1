"""Do the replicas still agree? A bitwise fingerprint of every parameter, compared across ranks; repair by broadcast.

Data parallelism keeps one copy of the model per rank and relies on every rank applying the same update to
the same weights. Bit-identical reduced gradients make that true on identical hardware; mixed hardware
(different GPUs, different kernels, a different BLAS) computes the same optimizer step with different
rounding, and replicas drift apart one ulp at a time. Nothing in training notices: each rank trains its own
slightly different model.

:func:`fingerprints` takes two 64-bit numbers per parameter and buffer, on the tensor's device: the XOR of
every element's bits (``torch.hash_tensor``) and their wrapping sum; any rounding difference changes one of
them. :func:`compare` all-gathers
them (a few bytes per tensor) and names the tensors whose hashes are not the same on every rank, with the
ranks that differ from rank zero. :func:`repair` broadcasts rank zero's parameters, buffers and optimizer
state to every rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Optional

import torch
import torch.distributed as dist
from torch import nn


@dataclass
class DriftReport:
    """The outcome of one comparison, identical on every rank."""

    checked: int  # tensors compared
    mismatched: dict[str, list[int]] = field(default_factory=dict)  # tensor name -> ranks that differ from rank 0

    @property
    def agree(self) -> bool:
        return not self.mismatched

    def describe(self, limit: int = 5) -> str:
        if self.agree:
            return f"all {self.checked} tensors agree on every rank"
        names = sorted(self.mismatched)
        shown = ", ".join(f"{n} (ranks {self.mismatched[n]})" for n in names[:limit])
        more = f" and {len(names) - limit} more" if len(names) > limit else ""
        return f"{len(names)} of {self.checked} tensors differ from rank 0: {shown}{more}"


def _named_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [*module.named_parameters(), *((n, b) for n, b in module.named_buffers() if b is not None)]


_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _fingerprint(t: torch.Tensor) -> torch.Tensor:
    """Two int64 numbers for one tensor: the XOR of its elements' bits (``torch.hash_tensor``) and the wrapping
    sum of the same bits. The XOR alone misses two elements moved by the same bit pattern (two values one ulp
    up from the same value); the sum sees those. Both are blind only to a permutation of the elements, which
    rounding differences do not produce."""
    t = t.detach()
    if not t.numel():
        return torch.zeros(2, dtype=torch.int64)
    bits = t.reshape(-1).view(_BITS[t.element_size()]) if t.element_size() in _BITS else t.reshape(-1)
    return torch.stack([torch.hash_tensor(t).view(torch.int64), bits.sum(dtype=torch.int64)]).cpu()


def fingerprints(module: nn.Module) -> tuple[list[str], torch.Tensor]:
    """Names and one fingerprint (two int64) per parameter and buffer, stacked ``[tensors, 2]`` on the CPU;
    each computed on its tensor's device."""
    named = _named_tensors(module)
    prints = [_fingerprint(t) for _, t in named]
    return [n for n, _ in named], (torch.stack(prints) if prints else torch.zeros(0, 2, dtype=torch.int64))


def compare(module: nn.Module, group: Optional[dist.ProcessGroup] = None) -> DriftReport:
    """Fingerprint ``module`` on every rank and compare (one all-gather on ``group``, which must take CPU
    tensors: gloo). Every rank must call it, with the same module structure."""
    names, mine = fingerprints(module)
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    if world == 1:
        return DriftReport(checked=len(names))
    mine = mine.reshape(-1).contiguous()
    everyone = torch.empty(world * mine.numel(), dtype=torch.int64)
    dist.all_gather_into_tensor(everyone, mine, group=group)
    differs = (everyone.view(world, len(names), -1) != everyone.view(world, len(names), -1)[0]).any(dim=2)
    mismatched = {names[j]: [r for r in range(world) if differs[r, j]] for j in range(len(names))
                  if bool(differs[:, j].any())}
    return DriftReport(checked=len(names), mismatched=mismatched)


def repair(module: nn.Module, optimizers: Iterable[torch.optim.Optimizer] = (),
           group: Optional[dist.ProcessGroup] = None) -> int:
    """Make every rank's parameters, buffers and optimizer state rank zero's (broadcasts on ``group``, whose
    backend must take the tensors' device: the default group does). Returns the number of tensors sent."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return 0
    src = dist.get_global_rank(group, 0) if group is not None else 0
    tensors = [t.detach() for _, t in _named_tensors(module)]
    for optimizer in optimizers:
        for state in optimizer.state.values():
            tensors += [v for _, v in sorted(state.items()) if isinstance(v, torch.Tensor)]
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else None
    with torch.no_grad():
        for t in tensors:
            if device is not None and t.device.type == "cpu":  # NCCL sends device tensors only (Adam's step count)
                moved = t.to(device)
                dist.broadcast(moved, src=src, group=group)
                t.copy_(moved)
            else:
                dist.broadcast(t, src=src, group=group)
    return len(tensors)
