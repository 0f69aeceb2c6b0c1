"""DiLoCo's exchanges: a fragment's weighted pseudo-gradient summed over the workers, here or on the sync's thread.

The part of :class:`~lightning_dist.sync.diloco.DiLoCoSync` that moves bytes: docs/sync.md ("How it works") has the
algorithm, and why the exchanges run on host tensors and gloo groups of their own.
"""

from __future__ import annotations

import math
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from lightning_dist.comm import CommStats
from lightning_dist.comm._common import all_gather_single
from lightning_dist.compression import Compressor, NoCompressor, Transport
from lightning_dist.sync.buckets import HOST, Bucket, host_copy
from lightning_dist.sync.diloco_fragments import Fragment, SyncedModel, Workers

THREAD_NAME = "lightning_dist-comm-sync"  # the streaming exchanges' thread (tests look for it)


@dataclass
class Exchange:
    """One fragment's sync between its start (after step ``step``) and its landing (after step ``lands``)."""

    fragment: Fragment
    step: int
    lands: int
    samples: list[float]  # the fragment's counts it used (given back if the exchange is dropped)
    snapshot: Optional[list[torch.Tensor]] = None  # the worker's parameters at ``step`` (a delay only)
    buffers: Optional[list[torch.Tensor]] = None  # the averaged buffers, reduced beside it (a delay only)
    stats: Optional[CommStats] = None  # its collectives' records, merged into the step's at landing (a delay only)
    future: Optional[Future] = None  # the reduction on the sync's thread (a delay only)
    locally_finite: bool = True  # this rank's contribution
    # the exchange's own wall time: the main thread's part and the reduction, or the main thread's wait for it where
    # that was longer (the sync's thread started, or was seen to end, late): never less than ``waited``
    seconds: float = 0.0
    waited: float = 0.0  # the main thread's part
    bytes_sent: int = 0  # this rank's bytes across workers, recorded in the step's stats so far
    norm: Optional[float] = None  # the mean pseudo-gradient's norm, once settled (NaN: skip)
    averages: bool = False  # a warm-up step's or the final sync's: theta_global takes the mean (lr 1, no momentum)
    rate: float = 0.0  # the mean inner learning rate of the steps it carries (0: unknown)

    @property
    def settled(self) -> bool:
        """Whether its reduction is done and its verdict read (:meth:`Exchanges.settle`)."""
        return self.norm is not None


class Exchanges:
    """A rank's exchanges: their start (the pseudo-gradient into the fragment's buckets, and its reduction), the ones
    in flight on the sync's thread (one, first in first out: every rank issues the same collectives in the same
    order, on groups only it uses), and their settling (the reduced sum's verdict)."""

    def __init__(self, settings: Any, workers: Workers, algorithm: str, cross_group: Optional[dist.ProcessGroup],
                 host_group: Optional[dist.ProcessGroup]) -> None:
        self.settings = settings
        self.workers = workers
        self.algorithm = algorithm
        self.cross_group = cross_group  # every rank (flat), or this rank's part across hosts (two_tier)
        self.host_group = host_group  # two_tier: the parts' all-gather inside the host
        self.inflight: list[Exchange] = []  # started, not landed (a delay only), in the order they started
        # per fragment, the step after which its newest reduced exchange started: every worker's progress up to it
        # is in theta_global (or in a reduced sum that lands)
        self.reduced_at: list[int] = []
        self.bytes_total = 0  # this rank's bytes across workers, every exchange that landed
        self.device = HOST  # the model's: the thread selects it
        self._thread: Optional[ThreadPoolExecutor] = None

    def attach(self, fragments: int, device: torch.device) -> None:
        self.reduced_at = [0] * fragments
        self.device = device

    @property
    def unsynced_from(self) -> int:
        """The first global batch (position) whose training is in no reduced exchange yet, for some fragment: what a
        worker lost now would take with it (exact without fragments; with them, some fragments hold a part of it)."""
        return min(self.reduced_at, default=0)

    def landing(self, step: int) -> list[Exchange]:
        """The exchanges in flight that land after ``step``, in the order they started."""
        return [ex for ex in self.inflight if ex.lands == step]

    # -- the start ----------------------------------------------------------------------------------------------
    def start(self, fragment: Fragment, step: int, samples: list[float], weight: float, theta: list[torch.Tensor],
              model: SyncedModel, stats: Optional[CommStats], tier: str, delay: int,
              averages: bool = False, rate: float = 0.0) -> Exchange:
        """The fragment's pseudo-gradient ``theta_global - theta_worker`` times ``weight`` into its buckets, and its
        reduction: here (no ``delay``) or on the sync's thread (then kept in flight until it lands)."""
        started = time.perf_counter()
        exchange = Exchange(fragment, step, step + delay, samples, averages=averages, rate=rate)
        with torch.no_grad():
            for bucket in fragment.buckets:
                flat = bucket.flat
                for i, (start, end) in zip(bucket.index, bucket.spans):  # the parameter read off the device
                    torch.sub(theta[i].reshape(-1), model.params[i].detach().reshape(-1).to(HOST),
                              out=flat[start:end])
                if weight != 1.0:
                    flat.mul_(weight)
            if delay:
                exchange.snapshot = [host_copy(model.params[i]) for i in fragment.params]
                if fragment.buffers and model.buffers:
                    exchange.buffers = [host_copy(b) for b in model.buffers]
        if not delay:
            recorder = stats.tier(tier) if stats is not None else None
            sent_before = stats.bytes_sent if stats is not None else 0
            exchange.locally_finite = self._reduce_all(fragment, recorder)
            exchange.bytes_sent = (stats.bytes_sent - sent_before) if stats is not None else 0
        else:
            exchange.stats = CommStats(keep_records=True)
            if self._thread is None:
                self._thread = self._executor()
            exchange.future = self._thread.submit(self._reduce_in_background, exchange)
            self.inflight.append(exchange)
        exchange.waited = time.perf_counter() - started
        exchange.seconds = exchange.waited
        return exchange

    def _reduce_in_background(self, exchange: Exchange) -> None:
        """The sync's thread: the fragment's reduction and, for the fragment that carries them, the buffers'
        average; on groups only this thread uses."""
        started = time.perf_counter()
        recorder = exchange.stats.tier("inter_host")
        with torch.no_grad():
            exchange.locally_finite = self._reduce_all(exchange.fragment, recorder)
            if exchange.buffers is not None:
                self.average(exchange.buffers, self.transport(recorder))
        exchange.seconds += time.perf_counter() - started

    # -- the reduction --------------------------------------------------------------------------------------------
    def transport(self, recorder: Any) -> Optional[Transport]:
        # one worker (one rank, or one host of a two_tier topology refused earlier): its sum is itself
        return Transport(self.algorithm, self.cross_group, recorder) if self.workers.count > 1 else None

    def _reduce_all(self, fragment: Fragment, recorder: Any) -> bool:
        """Every bucket of ``fragment`` summed over the workers (the same bits on every rank); whether this rank's own
        contribution was finite."""
        transport = self.transport(recorder)
        codec = NoCompressor() if fragment.compressor.warming_up else fragment.compressor
        finite = True
        with torch.no_grad():
            for bucket in fragment.buckets:
                finite &= self._reduce(bucket, codec, transport)
        return finite

    def _reduce(self, bucket: Bucket, codec: Compressor, transport: Optional[Transport]) -> bool:
        """The bucket's weighted pseudo-gradient (in ``bucket.flat``) summed over the workers in place (the same bits
        on every rank); whether this rank's contribution was finite."""
        flat = bucket.flat
        plan = bucket.plan
        if plan is None:
            finite = _sentinel(flat)
            if transport is not None:
                codec.reduce(flat, bucket.layout, transport)
            return finite
        # two_tier: this rank's part across hosts, then every part back from the host's ranks
        parts = torch.zeros(plan.width * self.workers.local_size, dtype=flat.dtype, device=flat.device)
        part = torch.zeros(plan.width, dtype=flat.dtype, device=flat.device)
        finite = True
        if plan.length:
            torch.cat([flat[a:b] for a, b in plan.spans], out=part[: plan.length])
            finite = _sentinel(part[: plan.length])
            codec.reduce(part[: plan.length], plan.layout, transport)
        all_gather_single(parts, part, group=self.host_group)
        torch.cat([parts[a:b] for a, b in plan.scatter], out=flat)
        return finite

    def average(self, buffers: list[torch.Tensor], transport: Optional[Transport]) -> None:
        """``buffers`` (copies of the model's, in order) become the mean over the workers in place (a host's ranks
        hold the same buffers: each part's group averages them alike); integer ones the floor of the mean."""
        count = self.workers.count
        for total in buffers:
            if transport is not None and total.is_floating_point():
                transport.allreduce_(total.view(-1))
                total.div_(count)
            elif count > 1:
                dist.all_reduce(total, group=self.cross_group)
                total.copy_(torch.div(total, count, rounding_mode="floor"))

    # -- settling ---------------------------------------------------------------------------------------------------
    def settle(self, exchange: Exchange) -> None:
        """Wait for the reduction; the verdict from the reduced sum (the same on every rank), and the fragment's
        compressor keeps its staged state or drops it. Once per exchange."""
        if exchange.settled:
            return
        if exchange.future is not None:
            waiting = time.perf_counter()
            exchange.future.result()  # a failed collective raises here, on the training loop's thread
            exchange.waited += time.perf_counter() - waiting
            exchange.seconds = max(exchange.seconds, exchange.waited)
            exchange.future = None
        buckets = exchange.fragment.buckets
        totals = torch.stack([b.flat.float().square().sum() for b in buckets]) if buckets else torch.zeros(1)
        exchange.norm = math.sqrt(float(totals.sum()))
        index = exchange.fragment.index
        self.reduced_at[index] = max(self.reduced_at[index], exchange.step)
        if math.isfinite(exchange.norm):
            exchange.fragment.compressor.commit()
        else:
            exchange.fragment.compressor.discard()

    def settle_all(self) -> None:
        """Every exchange in flight settled (before a checkpoint: what it saves is then the same on every run);
        nothing lands early."""
        for exchange in self.inflight:
            self.settle(exchange)

    def take(self, exchange: Exchange, stats: Optional[CommStats], tier: str) -> None:
        """The exchange settled and out of flight, to land now: a delayed exchange's bytes count in this step."""
        self.settle(exchange)
        if exchange.stats is not None and stats is not None:
            recorder = stats.tier(tier)
            for record in exchange.stats.records:
                recorder.record(record)
        if exchange in self.inflight:
            self.inflight.remove(exchange)

    def bad_workers(self, exchange: Exchange, agree: Optional[Callable[[list[bool]], list[bool]]]) -> list[int]:
        """On a skip (every rank takes this branch together): the workers whose own pseudo-gradient was not finite
        (``agree``: the flags agreed across every rank; None: this rank's own only)."""
        workers = self.workers
        flags = [w == workers.index and not exchange.locally_finite for w in range(workers.count)]
        if workers.count > 1 and agree is not None:
            flags = agree(flags)
        return [w for w in range(workers.count) if flags[w]]

    # -- the thread -----------------------------------------------------------------------------------------------
    def _executor(self) -> ThreadPoolExecutor:
        """The exchanges' thread (one, first in first out). It selects the model's CUDA device first: a thread's
        current device is its own (cuda:0 until set), and torch's point-to-point calls can hang without it."""
        device = self.device
        setup = (lambda: torch.cuda.set_device(device)) if device.type == "cuda" else None
        return ThreadPoolExecutor(1, thread_name_prefix=THREAD_NAME, initializer=setup)

    def close(self) -> None:
        """Stop the thread (teardown; after a fault an exchange may still wait for a peer: not waited for)."""
        if self._thread is not None:
            self._thread.shutdown(wait=False, cancel_futures=True)
            self._thread = None


def _sentinel(flat: torch.Tensor) -> bool:
    """A non-finite local sum makes the first element NaN (every compressor carries it to the same place of every
    rank's result); whether the sum was finite. ``x - 0.0`` leaves a finite first element as it was."""
    if not flat.numel():
        return True
    total = flat.sum(dtype=torch.float32)
    flat[:1].sub_((total - total).to(flat.dtype))
    return bool(torch.isfinite(total))
