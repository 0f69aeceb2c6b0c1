"""What the ring and the tree share: argument checks, the group's view of ranks, chunking, ``avg``."""

from __future__ import annotations

import atexit
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional

import torch
import torch.distributed as dist

from lightning_dist.comm.stats import CallRecord, CommStats

OPS = ("sum", "avg")
_INT_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
_warned_nccl: set[str] = set()


def check_op(op: str, dtype: torch.dtype) -> str:
    """Validate ``op`` for ``dtype`` before any byte moves (a bad op on one rank only would deadlock)."""
    if op not in OPS:
        raise ValueError(f"op={op!r} is not supported; use one of {OPS}.")
    if op == "avg" and (dtype in _INT_DTYPES or dtype == torch.bool):
        raise ValueError(
            f"op='avg' on a {dtype} tensor would truncate the mean; reduce with op='sum' and divide "
            "in floating point, or cast the tensor to a float dtype first."
        )
    return op


@dataclass(frozen=True)
class GroupView:
    """This rank's place in ``group``: its group rank, the group size, and group rank -> global rank."""

    group: Optional[dist.ProcessGroup]
    rank: int
    size: int
    global_ranks: tuple[int, ...]

    def peer(self, group_rank: int) -> int:
        """Global rank of ``group_rank`` (torch's point-to-point calls take global ranks)."""
        return self.global_ranks[group_rank % self.size]


def future_devices(value: Any) -> list[torch.device]:
    """The CUDA devices of ``value`` (a tensor, or a list or tuple of them): what a Future of it must be created with.

    A ``torch.futures.Future`` made without ``devices`` records no CUDA event when its result is set, so whoever waits
    for it (DDP, at the end of backward, before it copies the buckets into ``.grad``) synchronises with nothing: the
    kernels that wrote the result on another stream may still be running. Created with the devices, ``set_result``
    records an event on the current stream of each, and a waiter's stream waits for it; ``then`` passes the devices on
    to the chained Future. Empty for CPU values (no events to record)."""
    tensors = value if isinstance(value, (list, tuple)) else [value]
    found: list[torch.device] = []
    for t in tensors:
        device = getattr(t, "device", None)
        if isinstance(device, torch.device) and device.type == "cuda" and device not in found:
            found.append(device)
    return found


def completed_future(value: Any, devices: Optional[list[torch.device]] = None) -> torch.futures.Future:
    """A Future that is already done, for a result computed synchronously where a Future is expected. It carries
    ``value``'s CUDA devices (``devices``: given instead), so that a waiter's stream waits for the kernels that
    computed it (:func:`future_devices`); call it on the thread (stream) that computed ``value``."""
    fut: torch.futures.Future = torch.futures.Future(devices=future_devices(value) if devices is None else devices)
    fut.set_result(value)
    return fut


def group_view(group: Optional[dist.ProcessGroup]) -> GroupView:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialized: call torch.distributed.init_process_group() first "
            "(Lightning does this in the strategy's setup)."
        )
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("this rank is not a member of the given process group; call the collective only there.")
    ranks = tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
    return GroupView(group, rank, len(ranks), ranks)


def warn_if_experimental(tensor: torch.Tensor, algorithm: str) -> None:
    """Point-to-point rings over NCCL (CUDA tensors) are not tested here (one GPU at most): say so once."""
    if tensor.is_cuda and algorithm not in _warned_nccl:
        _warned_nccl.add(algorithm)
        warnings.warn(
            f"algorithm={algorithm!r} on the NCCL backend is experimental (its point-to-point path is not "
            "covered by CI); algorithm='auto' uses NCCL's native all_reduce instead.",
            stacklevel=3,
        )


# Reused scratch buffers, keyed by (dtype, device), one pool per thread. A fresh tens-of-MiB buffer per call
# costs a page fault per 4 KiB on first touch, a visible share of a large ring's or tree's time. The
# collectives on one thread run one at a time, so one buffer per dtype and device suffices there; a pool per
# thread keeps the strategy's communication worker and any collective on the main thread apart.
_POOLS = threading.local()


def _pool() -> dict[tuple[torch.dtype, torch.device], torch.Tensor]:
    pool = getattr(_POOLS, "buffers", None)
    if pool is None:
        pool = _POOLS.buffers = {}
    return pool


def scratch(numel: int, like: torch.Tensor) -> torch.Tensor:
    """A reusable buffer of ``numel`` elements of ``like``'s dtype and device; contents undefined.

    Grows, never shrinks (:func:`release_scratch` frees it). If ``like`` itself lives in the pooled buffer
    (a caller reducing a scratch view), a fresh buffer is returned so that the two cannot alias.
    """
    pool, key = _pool(), (like.dtype, like.device)
    buf = pool.get(key)
    if buf is not None and buf.untyped_storage().data_ptr() == like.untyped_storage().data_ptr():
        return torch.empty(numel, dtype=like.dtype, device=like.device)
    if buf is None or buf.numel() < numel:
        buf = pool[key] = torch.empty(numel, dtype=like.dtype, device=like.device)
    return buf[:numel]


def release_scratch() -> None:
    """Free the calling thread's pooled buffers (on a GPU they would hold memory); the strategy's worker
    frees its own as it ends, and the strategy the main thread's at teardown."""
    _pool().clear()


def destroy_groups(groups: Iterable[Optional[dist.ProcessGroup]]) -> list[str]:
    """Destroy each of ``groups`` (None skipped) at teardown; a group already gone with the default group after a
    fault is passed over. Returns what each such failure said."""
    failures = []
    for group in groups:
        if group is not None and dist.is_initialized():
            try:
                dist.destroy_process_group(group)
            except (RuntimeError, ValueError) as err:
                failures.append(f"{type(err).__name__}: {err}")
    return failures


_destroy_at_exit = False  # destroy_at_exit's hook is registered (once per process)


def destroy_at_exit() -> None:
    """Have every process group still alive destroyed when the interpreter exits, before it finalizes.

    A gloo group's threads release a finished collective's tensors a moment after it completes, and torch takes the GIL
    for that (a tensor that Python has seen is reference-counted for Python too). Once the interpreter has begun to
    finalize, a thread that asks for the GIL is ``pthread_exit``-ed by CPython inside a C++ ``noexcept`` destructor: the
    process dies with SIGABRT, "terminate called without an active exception". A group destroyed before that point (an
    ``atexit`` hook: the interpreter is still whole) joins its threads, so every release is done first. Lightning does
    the same for NCCL only; under gloo the default group otherwise lives until the process ends. Groups already
    destroyed (the strategy's own, at teardown) are not touched again; a group some object still holds (a DDP model
    kept past teardown) stays alive, as before.
    """
    global _destroy_at_exit
    if not _destroy_at_exit:
        _destroy_at_exit = True
        atexit.register(_destroy_all_groups)


def _destroy_all_groups() -> None:
    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()  # every group, the default one included
        except (RuntimeError, ValueError):  # already gone with a failed default group
            pass


def segment_bounds(start: int, end: int, segment: int) -> list[tuple[int, int]]:
    """``[start, end)`` cut into pieces of ``segment`` elements (the last may be shorter)."""
    return [(a, min(a + segment, end)) for a in range(start, end, segment)]


def grouped_send_receive(
    view: GroupView, send: Optional[torch.Tensor], dst: int, recv: Optional[torch.Tensor], src: int
) -> list[dist.Work]:
    """Post a send and/or a receive (global ranks; ``None`` skips one) as one group; return the handles.

    This is what NCCL needs: it queues a pair's sends and receives on one stream, so two ranks that each
    send to the other before receiving would wait on each other forever. gloo runs the group as plain ops.
    """
    ops = []
    if send is not None:
        ops.append(dist.P2POp(dist.isend, send, dst, view.group))
    if recv is not None:
        ops.append(dist.P2POp(dist.irecv, recv, src, view.group))
    return dist.batch_isend_irecv(ops) if ops else []


# torch 2.13 renamed all_gather_into_tensor and reduce_scatter_tensor (which still work, with a warning)
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def chunk_bounds(numel: int, parts: int) -> list[tuple[int, int]]:
    """Split ``range(numel)`` into ``parts`` contiguous chunks, sizes differing by at most one.

    The first ``numel % parts`` chunks get the extra element; chunks are empty when ``numel < parts``.
    """
    base, extra = divmod(numel, parts)
    bounds, start = [], 0
    for i in range(parts):
        end = start + base + (1 if i < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def flat_work_view(tensor: torch.Tensor) -> tuple[torch.Tensor, Callable[[], None]]:
    """A 1-D contiguous view to reduce in, and a function that writes it back if it had to be a copy."""
    if tensor.is_contiguous():
        return tensor.view(-1), lambda: None
    flat = tensor.contiguous().view(-1)
    return flat, lambda: tensor.copy_(flat.view_as(tensor))


# The body of a collective: reduces ``flat`` (1-D, contiguous, non-empty) across ``view``'s group by sum in
# place and returns (bytes sent, bytes received, whether those counts are estimates).
Body = Callable[[torch.Tensor, GroupView], tuple[int, int, bool]]


@dataclass
class InPlaceCall:
    """One collective between :func:`begin_in_place` and :meth:`finish`: the flat tensor to reduce, and what
    is needed to complete the call once it has been reduced (possibly later, on another thread)."""

    algorithm: str
    tensor: torch.Tensor
    flat: torch.Tensor
    view: GroupView
    op: str
    stats: Optional[CommStats]
    write_back: Callable[[], None]
    divided: bool
    started: float

    @property
    def trivial(self) -> bool:
        """Nothing to send: one rank, or no elements."""
        return self.view.size <= 1 or self.flat.numel() == 0

    def forget_group(self) -> None:
        """Drop the reference to the process group (see :func:`~lightning_dist.comm.allreduce_async`)."""
        self.view = GroupView(None, self.view.rank, self.view.size, self.view.global_ranks)

    def finish(self, sent: int = 0, received: int = 0, estimated: bool = False) -> torch.Tensor:
        post_divide(self.flat, self.op, self.view.size, self.divided)
        self.write_back()
        if self.stats is not None:
            seconds = time.perf_counter() - self.started
            self.stats.record(CallRecord(self.algorithm, self.tensor.numel(), sent, received, seconds, estimated))
        return self.tensor


def begin_in_place(
    algorithm: str, tensor: torch.Tensor, group: Optional[dist.ProcessGroup], op: str, stats: Optional[CommStats]
) -> InPlaceCall:
    """What every collective here does before its algorithm: check the op, flatten, ``avg`` pre-division."""
    check_op(op, tensor.dtype)
    started = time.perf_counter()
    view = group_view(group)
    if algorithm != "native":
        warn_if_experimental(tensor, algorithm)
    flat, write_back = flat_work_view(tensor)
    divided = pre_divide(flat, op, view.size)
    return InPlaceCall(algorithm, tensor, flat, view, op, stats, write_back, divided, started)


def run_in_place(
    algorithm: str,
    tensor: torch.Tensor,
    group: Optional[dist.ProcessGroup],
    op: str,
    stats: Optional[CommStats],
    body: Body,
) -> torch.Tensor:
    """A blocking collective: :func:`begin_in_place`, ``body`` unless the call is trivial, then
    :meth:`InPlaceCall.finish` (``avg`` division, write-back of a non-contiguous input, timing, record)."""
    call = begin_in_place(algorithm, tensor, group, op, stats)
    if call.trivial:
        return call.finish(estimated=algorithm == "native")
    return call.finish(*body(call.flat, call.view))


def segment_elements(segment_bytes: int, element_size: int, default: int) -> int:
    if segment_bytes <= 0:
        raise ValueError(f"segment_bytes={segment_bytes} must be positive (default {default}).")
    return max(1, segment_bytes // element_size)


def pre_divide(flat: torch.Tensor, op: str, world_size: int) -> bool:
    """For ``avg`` on float16, divide before summing so the sum cannot overflow 65504; returns whether done."""
    if op == "avg" and flat.dtype == torch.float16 and world_size > 1:
        flat.div_(world_size)
        return True
    return False


def post_divide(flat: torch.Tensor, op: str, world_size: int, already: bool) -> None:
    """For ``avg`` on other floats, divide the sum once (more accurate than dividing every term)."""
    if op == "avg" and not already and world_size > 1:
        flat.div_(world_size)
