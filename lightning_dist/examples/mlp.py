"""A bandwidth-bound workload: ``WideMLP`` (4.3 M parameters, 16.4 MiB of float32 gradients) on synthetic data.

The digits CNN's 85 KiB of gradients fit in one DDP bucket and cross a loopback link in well under a
millisecond, so it cannot show what communication costs. This MLP moves about as many bytes per step as it
computes for: at batch 16 per rank on a 2-core CPU machine its backward and its all-reduce take a similar
time, which is where overlapping the two pays most, and where gradient compression will. Its layers are
separate parameters, so DDP cuts its gradients into several buckets (``bucket_cap_mb``).

Layers, for a batch of B samples and the defaults ``features=64, width=1024, depth=4, classes=10``::

    (B, 64) -> linear -> ReLU                     (B, 1024)       66,560 parameters
            -> [linear -> ReLU] x 4               (B, 1024)    4,198,400
            -> linear                             (B, 10)         10,250

The data (:class:`SyntheticDataModule`) are Gaussian features labelled by a fixed random linear teacher,
made from a seed, so every run and every rank sees the same samples without a download.
"""

from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from typing_extensions import override


class WideMLP(L.LightningModule):
    """A plain ReLU MLP classifier trained with SGD + momentum; no normalisation, no dropout (per-rank state)."""

    def __init__(self, features: int = 64, width: int = 1024, depth: int = 4, classes: int = 10,
                 lr: float = 0.01) -> None:
        super().__init__()
        self.save_hyperparameters()
        layers: list[nn.Module] = [nn.Linear(features, width), nn.ReLU()]
        for _ in range(depth):
            layers += [nn.Linear(width, width), nn.ReLU()]
        layers.append(nn.Linear(width, classes))
        self.net = nn.Sequential(*layers)

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    @override
    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)


class SyntheticDataModule(L.LightningDataModule):
    """``samples`` Gaussian vectors of ``features`` dims, labelled by a seeded random linear map to ``classes``."""

    def __init__(self, samples: int = 4096, features: int = 64, classes: int = 10, batch_size: int = 16,
                 seed: int = 0) -> None:
        super().__init__()
        if samples < 1 or batch_size < 1:
            raise ValueError(f"samples={samples} and batch_size={batch_size} must both be >= 1.")
        self.samples, self.features, self.classes = samples, features, classes
        self.batch_size, self.seed = batch_size, seed

    def _dataset(self) -> TensorDataset:
        gen = torch.Generator().manual_seed(self.seed)
        x = torch.randn(self.samples, self.features, generator=gen)
        teacher = torch.randn(self.features, self.classes, generator=gen)
        return TensorDataset(x, (x @ teacher).argmax(dim=1))

    @override
    def train_dataloader(self) -> DataLoader:
        # Lightning replaces the sampler with a DistributedSampler, which shuffles by its own seed
        return DataLoader(self._dataset(), batch_size=self.batch_size, shuffle=True, drop_last=True)
