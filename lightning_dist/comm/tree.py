"""Latency-optimal all-reduce for small messages: recursive doubling, for any world size.

With N a power of two, ``log2 N`` rounds: in round ``k`` each rank swaps its whole vector with the rank whose
index differs in bit ``k`` and adds. A ring needs ``2 (N - 1)`` sequential messages; for a 1 KiB gradient
bucket the per-message latency (hundreds of microseconds over gloo) dominates, so fewer rounds win even
though each round sends the whole vector (Thakur, Rabenseifner & Gropp, "Optimization of Collective
Communication Operations in MPICH", 2005).

Other world sizes (the guide this project grew from says a tree suits only 2^n ranks; it need not): with
``p`` the largest power of two <= N and ``rem = N - p``, the first ``2 rem`` ranks pair up, each even rank
hands its vector to the odd rank after it and sits out; the ``p`` remaining ranks run recursive doubling;
each odd rank hands the result back. That costs two extra messages, ``log2 p + 2`` in all.

Each swap is cut into segments and every segment is added as soon as it lands, while the later ones are
still on the wire, so the add overlaps the transfer. At 2 ranks the tree then sends exactly the ring's
bytes in one dependent phase instead of two, and ``auto`` uses it at every size.

Both partners of a swap compute ``a + b`` and ``b + a``, which IEEE addition makes equal, so all ranks end
bit-identical, as with the ring.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from lightning_dist.comm._common import (
    GroupView,
    grouped_send_receive,
    run_in_place,
    scratch,
    segment_bounds,
    segment_elements,
)
from lightning_dist.comm.ring import DEFAULT_SEGMENT_BYTES
from lightning_dist.comm.stats import CommStats


def tree_allreduce_(
    tensor: torch.Tensor,
    group: Optional[dist.ProcessGroup] = None,
    op: str = "sum",
    *,
    stats: Optional[CommStats] = None,
    segment_bytes: int = DEFAULT_SEGMENT_BYTES,
) -> torch.Tensor:
    """Sum (or average) ``tensor`` across ``group`` in place by recursive doubling; returns ``tensor``.

    Same contract as :func:`lightning_dist.comm.ring_allreduce_`; meant for messages below the
    ``auto`` threshold at 3 or more ranks (it sends the whole vector ``log2 N`` times).
    """
    segment = segment_elements(segment_bytes, tensor.element_size(), DEFAULT_SEGMENT_BYTES)
    return run_in_place(
        "tree", tensor, group, op, stats, lambda flat, view: (*_recursive_doubling(flat, view, segment), False)
    )


def _recursive_doubling(flat: torch.Tensor, view: GroupView, segment: int) -> tuple[int, int]:
    n, r = view.size, view.rank
    nbytes = flat.numel() * flat.element_size()
    pow2 = 1 << (n.bit_length() - 1)  # largest power of two <= n
    rem = n - pow2
    sent = received = 0

    def send(rank: int) -> None:
        nonlocal sent
        dist.send(flat, dst=view.peer(rank), group=view.group)
        sent += nbytes

    def recv(into: torch.Tensor, rank: int) -> None:
        nonlocal received
        dist.recv(into, src=view.peer(rank), group=view.group)
        received += nbytes

    # Fold: the first 2*rem ranks pair up so that exactly pow2 ranks remain.
    incoming = scratch(flat.numel(), flat)
    if r < 2 * rem:
        if r % 2 == 0:
            send(r + 1)
            virtual = -1  # sits out the doubling rounds
        else:
            recv(incoming, r - 1)
            flat.add_(incoming)
            virtual = r // 2
    else:
        virtual = r - rem

    if virtual >= 0:
        mask = 1
        while mask < pow2:
            partner_virtual = virtual ^ mask
            partner = 2 * partner_virtual + 1 if partner_virtual < rem else partner_virtual + rem
            _swap_and_add(flat, incoming, view, view.peer(partner), segment)
            sent += nbytes
            received += nbytes
            mask <<= 1

    # Unfold: odd ranks of the folded pairs hand the result back.
    if r < 2 * rem:
        if r % 2 == 0:
            recv(flat, r + 1)
        else:
            send(r - 1)
    return sent, received


def _swap_and_add(flat: torch.Tensor, incoming: torch.Tensor, view: GroupView, peer: int, segment: int) -> None:
    """Exchange ``flat`` with ``peer`` segment by segment, adding each received segment as it lands."""
    if flat.is_cuda:  # NCCL (experimental): one grouped swap, no segments
        for work in grouped_send_receive(view, flat, peer, incoming, peer):
            work.wait()
        flat.add_(incoming)
        return
    pieces = segment_bounds(0, flat.numel(), segment)
    recvs = [dist.irecv(incoming[a:b], src=peer, group=view.group) for a, b in pieces]
    sends = [dist.isend(flat[a:b], dst=peer, group=view.group) for a, b in pieces]
    for (a, b), recv_work, send_work in zip(pieces, recvs, sends):
        recv_work.wait()
        send_work.wait()  # this segment of flat must not change while the transport may still read it
        flat[a:b].add_(incoming[a:b])
