"""One entry point for every algorithm: ``allreduce_(tensor, algorithm="auto")``, and gloo/NCCL's native.

``auto`` picks by message size and group size. At 2 ranks the (segmented) tree sends exactly the ring's
bytes in one phase instead of two, so it wins at every size; at 3 or more ranks it sends ``log2 N`` times the
message, so it wins below a fixed size and the ring above. The choice depends only on the byte size and
the group size, which every rank shares, so every rank makes the same choice (two ranks choosing
differently would each wait for messages the other never sends). The threshold is a constant measured by
``python -m lightning_dist.benchmarks.allreduce``, never a timing taken at run time on each rank. On NCCL,
``auto`` uses NCCL's own all_reduce: its ring and tree kernels beat Python point-to-point on GPUs.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from lightning_dist.comm._common import GroupView, group_view, run_in_place
from lightning_dist.comm.ring import ring_allreduce_, ring_bytes_sent
from lightning_dist.comm.stats import CommStats
from lightning_dist.comm.tree import tree_allreduce_

ALGORITHMS = ("ring", "tree", "native", "auto")

# At 3 or more ranks, messages smaller than this go through the tree under ``auto``. Measured by the
# allreduce benchmark (2-core CPU machines, gloo, 3 and 4 ranks): the tree beat the ring at every size up
# to 1 MiB in every run, the ring took over between 1 and 4 MiB (see README, "All-reduce benchmark").
AUTO_TREE_MAX_BYTES = 1 << 20


def check_algorithm(algorithm: str) -> str:
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm={algorithm!r} is not one of {ALGORITHMS}; 'auto' is the usual choice.")
    return algorithm


def choose_algorithm(
    nbytes: int, backend: str, world_size: int, tree_max_bytes: int = AUTO_TREE_MAX_BYTES
) -> str:
    """What ``auto`` runs: a pure function of values every rank shares (never of a per-rank timing)."""
    if backend == "nccl":
        return "native"
    if world_size <= 2:
        return "tree"
    return "tree" if nbytes < tree_max_bytes else "ring"


def native_allreduce_(
    tensor: torch.Tensor,
    group: Optional[dist.ProcessGroup] = None,
    op: str = "sum",
    *,
    stats: Optional[CommStats] = None,
) -> torch.Tensor:
    """``torch.distributed.all_reduce`` with the same ``op``/``stats`` contract as the ring.

    gloo has no ``ReduceOp.AVG``, so ``avg`` is a sum and a division (float16 divided first, as in the ring).
    The bytes recorded are the ring's count, marked ``estimated``: the backend does not report its own.
    """

    def body(flat: torch.Tensor, view: GroupView) -> tuple[int, int, bool]:
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        nbytes = ring_bytes_sent(flat.numel(), view.size, view.rank, flat.element_size())
        return nbytes, nbytes, True

    return run_in_place("native", tensor, group, op, stats, body)


def allreduce_(
    tensor: torch.Tensor,
    algorithm: str = "auto",
    group: Optional[dist.ProcessGroup] = None,
    op: str = "sum",
    *,
    stats: Optional[CommStats] = None,
    tree_max_bytes: int = AUTO_TREE_MAX_BYTES,
) -> torch.Tensor:
    """Reduce ``tensor`` in place across ``group`` with ``algorithm`` (``ring``, ``tree``, ``native``, ``auto``)."""
    check_algorithm(algorithm)
    if algorithm == "auto":
        view = group_view(group)  # raises a clear error when torch.distributed is not initialized
        # CUDA tensors travel over NCCL (also under a "cpu:gloo,cuda:nccl" backend string)
        backend = "nccl" if tensor.is_cuda else str(dist.get_backend(group))
        algorithm = choose_algorithm(tensor.numel() * tensor.element_size(), backend, view.size, tree_max_bytes)
    if algorithm == "ring":
        return ring_allreduce_(tensor, group, op, stats=stats)
    if algorithm == "tree":
        return tree_allreduce_(tensor, group, op, stats=stats)
    return native_allreduce_(tensor, group, op, stats=stats)
