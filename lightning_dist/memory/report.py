"""What each rank reports of its memory at a reading (:class:`RankMemory`, one number per :data:`SLOTS` name), what
rank zero logs of every rank's (:func:`summarize`), and the advice that goes with an estimate that does not fit
(:func:`advice`). :class:`~lightning_dist.callbacks.MemoryMonitor` decides when to read and what to do.

Under heterogeneous batching the fix to name is a per-rank cap, ``hetero.memory_caps`` (:func:`caps_advice`): with
per-rank accumulation on, a lower cap runs the same share as more micro-batches, so nothing moves to other ranks. The
strategy's batching reaches this module as plain values (:class:`Passes`), never as the strategy's objects.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence, Union

import torch

from lightning_dist.memory import readers
from lightning_dist.memory.estimate import MemoryEstimate, MiB

# what every rank sends at each reading, in this order (bytes unless named otherwise; -1: not available here)
SLOTS = ("rss", "rss_peak", "usage", "capacity", "estimate", "measured", "cuda_allocated", "cuda_allocated_peak",
         "cuda_reserved", "cuda_reserved_peak", "cuda_alloc_retries", "cuda_ooms", "gpu_util")
_BYTES = ("rss", "rss_peak", "cuda_allocated", "cuda_allocated_peak", "cuda_reserved", "cuda_reserved_peak")
_COUNTS = ("cuda_alloc_retries", "cuda_ooms")


class RankMemory:
    """This rank's memory over a fit, read in :data:`SLOTS` order.

    ``usage`` is the peak since the last reading over :attr:`capacity` (reserved CUDA memory on a GPU, host RSS on
    CPU); ``measured`` is the largest training footprint so far (CUDA: the allocator's peak; CPU: the growth in peak
    RSS since :meth:`start` plus the weights that already existed then).
    """

    def __init__(self) -> None:
        self.cuda: Optional[torch.device] = None  # None: every CUDA reading is skipped
        self.capacity = 0  # bytes this rank may hold (detected, or given)
        self.reset_peaks = True
        self.measured = 0.0
        self._rss_at_start = self._bytes_at_start = 0
        self._gpu = readers.GpuUtilization()  # off for the run after its first failure

    def start(self, cuda: Optional[torch.device], tensors: Iterable[torch.Tensor], reset_peaks: bool) -> None:
        """At set-up: the peaks restart (``reset_peaks``), and the footprint is measured from here on; ``tensors``
        (the model's parameters and buffers) already exist and count."""
        self.cuda, self.reset_peaks, self.measured = cuda, reset_peaks, 0.0
        if reset_peaks:
            self._restart_peaks()
        self._rss_at_start = readers.host_rss()
        self._bytes_at_start = sum(t.numel() * t.element_size() for t in tensors if not t.is_cuda)

    @property
    def baseline(self) -> int:
        """What the process held at :meth:`start` besides the training state (libraries, the interpreter): on CPU
        it counts against the capacity; on CUDA the capacity excludes it already."""
        return 0 if self.cuda is not None else max(self._rss_at_start - self._bytes_at_start, 0)

    def read(self, estimate: Optional[int]) -> list[float]:
        """This rank's values, in :data:`SLOTS` order (``estimate``: this rank's estimated total, bytes); the peaks
        restart afterwards when ``reset_peaks``."""
        cuda = readers.cuda_stats(self.cuda)
        rss, rss_peak = readers.host_rss(), readers.host_rss_peak()
        if self.cuda is not None:
            held, measured = cuda["cuda_reserved_peak"], cuda["cuda_allocated_peak"]
        else:
            held, measured = rss_peak, rss_peak - self._rss_at_start + self._bytes_at_start
        self.measured = max(self.measured, float(measured))
        values = {
            "rss": float(rss), "rss_peak": float(rss_peak),
            "usage": held / self.capacity if self.capacity > 0 else readers.UNAVAILABLE,
            "capacity": float(self.capacity),
            "estimate": float(estimate) if estimate is not None else readers.UNAVAILABLE,
            "measured": self.measured,
            **{k: v for k, v in cuda.items() if k in SLOTS},
            "gpu_util": self._gpu.read(self.cuda),
        }
        if self.reset_peaks:
            self._restart_peaks()
        return [values[name] for name in SLOTS]

    def _restart_peaks(self) -> None:
        readers.reset_host_peak()
        if self.cuda is not None:
            torch.cuda.reset_peak_memory_stats(self.cuda)


def summarize(rows: list[dict[str, float]], per_rank: bool = False) -> dict[str, float]:
    """The logged metrics from every rank's values (``rows[r]`` is rank ``r``'s): max, min and which rank."""
    metrics: dict[str, float] = {}

    def spread(key: str, values: list[float], scale: float, low_rank: bool = False) -> None:
        have = [(v, r) for r, v in enumerate(values) if v >= 0]
        if not have:
            return  # not available on any rank (CUDA values on CPU, NVML without the library)
        top, low = max(have), min(have)
        metrics[f"{key}_max"], metrics[f"{key}_min"] = top[0] * scale, low[0] * scale
        metrics[f"{key}_{'min' if low_rank else 'max'}_rank"] = float((low if low_rank else top)[1])

    column = {name: [row[name] for row in rows] for name in SLOTS}
    for name in _BYTES:
        spread(f"memory/{name}_mib", column[name], 1 / MiB)
    spread("memory/usage_pct", column["usage"], 100.0)
    for name in _COUNTS:
        spread(f"memory/{name}", column[name], 1.0)
    spread("memory/gpu_util_pct", column["gpu_util"], 1.0, low_rank=True)
    spread("memory/measured_mib", column["measured"], 1 / MiB)
    estimates = [v for v in column["estimate"] if v >= 0]
    if estimates:
        metrics["memory/estimate_mib_max"] = max(estimates) / MiB
        worst = max(range(len(rows)), key=lambda r: column["measured"][r])
        measured, estimate = column["measured"][worst], column["estimate"][worst]
        if measured > 0 and estimate >= 0:
            metrics["memory/estimate_error_pct"] = 100.0 * (estimate - measured) / measured
    if per_rank:
        for r, row in enumerate(rows):
            for name in ("rss", *_BYTES[2:], "measured"):
                if row[name] >= 0:
                    metrics[f"memory/rank{r}/{name}_mib"] = row[name] / MiB
            if row["usage"] >= 0:
                metrics[f"memory/rank{r}/usage_pct"] = 100.0 * row["usage"]
    return metrics


@dataclass
class Passes:
    """Heterogeneous batching as the memory advice needs it: plain values the callback reads from the strategy's
    ``HeteroBatching`` (``accumulate``, ``micro_caps``, ``micro_sizes``, ``elastic``)."""

    accumulate: Union[str, list[int]]  # "auto", "off" or per-rank counts of micro-batches
    caps: Optional[list[int]]  # per rank, the most samples one pass may hold now (memory_caps, max_batch_size); None
    sizes: list[list[int]]  # per rank, the micro-batches of the step at hand, in samples ([share]: one pass)
    elastic: bool = False  # hetero=elastic: no per-rank lists, one max_batch_size for every rank


def activation_note(sizes: Sequence[int]) -> str:
    """What the activation probe measured when this rank runs its share as the micro-batches ``sizes``: the first
    forward pass is the first micro-batch's (the largest: sizes differ by at most one, larger first), whose backward
    frees its activations before the next micro-batch's forward, so one micro-batch's activations are the peak's."""
    if len(sizes) == 1:
        return f"saved for backward in the first forward pass: this rank's whole share, {sizes[0]} samples in one pass"
    return (f"saved for backward in the first forward pass: micro-batch 1 of {len(sizes)} ({sizes[0]} of this rank's "
            f"{sum(sizes)} samples); its backward frees them before the next")


def cap_that_fits(held: float, capacity: float, activations: float, samples: int) -> Optional[int]:
    """The most samples one pass may hold for a rank that holds ``held`` bytes at ``samples`` a pass to hold at most
    ``capacity`` bytes, the activations (``activations`` bytes at ``samples``: saved ones and backward's temporaries)
    taken as proportional to a pass's samples. Above ``samples`` when the rank has room. None: nothing measured, or
    not even one sample a pass fits (then activations are not what to cut). A pass's inputs that are views of the whole
    share count whole in the measurement, so the figure errs low."""
    if activations <= 0 or samples < 1 or capacity <= 0:
        return None
    cap = math.floor(samples - (held - capacity) * samples / activations)
    return cap if cap >= 1 else None


def caps_advice(passes: Passes, fitting: Sequence[Optional[int]], short: Sequence[int]) -> str:
    """The per-rank cap that brings the ranks in ``short`` under their capacity: ``hetero.memory_caps=[...]``
    (``hetero.max_batch_size=N`` under hetero=elastic, which takes no per-rank list), and what accumulate then does
    with each share. ``fitting``: :func:`cap_that_fits` per rank; a rank that is not short keeps the lower of its cap
    in force and what fits it (the step's whole batch where neither is known)."""
    unfit = [r for r in short if fitting[r] is None]
    if unfit:  # no figure to give
        setting = "hetero.max_batch_size" if passes.elastic else "hetero.memory_caps entry"
        return (f"a lower {setting} for rank {unfit[0]} (no figure: its activations were not measured, or even one "
                "sample a pass would not fit)")
    total = sum(sum(sizes) for sizes in passes.sizes)
    caps = [min((c for c in (fitting[r], passes.caps[r] if passes.caps else None) if c is not None), default=total)
            for r in range(len(passes.sizes))]
    lowered = ", ".join(f"rank {r}: {max(sizes)} -> {cap} samples a pass" for r, (sizes, cap)
                        in enumerate(zip(passes.sizes, caps)) if r in short or cap < max(sizes))
    lowered += ", activations taken as proportional to a pass's samples"
    if passes.elastic:  # one cap for every rank
        return (f"hetero.max_batch_size={min(caps)} ({lowered}; hetero=elastic takes no per-rank list; with "
                "hetero.accumulate=auto a share above it runs as more micro-batches)")
    setting = f"hetero.memory_caps=[{','.join(map(str, caps))}] ({lowered}"
    if isinstance(passes.accumulate, list):
        counts = [max(k, -(-sum(sizes) // c)) for k, sizes, c in zip(passes.accumulate, passes.sizes, caps)]
        return (f"{setting}; a share then holds at most count x cap: hetero.accumulate=[{','.join(map(str, counts))}] "
                "or hetero.accumulate=auto)")
    if passes.accumulate == "off" and passes.caps is not None:  # off by choice (with a cap the default is auto)
        return (f"{setting}; with hetero.accumulate=auto a lower cap runs the same share as more micro-batches, where "
                "accumulate off moves the samples to other ranks)")
    return (f"{setting}; with accumulate on, the default once a cap is set, a lower cap runs the same share as more "
            "micro-batches: nothing moves to other ranks)")


def advice(est: MemoryEstimate, caps: Optional[str] = None) -> str:
    """What would shrink the largest parts, with the figures. ``caps``: under heterogeneous batching, the per-rank cap
    to name instead of "a smaller per-rank batch" (:func:`caps_advice`)."""
    parts = est.parts
    tips = []
    if parts.get("activations", 0):
        tips.append(f"{caps or 'a smaller per-rank batch'} or bf16 mixed precision (activations: "
                    f"{parts['activations'] / 2**30:.2f} GiB)")
    elif caps:
        tips.append(caps)
    if parts.get("ddp_buckets", 0):
        tips.append(f"strategy gradient_as_bucket_view=True (saves {parts['ddp_buckets'] / 2**30:.2f} GiB)")
    if parts.get("optimizer_state", 0) > parts.get("weights", 0):
        tips.append(f"an optimizer with less state (this one: {parts['optimizer_state'] / 2**30:.2f} GiB)")
    if parts.get("compressor_state", 0):
        tips.append(f"no error feedback or a compressor without it ({parts['compressor_state'] / 2**30:.2f} GiB)")
    if parts.get("optimizer_step", 0):
        tips.append("foreach=False or fused=True in the optimizer (its multi-tensor step holds "
                    f"{parts['optimizer_step'] / 2**30:.2f} GiB of temporaries)")
    tips.append("more ranks, or MemoryMonitor(preflight='off') to try anyway")
    return "To fit: " + "; ".join(tips) + "."
