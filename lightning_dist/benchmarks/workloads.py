"""What the benchmarks train, and under which strategy: :data:`DIGITS` (the default job's 22 k-parameter CNN, one
bucket: latency-bound), :data:`MLP` (``WideMLP``, 4.3 M parameters in 5 buckets of 4 MiB: bandwidth-bound), the memory
estimate's models (:func:`big_mlp`, weights and optimizer state dominate; :class:`ConvClassifier`, activations do), and
one strategy builder (:func:`make_strategy`).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Optional

import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy, Strategy
from torch import nn
from typing_extensions import override

from lightning_dist.benchmarks._common import COLLECTIVE_TIMEOUT_S
from lightning_dist.examples import DigitsCNN, DigitsDataModule, SyntheticDataModule, WideMLP
from lightning_dist.strategy import RingDDPStrategy
from lightning_dist.testing import ToyClassifier


@dataclass(frozen=True)
class Workload:
    """A model and its data, as every benchmark trains them."""

    name: str
    model: Callable[[], L.LightningModule]
    data: Callable[[], L.LightningDataModule]
    batch_size: int  # per rank
    bucket_cap_mb: Optional[float]  # every strategy alike; None: DDP's default (25)
    description: str


DIGITS = Workload("digits", DigitsCNN, lambda: DigitsDataModule(batch_size=32), batch_size=32, bucket_cap_mb=None,
                  description="DigitsCNN, 22k params, 1 bucket, batch 32/rank")
MLP = Workload("mlp", WideMLP, lambda: SyntheticDataModule(batch_size=16), batch_size=16, bucket_cap_mb=4,
               description="WideMLP, 4.3M params (16.4 MiB grads), 5 buckets, batch 16/rank")


def make_strategy(algorithm: Optional[str], bucket_cap_mb: Optional[float] = None, start_method: str = "fork",
                  stock: type[DDPStrategy] = DDPStrategy, **kwargs: Any) -> Strategy:
    """``RingDDPStrategy(algorithm=..., **kwargs)``, or with ``algorithm=None`` Lightning's ``DDPStrategy`` (or
    ``stock``), with the benchmarks' collective timeout and ``bucket_cap_mb``; ``popen`` starts no ranks."""
    kwargs.update(start_method=start_method, timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    if bucket_cap_mb is not None:
        kwargs["bucket_cap_mb"] = bucket_cap_mb
    return stock(**kwargs) if algorithm is None else RingDDPStrategy(algorithm=algorithm, **kwargs)


# -- the memory estimate's models: testing's ToyClassifier (fixed data read in order, an optimizer by name) ----------
OPTIMIZERS = {"sgd": {"optimizer": "sgd", "lr": 0.01}, "adam": {"optimizer": "adam", "lr": 1e-4},
              "sgd-momentum": {"optimizer": "sgd", "lr": 0.01, "momentum": 0.9},
              "adamw": {"optimizer": "adamw", "lr": 1e-4}}  # torch's weight decay, 0.01


def big_mlp(optimizer: str) -> L.LightningModule:
    """50,384,906 parameters: three Linear(4096, 4096) + Tanh and a 10-way head; 64 samples, batch 4 per rank."""
    return ToyClassifier(features=4096, hidden=(4096,) * 3, classes=10, samples=64, batch_size=4,
                         distributed_sampler=True, seed=0, **OPTIMIZERS[optimizer])


class ConvClassifier(ToyClassifier):
    """76 k parameters, ~100 MiB of activations: three 3x3 convolutions (3 -> 64 -> 64 -> 64) + ReLU on 64x64
    images, global average pooling and a 10-way head; ``batches`` batches of 32 random images."""

    def __init__(self, optimizer: str, batches: int) -> None:
        super().__init__(samples=32 * batches, batch_size=32, distributed_sampler=True, **OPTIMIZERS[optimizer])
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Conv2d(3, 64, 3, padding=1), nn.ReLU(), nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(),
                                 nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                                 nn.Linear(64, 10))

    @override
    def data(self) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(0)
        return (torch.randn(self.samples, 3, 64, 64, generator=gen),
                torch.randint(0, 10, (self.samples,), generator=gen))
