"""Ring all-reduce over ``torch.distributed`` point-to-point operations (Patarasuk & Yuan, 2009).

The tensor is cut into N chunks, one per rank. In ``N - 1`` reduce-scatter steps every rank sends one
chunk to its right neighbour and adds the chunk arriving from its left; after them rank ``r`` holds the full
sum of chunk ``r + 1``. In ``N - 1`` all-gather steps the finished chunks travel once more round the ring.
Each rank sends every chunk but ``r + 1`` in the first phase and every chunk but ``r + 2`` in the second,
``2 (N - 1) / N`` of the tensor when N divides its length: the bandwidth-optimal amount, independent of N.

With ``t`` counting all ``2 (N - 1)`` steps, rank ``r`` sends chunk ``(r - t) mod N`` and receives chunk
``(r - t - 1) mod N`` at step ``t``, in both phases: the chunk received at step ``t`` is the one sent at
step ``t + 1``. So the ring is one pipeline. Each chunk is cut into segments; a segment is forwarded the
moment it has been reduced, while the later segments of the same chunk are still on the wire, and the
receives of step ``t + 1`` are posted before step ``t`` is processed, those of steps 0 and 1 before anything
is sent (gloo moves data only once the receiver's notice that it posted its buffer has arrived, and the notice
queues behind data already sent on the same connection). Large messages then reach the bandwidth of gloo's
own C++ all_reduce, on loopback and across hosts.

Every chunk is summed along one chain and then copied, so all ranks end with bit-identical results.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from lightning_dist.comm._common import (
    GroupView,
    chunk_bounds,
    grouped_send_receive,
    run_in_place,
    scratch,
    segment_bounds,
    segment_elements,
)
from lightning_dist.comm.stats import CommStats

# Segment size for the pipeline. Smaller segments overlap more, but each costs main-thread CPU plus a hand-off
# from gloo's I/O thread (a scheduler slice when cores are busy). The value is the allreduce benchmark's segment
# sweep's choice (`python -m lightning_dist.benchmarks.allreduce --segment-sweep`; results in the docs' benchmarks).
DEFAULT_SEGMENT_BYTES = 4 << 20


def ring_bytes_sent(numel: int, world_size: int, rank: int, element_size: int) -> int:
    """Bytes rank ``rank`` sends in a ring all-reduce of ``numel`` elements: all chunks but ``r+1`` and ``r+2``.

    Equals ``2 (N - 1) / N * numel * element_size`` when N divides ``numel``.
    """
    if world_size <= 1:
        return 0
    bounds = chunk_bounds(numel, world_size)
    size = [end - start for start, end in bounds]
    skipped = size[(rank + 1) % world_size] + size[(rank + 2) % world_size]
    return (2 * numel - skipped) * element_size


def ring_allreduce_(
    tensor: torch.Tensor,
    group: Optional[dist.ProcessGroup] = None,
    op: str = "sum",
    *,
    stats: Optional[CommStats] = None,
    segment_bytes: int = DEFAULT_SEGMENT_BYTES,
) -> torch.Tensor:
    """Sum (or average) ``tensor`` across ``group`` in place with a pipelined ring; returns ``tensor``.

    Args:
        tensor: any shape, any float or int dtype; every rank passes the same shape and dtype.
        group: process group (default: the world).
        op: ``"sum"`` or ``"avg"``; ``"avg"`` on integer tensors raises ``ValueError``. float16 is divided
            by N before summing, so an average of values near 65504 cannot overflow.
        stats: if given, one :class:`CallRecord` with the counted bytes and the wall time is added.
        segment_bytes: pipeline segment size; every rank must pass the same value.
    """
    segment = segment_elements(segment_bytes, tensor.element_size(), DEFAULT_SEGMENT_BYTES)
    return run_in_place(
        "ring", tensor, group, op, stats, lambda flat, view: (*_pipelined_ring(flat, view, segment), False)
    )


def _pipelined_ring(flat: torch.Tensor, view: GroupView, segment: int) -> tuple[int, int]:
    """The ``2 (N - 1)`` pipelined steps on a flat contiguous tensor; returns (bytes sent, bytes received)."""
    if flat.is_cuda:
        return _grouped_ring(flat, view)
    n, r = view.size, view.rank
    right, left = view.peer(r + 1), view.peer(r - 1)
    bounds = chunk_bounds(flat.numel(), n)
    steps = 2 * (n - 1)
    esize = flat.element_size()
    # Two staging buffers for reduce-scatter receives: step t + 1 lands in one while step t is added from
    # the other. All-gather receives go straight into ``flat`` (the chunk they overwrite was already sent,
    # and its reduced segment cannot arrive before our own contribution to it was read off the wire).
    longest = bounds[0][1] - bounds[0][0]
    buf = scratch(2 * longest, flat)
    staging = [buf[:longest], buf[longest:]]

    def segments(chunk: int) -> list[tuple[int, int]]:
        return segment_bounds(*bounds[chunk], segment)

    def post_receives(step: int) -> list[tuple[dist.Work, int, int, torch.Tensor]]:
        chunk = (r - step - 1) % n
        base = bounds[chunk][0]
        posted = []
        for a, b in segments(chunk):
            dst = staging[step % 2][a - base : b - base] if step < n - 1 else flat[a:b]
            posted.append((dist.irecv(dst, src=left, group=view.group), a, b, dst))
        return posted

    # The receives of steps 0 and 1 are posted before anything is sent. A gloo send waits for the receiver's
    # "ready" notice, and that notice travels in-band behind whatever data the receiver has already queued on
    # the same connection: at N = 2 (left == right, one TCP connection) a receive posted after our own large
    # send lets the peer start sending only once all of it is on the wire, and the two directions take turns
    # instead of running at once (what that costs on a slow link: the cluster benchmark, in the docs).
    pending, upcoming = post_receives(0), post_receives(1)  # steps >= 2: this runs on 2 ranks or more
    sends: list[dist.Work] = []
    sent = received = 0
    for a, b in segments(r % n):  # step 0 sends this rank's own chunk as it is
        sends.append(dist.isend(flat[a:b], dst=right, group=view.group))
        sent += (b - a) * esize
    for step in range(steps):
        for work, a, b, dst in pending:
            work.wait()
            received += (b - a) * esize
            if step < n - 1:
                flat[a:b].add_(dst)
            if step + 1 < steps:  # forward the finished segment as part of step + 1
                sends.append(dist.isend(flat[a:b], dst=right, group=view.group))
                sent += (b - a) * esize
        # step + 2 lands in the staging buffer step's sums were just read from
        pending, upcoming = upcoming, (post_receives(step + 2) if step + 2 < steps else [])
    for work in sends:
        work.wait()
    return sent, received


def _grouped_ring(flat: torch.Tensor, view: GroupView) -> tuple[int, int]:
    """The same ring for CUDA tensors over NCCL (experimental): each step's send and receive grouped, no
    pipeline (the overlap that segments buy on gloo, NCCL's own kernels already have)."""
    n, r = view.size, view.rank
    right, left = view.peer(r + 1), view.peer(r - 1)
    bounds = chunk_bounds(flat.numel(), n)
    staging = scratch(bounds[0][1] - bounds[0][0], flat)
    esize, sent, received = flat.element_size(), 0, 0
    for step in range(2 * (n - 1)):
        out_start, out_end = bounds[(r - step) % n]
        in_start, in_end = bounds[(r - step - 1) % n]
        reduce = step < n - 1
        dst = staging[: in_end - in_start] if reduce else flat[in_start:in_end]
        send = flat[out_start:out_end] if out_end > out_start else None  # empty chunks travel on neither side
        recv = dst if in_end > in_start else None
        for work in grouped_send_receive(view, send, right, recv, left):
            work.wait()
        if reduce:
            flat[in_start:in_end].add_(dst)
        sent += (out_end - out_start) * esize
        received += (in_end - in_start) * esize
    return sent, received
