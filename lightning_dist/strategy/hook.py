"""The DDP communication hook that sends every gradient bucket through lightning_dist's collectives.

DDP calls ``ring_comm_hook(state, bucket)`` once per gradient bucket as soon as backward has filled it, in
bucket order. The bucket's reduction has four visible stages, each a
``torch.profiler.record_function`` range, so they show in a Chrome trace:

1. **weight**: scale the local gradient by this rank's share of the step (``1 / N`` with equal batches).
   Under RingDDPStrategy with automatic optimization this has already happened in autograd: the
   strategy multiplies the gradient flowing out of the loss by the share
   (:meth:`RingHookState.loss_gradient_scale`), so every gradient arrives weighted and the hook skips a
   pass over the bucket (stock DDP fuses the same scaling into its copy into the bucket; a separate pass
   cost ~3% of a bandwidth-bound CPU step). Under manual optimization, or when backward did not go
   through the strategy (DDP used directly), the hook multiplies the bucket here instead. At 2 ranks both
   are exact (a power of two), so ring_ddp and stock DDP agree bit for bit.
2. **compress**: the compressor turns the bucket into a payload (identity for now).
3. **transport**: ``ring``, ``tree``, ``native`` or ``auto`` all-reduce of the payload, by sum, on the
   hook's own process group.
4. **decompress**: the reduced payload goes back into the bucket's buffer.

With a :class:`~lightning_dist.strategy.comm_worker.CommWorker` in the state (the default) the hook returns
a pending ``Future``: backward goes on computing the next buckets' gradients while this one travels, and
DDP waits for every Future at the end of backward. Work that would block (our ring's and tree's loops)
is queued on the worker; the backend's native all-reduce of a lightly compressed bucket is issued
asynchronously (:func:`~lightning_dist.comm.allreduce_async`) right here when the worker is idle, and
decompressed in its completion callback; so is the last bucket, behind which nothing is left to overlap.
Without a worker the hook reduces on the autograd thread and returns a completed ``Future``
(``overlap=False``: simpler to debug, and the baseline the step benchmark compares against).

Per step, ``state.stats`` collects bytes and seconds inside the transport, and ``state.exposed_s`` the
communication that backward did not hide. Overlapped, that is the time from the moment DDP hands over the
last bucket (backward's own computation is then over) until every bucket is reduced; the strategy adds it
up after each backward pass (:meth:`RingHookState.close_backward`). Blocking, it is the whole time spent in
the hook. The strategy reads and resets both once per step.
"""

# no `from __future__ import annotations`: DDP inspects the hook's real annotations (dist.GradBucket)

import contextlib
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch.profiler import record_function

from lightning_dist.comm import CommStats, allreduce_, allreduce_async, completed_future, resolve_algorithm
from lightning_dist.compression import Compressor, NoCompressor
from lightning_dist.strategy.comm_worker import CommWorker


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
    weight: Optional[float] = None  # this rank's share of the step's samples; None means 1 / world_size
    # True while a backward runs whose loss gradient the strategy already scaled by the share: the weight
    # stage then has nothing left to do
    weighted_in_autograd: bool = False
    # called on the autograd thread when DDP hands over the step's last bucket: the strategy starts the
    # per-step control exchange here, so that it travels alongside that bucket
    on_last_bucket: Optional[Callable[[], None]] = None
    # -- outputs, read and reset by the strategy once per step
    stats: CommStats = field(default_factory=lambda: CommStats(keep_records=False))
    exposed_s: float = 0.0  # communication time backward did not hide (summed over backward passes)
    handed_at: Optional[float] = None  # perf_counter when this backward pass handed over its last bucket
    clock: _Clock = field(default_factory=_Clock)  # perf_counter when the latest bucket reduction finished
    # id(parameter) -> its name in the module; compressor state is keyed by names, because DDP rebuilds
    # (and renumbers) its buckets after the first step and in every new process
    param_names: dict[int, str] = field(default_factory=dict)
    _bucket_keys: dict[tuple[int, int, int], str] = field(default_factory=dict)

    def loss_gradient_scale(self) -> float:
        """This rank's share of the step: what the gradient of the loss is multiplied by."""
        return 1.0 / self.world_size if self.weight is None else self.weight

    def close_backward(self) -> None:
        """After a backward pass (all its buckets reduced): add the time backward waited for the last of them."""
        if self.handed_at is not None:
            self.exposed_s += max(0.0, self.clock.done_at - self.handed_at)
            self.handed_at = None

    def reset_step(self) -> None:
        self.stats.reset()
        self.exposed_s, self.handed_at = 0.0, None


def ring_comm_hook(state: RingHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Reduce one gradient bucket: weight -> compress -> transport -> decompress, on the worker if any."""
    is_last = bucket.is_last()
    if state.on_last_bucket is not None and is_last:
        state.on_last_bucket()
    buffer = bucket.buffer()
    key = _bucket_key(state, bucket)
    if state.worker is None:
        started = time.perf_counter()
        payload, ctx = _weigh_and_compress(state, buffer, key)
        with _stage(f"lightning_dist.transport.{state.algorithm}"):
            allreduce_(payload, state.algorithm, group=state.process_group, op="sum", stats=state.stats)
        result = _decompress(state.compressor, state.clock, payload, ctx, buffer)
        state.exposed_s += time.perf_counter() - started
        return completed_future(result)
    if is_last:
        state.handed_at = time.perf_counter()
    # Work that only issues the backend's asynchronous all-reduce never blocks; it runs right here when the
    # worker is idle (the order stays DDP's), as does the last bucket, behind which nothing is left to overlap.
    issue_only = state.compressor.light and resolve_algorithm(buffer, state.algorithm, state.process_group) == "native"

    def job() -> torch.futures.Future:
        payload, ctx = _weigh_and_compress(state, buffer, key)
        compressor, clock = state.compressor, state.clock  # never the state itself: see _Clock
        with _stage(f"lightning_dist.transport.{state.algorithm}"):
            return allreduce_async(payload, state.algorithm, group=state.process_group, op="sum", stats=state.stats,
                                   then=lambda reduced: _decompress(compressor, clock, reduced, ctx, buffer))

    what = f"gradient bucket {bucket.index()} ({_short(key)})"
    return state.worker.submit(job, what=what, here_if_idle=issue_only or is_last)


def _weigh_and_compress(state: RingHookState, buffer: torch.Tensor, key: str) -> tuple[torch.Tensor, object]:
    with _stage("lightning_dist.weight"):
        if not state.weighted_in_autograd:
            buffer.mul_(state.loss_gradient_scale())
    with _stage("lightning_dist.compress"):
        return state.compressor.compress(buffer, key)


def _decompress(compressor: Compressor, clock: _Clock, payload: torch.Tensor, ctx: object,
                buffer: torch.Tensor) -> torch.Tensor:
    with _stage("lightning_dist.decompress"):
        result = compressor.decompress(payload, ctx, buffer)
    clock.done_at = max(clock.done_at, time.perf_counter())
    return result


def _bucket_key(state: RingHookState, bucket: dist.GradBucket) -> str:
    """The names of the bucket's parameters, joined: stable when DDP rebuilds and renumbers its buckets."""
    params = bucket.parameters()
    if not params:
        return f"bucket{bucket.index()}"
    cache_key = (bucket.index(), id(params[0]), len(params))
    key = state._bucket_keys.get(cache_key)
    if key is None:
        key = ",".join(state.param_names.get(id(p), f"param{i}") for i, p in enumerate(params))
        state._bucket_keys[cache_key] = key
    return key


def _stage(name: str) -> contextlib.AbstractContextManager:
    """A profiler range while torch's profiler runs; nothing otherwise (entering a ``record_function`` goes
    through the op dispatcher: ~2% of a bandwidth-bound step at 4 stages per bucket)."""
    return record_function(name) if torch.autograd.profiler._is_profiler_enabled else contextlib.nullcontext()


def _short(key: str, limit: int = 80) -> str:
    return key if len(key) <= limit else key[: limit - 3] + "..."
