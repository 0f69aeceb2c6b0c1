"""What the benchmarks train, and under which strategy: the models, their data, and one strategy builder.

- :data:`DIGITS`: the default job's ``DigitsCNN`` (22 k parameters, 85 KiB of gradients: one DDP bucket) on
  ``DigitsDataModule``, batch 32 per rank. Latency-bound: communication is a small part of a step.
- :data:`MLP`: ``WideMLP`` (4.3 M parameters, 16.4 MiB of gradients) on ``SyntheticDataModule``, batch 16 per
  rank, ``bucket_cap_mb=4`` for every strategy (5 buckets). Bandwidth-bound: backward and the all-reduce take
  similar times, so whether they overlap decides the step time.
- :func:`big_mlp` and :func:`activation_cnn`: the memory estimate's models, one whose weights and optimizer
  state dominate (50 M parameters) and one whose activations do.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Optional

import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy, Strategy
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from typing_extensions import override

from lightning_dist.benchmarks._common import COLLECTIVE_TIMEOUT_S
from lightning_dist.examples import DigitsCNN, DigitsDataModule, SyntheticDataModule, WideMLP
from lightning_dist.strategy import RingDDPStrategy


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
    """``RingDDPStrategy(algorithm=..., **kwargs)``, or with ``algorithm=None`` Lightning's stock ``DDPStrategy``
    (or ``stock``), both with :data:`~lightning_dist.benchmarks._common.COLLECTIVE_TIMEOUT_S` and
    ``bucket_cap_mb``. ``fork`` starts the ranks; ``popen`` inside ``launched_externally`` starts nothing."""
    kwargs.update(start_method=start_method, timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    if bucket_cap_mb is not None:
        kwargs["bucket_cap_mb"] = bucket_cap_mb
    return stock(**kwargs) if algorithm is None else RingDDPStrategy(algorithm=algorithm, **kwargs)


# -- the memory estimate's models ------------------------------------------------------------------------------
def _optimizer(name: str, params: Any) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.01)
    if name == "sgd-momentum":
        return torch.optim.SGD(params, lr=0.01, momentum=0.9)
    if name == "adam":
        return torch.optim.Adam(params, lr=1e-4)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01)
    raise ValueError(f"optimizer {name!r}: use sgd, sgd-momentum, adam or adamw")


class _Classifier(L.LightningModule):
    """A network, an optimizer by name, and a fixed random data set read in order by a DistributedSampler."""

    def __init__(self, net: nn.Module, optimizer: str, inputs: torch.Tensor, labels: torch.Tensor,
                 batch_size: int) -> None:
        super().__init__()
        self.net, self.optimizer_name, self.batch_size = net, optimizer, batch_size
        self._data = TensorDataset(inputs, labels)

    @override
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return _optimizer(self.optimizer_name, self.parameters())

    @override
    def train_dataloader(self) -> DataLoader:
        return DataLoader(self._data, batch_size=self.batch_size, sampler=DistributedSampler(self._data, shuffle=False))


def big_mlp(optimizer: str) -> L.LightningModule:
    """50,384,906 parameters: three Linear(4096, 4096) + ReLU and a 10-way head; 64 samples, batch 4 per rank."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(3):
        layers += [nn.Linear(4096, 4096), nn.ReLU()]
    net = nn.Sequential(*layers, nn.Linear(4096, 10))
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4096, generator=gen)
    return _Classifier(net, optimizer, x, x[:, :10].argmax(1), batch_size=4)


def activation_cnn(optimizer: str, batches: int) -> L.LightningModule:
    """76 k parameters, ~100 MiB of activations: three 3x3 convolutions (3 -> 64 -> 64 -> 64) + ReLU on 64x64
    images, global average pooling and a 10-way head; ``batches`` batches of 32."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 64, 3, padding=1), nn.ReLU(), nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(),
                        nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                        nn.Linear(64, 10))
    gen = torch.Generator().manual_seed(0)
    n = 32 * batches
    return _Classifier(net, optimizer, torch.randn(n, 3, 64, 64, generator=gen),
                       torch.randint(0, 10, (n,), generator=gen), batch_size=32)
