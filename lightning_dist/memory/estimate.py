"""What a training run will hold in memory, per rank, before it holds it.

The rule of thumb "parameters x (weight + gradient + optimizer-state bytes)" misses most of what sinks a run:
DDP's gradient buckets (a second copy of every gradient unless ``gradient_as_bucket_view=True``), the
optimizer's temporaries (torch's multi-tensor Adam allocates a parameter-sized ``sqrt(v)``), a lossy
compressor's error-feedback residuals (two copies at a step's peak: the committed and the staged one), the
transport's buffers, and the activations the forward pass saves for backward. :func:`estimate_memory` adds up
each from the live objects (real dtypes, real optimizer settings, the strategy's compressor), and
:class:`ActivationProbe` measures the activations of one forward pass exactly: it sums the storages autograd
saves for backward (``torch.autograd.graph.saved_tensors_hooks``), leaving the tensors and the step untouched.

The estimate is of the peak. It adds parts that do not all peak at the same moment (activations are freed as the
gradients appear) and, for backward, three activation-sized temporaries beside the saved activations (the
incoming gradient, an elementwise op's result, a layer's input gradient). On the configurations the ``memory``
benchmark measures (50 M-parameter MLPs with SGD, momentum, Adam, AdamW, bucket views, top-k with error feedback,
stock DDP, and a convolution net whose activations dominate) it lands within 30% of the growth in resident
memory the run shows.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

MiB = 2**20

# Optimizer state per parameter element, in multiples of the parameter's element size, for the optimizers
# whose state torch documents: SGD keeps a momentum buffer when momentum != 0; Adam and AdamW keep exp_avg and
# exp_avg_sq (and max_exp_avg_sq with amsgrad), plus a scalar step per parameter tensor.
_STEP_TENSOR_BYTES = 4  # Adam's per-parameter ``step``: a float32 scalar
BACKWARD_TEMPORARIES = 3  # activation-sized buffers backward holds at once, beyond the saved activations


@dataclass
class MemoryEstimate:
    """One rank's estimate: named parts in bytes, how each was obtained, and what the rank has."""

    parts: dict[str, int] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)
    capacity: int = 0  # bytes this rank's training may use (0: unknown)
    capacity_source: str = ""
    baseline: int = 0  # what the process holds besides the training state (CPU: libraries, the interpreter)

    @property
    def total(self) -> int:
        """The training state at its peak: the sum of the parts."""
        return sum(self.parts.values())

    @property
    def needed(self) -> int:
        """What the rank needs in all: the training state plus the process's baseline."""
        return self.total + self.baseline

    @property
    def fits(self) -> bool:
        return self.capacity <= 0 or self.needed <= self.capacity

    def table(self) -> str:
        """The parts, largest first, in MiB, and the verdict against the capacity."""
        width = max((len(k) for k in self.parts), default=8)
        lines = [f"  {name:<{width}} {value / MiB:10.1f} MiB  {self.notes.get(name, '')}".rstrip()
                 for name, value in sorted(self.parts.items(), key=lambda kv: -kv[1])]
        lines.append(f"  {'total':<{width}} {self.total / MiB:10.1f} MiB")
        if self.baseline:
            lines.append(f"  {'+ process':<{width}} {self.baseline / MiB:10.1f} MiB  (held before training)")
        if self.capacity > 0:
            verdict = "fits" if self.fits else "DOES NOT FIT"
            lines.append(f"  {'capacity':<{width}} {self.capacity / MiB:10.1f} MiB  ({self.capacity_source}): "
                         f"{100 * self.needed / self.capacity:.0f}% used, {verdict}")
        return "\n".join(lines)


# -- parameters -------------------------------------------------------------------------------------------------
def _unique_bytes(tensors: Iterable[torch.Tensor]) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        try:
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        except (RuntimeError, NotImplementedError):  # a tensor subclass without a plain storage
            seen[id(t)] = t.numel() * t.element_size()
    return sum(seen.values())


def weight_bytes(module: torch.nn.Module) -> int:
    """Parameters and buffers, each storage once (tied weights are shared)."""
    return _unique_bytes([*module.parameters(), *module.buffers()])


def trainable(module: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    return [(n, p) for n, p in module.named_parameters() if p.requires_grad]


def gradient_bytes(module: torch.nn.Module) -> int:
    """One gradient per trainable parameter, in the parameter's dtype."""
    return sum(p.numel() * p.element_size() for _, p in trainable(module))


# -- the optimizer ----------------------------------------------------------------------------------------------
def _state_tensor_bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_state_tensor_bytes(v) for v in value)
    if isinstance(value, dict):
        return sum(_state_tensor_bytes(v) for v in value.values())
    return 0


def measured_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """The bytes an optimizer's state holds now (every tensor in ``optimizer.state``)."""
    return sum(_state_tensor_bytes(s) for s in optimizer.state.values())


def _group_params(optimizer: torch.optim.Optimizer) -> list[tuple[dict[str, Any], list[torch.Tensor]]]:
    return [(g, [p for p in g["params"] if p.requires_grad]) for g in optimizer.param_groups]


def _known_multiple(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> Optional[tuple[float, int]]:
    """(state elements per parameter element, fixed bytes per parameter tensor) from the table, or None."""
    if type(optimizer) is torch.optim.SGD:
        return (1.0 if group.get("momentum", 0) else 0.0), 0
    if type(optimizer) in (torch.optim.Adam, torch.optim.AdamW):
        return (3.0 if group.get("amsgrad", False) else 2.0), _STEP_TENSOR_BYTES
    return None


def probe_state_multiple(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> tuple[float, int]:
    """Learn an optimizer's state size by stepping a copy of it on two dummy parameters of different sizes.

    Returns (state bytes per parameter byte, fixed bytes per parameter tensor). The copy is the same class with
    the group's settings, on float32 CPU tensors; the real optimizer and model are not touched.
    """
    # only what the constructor takes (an LR scheduler adds initial_lr to the group), and nothing that needs a
    # CUDA tensor (fused and capturable do not change the state's size)
    accepted = inspect.signature(type(optimizer)).parameters
    settings = {k: v for k, v in group.items() if k in accepted and k not in ("params", "fused", "capturable")}
    sizes, found = (1024, 4096), []
    for n in sizes:
        param = torch.nn.Parameter(torch.linspace(-1.0, 1.0, n))
        probe = type(optimizer)([param], **settings)

        def closure(p: torch.Tensor = param, opt: torch.optim.Optimizer = probe) -> torch.Tensor:
            opt.zero_grad()
            loss = (p * p).sum()
            loss.backward()
            return loss

        probe.step(closure)
        found.append(measured_state_bytes(probe))
    per_element = (found[1] - found[0]) / ((sizes[1] - sizes[0]) * 4)
    fixed = max(0, round(found[0] - per_element * sizes[0] * 4))
    return max(per_element, 0.0), fixed


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> tuple[int, str]:
    """The optimizer's state once it has stepped, and how that was found.

    An optimizer that already holds state (a resumed run) is measured; SGD, Adam and AdamW follow torch's
    documented state; any other is probed (:func:`probe_state_multiple`).
    """
    if optimizer.state:
        return measured_state_bytes(optimizer), "measured (the optimizer holds state)"
    total, how = 0, set()
    for group, params in _group_params(optimizer):
        if not params:
            continue
        known = _known_multiple(optimizer, group)
        if known is None:
            try:
                known = probe_state_multiple(optimizer, group)
                how.add(f"probed {type(optimizer).__name__} on dummy parameters")
            except Exception as err:  # noqa: BLE001 - any optimizer may refuse the probe; say so, count nothing
                how.add(f"unknown: probing {type(optimizer).__name__} failed ({type(err).__name__}: {err})")
                continue
        else:
            how.add(f"{type(optimizer).__name__}: {known[0]:g} x parameters")
        multiple, fixed = known
        total += sum(math.ceil(multiple * p.numel() * p.element_size()) + fixed for p in params)
    return total, "; ".join(sorted(how)) or "no trainable parameters"


def _multi_tensor(optimizer: torch.optim.Optimizer, group: dict[str, Any], params: list[torch.Tensor]) -> str:
    """'fused', 'foreach' or 'single': the implementation torch will pick for this group."""
    if group.get("fused"):
        return "fused"
    foreach = group.get("foreach")
    if foreach is None:  # torch's default: the multi-tensor path when every parameter is on a CUDA device
        foreach = bool(params) and all(p.is_cuda for p in params)
    return "foreach" if foreach else "single"


def optimizer_transient_bytes(optimizer: torch.optim.Optimizer) -> tuple[int, str]:
    """Temporaries inside ``optimizer.step``: parameter-sized for the multi-tensor paths, one parameter's for
    the per-parameter loop, none for fused kernels."""
    total, how = 0, set()
    for group, params in _group_params(optimizer):
        if not params:
            continue
        kind = _multi_tensor(optimizer, group, params)
        maximize = int(bool(group.get("maximize", False)))  # the negated gradients
        if type(optimizer) in (torch.optim.Adam, torch.optim.AdamW):
            # sqrt(exp_avg_sq); coupled weight decay (Adam's, unless decoupled_weight_decay) adds a decayed copy
            coupled = type(optimizer) is torch.optim.Adam and not group.get("decoupled_weight_decay", False)
            copies = 1 + int(coupled and group.get("weight_decay", 0) != 0) + maximize
        elif type(optimizer) is torch.optim.SGD:
            # the decayed gradients; nesterov's update is in place
            copies = int(group.get("weight_decay", 0) != 0) + maximize
        else:
            copies = 1  # unknown: one parameter-sized temporary
        if kind == "fused":
            copies = 0
        sizes = [p.numel() * p.element_size() for p in params]
        total += copies * (sum(sizes) if kind == "foreach" else max(sizes))
        how.add(f"{kind}, {copies} temporar{'y' if copies == 1 else 'ies'}")
    return total, "; ".join(sorted(how))


# -- the whole estimate -----------------------------------------------------------------------------------------
@dataclass
class CommSetup:
    """What the data-parallel wrapper and the strategy's communication add (zero when absent)."""

    buckets_are_views: bool = True  # DDP's gradient_as_bucket_view (no wrapper: no buckets)
    has_buckets: bool = False
    bucket_cap_bytes: int = 25 * MiB
    transport_buffers: bool = False  # ring_ddp's collectives keep a scratch buffer per bucket-sized message
    compressor: Any = None  # a lightning_dist Compressor, or None
    world_size: int = 1
    # ring_ddp's two-tier reduction: the ranks per host (0: flat). Each bucket's parts are kept rearranged, and the
    # compressor holds state for this rank's part of every bucket only
    two_tier_ranks_per_host: int = 0
    # syncing every H steps (lightning_dist.sync.DiLoCoSync.memory_bytes): theta_global and the outer momentum (two
    # parameter copies), the exchange's flat buckets, the pseudo-gradient compressor's state; 0 without DiLoCo
    sync_bytes: int = 0


def comm_setup_of(model: torch.nn.Module, compressor: Any = None, world_size: int = 1,
                  transport_buffers: bool = False, two_tier_ranks_per_host: int = 0,
                  sync_bytes: int = 0) -> CommSetup:
    """Read DDP's bucket settings off the wrapped model (any other wrapper: no buckets)."""
    from torch.nn.parallel import DistributedDataParallel

    setup = CommSetup(compressor=compressor, world_size=world_size, transport_buffers=transport_buffers,
                      two_tier_ranks_per_host=two_tier_ranks_per_host, sync_bytes=sync_bytes)
    if isinstance(model, DistributedDataParallel):
        setup.buckets_are_views, setup.has_buckets = bool(model.gradient_as_bucket_view), True
        setup.bucket_cap_bytes = int(model.bucket_bytes_cap)
    return setup


def estimate_memory(module: torch.nn.Module, optimizers: Iterable[torch.optim.Optimizer], comm: CommSetup,
                    activation_bytes: Optional[int] = None, largest_activation: int = 0) -> MemoryEstimate:
    """The parts of one rank's peak training memory, from the live module, optimizers and communication setup.

    ``module`` is the unwrapped model; ``activation_bytes`` and ``largest_activation`` what
    :class:`ActivationProbe` measured (None: not yet, the part is left out and noted).
    """
    est = MemoryEstimate()
    params = trainable(module)
    est.parts["weights"] = weight_bytes(module)
    est.notes["weights"] = f"{sum(p.numel() for p in module.parameters()):,} parameters + buffers"
    grads = gradient_bytes(module)
    est.parts["gradients"] = grads
    dtypes = sorted({str(p.dtype).replace("torch.", "") for _, p in params})
    est.notes["gradients"] = f"{sum(p.numel() for _, p in params):,} trainable, {'/'.join(dtypes) or '-'}"
    if comm.has_buckets:
        est.parts["ddp_buckets"] = 0 if comm.buckets_are_views else grads
        est.notes["ddp_buckets"] = ("gradients are views into the buckets" if comm.buckets_are_views else
                                    "a second copy of the gradients (gradient_as_bucket_view=False)")
    state, how_state, transient, how_transient = 0, [], 0, []
    for opt in optimizers:
        b, how = optimizer_state_bytes(opt)
        state, how_state = state + b, how_state + [how]
        b, how = optimizer_transient_bytes(opt)
        transient, how_transient = transient + b, how_transient + [how]
    est.parts["optimizer_state"], est.notes["optimizer_state"] = state, "; ".join(how_state)
    est.parts["optimizer_step"], est.notes["optimizer_step"] = transient, "; ".join(how_transient)
    _comm_parts(est, params, comm, grads)
    if comm.sync_bytes:
        est.parts["sync_state"] = int(comm.sync_bytes)
        est.notes["sync_state"] = ("DiLoCo: theta_global and the outer momentum (two parameter copies; a third, "
                                   "the workers' mean validated by default), the "
                                   "pseudo-gradient's buckets and its compressor's state")
    if activation_bytes is None:
        est.notes["activations"] = "not measured yet (the first forward pass measures them)"
    else:
        est.parts["activations"] = int(activation_bytes)
        est.notes["activations"] = "saved for backward in the first forward pass"
        # backward holds activation-sized gradients beside what is still saved: the incoming gradient, an
        # elementwise op's result, a layer's input gradient (a ReLU-conv chain peaks at about this)
        est.parts["activation_grads"] = BACKWARD_TEMPORARIES * int(largest_activation)
        est.notes["activation_grads"] = (f"backward's temporaries: {BACKWARD_TEMPORARIES} x the largest saved "
                                         f"activation ({largest_activation / MiB:.1f} MiB)")
    return est


def _comm_parts(est: MemoryEstimate, params: list[tuple[str, torch.nn.Parameter]], comm: CommSetup,
                grads: int) -> None:
    if not params or comm.world_size <= 1 and comm.compressor is None:
        return
    element = max(p.element_size() for _, p in params)
    largest_param = max(p.numel() * p.element_size() for _, p in params)
    bucket_bytes = min(grads, max(comm.bucket_cap_bytes, largest_param))  # a parameter never splits
    bucket_numel = bucket_bytes // element
    compressor, per_host = comm.compressor, comm.two_tier_ranks_per_host
    if compressor is not None:
        from lightning_dist.compression.base import BucketLayout

        layout = BucketLayout.of([(n, p.shape) for n, p in params])
        if per_host:  # two_tier: the state of this rank's part (slice 0 is the largest)
            layout = layout.split(per_host)[0][0]
        state = compressor.state_bytes(layout, element)
        if state:
            est.parts["compressor_state"] = state
            est.notes["compressor_state"] = f"{compressor.describe()}: residuals / factors"
    peers = comm.world_size // per_host if per_host else comm.world_size  # whom the compressor reduces with
    coded = -(-bucket_numel // per_host) if per_host else bucket_numel
    workspace = compressor.workspace_bytes(coded, element, peers) if compressor is not None else 0
    if per_host:
        est.parts["two_tier_buffers"] = grads + -(-grads // per_host)
        est.notes["two_tier_buffers"] = (f"two_tier, {per_host} ranks per host: every bucket's parts, rearranged, "
                                         "and this rank's part of each")
    if comm.transport_buffers:
        # a scratch pool per thread that runs collectives (the communication worker, and the autograd thread
        # when it reduces a bucket itself), each up to a bucket (the ring's staging is 2/N of it, the tree's all)
        workspace += 2 * bucket_bytes
    if workspace:
        est.parts["comm_workspace"] = workspace
        est.notes["comm_workspace"] = (f"transport staging and compressor temporaries, per bucket in flight "
                                       f"(largest {bucket_bytes / MiB:.1f} MiB)")


# -- activations ------------------------------------------------------------------------------------------------
class ActivationProbe:
    """Counts the bytes autograd saves for backward while it is active: the forward pass's activations.

    Use as a context manager, or :meth:`start` / :meth:`stop` from two hooks (``on_train_batch_start`` and
    ``on_before_backward``). Storages are counted once; the parameters and buffers given as ``exclude``
    (weights a layer saves for its backward) are not counted. The tensors themselves pass through untouched.
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self._skip = set()
        for t in exclude:
            try:
                self._skip.add(t.untyped_storage().data_ptr())
            except (RuntimeError, NotImplementedError):
                pass
        self._seen: dict[int, int] = {}
        self._hooks: Optional[Any] = None

    @property
    def active(self) -> bool:
        return self._hooks is not None

    @property
    def bytes(self) -> int:
        return sum(self._seen.values())

    @property
    def largest(self) -> int:
        """The largest single storage saved (what backward's activation-sized gradients are sized like)."""
        return max(self._seen.values(), default=0)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        try:
            storage = tensor.untyped_storage()
            key, size = storage.data_ptr(), storage.nbytes()
        except (RuntimeError, NotImplementedError):
            key, size = id(tensor), tensor.numel() * tensor.element_size()
        if key not in self._skip:
            self._seen[key] = max(self._seen.get(key, 0), size)
        # detached: a saved *output* returned as it is would point back at its own grad_fn, a cycle through C++
        # that the garbage collector cannot free if the graph is dropped without a backward
        return tensor.detach()

    @staticmethod
    def _unpack(tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def start(self) -> None:
        if self._hooks is None:
            self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
            self._hooks.__enter__()

    def stop(self) -> int:
        """Stop counting (idempotent); returns the bytes counted."""
        if self._hooks is not None:
            hooks, self._hooks = self._hooks, None
            hooks.__exit__(None, None, None)
        return self.bytes

    def __enter__(self) -> ActivationProbe:
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()
