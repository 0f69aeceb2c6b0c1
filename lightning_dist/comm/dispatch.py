"""One entry point for every algorithm: ``allreduce_(tensor, algorithm="auto")``, and gloo/NCCL's native.

``auto`` picks by message size and group size: at 3 or more ranks, the latency-optimal tree below
:data:`AUTO_TREE_MAX_BYTES`; otherwise the backend's own all-reduce. The choice depends only on the byte
size, the group size and the backend, which every rank shares, so every rank makes the same choice (two
ranks choosing differently would each wait for messages the other never sends). The rule comes from
measurements (``python -m lightning_dist.benchmarks.allreduce`` and ``.step``), never from a timing taken
at run time on each rank.

Why (measured on 2-core machines over gloo; docs/benchmarks.md, ``allreduce``, has the figures):

- Large messages: gloo's own all-reduce is itself a bandwidth-optimal ring, in C++. From 1 MiB it was as
  fast as or faster than ours at every world size, and in a training step, where backward keeps every core
  busy, an asynchronous native all-reduce needs no Python thread to be scheduled between the pieces of a
  message: the overlapped step of the bandwidth-bound MLP was slower with our ring or tree than with native.
- Small messages at 3 or more ranks: recursive doubling needs ``log2 N`` rounds where a ring needs
  ``2 (N - 1)``; the tree beat native in isolation and in the digits CNN's step (one small bucket).
- Small messages at 2 ranks: both are a single exchange, so the tree saves no round; what it saved in
  isolation it loses to Python's per-call cost inside a step.

Our ring stays available by name (``algorithm="ring"``); compressed payloads that need our own reduction
travel on it. On NCCL, ``auto`` always uses NCCL's kernels.

:func:`allreduce_async` is the form the strategy's hook uses: native calls are issued asynchronously and
complete on the backend's thread, so the caller goes straight on to the next bucket.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from lightning_dist.comm._common import begin_in_place, completed_future, group_view
from lightning_dist.comm.ring import ring_allreduce_, ring_bytes_sent
from lightning_dist.comm.stats import CommStats
from lightning_dist.comm.tree import tree_allreduce_

ALGORITHMS = ("ring", "tree", "native", "auto")

# At 3 or more ranks, messages smaller than this go through the tree under ``auto``, larger ones through the
# backend's own all-reduce. Measured by the allreduce benchmark (2-core CPU machines, gloo, 3 and 4 ranks):
# the tree beat native at every size below 1 MiB; from 1 MiB native was faster or level.
AUTO_TREE_MAX_BYTES = 1 << 20


def check_algorithm(algorithm: str) -> str:
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm={algorithm!r} is not one of {ALGORITHMS}; 'auto' is the usual choice.")
    return algorithm


def choose_algorithm(
    nbytes: int, backend: str, world_size: int, tree_max_bytes: int = AUTO_TREE_MAX_BYTES
) -> str:
    """What ``auto`` runs: a pure function of values every rank shares (never of a per-rank timing)."""
    if backend == "nccl" or world_size < 3:
        return "native"
    return "tree" if nbytes < tree_max_bytes else "native"


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
    return _native_async(tensor, group, op, stats).wait()


def _native_async(
    tensor: torch.Tensor,
    group: Optional[dist.ProcessGroup],
    op: str,
    stats: Optional[CommStats],
    then: Optional[Callable[[torch.Tensor], Any]] = None,
) -> torch.futures.Future:
    """Issue the backend's all_reduce with ``async_op=True``; the Future's one callback (on the backend's
    thread) divides for ``avg``, writes back a non-contiguous input, records the call and applies ``then``."""
    call = begin_in_place("native", tensor, group, op, stats)
    if call.trivial:
        return completed_future(_apply(then, call.finish(estimated=True)))
    work = dist.all_reduce(call.flat, op=dist.ReduceOp.SUM, group=group, async_op=True)
    nbytes = ring_bytes_sent(call.flat.numel(), call.view.size, call.view.rank, call.flat.element_size())
    # The callback runs, and is destroyed, on the backend's thread. Holding the process group there could
    # make it the group's last reference once the strategy has torn down: its destructor would then join
    # the very thread it runs on (std::system_error "Resource deadlock avoided", the process aborts).
    call.forget_group()

    def finish(done: torch.futures.Future) -> Any:
        done.value()  # raises the backend's error (a peer that died, a timeout)
        return _apply(then, call.finish(nbytes, nbytes, estimated=True))

    return work.get_future().then(finish)


def _apply(then: Optional[Callable[[torch.Tensor], Any]], reduced: torch.Tensor) -> Any:
    return reduced if then is None else then(reduced)


def resolve_algorithm(
    tensor: torch.Tensor, algorithm: str, group: Optional[dist.ProcessGroup], tree_max_bytes: int = AUTO_TREE_MAX_BYTES
) -> str:
    """``algorithm`` itself, or what ``auto`` chooses for ``tensor`` (the same on every rank)."""
    check_algorithm(algorithm)
    if algorithm != "auto":
        return algorithm
    view = group_view(group)  # raises a clear error when torch.distributed is not initialized
    # CUDA tensors travel over NCCL (also under a "cpu:gloo,cuda:nccl" backend string)
    backend = "nccl" if tensor.is_cuda else str(dist.get_backend(group))
    return choose_algorithm(tensor.numel() * tensor.element_size(), backend, view.size, tree_max_bytes)


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
    return allreduce_async(tensor, algorithm, group, op, stats=stats, tree_max_bytes=tree_max_bytes).wait()


def allreduce_async(
    tensor: torch.Tensor,
    algorithm: str = "auto",
    group: Optional[dist.ProcessGroup] = None,
    op: str = "sum",
    *,
    stats: Optional[CommStats] = None,
    tree_max_bytes: int = AUTO_TREE_MAX_BYTES,
    then: Optional[Callable[[torch.Tensor], Any]] = None,
) -> torch.futures.Future:
    """:func:`allreduce_` returning a Future of ``tensor``, reduced in place (or of ``then(tensor)``).

    ``native`` is issued with ``async_op=True`` and finished (``avg`` division, write-back, stats, then
    ``then``) in one callback on the backend's thread when it completes; its recorded seconds run from issue
    to completion, so they include waiting behind earlier calls. The ring and the tree run to completion
    here, on the calling thread, and return a completed Future. ``then`` saves a second callback: every
    Python callback on the backend's thread takes the GIL, which the thread issuing the next bucket wants.
    """
    algorithm = resolve_algorithm(tensor, algorithm, group, tree_max_bytes)
    if algorithm == "native":
        return _native_async(tensor, group, op, stats, then)
    reduce = ring_allreduce_ if algorithm == "ring" else tree_allreduce_
    return completed_future(_apply(then, reduce(tensor, group, op, stats=stats)))
