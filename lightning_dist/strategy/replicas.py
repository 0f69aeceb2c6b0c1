"""Do the replicas still agree? A bitwise fingerprint of every parameter, compared across ranks; repair by broadcast.

Data parallelism keeps one copy of the model per rank and relies on every rank applying the same update to
the same weights. Bit-identical reduced gradients make that true on identical hardware; mixed hardware
(different GPUs, different kernels, a different BLAS) computes the same optimizer step with different
rounding, and replicas drift apart one ulp at a time. Nothing in training notices: each rank trains its own
slightly different model.

:func:`fingerprints` takes one 64-bit hash per parameter and buffer (``torch.hash_tensor``: the XOR of every
element's bits, on the tensor's device: a one-ulp change anywhere changes it). :func:`compare` all-gathers
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


def fingerprints(module: nn.Module) -> tuple[list[str], torch.Tensor]:
    """Names and one int64 hash per parameter and buffer (on the CPU; each hash computed on its tensor's device)."""
    named = _named_tensors(module)
    hashes = [torch.hash_tensor(t.detach()).view(torch.int64).cpu() if t.numel() else torch.zeros((), dtype=torch.int64)
              for _, t in named]
    return [n for n, _ in named], (torch.stack(hashes) if hashes else torch.zeros(0, dtype=torch.int64))


def compare(module: nn.Module, group: Optional[dist.ProcessGroup] = None) -> DriftReport:
    """Fingerprint ``module`` on every rank and compare (one all-gather on ``group``, which must take CPU
    tensors: gloo). Every rank must call it, with the same module structure."""
    names, mine = fingerprints(module)
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    if world == 1:
        return DriftReport(checked=len(names))
    everyone = torch.empty(world * mine.numel(), dtype=torch.int64)
    dist.all_gather_into_tensor(everyone, mine, group=group)
    everyone = everyone.view(world, mine.numel())
    differs = everyone != everyone[0]
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
