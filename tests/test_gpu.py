"""The GPU tier (``pytest -m gpu``; ``scripts/gpu-check.sh`` runs it and prints a table): the CUDA paths issue 41
fixed, on a real device. Skipped where CUDA is not available (every CPU machine of this project so far: no GPU has
been lent, so none of these has run yet). tests/test_gpu_path_pure.py checks the same contracts on the CPU.

What runs here, on one GPU: the comm hook's Futures on CUDA buckets (DDP over world-size-1 NCCL, the hook's output
against stock DDP); every compressor on CUDA buckets with torch's sync debug mode set to raise (no host sync on the
worker's path) and against the CPU result; the compiled int8 kernels; DiLoCo's state placement (0 bytes beside the
model, pinned host memory); the memory readers; LossScaler.
"""

from __future__ import annotations

import pytest
import torch

CUDA = torch.cuda.is_available()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not CUDA, reason="needs a CUDA device (torch.cuda.is_available() is False here; run scripts/gpu-check.sh on one)")]

# the per-step compressors (as in tests/test_gpu_path_pure.py); top-k's default selection runs torch.topk on CUDA
CODECS = [("none", {}), ("fp16", {}), ("bf16", {}), ("int8", {}), ("int4", {}), ("powersgd", {}), ("sign", {}),
          ("topk", {}),
          ("int8", {"clip_norm": 1.0}), ("topk", {"clip_norm": 0.5})]


def _bucket(device, seed=0):
    from lightning_dist.compression import BucketLayout

    layout = BucketLayout.of([("w", torch.Size([512, 384])), ("b", torch.Size([512])), ("v", torch.Size([70000]))])
    flat = torch.randn(layout.numel, generator=torch.Generator().manual_seed(seed)).to(device)
    return layout, flat


@pytest.mark.parametrize("name,options", CODECS, ids=[f"{n}{'+clip' if o else ''}" for n, o in CODECS])
def test_every_compressor_on_cuda_without_a_host_sync(name, options):
    from lightning_dist.compression import build_compressor
    from lightning_dist.compression.emulate import MirrorTransport

    on_gpu, on_cpu = build_compressor(name, **options), build_compressor(name, **options)
    for step in range(3):
        layout, flat = _bucket("cuda", step)
        reference = flat.cpu()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")  # any synchronising call on the worker's path raises
        try:
            on_gpu.reduce(flat, layout, MirrorTransport(2))
        finally:
            torch.cuda.set_sync_debug_mode("default")
        on_cpu.reduce(reference, layout, MirrorTransport(2))
        on_gpu.commit()
        on_cpu.commit()
        scale = reference.abs().max().item()
        assert torch.allclose(flat.cpu(), reference, atol=0.05 * scale + 1e-6), name  # codecs' noise differs


def test_compiled_int8_kernels_on_cuda_match_the_plain_path(monkeypatch):
    from torch.utils._triton import has_triton

    from lightning_dist.compression import kernels

    if not has_triton():
        pytest.skip("Triton is not installed: the CUDA kernels are not compiled here")
    shape = (2, 1024, 512)
    x = torch.randn(shape, device="cuda") * 1e-2
    step = x.abs().amax(2, keepdim=True) / 126.999
    inverse, noise = 1.0 / step, torch.rand((1, 1024, 512), device="cuda")
    results = {}
    for mode in ("0", "1"):
        monkeypatch.setenv("LIGHTNING_DIST_COMPILE", mode)
        codes = torch.empty(shape, dtype=torch.int8, device="cuda")
        for grad in (True, False):  # the worker's and the autograd thread's grad modes: one compile
            with torch.set_grad_enabled(grad):
                kernels.int8_encode(x, inverse, noise, codes, torch.empty(shape, device="cuda"))
        results[mode] = codes
    assert (results["0"] != results["1"]).float().mean() < 1e-5
    assert "int8_codes" not in kernels._failed


@pytest.fixture
def nccl_world_of_one(tmp_path):
    import torch.distributed as dist

    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("compressor", ["none", "int8", "topk"])
def test_the_hook_on_cuda_buckets_over_nccl(nccl_world_of_one, compressor):
    """DDP with ring_comm_hook on CUDA buckets (overlapped: the worker thread, Futures with the bucket's device) gives
    the gradients of a model without DDP (world size 1: the reduction is the identity, up to the codec)."""
    from torch.nn.parallel import DistributedDataParallel

    from lightning_dist.compression import build_compressor
    from lightning_dist.strategy.hook import RingHookState, ring_comm_hook

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10)).cuda()
    plain = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10)).cuda()
    plain.load_state_dict(model.state_dict())
    ddp = DistributedDataParallel(model, device_ids=[0], bucket_cap_mb=0.25)
    options = {} if compressor == "none" else {"error_feedback": False}
    state = RingHookState(compressor=build_compressor(compressor, **options))
    state.bind(ddp.module, None, 1, None)
    state.start_worker("gpu-test", torch.device("cuda", 0))
    ddp.register_comm_hook(state, ring_comm_hook)
    try:
        x = torch.randn(64, 256, device="cuda")
        ddp(x).square().mean().backward()
        plain(x).square().mean().backward()
    finally:
        state.stop_worker(10.0)
    tolerance = 1e-6 if compressor == "none" else 0.05
    for a, b in zip(model.parameters(), plain.parameters(), strict=True):
        assert torch.allclose(a.grad, b.grad, atol=tolerance * b.grad.abs().max().item() + 1e-7)


def test_diloco_keeps_no_state_on_the_gpu():
    from lightning_dist.sync import DiLoCo
    from lightning_dist.sync.diloco import DiLoCoSync
    from lightning_dist.sync.diloco_fragments import Workers

    model = torch.nn.Linear(1024, 1024).cuda()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    sync = DiLoCoSync(DiLoCo(every=2, outer_momentum=0.9, delay=1), Workers(((0,),), rank=0), "auto", None)
    sync.attach(model)
    for step in (2, 3, 4):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01)
        sync.sync_after(step=step)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before  # GPU-resident extra state: 0 bytes
    state = sync.state_tensors()
    assert state and all(t.device.type == "cpu" and t.is_pinned() for t in state)
    assert sync.memory_by_device().get("cuda", 0) == 0
    assert all(p.device.type == "cuda" for p in model.parameters())
    sync.close()


def test_the_memory_readers_read_the_device():
    from lightning_dist.memory import readers

    device = readers.cuda_device(torch.device("cuda"))
    held = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    stats = readers.cuda_stats(device)
    assert stats["cuda_allocated"] >= held.numel() and stats["cuda_reserved"] >= stats["cuda_allocated"]
    capacity, note = readers.cuda_capacity(device)
    assert capacity > held.numel() and "GiB" in note


def test_the_loss_scaler_skips_a_non_finite_step_on_cuda():
    from lightning_dist.loss_scaler import LossScaler

    param = torch.nn.Parameter(torch.ones(4, device="cuda"))
    optimizer = torch.optim.SGD([param], lr=0.1)
    scaler = LossScaler("cuda", init_scale=1024.0)
    scaler.scale(param.sum()).backward()
    scaler.unscale_(optimizer)
    assert not scaler.found_inf(optimizer) and torch.allclose(param.grad, torch.ones(4, device="cuda"))
    fresh = LossScaler("cuda", init_scale=1024.0)
    fresh.scale(param.sum())  # makes its scale on the device
    param.grad = torch.full((4,), float("inf"), device="cuda")
    fresh.unscale_(optimizer)
    assert fresh.found_inf(optimizer)
