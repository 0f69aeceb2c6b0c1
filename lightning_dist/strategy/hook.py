"""The DDP communication hook that sends every gradient bucket through lightning_dist's collectives.

DDP calls ``ring_comm_hook(state, bucket)`` once per gradient bucket as soon as backward has filled it, in
bucket order. The bucket's reduction has four visible stages, each a
``torch.profiler.record_function`` range, so they show in a Chrome trace:

1. **weight**: scale the local gradient by this rank's share of the step (``1 / N`` with equal batches).
   Under RingDDPStrategy with automatic optimization this has already happened in autograd: the
   strategy multiplies the gradient flowing out of the loss by the share
   (:meth:`RingHookState.step_share`, :mod:`lightning_dist.strategy.stepping`), so every gradient arrives
   weighted and the hook skips a pass over the bucket (stock DDP fuses the same scaling into its copy into the
   bucket; a separate pass is a full read and write of the bucket, which a bandwidth-bound step notices). Under
   manual optimization, or when
   backward did not go through the strategy (DDP used directly), the hook multiplies the bucket here instead.
2. **compress**: the compressor turns the bucket into a payload (:mod:`lightning_dist.compression`).
3. **transport**: ``ring``, ``tree``, ``native`` or ``auto`` all-reduce of the payload, by sum, on the
   hook's own process group.
4. **decompress**: the reduced payload goes back into the bucket's buffer.

With :class:`~lightning_dist.callbacks.NaNRecovery`, each bucket is also summed before compression (a
non-finite local gradient turns the bucket's first element, the sentinel, into NaN) and the sentinel is read
after the all-reduce, where every rank sees the same value: :mod:`lightning_dist.strategy.skip`.

That is the path of *summable* compressors (none, fp16, bf16). The others (int8, top-k, threshold,
PowerSGD, anything with error feedback) reduce the bucket through their own collectives
(:meth:`~lightning_dist.compression.Compressor.reduce`, one ``lightning_dist.compressed_reduce.<name>``
range), always on the worker. Per-parameter state is keyed by the bucket's :class:`BucketLayout`
(parameter names, shapes, offsets). During a compressor's warm-up (``start_step``) buckets travel dense.

With a :class:`~lightning_dist.strategy.comm_worker.CommWorker` in the state (the default) the hook returns
a pending ``Future``: backward goes on computing the next buckets' gradients while this one travels, and
DDP waits for every Future at the end of backward. Work that would block (our ring's and tree's loops)
is queued on the worker; the backend's native all-reduce of a lightly compressed bucket is issued
asynchronously (:func:`~lightning_dist.comm.allreduce_async`) right here when the worker is idle, and
decompressed in its completion callback; so is the last bucket, behind which nothing is left to overlap.
With a two-tier topology (``RingHookState.tiers``, :mod:`lightning_dist.strategy.tiers`) the hook checks and
weights the bucket and issues its reduce-scatter inside the host right away (asynchronous: it runs while backward
computes the next buckets); the worker then waits for it, reduces this rank's part across hosts through the
compressor and all-gathers the parts inside the host. On CUDA (NCCL) the worker issues the reduce-scatter too: NCCL
documents deadlocks when operations on different communicators are launched in a different order on different ranks,
and two threads issuing on three groups interleave differently on each rank. One thread per process, in DDP's bucket
order, gives every rank the same launch order on every group (a job the autograd thread runs in its place, with
``here_if_idle``, runs only when nothing is queued or running: the order is the same). On NCCL the reduce-scatter is
asynchronous on the device either way (the CPU only enqueues it), so issuing it from the worker costs the overlap
little. gloo runs each group's operations on threads of its own, with no shared launch queue: the CPU path keeps the
early issue from the autograd thread.

CUDA streams: every Future the hook returns is created with the bucket's device
(:func:`~lightning_dist.comm.future_devices`), so setting its result records an event on the completing thread's
stream and DDP's wait at the end of backward waits for it before copying the buckets into ``.grad``.

Without a worker the hook reduces on the autograd thread and returns a completed ``Future``
(``overlap=False``: simpler to debug, and the baseline the step benchmark compares against).

Per step, ``state.stats`` collects bytes and seconds inside the transport, and ``state.exposed_s`` the
communication that backward did not hide. Overlapped, that is the time from the moment DDP hands over the
last bucket (backward's own computation is then over) until every bucket is reduced; the strategy adds it
up after each backward pass (:meth:`RingHookState.close_backward`). Blocking, it is the whole time spent in
the hook. The strategy reads and resets both once per step.

A feature that needs to see the buckets themselves registers a :class:`BucketObserver` through
:meth:`~lightning_dist.strategy.RingFeatures.add_bucket_observer`: it is told when the hook is handed each bucket
(before anything changes the gradient) and when the bucket's reduction is done. With no observer the hook pays one
test of an empty list per bucket.
"""

# no `from __future__ import annotations`: DDP inspects the hook's real annotations (dist.GradBucket)

import contextlib
import functools
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch.profiler import record_function

from lightning_dist.comm import (
    CommStats,
    allreduce_async,
    completed_future,
    future_devices,
    resolve_algorithm,
    ring_bytes_sent,
)
from lightning_dist.comm.stats import TierStats
from lightning_dist.compression import BucketLayout, Compressor, NoCompressor, Transport
from lightning_dist.strategy.comm_worker import CommWorker
from lightning_dist.strategy.skip import StepGuard
from lightning_dist.strategy.tiers import TwoTier
from lightning_dist.upstream import profiler_enabled


class BucketObserver:
    """Sees each gradient bucket the comm hook is handed and learns when its reduction is done: the seam through
    which a feature watches the per-bucket path (``lightning-dist-advise`` times the buckets' hand-overs and
    completions, and replays the gradients of one step through every compressor). Register one with
    :meth:`~lightning_dist.strategy.RingFeatures.add_bucket_observer`; subclass and override what you need.

    Both methods run on the hot path, once per bucket: keep them short. :meth:`bucket_done` runs on whichever
    thread completes the bucket (the backend's, the communication worker's or the autograd thread), so what it
    touches must be safe to touch from there (appending to a list is).
    """

    def bucket_handed(self, index: int, layout: BucketLayout, buffer: torch.Tensor) -> None:
        """DDP handed bucket ``index`` to the hook (on the autograd thread). ``buffer`` holds this rank's gradient,
        already weighted by its share under automatic optimization, not yet reduced; the reduction then writes into
        it, so copy what you want to keep."""

    def bucket_done(self, index: int) -> None:
        """Bucket ``index``'s reduction is complete (its Future is about to be set)."""


@dataclass
class _Clock:
    """When the latest bucket reduction finished. Completion callbacks capture this rather than the state:
    a callback is released on the backend's thread, and if it held the last reference to the state, and
    through it to the process group, the group's destructor would join that very thread and abort."""

    done_at: float = 0.0


@dataclass
class RingHookState:
    """Everything the hook needs; one per DDP model, owned by the strategy."""

    # -- settings
    algorithm: str = "auto"  # "ring", "tree", "native" or "auto"
    process_group: Optional[dist.ProcessGroup] = None  # None: the world; the strategy gives it one of its own
    compressor: Compressor = field(default_factory=NoCompressor)
    worker: Optional[CommWorker] = None  # None: reduce on the autograd thread (blocking)
    # -- per-step inputs, set by the strategy
    world_size: int = 1
    share: Optional[float] = None  # this rank's share of the step's samples; None means 1 / world_size
    # True while a backward runs whose loss gradient the strategy already scaled by the share: the weight
    # stage then has nothing left to do
    weighted_in_autograd: bool = False
    # called on the autograd thread when DDP hands over the step's last bucket: the strategy starts the
    # per-step exchange here, so that it travels alongside that bucket
    on_last_bucket: Optional[Callable[[], None]] = None
    # finiteness checks of each bucket, local before compression and reduced after the all-reduce (armed by
    # NaNRecovery; see lightning_dist.strategy.skip); None or unarmed: no checks
    guard: Optional[StepGuard] = None
    check_reduced: bool = True  # False under fp16 loss scaling: the LossScaler's unscale_ checks instead
    # -- outputs, read and reset by the strategy once per step
    stats: CommStats = field(default_factory=lambda: CommStats(keep_records=False))
    exposed_s: float = 0.0  # communication time backward did not hide (summed over backward passes)
    handed_at: Optional[float] = None  # perf_counter when this backward pass handed over its last bucket
    clock: _Clock = field(default_factory=_Clock)  # perf_counter when the latest bucket reduction finished
    # id(parameter) -> its name in the module; compressor state is keyed by names, because DDP rebuilds
    # (and renumbers) its buckets after the first step and in every new process
    param_names: dict[int, str] = field(default_factory=dict)
    rank: int = 0  # this rank's place in process_group (for counting the dense ring's bytes)
    # two-tier reduction (None: flat, every bucket on process_group); with it, process_group is unused
    tiers: Optional[TwoTier] = None
    # the tier of process_group's traffic on the flat path: "inter_host" when its ranks span hosts
    flat_tier: str = "intra_host"
    transport: Optional[Transport] = None  # made on first use from process_group, algorithm and stats
    # features watching the buckets (RingFeatures.add_bucket_observer); empty: the hook skips them at no cost
    observers: list[BucketObserver] = field(default_factory=list)
    _layouts: dict[tuple[int, int, int], BucketLayout] = field(default_factory=dict)
    _dense_bytes: dict[BucketLayout, int] = field(default_factory=dict)  # the dense ring's bytes per bucket

    def get_transport(self) -> Transport:
        if self.transport is None or self.transport.group is not self.process_group:
            self.transport = Transport(self.algorithm, self.process_group, self.flat_stats())
        return self.transport

    def flat_stats(self) -> TierStats:
        """The step's stats as the flat path records into them (bytes counted under :attr:`flat_tier`)."""
        return self.stats.tier(self.flat_tier)

    def step_share(self) -> float:
        """This rank's share of the step: what the gradient of the loss is multiplied by."""
        return 1.0 / self.world_size if self.share is None else self.share

    def bind(self, model: torch.nn.Module, group: Optional[dist.ProcessGroup], world_size: int,
             on_last_bucket: Optional[Callable[[], None]], tiers: Optional[TwoTier] = None,
             spans_hosts: bool = False) -> None:
        """Attach to a freshly wrapped DDP model: its parameters' names, the comm group (or the two-tier groups),
        no cached buckets."""
        self.world_size, self.process_group, self.on_last_bucket = world_size, group, on_last_bucket
        self.tiers, self.flat_tier = tiers, "inter_host" if spans_hosts else "intra_host"
        self.rank = dist.get_rank(group) if group is not None else 0
        self.transport = None
        self._layouts.clear()
        self._dense_bytes.clear()
        self.param_names = {id(p): name for name, p in model.named_parameters()}

    def start_worker(self, name: str, device: torch.device) -> None:
        """The communication thread that overlaps the buckets' reduction with backward."""
        on_start = (lambda: torch.cuda.set_device(device)) if device.type == "cuda" else None
        self.worker = CommWorker(name=name, on_start=on_start).start()

    def stop_worker(self, timeout_s: float) -> Optional[str]:
        """End the communication thread; a warning when it is still blocked in a collective after ``timeout_s``."""
        worker, self.worker = self.worker, None
        if worker is None or worker.stop(timeout_s):
            return None
        return (f"{worker.name} is still blocked in a collective {timeout_s:.0f}s after teardown (a peer stopped "
                "answering); it is a daemon thread and ends with the process.")

    def unbind(self) -> None:
        """After teardown: no group, no transport (the groups are destroyed)."""
        self.process_group = self.transport = self.tiers = None

    def close_backward(self) -> None:
        """After a backward pass (all its buckets reduced): add the time backward waited for the last of them."""
        if self.handed_at is not None:
            self.exposed_s += max(0.0, self.clock.done_at - self.handed_at)
            self.handed_at = None

    def backward_window(self) -> Optional[tuple[float, float]]:
        """``(handed, done)`` of the backward pass in progress: when DDP handed over its last bucket to the worker
        and when the latest bucket reduction finished; None when no bucket was handed over (blocking hook)."""
        return None if self.handed_at is None else (self.handed_at, max(self.handed_at, self.clock.done_at))

    def reset_step(self) -> None:
        self.stats.reset()
        self.exposed_s, self.handed_at = 0.0, None


def ring_comm_hook(state: RingHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Reduce one gradient bucket: weight -> compress -> transport -> decompress, on the worker if any."""
    buffer = bucket.buffer()
    layout = _bucket_layout(state, bucket)
    if not state.observers:
        return _reduce_bucket(state, bucket, buffer, layout)
    observers, index = tuple(state.observers), bucket.index()  # a copy: the list may change while this one travels
    for observer in observers:
        observer.bucket_handed(index, layout, buffer)
    return _reduce_bucket(state, bucket, buffer, layout).then(functools.partial(_tell_done, observers, index))


def _tell_done(observers: tuple[BucketObserver, ...], index: int, fut: torch.futures.Future) -> torch.Tensor:
    for observer in observers:
        observer.bucket_done(index)
    return fut.value()  # raises the reduction's error into the chained Future, for DDP to rethrow


def _reduce_bucket(state: RingHookState, bucket: dist.GradBucket, buffer: torch.Tensor,
                   layout: BucketLayout) -> torch.futures.Future[torch.Tensor]:
    """:func:`ring_comm_hook`'s work, once its observers (if any) have seen the bucket."""
    is_last = bucket.is_last()
    if state.on_last_bucket is not None and is_last:
        state.on_last_bucket()
    state.stats.record_dense(state._dense_bytes[layout])
    # during the compressor's warm-up (start_step) the bucket travels dense
    codec = _DENSE if state.compressor.warming_up else state.compressor
    guard = state.guard if state.guard is not None and state.guard.armed else None
    reduced_check = None
    if guard is not None and state.check_reduced:
        reduced_check = functools.partial(guard.check_reduced,
                                          every_element=codec.can_overflow or not codec.keeps_sentinel)

    def reduce_job() -> torch.Tensor:  # the general path, to completion: check, weight, reduce, check
        if guard is not None:
            guard.check_local(buffer)
        _weigh(state, buffer)
        _reduce(state, codec, buffer, layout)
        if reduced_check is not None:
            reduced_check(buffer)
        return buffer

    if state.worker is None:
        started = time.perf_counter()
        if state.tiers is not None:
            _begin_two_tier(state, codec, buffer, layout, bucket.index(), guard, reduced_check)().wait()
        else:
            reduce_job()
        state.exposed_s += time.perf_counter() - started
        return completed_future(buffer, future_devices(buffer))
    if is_last:
        state.handed_at = time.perf_counter()
    what = f"gradient bucket {bucket.index()} ({_short(layout.key)})"
    devices = future_devices(buffer)  # a CUDA bucket's Future records an event as it completes: DDP then waits for it
    if state.tiers is not None and buffer.is_cuda:  # NCCL: every collective of the three groups from one thread
        def two_tier_job() -> torch.futures.Future:
            return _begin_two_tier(state, codec, buffer, layout, bucket.index(), guard, reduced_check)()

        return state.worker.submit(two_tier_job, what=what, here_if_idle=is_last, devices=devices)
    if state.tiers is not None:  # the host's reduce-scatter issued now, the rest on the worker (tiers.py)
        return state.worker.submit(_begin_two_tier(state, codec, buffer, layout, bucket.index(), guard,
                                                   reduced_check), what=what, here_if_idle=is_last, devices=devices)
    if not codec.summable:  # its own collectives, run to completion on the worker
        return state.worker.submit(reduce_job, what=what, here_if_idle=is_last, devices=devices)
    # Work that only issues the backend's asynchronous all-reduce never blocks; it runs right here when the
    # worker is idle (the order stays DDP's), as does the last bucket, behind which nothing is left to overlap.
    issue_only = codec.light and resolve_algorithm(buffer, state.algorithm, state.process_group) == "native"

    timed = not isinstance(codec, NoCompressor)  # the identity has no coding time to measure

    def job() -> torch.futures.Future:
        if guard is not None:
            guard.check_local(buffer)
        _weigh(state, buffer)
        started = time.perf_counter()
        with _stage("lightning_dist.compress"):
            payload, ctx = codec.compress(buffer, layout)
        stats, clock = state.stats, state.clock  # never the state itself: see _Clock
        if timed:
            stats.record_codec(time.perf_counter() - started)
        with _stage(f"lightning_dist.transport.{state.algorithm}"):
            return allreduce_async(payload, state.algorithm, group=state.process_group, op="sum",
                                   stats=state.flat_stats(),
                                   then=lambda reduced: _decompress(codec, stats, clock, reduced, ctx, buffer, timed,
                                                                     reduced_check))

    return state.worker.submit(job, what=what, here_if_idle=issue_only or is_last, devices=devices)


_DENSE = NoCompressor()


def _weigh(state: RingHookState, buffer: torch.Tensor) -> None:
    with _stage("lightning_dist.weight"):
        if not state.weighted_in_autograd:
            buffer.mul_(state.step_share())


def _reduce(state: RingHookState, codec: Compressor, buffer: torch.Tensor, layout: BucketLayout) -> torch.Tensor:
    """The general path: the compressor drives its own collectives through the state's transport."""
    transport = state.get_transport()
    started, on_wire = time.perf_counter(), transport.seconds
    with _stage(f"lightning_dist.compressed_reduce.{codec.name}"):
        codec.reduce(buffer, layout, transport)
    state.stats.record_codec(max(0.0, time.perf_counter() - started - (transport.seconds - on_wire)))
    state.clock.done_at = max(state.clock.done_at, time.perf_counter())
    return buffer


def _begin_two_tier(state: RingHookState, codec: Compressor, buffer: torch.Tensor, layout: BucketLayout, slot: int,
                    guard: Optional[StepGuard], reduced_check: Optional[Callable[[torch.Tensor], None]]
                    ) -> Callable[[], torch.futures.Future]:
    """On the autograd thread: check, weight, and issue the bucket's reduce-scatter inside the host. Returns the job
    that finishes it on the worker (across hosts, then the all-gather, whose completion checks the reduced bucket)."""
    if guard is not None:
        guard.check_local(buffer)
    _weigh(state, buffer)
    tiers = state.tiers
    with _stage("lightning_dist.two_tier.reduce_scatter"):
        flight = tiers.begin(buffer, layout, slot)
    stats, clock = state.stats, state.clock  # never the state itself in a callback: see _Clock

    def finish_job() -> torch.futures.Future:
        started, on_wire = time.perf_counter(), tiers.seconds
        with _stage(f"lightning_dist.compressed_reduce.{codec.name}"):
            gathered = tiers.finish(flight, codec)
        stats.record_codec(max(0.0, time.perf_counter() - started - (tiers.seconds - on_wire)))

        def done(fut: torch.futures.Future) -> torch.Tensor:
            reduced = fut.value()
            if reduced_check is not None:
                reduced_check(reduced)
            clock.done_at = max(clock.done_at, time.perf_counter())
            return reduced

        return gathered.then(done)

    return finish_job


def _decompress(codec: Compressor, stats: CommStats, clock: _Clock, payload: torch.Tensor, ctx: object,
                buffer: torch.Tensor, timed: bool,
                reduced_check: Optional[Callable[[torch.Tensor], None]]) -> torch.Tensor:
    started = time.perf_counter()
    with _stage("lightning_dist.decompress"):
        result = codec.decompress(payload, ctx, buffer)
    now = time.perf_counter()
    if timed:
        stats.record_codec(now - started)
    if reduced_check is not None:
        reduced_check(result)
        now = time.perf_counter()
    clock.done_at = max(clock.done_at, now)
    return result


def _bucket_layout(state: RingHookState, bucket: dist.GradBucket) -> BucketLayout:
    """The bucket's parameters by name, shape and offset: stable when DDP rebuilds and renumbers its buckets."""
    params = bucket.parameters()
    cache_key = (bucket.index(), id(params[0]) if params else 0, len(params))
    layout = state._layouts.get(cache_key)
    if layout is None:
        if params:
            layout = BucketLayout.of([(state.param_names.get(id(p), f"param{i}"), p.shape)
                                      for i, p in enumerate(params)])
        else:
            layout = BucketLayout.single(bucket.buffer().numel(), f"bucket{bucket.index()}")
        if layout.numel != bucket.buffer().numel():
            raise RuntimeError(f"gradient bucket {bucket.index()} holds {bucket.buffer().numel()} elements but its "
                               f"parameters {layout.names} have {layout.numel}; sparse gradients are not supported")
        state._layouts[cache_key] = layout
        buffer = bucket.buffer()
        state._dense_bytes[layout] = ring_bytes_sent(buffer.numel(), state.world_size, state.rank,
                                                     buffer.element_size())
    return layout


def _stage(name: str) -> contextlib.AbstractContextManager:
    """A profiler range while torch's profiler runs; nothing otherwise (entering a ``record_function`` goes
    through the op dispatcher, a cost a bandwidth-bound step notices at 4 stages per bucket)."""
    return record_function(name) if profiler_enabled() else contextlib.nullcontext()


def _short(key: str, limit: int = 80) -> str:
    return key if len(key) <= limit else key[: limit - 3] + "..."
