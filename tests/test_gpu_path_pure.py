"""The GPU path's contracts, checked on the CPU (issue 41): what a CUDA run depends on that these machines can show
without a GPU. Each test fails on the code before its fix. ``-m gpu`` (tests/test_gpu.py) runs the same paths on a
device where one is present."""

from __future__ import annotations

import contextlib
import threading
import warnings
from typing import TypeVar

import pytest
import torch

from lightning_dist.comm import completed_future, future_devices
from lightning_dist.compression import BucketLayout, build_compressor, kernels
from lightning_dist.compression.emulate import MirrorTransport
from lightning_dist.fault import rng
from lightning_dist.strategy.comm_worker import CommWorker
from lightning_dist.strategy.skip import StepGuard

# the compressors of the per-step path (the registry's, as of issue 41), with and without error feedback
CODECS = [("none", {}), ("fp16", {}), ("bf16", {}), ("int8", {}), ("int4", {}), ("powersgd", {}), ("sign", {}),
          ("topk", {"selection": "exact"}),  # on CUDA top-k always runs torch.topk (compression/topk.py)
          ("int8", {"clip_norm": 1.0}), ("powersgd", {"clip_norm": 1.0}), ("topk", {"selection": "exact",
                                                                                     "clip_norm": 0.5})]
SYNCING = ("item", "__bool__", "__int__", "__float__", "__index__", "tolist", "nonzero")


@contextlib.contextmanager
def host_syncs(monkeypatch):
    """Count every read of a tensor's value into Python (and every ``nonzero``, whose size is the data) on any thread:
    on a CUDA tensor each waits for every kernel queued so far. A draw from a CPU generator is no such wait (it is
    on the host already), so ``torch.randint(..., generator=<cpu>)``'s result is not counted."""
    counts: list[str] = []
    host_born: set[int] = set()
    real_randint = torch.randint

    def randint(*args, **kwargs):
        out = real_randint(*args, **kwargs)
        gen = kwargs.get("generator")
        if gen is not None and gen.device.type == "cpu":
            host_born.add(id(out))
        return out

    def counting(name, real):
        def wrapper(self, *args, **kwargs):
            if id(self) not in host_born:
                counts.append(f"{name} on {threading.current_thread().name}")
            return real(self, *args, **kwargs)
        return wrapper

    monkeypatch.setattr(torch, "randint", randint)
    for name in SYNCING:
        monkeypatch.setattr(torch.Tensor, name, counting(name, getattr(torch.Tensor, name)))
    real_nonzero = torch.nonzero

    def nonzero(t, *args, **kwargs):
        counts.append("torch.nonzero")
        return real_nonzero(t, *args, **kwargs)

    monkeypatch.setattr(torch, "nonzero", nonzero)
    try:
        yield counts
    finally:
        monkeypatch.undo()


def _bucket(seed=0):
    layout = BucketLayout.of([("w", torch.Size([64, 48])), ("b", torch.Size([64])), ("v", torch.Size([1000]))])
    return layout, torch.randn(layout.numel, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name,options", CODECS, ids=[f"{n}{'+clip' if 'clip_norm' in o else ''}" for n, o in CODECS])
def test_no_host_sync_on_the_workers_path_for_any_compressor(monkeypatch, name, options):
    """Issue 41 finding 3: every compressed reduction (error feedback, clipping and the step guard's checks included)
    runs without reading a tensor into Python; the finiteness flags are read once per step, at the commit."""
    compressor = build_compressor(name, **options)
    guard = StepGuard()
    for step in range(2):  # the second step reads the first's residuals and factors
        layout, flat = _bucket(step)
        with host_syncs(monkeypatch) as counts:
            guard.check_local(flat)
            compressor.reduce(flat, layout, MirrorTransport(2))
            guard.check_reduced(flat)
        assert counts == [], f"{compressor.describe()}: host syncs on the worker's path: {counts}"
        compressor.commit()  # between steps, on the main thread: the one read of the step's flags


def test_a_non_finite_bucket_keeps_the_residuals_it_had():
    """The finiteness flag, now read at the commit, still keeps the residuals of a non-finite bucket as they were."""
    compressor = build_compressor("int8")
    layout, flat = _bucket(1)
    compressor.reduce(flat, layout, MirrorTransport(2))
    compressor.commit()
    before = {n: compressor.residuals.committed(n).clone() for n in layout.names}
    _, bad = _bucket(2)
    bad[3] = float("nan")
    compressor.reduce(bad, layout, MirrorTransport(2))
    compressor.commit()
    for n in layout.names:
        assert torch.equal(compressor.residuals.committed(n), before[n])


def test_clipping_on_the_device_matches_the_norm_test():
    compressor = build_compressor("int8", clip_norm=0.5)
    layout, flat = _bucket(3)
    expected = flat.clone()
    for grad in layout.views(expected):
        norm = grad.norm()
        if norm > 0.5:
            grad.mul_(0.5 / norm)
    seen = []
    compressor.inner.reduce = lambda f, lay, t, fed=None: seen.append(f.clone()) or f
    compressor.reduce(flat, layout, MirrorTransport(2))
    assert torch.equal(seen[0], expected)


def test_the_step_verdict_reads_the_buckets_with_one_sync(monkeypatch):
    guard = StepGuard()
    guard.arm()
    for seed in range(4):
        _, flat = _bucket(seed)
        guard.check_local(flat)
        guard.check_reduced(flat)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    with host_syncs(monkeypatch) as counts:
        verdict = guard.decide(optimizer, None, None, 0, 1, 0)
    assert not verdict.skipped and len(counts) == 1, counts


# -- futures carry their devices (finding 1) --
_real_future = torch.futures.Future
T = TypeVar("T")


class _Recorder(_real_future[T]):
    """A torch.futures.Future that records the devices each one is made with."""

    made: list = []

    def __init__(self, *, devices=None):
        type(self).made.append(devices)
        super().__init__(devices=devices)


class _FakeCuda:
    device = torch.device("cuda", 1)


def test_future_devices_names_the_cuda_devices_of_a_value():
    assert future_devices(torch.zeros(2)) == []
    assert future_devices(_FakeCuda()) == [torch.device("cuda", 1)]
    assert future_devices([_FakeCuda(), torch.zeros(1), _FakeCuda()]) == [torch.device("cuda", 1)]


def test_every_future_of_the_worker_is_made_with_the_buckets_devices(monkeypatch):
    """Issue 41 finding 1: a Future made without ``devices`` records no CUDA event, so DDP's wait synchronises with
    nothing. The worker's Futures (queued or run on the calling thread) and completed ones get the devices."""
    monkeypatch.setattr(torch.futures, "Future", _Recorder)
    _Recorder.made = []
    worker = CommWorker("devices").start()
    try:
        bucket = torch.ones(4)
        devices = future_devices(bucket)
        queued = worker.submit(lambda: bucket, here_if_idle=False, devices=devices)
        assert torch.equal(queued.wait(), bucket)
        here = worker.submit(lambda: bucket, here_if_idle=True, devices=devices)
        assert torch.equal(here.wait(), bucket)
        completed_future(bucket)
    finally:
        worker.stop()
    assert _Recorder.made and all(d is not None for d in _Recorder.made), _Recorder.made


def test_a_completed_future_carries_its_values_devices(monkeypatch):
    monkeypatch.setattr(torch.futures, "Future", _Recorder)
    _Recorder.made = []
    completed_future(torch.zeros(1))
    assert _Recorder.made == [[]]


# -- compiled kernels (finding 7) --
def test_compiled_kernels_run_with_grad_off_and_every_call_falls_back(monkeypatch):
    """Issue 41 finding 7: Dynamo guards on grad mode; the comm worker codes with grad on, the autograd thread's
    last bucket with grad off. Every compiled call runs with grad off (one compile), and a failing later call (a
    recompile) falls back to the plain path instead of raising."""
    modes, calls = [], {"n": 0}

    def fake_compile(fn, **kwargs):
        def compiled(*args):
            calls["n"] += 1
            modes.append(torch.is_grad_enabled())
            if calls["n"] == 3:
                raise RuntimeError("recompile failed")
            return fn(*args)
        return compiled

    monkeypatch.setattr(torch, "compile", fake_compile)
    monkeypatch.setenv("LIGHTNING_DIST_COMPILE", "1")
    monkeypatch.setattr(kernels, "MIN_ELEMENTS", 1)
    monkeypatch.setattr(kernels, "_compiled", {})
    monkeypatch.setattr(kernels, "_failed", set())
    x = torch.randn(2, 4, 8)
    inverse, noise = torch.full((2, 4, 1), 10.0), torch.rand(1, 4, 8)
    plain = torch.empty(2, 4, 8, dtype=torch.int8)
    kernels._int8_codes_plain(x, inverse, noise, plain, torch.empty(2, 4, 8))
    for i, grad in enumerate((True, False, True, True)):
        codes = torch.zeros(2, 4, 8, dtype=torch.int8)
        with torch.set_grad_enabled(grad), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            kernels.int8_encode(x, inverse, noise, codes, torch.empty(2, 4, 8))
        assert torch.equal(codes, plain)
        assert any("int8_codes" in str(w.message) for w in caught) == (i == 2)
    assert modes == [False, False, False], modes  # the fourth call takes the plain path
    assert "int8_codes" in kernels._failed


# -- RNG state per device (finding 10) --
class _FakeCudaRng:
    """torch.cuda's generator functions over ``count`` fake devices, each with its own state."""

    def __init__(self, count, current):
        self.states = [torch.full((8,), i, dtype=torch.uint8) for i in range(count)]
        self.current = current

    def install(self, monkeypatch):
        cuda = torch.cuda
        monkeypatch.setattr(cuda, "is_available", lambda: True)
        monkeypatch.setattr(cuda, "is_initialized", lambda: True)
        monkeypatch.setattr(cuda, "device_count", lambda: len(self.states))
        monkeypatch.setattr(cuda, "current_device", lambda: self.current)
        monkeypatch.setattr(cuda, "get_rng_state", lambda device="cuda": self.states[self.current].clone())
        monkeypatch.setattr(cuda, "get_rng_state_all", lambda: [s.clone() for s in self.states])

        def set_state(state, device="cuda"):
            self.states[self.current] = state.clone()

        def set_all(states):
            for i, s in enumerate(states):
                self.states[i] = s.clone()  # IndexError with fewer devices, as torch's own

        monkeypatch.setattr(cuda, "set_rng_state", set_state)
        monkeypatch.setattr(cuda, "set_rng_state_all", set_all)


def test_rng_state_is_the_current_devices_only(monkeypatch):
    """Issue 41 finding 10: a rank saves and restores its own device's generator. After an elastic remap the rank
    on cuda:0 of a 1-GPU process restores the state saved by the rank that ran on cuda:1 of 2 (not cuda:0's, and no
    IndexError)."""
    saved_on = _FakeCudaRng(2, current=1)
    saved_on.install(monkeypatch)
    state = rng.capture()
    assert torch.equal(torch.as_tensor(state["cuda"]), saved_on.states[1])
    restored_on = _FakeCudaRng(1, current=0)
    restored_on.install(monkeypatch)
    rng.restore(state)
    assert torch.equal(restored_on.states[0], saved_on.states[1])


# -- DiLoCo's state off the GPU (findings 4, 5, 6, 8) --
class _OnCuda(torch.Tensor):
    """A CPU tensor that says it lives on cuda:0 (what ``torch.load(map_location="cuda:0")`` or a GPU model hands
    over); ``.to(...)`` and ``copy_`` read its data as a plain tensor's."""

    @property
    def device(self):
        return torch.device("cuda", 0)

    def to(self, *args, **kwargs):
        return self.as_subclass(torch.Tensor).to(*args, **kwargs)


def _on_cuda(t):
    return t.detach().clone().as_subclass(_OnCuda)


def _on_host(t):
    return type(t) is torch.Tensor and t.device.type == "cpu"


def _tensors(value):
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _delayed_sync(module):
    from lightning_dist.sync import DiLoCo
    from lightning_dist.sync.diloco import DiLoCoSync
    from lightning_dist.sync.diloco_fragments import Workers

    sync = DiLoCoSync(DiLoCo(every=2, outer_momentum=0.9, delay=1), Workers(((0,),), rank=0), "auto", None)
    sync.attach(module)
    return sync


def _step(module, by=0.1):
    with torch.no_grad():
        for p in module.parameters():
            p.add_(by)


def test_diloco_keeps_its_state_in_host_memory(monkeypatch):
    """Issue 41 finding 5: theta_global, the momentum, the buffers, the buckets and the snapshots of an exchange in
    flight are host tensors, none of them a parameter's storage; by device, 0 bytes beside the model."""
    module = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    sync = _delayed_sync(module)
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    for step in (2, 3, 4):  # a sync lands (momentum made), the next one is in flight
        _step(module)
        sync.sync_after(step=step)
    assert sync.inflight and sync.inflight[0].snapshot
    state = sync.state_tensors()
    assert len(state) >= 2 * len(params) + 2 and all(_on_host(t) for t in state)
    assert not params & {t.untyped_storage().data_ptr() for t in state}
    by_device = sync.memory_by_device()
    assert by_device.get("cuda", 0) == 0 and by_device["cpu"] == sync.memory_bytes() > 0
    sync.close()


def test_memory_monitor_counts_diloco_on_the_host_not_the_gpu():
    from lightning_dist.callbacks.memory_monitor import _sync_bytes
    from lightning_dist.comm import CommStats
    from lightning_dist.sync import DiLoCo, SyncContext

    context = SyncContext(rank=0, world_size=1, module=torch.nn.Linear(4, 3), topology=None, algorithm="auto",
                          timeout=None, stats=CommStats())
    driver = DiLoCo(every=2, outer_momentum=0.9, delay=1).bind(context)  # one rank: no group
    assert _sync_bytes(driver, on_gpu=True) == 0
    assert _sync_bytes(driver, on_gpu=False) == driver.loop.memory_bytes() == driver.report().memory_bytes
    driver.close()


def test_what_diloco_gathers_and_saves_is_on_the_host(monkeypatch):
    """Issue 41 finding 4: every rank's part is moved to the CPU before gather_object pickles it (else rank zero
    unpickles every rank's CUDA tensors onto its own GPU)."""
    import torch.distributed as dist

    from lightning_dist.sync import diloco_driver

    module = torch.nn.Linear(4, 3)
    sync = _delayed_sync(module)
    _step(module)
    sync.sync_after(step=2)  # an exchange in flight: settled and saved
    gathered = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "gather_object", lambda obj, out, dst, group: gathered.append(obj))
    worker = {"module": {k: _on_cuda(v) for k, v in module.state_dict().items()},
              "optimizers": [{"state": {0: {"exp_avg": _on_cuda(torch.ones(3))}}, "param_groups": []}]}
    entry = diloco_driver.sync_entry(sync, worker, rank=1, world_size=2, group=None)
    saved = _tensors(gathered) + _tensors(entry["state"])
    assert saved and all(_on_host(t) for t in saved), {type(t).__name__ for t in saved}
    sync.close()


def test_a_resume_with_an_exchange_in_flight_lands_on_the_host_from_any_map_location():
    """Issue 41 finding 6: a checkpoint mapped to a GPU (here: tensors that say cuda:0) restores every part of the
    exchange in flight (its reduced sums, buffers and the worker's snapshot) into host memory, beside theta_global,
    and it lands as the uninterrupted run does."""
    torch.manual_seed(0)
    module = torch.nn.Linear(4, 3)
    sync = _delayed_sync(module)
    _step(module)
    sync.sync_after(step=2)
    state, snapshots = sync.state_dict(), sync.inflight_snapshots()
    mapped = {**state, "global": {k: _on_cuda(v) for k, v in state["global"].items()},
              "inflight": [{**ex, "sums": [_on_cuda(t) for t in ex["sums"]],
                            "buffers": None if ex["buffers"] is None else [_on_cuda(b) for b in ex["buffers"]]}
                           for ex in state["inflight"]]}
    mapped_snapshots = [{k: _on_cuda(v) for k, v in snap.items()} for snap in snapshots]
    resumed_module = torch.nn.Linear(4, 3)
    resumed_module.load_state_dict(module.state_dict())
    resumed = _delayed_sync(resumed_module)
    resumed.load_state_dict(mapped)
    resumed.load_inflight_snapshots(mapped_snapshots)
    assert all(_on_host(t) for t in resumed.state_tensors())
    _step(module, 0.05)
    _step(resumed_module, 0.05)
    sync.sync_after(step=3)
    resumed.sync_after(step=3)
    for a, b in zip(module.parameters(), resumed_module.parameters(), strict=True):
        assert torch.equal(a, b)
    sync.close()
    resumed.close()


def test_the_exchange_thread_selects_the_models_device(monkeypatch):
    """Issue 41 finding 8: DiLoCo's exchange thread sets the model's CUDA device before its first job."""
    selected = []
    monkeypatch.setattr(torch.cuda, "set_device",
                        lambda device: selected.append((device, threading.current_thread().name)))
    sync = _delayed_sync(torch.nn.Linear(2, 2))
    sync.exchanges.device = torch.device("cuda", 1)
    executor = sync.exchanges._executor()
    executor.submit(lambda: None).result()
    executor.shutdown()
    assert selected and selected[0][0] == torch.device("cuda", 1) and "sync" in selected[0][1]


# -- step timing on the device (finding 2) --
class _CudaBatch(torch.Tensor):
    @property
    def is_cuda(self):
        return True


class _FakeEvent:
    """torch.cuda.Event over a scripted device clock (milliseconds): each record() takes the next time."""

    clock: list = []

    def __init__(self, enable_timing=False):
        assert enable_timing
        self.at = None

    def record(self, stream=None):
        self.at = _FakeEvent.clock.pop(0)

    def synchronize(self):
        pass

    def elapsed_time(self, end):
        return end.at - self.at


def test_compute_time_on_a_gpu_is_device_time_read_one_step_later(monkeypatch):
    """Issue 41 finding 2: on CUDA the host's clock times the queuing of kernels; compute_s comes from CUDA events
    (step start to the end of backward), read a step later with that step's samples."""
    from lightning_dist.comm import CommStats
    from lightning_dist.strategy.step_meter import StepMeter

    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    _FakeEvent.clock = [0.0, 5.0, 10.0, 40.0, 50.0, 52.0]  # device ms: steps of 5, 30 and 2 ms
    meter = StepMeter()
    rows = []
    for size in (4, 6, 3):
        meter.batch_started(torch.zeros(size, 2).as_subclass(_CudaBatch))
        meter.backward_done()
        meter.step_finished(CommStats(), exposed_s=0.0)
        rows.append((meter.last_step["samples"], meter.last_step["compute_s"]))
    assert rows == [(0.0, 0.0), (4.0, 0.005), (6.0, 0.030)], rows
    assert meter.totals["samples"] == 13
