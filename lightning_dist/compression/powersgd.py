"""PowerSGD: a rank-``r`` approximation of each gradient matrix by one step of power iteration (Vogels,
Karimireddy & Jaggi, 2019), with warm start; error feedback (on by default) keeps what the approximation
missed.

For each parameter with two or more dimensions, seen as an ``n x m`` matrix ``M`` (the first dimension by
the rest), and a factor ``Q`` (``m x r``) that every rank holds alike:

1. ``P = M Q``; the ``P`` of every parameter, and the full gradient of the parameters not worth
   compressing (vectors, and matrices where ``r (n + m) >= n m``), travel in **one** sum all-reduce;
2. ``P`` is orthonormalised (Gram-Schmidt, identically on every rank, since every rank holds the same sum);
3. ``Q = M^T P``; every ``Q`` travels in a second sum all-reduce; the result is ``P Q^T``;
4. the summed ``Q`` is kept for the next step (warm start: one power-iteration step per training step
   tracks the gradient's slowly turning top subspace).

Both rounds are sums, so they ride on the strategy's own algorithm (ring, tree or native). Bytes: ``r (n + m)``
per matrix instead of ``n m``. This rank's own contribution, ``P P^T M``, is what error feedback subtracts (r
rank-1 updates of the corrected gradient, which then is the residual).
The first ``Q`` is drawn from a generator seeded by the parameter's name, so every rank draws the same one.
A non-finite ``M`` makes ``P`` non-finite on every rank after the first sum; a non-finite ``Q`` is never
kept for the next step.
"""

from __future__ import annotations

import zlib
from typing import Optional

import torch

from lightning_dist.compression.base import BucketLayout, Compressor, Feedback
from lightning_dist.compression.state import ParamState
from lightning_dist.compression.transport import Transport

_EPS = 1e-8


class PowerSGDCompressor(Compressor):
    """Rank-``rank`` PowerSGD with warm start, one power iteration per step."""

    name = "powersgd"
    summable = False
    light = False
    lossy = True
    wants_error_feedback = True

    def __init__(self, rank: int = 2, seed: int = 0, start_step: int = 0) -> None:
        super().__init__(start_step)
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ValueError(f"powersgd rank={rank!r} must be an int >= 1 (the approximation's rank; 1-4 is usual)")
        self.rank, self.seed = rank, seed
        self.q = ParamState()

    def describe(self) -> str:
        return f"powersgd(rank={self.rank})"

    def plan(self, layout: BucketLayout) -> list[Optional[tuple[int, int, int]]]:
        """Per parameter: (n, m, r) when it is compressed, None when it is sent dense."""
        out: list[Optional[tuple[int, int, int]]] = []
        for shape in layout.shapes:
            if len(shape) < 2:
                out.append(None)
                continue
            n = shape[0]
            m = shape.numel() // n
            r = min(self.rank, n, m)
            out.append((n, m, r) if r * (n + m) < n * m else None)
        return out

    def reduce(self, flat: torch.Tensor, layout: BucketLayout, transport: Transport,
               feedback: Optional[Feedback] = None) -> torch.Tensor:
        plan = self.plan(layout)
        spans = layout.spans()
        # with error feedback the corrected gradient is built in `keep`, which then becomes the residual: the
        # dense parameters are sent exactly (owed nothing), each matrix owes M - P (M^T P)^T
        source = flat if feedback is None else feedback.add_owed(flat, layout, feedback.keep)
        work = source.float() if source.dtype != torch.float32 else source
        matrices = {i: work[start:end].view(p[0], p[1]) for i, ((_, start, end, _), p) in enumerate(zip(spans, plan))
                    if p is not None}
        dense = [i for i, p in enumerate(plan) if p is None]
        qs = {i: self._factor(layout.names[i], plan[i], work) for i in matrices}
        # round 1: P = M Q for every matrix, and the dense parameters as they are, in one sum
        ps = {i: (qs[i].t().contiguous() @ matrices[i].t()).t() for i in matrices}  # M Q, as BLAS runs it fast
        first = torch.cat([work[spans[i][1]:spans[i][2]] for i in dense] + [ps[i].reshape(-1) for i in matrices])
        transport.allreduce_(first)
        if feedback is not None:  # any rank's non-finite M makes the summed P non-finite, and every residual
            feedback.finite = torch.isfinite(first).all()  # a device flag, read at the commit
        offset = 0
        for i in dense:
            start, end = spans[i][1], spans[i][2]
            flat[start:end].copy_(first[offset : offset + end - start])
            if feedback is not None:
                feedback.keep[start:end].zero_()
            offset += end - start
        for i in matrices:
            n, _, r = plan[i]
            ps[i] = _orthonormalize(first[offset : offset + n * r].view(n, r))
            offset += n * r
        # round 2: Q = M^T P, summed; this rank's own share is P (M^T P)^T
        local_q = {i: (ps[i].t().contiguous() @ matrices[i]).t() for i in matrices}  # M^T P
        if feedback is not None:
            for i in matrices:
                _outer(ps[i], local_q[i], matrices[i], subtract=True)
                if work is not source:
                    start, end = spans[i][1], spans[i][2]
                    source[start:end].copy_(work[start:end])
        second = torch.cat([local_q[i].reshape(-1) for i in matrices]) if matrices else None
        if second is not None:
            transport.allreduce_(second)
        offset = 0
        for i in matrices:
            _, m, r = plan[i]
            q = second[offset : offset + m * r].view(m, r)
            offset += m * r
            start, end = spans[i][1], spans[i][2]
            if flat.dtype == torch.float32:
                _outer(ps[i], q, flat[start:end].view(plan[i][0], m))
            else:
                flat[start:end].copy_((ps[i] @ q.t()).view(-1))
            # a non-finite factor would poison every later step: kept at the commit only if finite (a device flag
            # read there, once per step; not here on the communication worker)
            self.q.stage(layout.names[i], q.clone(), keep_if=torch.isfinite(q).all())
        return flat

    def state_bytes(self, layout: BucketLayout, element_size: int) -> int:
        # a float32 (m x r) factor Q per compressed matrix, committed and staged
        return 2 * 4 * sum(m * r for _, m, r in filter(None, self.plan(layout)))

    def workspace_bytes(self, numel: int, element_size: int, world_size: int) -> int:
        # a float32 working copy of a half-precision bucket, and the first round's message (the dense
        # parameters travel in it: up to the whole bucket); the P and Q factors are small next to them
        return numel * (4 if element_size != 4 else 0) + numel * 4

    def _factor(self, name: str, plan: tuple[int, int, int], like: torch.Tensor) -> torch.Tensor:
        _, m, r = plan
        q = self.q.get(name)
        if q is not None and q.shape == (m, r):
            return q.to(like.device)
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + zlib.crc32(name.encode()))
        return torch.randn(m, r, generator=gen).to(like.device)

    def commit(self) -> None:
        super().commit()
        self.q.commit()

    def discard(self) -> None:
        self.q.discard()

    def state_dict(self) -> dict:
        return {**super().state_dict(), "q": self.q.state_dict()}

    def load_state_dict(self, state: dict, shared_only: bool = False) -> None:
        super().load_state_dict(state, shared_only)
        self.q.load_state_dict(state.get("q", {}))  # every rank holds the same factors: shared


def _outer(p: torch.Tensor, q: torch.Tensor, out: torch.Tensor, subtract: bool = False) -> torch.Tensor:
    """``out = p q^T`` (or ``out -= p q^T``) for thin ``p`` (n x r) and ``q`` (m x r): a rank-1 update per column
    for small r, each one pass over ``out`` (one thread's ``mm`` into a 1024 x 1024 output costs several)."""
    r = p.shape[1]
    if r > 4:
        return out.addmm_(p, q.t(), alpha=-1.0) if subtract else torch.mm(p, q.t(), out=out)
    rows = q.t().contiguous()
    for j in range(r):
        if subtract or j:
            out.addcmul_(p[:, j : j + 1], rows[j], value=-1.0 if subtract else 1.0)
        else:
            torch.mul(p[:, j : j + 1], rows[j], out=out)
    return out


def _orthonormalize(p: torch.Tensor) -> torch.Tensor:
    """Gram-Schmidt on the columns, in place (NaN stays NaN; a zero column stays zero)."""
    for j in range(p.shape[1]):
        col = p[:, j]
        if j:
            col -= p[:, :j] @ (p[:, :j].t() @ col)
        col /= col.norm().clamp_min(_EPS)
    return p
