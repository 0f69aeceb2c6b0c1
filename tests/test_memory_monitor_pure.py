"""MemoryMonitor's pieces without ranks: the estimate's parts, the activation probe, the readers, the
aggregation, the thresholds' decisions, settings and state."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from lightning_dist.callbacks import MemoryMonitor
from lightning_dist.callbacks.memory_monitor import check_settings
from lightning_dist.compression import build_compressor
from lightning_dist.compression.base import BucketLayout
from lightning_dist.memory import readers
from lightning_dist.memory.estimate import (
    ActivationProbe,
    CommSetup,
    MiB,
    estimate_memory,
    measured_state_bytes,
    optimizer_state_bytes,
    optimizer_transient_bytes,
)
from lightning_dist.memory.report import SLOTS, summarize


def _mlp(dtype=torch.float32):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).to(dtype)


def _step(model, optimizer, dtype=torch.float32):
    x = torch.randn(8, 16, dtype=dtype)

    def closure():
        optimizer.zero_grad()
        loss = model(x).float().pow(2).mean()
        loss.backward()
        return loss

    optimizer.step(closure)


OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1),
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "adam": lambda p: torch.optim.Adam(p),
    "adamw_amsgrad": lambda p: torch.optim.AdamW(p, amsgrad=True),
    # not in the table: probed on dummy parameters
    "adagrad": lambda p: torch.optim.Adagrad(p),
    "rmsprop_momentum": lambda p: torch.optim.RMSprop(p, momentum=0.9, centered=True),
    "nadam": lambda p: torch.optim.NAdam(p),
    "adamax": lambda p: torch.optim.Adamax(p),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_optimizer_state_estimate_equals_the_state_after_one_step(name, dtype):
    model = _mlp(dtype)
    optimizer = OPTIMIZERS[name](model.parameters())
    estimate, how = optimizer_state_bytes(optimizer)
    _step(model, optimizer, dtype)
    measured = measured_state_bytes(optimizer)
    assert estimate == pytest.approx(measured, rel=0.02, abs=64), how  # the probe's steps are float32 scalars
    # Adagrad creates its state in the constructor: measured as it is
    assert ("probed" in how) == (name in ("rmsprop_momentum", "nadam", "adamax"))
    assert how.startswith("measured") == (name == "adagrad")
    if name == "sgd":
        assert estimate == 0
    if name == "adam":  # 2 x parameters + a float32 step per tensor
        assert estimate == 2 * sum(p.numel() * p.element_size() for p in model.parameters()) + 4 * 4


def test_an_optimizer_with_state_is_measured_and_one_that_refuses_the_probe_is_named():
    model = _mlp()
    optimizer = torch.optim.Adam(model.parameters())
    _step(model, optimizer)
    assert optimizer_state_bytes(optimizer) == (measured_state_bytes(optimizer),
                                                "measured (the optimizer holds state)")

    class Picky(torch.optim.SGD):
        def __init__(self, params, lr, secret):
            super().__init__(params, lr=lr)

    bytes_, how = optimizer_state_bytes(Picky(model.parameters(), lr=0.1, secret=1))
    assert bytes_ == 0 and "probing Picky failed" in how


def test_the_probe_ignores_what_a_scheduler_adds_to_the_group():
    model = _mlp()
    optimizer = torch.optim.RMSprop(model.parameters(), lr=0.01, momentum=0.9)
    torch.optim.lr_scheduler.StepLR(optimizer, step_size=10)  # adds initial_lr to every group
    estimate, how = optimizer_state_bytes(optimizer)
    assert "probed RMSprop" in how
    _step(model, optimizer)
    assert estimate == pytest.approx(measured_state_bytes(optimizer), rel=0.02, abs=64)


def test_optimizer_temporaries_follow_the_implementation():
    model = nn.Sequential(nn.Linear(100, 100), nn.Linear(100, 10))
    total = sum(p.numel() * 4 for p in model.parameters())
    largest = 100 * 100 * 4
    assert optimizer_transient_bytes(torch.optim.Adam(model.parameters(), foreach=True))[0] == total
    assert optimizer_transient_bytes(torch.optim.Adam(model.parameters(), foreach=False))[0] == largest
    assert optimizer_transient_bytes(torch.optim.Adam(model.parameters(), foreach=True, weight_decay=0.1))[0] == \
        2 * total  # coupled weight decay: a decayed copy of the gradients too
    assert optimizer_transient_bytes(torch.optim.AdamW(model.parameters(), foreach=True))[0] == total
    assert optimizer_transient_bytes(torch.optim.SGD(model.parameters(), lr=0.1, foreach=True))[0] == 0
    assert optimizer_transient_bytes(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True,
                                                     foreach=True))[0] == 0  # nesterov updates in place
    assert optimizer_transient_bytes(torch.optim.SGD(model.parameters(), lr=0.1, weight_decay=0.1,
                                                     foreach=True))[0] == total
    assert optimizer_transient_bytes(torch.optim.Adam(model.parameters(), foreach=True, maximize=True))[0] == \
        2 * total  # the negated gradients
    if "decoupled_weight_decay" in torch.optim.Adam.__init__.__code__.co_varnames:
        assert optimizer_transient_bytes(torch.optim.Adam(model.parameters(), foreach=True, weight_decay=0.1,
                                                          decoupled_weight_decay=True))[0] == total
    # CPU parameters and no choice: torch's per-parameter loop
    kind = optimizer_transient_bytes(torch.optim.Adam(model.parameters()))[1]
    assert kind.startswith("single")


def test_activation_probe_counts_what_autograd_saves_and_changes_nothing():
    model = _mlp()
    x = torch.randn(8, 16)
    with ActivationProbe(exclude=model.parameters()) as probe:
        out = model(x).sum()
    # the first Linear saves its input (8 x 16), ReLU its output (8 x 32), which the second Linear saves too;
    # the weights Linear saves are parameters, not activations
    assert probe.bytes == 8 * 16 * 4 + 8 * 32 * 4 and probe.largest == 8 * 32 * 4
    out.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model(x).sum().backward()
    assert all(torch.equal(a, p.grad) for a, p in zip(grads, model.parameters(), strict=True))
    # start/stop from two hooks, idempotent stop; nothing counted after
    probe = ActivationProbe(exclude=model.parameters())
    probe.start()
    probe.start()
    model(x)
    assert probe.stop() == probe.stop() == 8 * 16 * 4 + 8 * 32 * 4
    model(x)
    assert probe.bytes == 8 * 16 * 4 + 8 * 32 * 4 and not probe.active


def test_a_probed_graph_dropped_without_backward_is_freed():
    import gc
    import weakref

    model = _mlp()
    with ActivationProbe(exclude=model.parameters()) as probe:
        out = torch.tanh(model(torch.randn(8, 16)))  # tanh saves its output
    assert probe.bytes > 0
    ref = weakref.ref(out)
    del out
    gc.collect()
    assert ref() is None


def test_estimate_parts_follow_buckets_compressor_and_activations():
    model = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 8))
    n = sum(p.numel() for p in model.parameters())
    grads = 4 * n
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    est = estimate_memory(model, [sgd], CommSetup(has_buckets=True, buckets_are_views=False, world_size=2))
    assert est.parts["weights"] == est.parts["gradients"] == est.parts["ddp_buckets"] == grads
    assert est.parts["optimizer_state"] == grads and "activations" not in est.parts
    assert "not measured yet" in est.notes["activations"]
    est = estimate_memory(model, [sgd], CommSetup(has_buckets=True, buckets_are_views=True, world_size=2,
                                                  transport_buffers=True), activation_bytes=1234,
                         largest_activation=500)
    assert est.parts["ddp_buckets"] == 0 and est.parts["activations"] == 1234
    assert est.parts["activation_grads"] == 1500  # backward's temporaries: 3 x the largest
    # a bucket of scratch for each of two threads (one bucket: the model is smaller than 25 MiB)
    assert est.parts["comm_workspace"] == 2 * grads
    topk = build_compressor("topk", ratio=0.01)  # with error feedback
    est = estimate_memory(model, [sgd], CommSetup(compressor=topk, world_size=2))
    assert est.parts["compressor_state"] == 2 * grads  # residuals, committed and staged
    # two_tier, 2 ranks per host: residuals for this rank's half of every parameter; the parts rearranged, and its own
    est = estimate_memory(model, [sgd], CommSetup(compressor=topk, world_size=4, two_tier_ranks_per_host=2))
    assert est.parts["compressor_state"] == 2 * 4 * (128 * 256 + 128 + 4 * 256 + 4)
    assert est.parts["two_tier_buffers"] == grads + grads // 2
    assert est.total == sum(est.parts.values())
    est.capacity, est.baseline, est.capacity_source = est.total, 1, "test"
    assert not est.fits and "DOES NOT FIT" in est.table()
    est.baseline = 0
    assert est.fits and "fits" in est.table()


def test_compressors_report_their_memory():
    layout = BucketLayout.of([("w", torch.Size([64, 32])), ("b", torch.Size([64]))])
    assert build_compressor("none").state_bytes(layout, 4) == 0
    assert build_compressor("fp16").workspace_bytes(1000, 4, 2) == 2000
    assert build_compressor("int8").state_bytes(layout, 4) == 2 * layout.numel * 4  # error feedback
    power = build_compressor("powersgd", rank=2, error_feedback=False)
    assert power.state_bytes(layout, 4) == 2 * 4 * 32 * 2  # Q (32 x 2) for the matrix; the bias goes dense
    sparse = build_compressor("topk", ratio=0.1, error_feedback=False)
    assert sparse.workspace_bytes(1000, 4, 4) > sparse.workspace_bytes(1000, 4, 2) > 0  # gathered payloads


def test_cgroup_limits_and_capacity(tmp_path, monkeypatch):
    root, proc = tmp_path / "cgroup", tmp_path / "proc_self_cgroup"
    assert readers.cgroup_limit(str(root), str(proc)) is None  # no /proc entry, no files
    # cgroup v2, a SLURM job: the job's limit, not the step's "max" nor the unlimited root
    proc.write_text("0::/system.slice/slurmstepd.scope/job_5/step_0\n")
    for rel, text in (("", None), ("system.slice", "max"), ("system.slice/slurmstepd.scope/job_5", "2147483648"),
                      ("system.slice/slurmstepd.scope/job_5/step_0", "max")):
        (root / rel).mkdir(parents=True, exist_ok=True)
        if text is not None:
            (root / rel / "memory.max").write_text(text + "\n")
    assert readers.cgroup_limit(str(root), str(proc)) == 2**31
    (root / "memory.max").write_text("1073741824\n")  # a container's own group, seen at the mount's root
    assert readers.cgroup_limit(str(root), str(proc)) == 2**30
    # cgroup v1: the memory controller's hierarchy; its "no limit" is a huge number
    proc.write_text("12:cpu,cpuacct:/job_7\n5:memory:/slurm/job_7\n")
    (root / "memory" / "slurm" / "job_7").mkdir(parents=True)
    (root / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    assert readers.cgroup_limit(str(root), str(proc)) is None
    (root / "memory" / "slurm" / "job_7" / "memory.limit_in_bytes").write_text("3221225472\n")
    assert readers.cgroup_limit(str(root), str(proc)) == 3 * 2**30
    monkeypatch.setattr(readers, "cgroup_limit", lambda: 2**30)
    capacity, source = readers.host_capacity(4)
    assert capacity == 2**28 and source == "cgroup limit / 4 ranks on this machine"


def test_host_readers_see_an_allocation():
    readers.release_host_memory()
    assert readers.reset_host_peak() == os.path.exists("/proc/self/clear_refs")
    rss, peak = readers.host_rss(), readers.host_rss_peak()
    held = torch.ones(64 * MiB // 4)  # 64 MiB, touched
    assert readers.host_rss() - rss >= 48 * MiB
    del held
    readers.release_host_memory()
    assert readers.host_rss_peak() - peak >= 48 * MiB  # the peak remembers it after it was freed
    readers.reset_host_peak()
    assert readers.host_rss_peak() - peak < 32 * MiB  # ... until it restarts


def test_cuda_paths_skip_cleanly_without_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the device script covers the CUDA paths")
    assert readers.cuda_device(torch.device("cpu")) is None
    assert readers.cuda_device(torch.device("cuda", 0)) is None
    assert set(readers.cuda_stats(None).values()) == {readers.UNAVAILABLE}
    assert readers.GpuUtilization().read(None) == readers.UNAVAILABLE
    monitor = MemoryMonitor(oom_snapshot=True)
    monitor._start_recording(SimpleNamespace(log_dir=None, default_root_dir="."))  # says so, records nothing
    assert not monitor._oom.recording
    monitor.on_exception(SimpleNamespace(strategy=None), None, torch.cuda.OutOfMemoryError("test"))
    assert monitor.snapshots == []


def _row(rss_mib, usage, rank_cuda=False, **extra):
    row = dict.fromkeys(SLOTS, readers.UNAVAILABLE)
    row.update(rss=rss_mib * MiB, rss_peak=rss_mib * MiB, usage=usage, capacity=1000.0 * MiB,
               estimate=100.0 * MiB, measured=rss_mib * MiB / 2, **extra)
    return row


def test_summarize_names_the_rank_and_skips_what_no_rank_has():
    rows = [_row(300, 0.3), _row(900, 0.9), _row(500, 0.5)]
    metrics = summarize(rows, per_rank=True)
    assert metrics["memory/rss_mib_max"] == 900 and metrics["memory/rss_mib_min"] == 300
    assert metrics["memory/rss_mib_max_rank"] == 1 and metrics["memory/usage_pct_max"] == pytest.approx(90)
    assert metrics["memory/rank2/rss_mib"] == 500 and metrics["memory/rank0/usage_pct"] == pytest.approx(30)
    assert metrics["memory/measured_mib_max"] == 450 and metrics["memory/estimate_mib_max"] == 100
    assert metrics["memory/estimate_error_pct"] == pytest.approx(100 * (100 - 450) / 450)
    assert not any("cuda" in k or "gpu" in k for k in metrics)
    rows[0]["gpu_util"], rows[1]["gpu_util"] = 80.0, 20.0  # rank 2 has no NVML
    metrics = summarize(rows)
    assert metrics["memory/gpu_util_pct_min"] == 20 and metrics["memory/gpu_util_pct_min_rank"] == 1
    assert not any("/rank" in k for k in metrics)


class _Trainer(SimpleNamespace):
    def save_checkpoint(self, path):
        self.saved.append(path)


def _trainer(step):
    return _Trainer(global_step=step, is_global_zero=True, loggers=[], saved=[], should_stop=False,
                    checkpoint_callback=None, default_root_dir="/runs/x")


@pytest.mark.filterwarnings("ignore:MemoryMonitor")  # the warn action warns, as it should
def test_thresholds_fire_once_per_crossing_and_stop_after_a_checkpoint():
    monitor = MemoryMonitor(warn_at=0.5, empty_cache_at=0.7, stop_at=0.9)
    trainer = _trainer(10)
    monitor._handle(trainer, [_row(100, 0.2), _row(600, 0.6)])
    assert [(e["action"], e["rank"], e["step"]) for e in monitor.events] == [("warn", 1, 10)]
    trainer.global_step = 20
    monitor._handle(trainer, [_row(100, 0.2), _row(650, 0.65)])  # still above: no second warning
    assert len(monitor.events) == 1
    trainer.global_step = 30
    monitor._handle(trainer, [_row(100, 0.2), _row(300, 0.3)])  # fell back: re-armed
    trainer.global_step = 40
    monitor._handle(trainer, [_row(950, 0.95), _row(300, 0.3)])
    assert [(e["action"], e["rank"], e["step"]) for e in monitor.events[1:]] == [
        ("warn", 0, 40), ("empty_cache", 0, 40), ("stop", 0, 40)]
    assert trainer.should_stop and trainer.saved == ["/runs/x/checkpoints/memory-stop-step=40.ckpt"]
    assert monitor.readings == 4 and monitor.peaks["memory/rss_mib_max"] == 950


def test_settings_are_checked_with_their_fix():
    assert check_settings(every_n_steps=None, warn_at=0.9, empty_cache_at=None, stop_at=None, preflight="warn",
                          capacity_gib=None, snapshot_entries=10) == []
    problems = check_settings(every_n_steps=0, warn_at=90, stop_at=True, preflight="loud", capacity_gib=0,
                              snapshot_entries=0)
    assert len(problems) == 6
    with pytest.raises(ValueError, match=r"warn_at=90 must be a fraction of capacity in \(0, 1.5\]"):
        MemoryMonitor(warn_at=90)
    with pytest.raises(ValueError, match="preflight='loud'"):
        MemoryMonitor(preflight="loud")


def test_nan_recovery_reports_its_snapshot():
    from lightning_dist.callbacks import NaNRecovery

    parts = {"weights": 10, "optimizer_state": 20, "gradients": 10}
    assert NaNRecovery().memory_parts(parts, on_accelerator=False) == {"nan_recovery_snapshot": 30}
    assert NaNRecovery().memory_parts(parts, on_accelerator=True) == {}  # in host memory: not the GPU's
    assert NaNRecovery(snapshot_device="same").memory_parts(parts, on_accelerator=True) == {
        "nan_recovery_snapshot": 30}


@pytest.mark.filterwarnings("ignore:MemoryMonitor")
def test_state_round_trips():
    monitor = MemoryMonitor(warn_at=0.5)
    monitor._handle(_trainer(5), [_row(600, 0.6)])
    restored = MemoryMonitor()
    restored.load_state_dict(monitor.state_dict())
    assert restored.events == monitor.events and restored.peaks == monitor.peaks and restored.readings == 1


def test_cuda_readings_map_the_allocators_counters(monkeypatch):
    stats = {"allocated_bytes.all.current": 3 * MiB, "allocated_bytes.all.peak": 5 * MiB,
             "reserved_bytes.all.current": 8 * MiB, "reserved_bytes.all.peak": 10 * MiB,
             "num_alloc_retries": 2, "num_ooms": 1}
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device: stats)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (100 * MiB, 120 * MiB))
    got = readers.cuda_stats(torch.device("cuda", 0))
    assert got == {"cuda_allocated": 3 * MiB, "cuda_allocated_peak": 5 * MiB, "cuda_reserved": 8 * MiB,
                   "cuda_reserved_peak": 10 * MiB, "cuda_alloc_retries": 2, "cuda_ooms": 1,
                   "cuda_nontorch": 12 * MiB}  # 20 MiB in use on the device, 8 of them ours


def test_oom_snapshots_name_rank_and_step_and_the_observer_is_not_a_leak(tmp_path, monkeypatch):
    import gc
    import weakref

    from lightning_dist.memory import oom

    dumped = []
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", lambda path: dumped.append(path))
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda *a, **k: None)
    attached = []
    monkeypatch.setattr(torch._C, "_cuda_attach_out_of_memory_observer", attached.append, raising=False)
    monkeypatch.setattr(oom, "_ATTACHED", False)
    monitor = MemoryMonitor(oom_snapshot=True, snapshot_dir=str(tmp_path / "snaps"))
    trainer = _trainer(17)
    trainer.strategy = SimpleNamespace()
    monitor._memory.cuda = torch.device("cuda", 0)
    monitor._start_recording(trainer)
    (observer,) = attached
    observer(0, 1 << 30, 0, 0)  # the allocator's observer, at a failed allocation
    observer(0, 1 << 30, 0, 0)  # a retry at the same step overwrites the same file
    path = str(tmp_path / "snaps" / "oom-rank0-step17.pickle")
    assert dumped == [path, path] and monitor.snapshots == [path]
    monitor.on_exception(trainer, None, torch.cuda.OutOfMemoryError("CUDA out of memory"))
    assert len(dumped) == 2  # the observer's snapshot of this step is the one kept
    observer(0, 1 << 30, 0, 0)  # the fit is over: nothing records, nothing is written
    assert len(dumped) == 2 and not monitor._oom.recording
    # without an observer, the exception itself dumps; a second fit attaches no second observer
    monitor._start_recording(trainer)
    assert len(attached) == 1
    trainer.global_step = 20
    monitor.on_exception(trainer, None, torch.cuda.OutOfMemoryError("CUDA out of memory"))
    assert dumped[-1].endswith("oom-rank0-step20.pickle")
    monitor._start_recording(trainer)
    monitor.on_exception(trainer, None, ValueError("not an OOM"))
    assert len(dumped) == 3 and not monitor._oom.recording
    # the observer holds neither the monitor nor the trainer
    ref = weakref.ref(trainer)
    del trainer
    gc.collect()
    assert ref() is None


# -- heterogeneous batching: the estimate's micro-batch, and hetero.memory_caps in the advice -------------------


def _hetero(world=2, **kwargs):
    """A HeteroBatching attached as the strategy holds it during a fit (B = 64: world 2 x 32)."""
    from lightning_dist.hetero import HeteroBatching
    from lightning_dist.hetero.sampler import HeteroBatchSampler

    hetero = HeteroBatching(**kwargs)
    plan = hetero.make_plan(world, 32)
    hetero.sampler = HeteroBatchSampler(640, world, 0, hetero.global_batch, plan)
    return hetero


def test_a_cap_that_fits_scales_the_measured_activations_by_a_passs_samples():
    from lightning_dist.memory.report import cap_that_fits

    # 400 bytes of activations at 16 samples: 25 a sample; 200 bytes over capacity -> 8 samples fewer
    assert cap_that_fits(held=1000, capacity=800, activations=400, samples=16) == 8
    assert cap_that_fits(held=600, capacity=800, activations=400, samples=16) == 24  # room: above today's pass
    assert cap_that_fits(held=1000, capacity=500, activations=400, samples=16) is None  # not even one sample fits
    assert cap_that_fits(held=1000, capacity=800, activations=0, samples=16) is None  # nothing measured
    assert cap_that_fits(held=1000, capacity=0, activations=400, samples=16) is None  # capacity unknown


def test_the_advice_names_hetero_memory_caps_and_what_accumulate_does_with_the_share():
    from lightning_dist.memory.estimate import MemoryEstimate
    from lightning_dist.memory.report import Passes, activation_note, advice, caps_advice

    auto = Passes(accumulate="auto", caps=[16, 64], sizes=[[16, 16, 16], [16]])
    said = caps_advice(auto, fitting=[8, 40], short=[0])
    assert said.startswith("hetero.memory_caps=[8,40] (rank 0: 16 -> 8 samples a pass")
    assert "runs the same share as more micro-batches: nothing moves to other ranks" in said
    assert "rank 1" not in said  # 40 fits rank 1's pass of 16: not lowered, only bounded below its cap of 64
    # no cap yet (accumulate resolved to off): a cap turns accumulate on by default
    said = caps_advice(Passes(accumulate="off", caps=None, sizes=[[48], [16]]), fitting=[20, 90], short=[0])
    assert said.startswith("hetero.memory_caps=[20,90] (rank 0: 48 -> 20") and "the default once a cap" in said
    # off by choice, with a cap: the cap would move samples; auto keeps the share
    said = caps_advice(Passes(accumulate="off", caps=[16, 64], sizes=[[16], [48]]), fitting=[10, 90], short=[0])
    assert "with hetero.accumulate=auto a lower cap runs the same share" in said and "moves the samples" in said
    # per-rank counts: a share holds at most count x cap, so the counts that hold 24 at a cap of 8 are named
    counts = Passes(accumulate=[2, 1], caps=[12, 64], sizes=[[12, 12], [40]])
    assert "hetero.accumulate=[3,1] or hetero.accumulate=auto" in caps_advice(counts, fitting=[8, 50], short=[0])
    # hetero=elastic takes no per-rank list: one max_batch_size
    elastic = Passes(accumulate="auto", caps=None, sizes=[[32], [32]], elastic=True)
    assert caps_advice(elastic, fitting=[20, 40], short=[0]).startswith("hetero.max_batch_size=20 (rank 0: 32 -> 20")
    assert caps_advice(auto, fitting=[None, 40], short=[0]).startswith(
        "a lower hetero.memory_caps entry for rank 0 (no figure")
    est = MemoryEstimate(parts={"weights": 2**30, "activations": 2**30})
    assert "a smaller per-rank batch or bf16 mixed precision (activations: 1.00 GiB)" in advice(est)
    said = advice(est, caps_advice(auto, fitting=[8, 40], short=[0]))
    assert "To fit: hetero.memory_caps=[8,40] (" in said and "per-rank batch" not in said
    assert activation_note([16, 16, 16]) == ("saved for backward in the first forward pass: micro-batch 1 of 3 (16 of "
                                             "this rank's 48 samples); its backward frees them before the next")


def _monitor_under_hetero(monkeypatch, hetero, **kwargs):
    """A MemoryMonitor whose trainer's strategy exposes ``hetero`` through the feature seam, at batch 0 of epoch 0,
    its estimate measured on this rank's first pass (rank 0)."""
    from lightning_dist.callbacks import memory_monitor
    from lightning_dist.memory.estimate import MemoryEstimate

    features = SimpleNamespace(hetero=hetero, topology=None, compressor=None, sync=None)
    monkeypatch.setattr(memory_monitor, "features_of", lambda strategy: features if hetero is not None else None)
    monitor = MemoryMonitor(**kwargs)
    monitor._batch, monitor._probed_samples = (0, 0), 16
    monitor.estimate = MemoryEstimate(parts={"weights": 100 * MiB, "activations": 120 * MiB,
                                             "activation_grads": 40 * MiB})  # 10 MiB a sample
    return monitor


def test_the_warning_names_the_cap_that_brings_the_rank_under_the_threshold(monkeypatch):
    hetero = _hetero(speeds=[3, 1], memory_caps=[16, 64])  # rank 0: 48 samples as 3 x 16; rank 1: 16 in one pass
    monitor = _monitor_under_hetero(monkeypatch, hetero, warn_at=0.5)
    trainer = _trainer(10)
    trainer.strategy = None
    # rank 0 peaks at 600 of 1000 MiB; 90% of the 50% threshold is 450 MiB: 150 MiB at 10 a sample -> 15 fewer
    # rank 1 at 200 MiB has room for 25 more samples a pass: 41
    with pytest.warns(UserWarning, match=r"Set hetero.memory_caps=\[1,41\] \(rank 0: 16 -> 1 samples a pass") as got:
        monitor._handle(trainer, [_row(600, 0.6), _row(200, 0.2)])
    said = str(got[0].message)
    assert "nothing moves to other ranks" in said and "Reduce the per-rank batch" not in said
    # rank 1 (one pass of 16) at 55%: 100 MiB over 450 -> 10 fewer; rank 0 keeps its cap of 16
    monitor = _monitor_under_hetero(monkeypatch, hetero, warn_at=0.5)
    with pytest.warns(UserWarning, match=r"hetero.memory_caps=\[16,6\] \(rank 1: 16 -> 6 samples a pass"):
        monitor._handle(trainer, [_row(300, 0.3), _row(550, 0.55)])
    # without heterogeneous batching the warning is what it was
    monitor = _monitor_under_hetero(monkeypatch, None, warn_at=0.5)
    with pytest.warns(UserWarning, match="Reduce the per-rank batch"):
        monitor._handle(trainer, [_row(600, 0.6)])


def test_the_preflight_names_every_ranks_cap_and_the_table_the_first_micro_batch(monkeypatch):
    from lightning_dist.callbacks import InsufficientMemoryError, memory_monitor

    hetero = _hetero(speeds=[3, 1], memory_caps=[16, 64])
    assert hetero.micro_sizes(0, 0, 0) == [16, 16, 16] and hetero.micro_sizes(0, 0, 1) == [16]
    monitor = _monitor_under_hetero(monkeypatch, hetero, preflight="error")
    # the estimate, as the probe's end builds it: the activations are the first micro-batch's, and the table says so
    model = nn.Linear(4, 4)
    trainer = SimpleNamespace(strategy=SimpleNamespace(model=None), world_size=2, global_rank=0, callbacks=[],
                              optimizers=[torch.optim.SGD(model.parameters(), lr=0.1)])
    est = monitor._estimate(trainer, model, activations=120 * MiB, largest=MiB)
    assert "micro-batch 1 of 3 (16 of this rank's 48 samples)" in est.table()
    assert "this rank's whole share" not in est.table()
    # every rank's needed, capacity, total and activations (bytes): rank 0 short by 80 MiB at 10 MiB a sample
    rows = [[1080 * MiB, 1000 * MiB, 1000 * MiB, 160 * MiB], [500 * MiB, 1000 * MiB, 500 * MiB, 160 * MiB]]
    monkeypatch.setattr(memory_monitor, "gather", lambda trainer, values: rows)
    monitor._preflight_pending = True
    # rank 1 has room for 66 a pass and keeps its cap of 64
    with pytest.raises(InsufficientMemoryError, match=r"To fit: hetero.memory_caps=\[8,64\] \(rank 0: 16 -> 8 samples"):
        monitor._check_preflight(trainer)
    # without micro-batches (accumulate off, no cap) the table says nothing of them, and the advice names the cap
    off = _hetero(speeds=[3, 1])
    monitor = _monitor_under_hetero(monkeypatch, off, preflight="error")
    assert "micro-batch" not in monitor._estimate(trainer, model, activations=120 * MiB, largest=MiB).table()
    monitor._preflight_pending = True
    # rank 0's 160 MiB of activations are of its pass of 48 now: 80 MiB over -> 24 fewer
    with pytest.raises(InsufficientMemoryError, match=r"hetero.memory_caps=\[24,66\] \(rank 0: 48 -> 24 .*the "
                                                      r"default once a cap is set"):
        monitor._check_preflight(trainer)
