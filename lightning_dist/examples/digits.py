"""``DigitsDataModule``: scikit-learn's handwritten digits as a LightningDataModule.

The data are the UCI optical-recognition digits (Alpaydin & Kaynak, 1998) that ship with scikit-learn as
``sklearn.datasets.load_digits``: 1,797 images of 8x8 pixels with values 0..16, ten classes, about 180 per
class. Nothing is downloaded, so every rank loads the same arrays from disk with no race.

Samples are ``(1, 8, 8)`` float32 tensors in [0, 1] and int64 labels. The train/val split is stratified
and depends only on ``seed``, so every rank builds the same split. The loaders are plain ``DataLoader``s:
under DDP Lightning replaces the sampler with a ``DistributedSampler`` itself, and ``batch_size`` is per rank.
"""

from __future__ import annotations

import lightning as L
import numpy as np
import torch
from lightning.pytorch.utilities.types import EVAL_DATALOADERS, TRAIN_DATALOADERS
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch.utils.data import DataLoader, TensorDataset
from typing_extensions import override

NUM_CLASSES = 10
IMAGE_SHAPE = (1, 8, 8)  # (channels, height, width)
_PIXEL_MAX = 16.0  # load_digits pixel values are integers in 0..16


def _check_int(name: str, value: object, minimum: int, hint: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"DigitsDataModule: `{name}` must be an int >= {minimum}, got {value!r}. {hint}")


class DigitsDataModule(L.LightningDataModule):
    """Stratified train/val split of the 8x8 digits, as ``(1, 8, 8)`` float tensors in [0, 1].

    Args:
        batch_size: samples per batch on each rank; the global batch is ``batch_size * world_size``.
        val_fraction: fraction of the 1,797 samples held out for validation (0.2 gives 360).
        num_workers: ``DataLoader`` worker processes per rank; 0 loads in the main process, which is
            fastest for a data set this small.
        seed: seed of the train/val split and of the single-process shuffle order. The split is the same
            on every rank for a given seed; under DDP the shuffle comes from Lightning's
            ``DistributedSampler`` instead.
    """

    def __init__(self, batch_size: int = 32, val_fraction: float = 0.2, num_workers: int = 0, seed: int = 0):
        super().__init__()
        _check_int("batch_size", batch_size, 1, "Pass the per-rank batch size, e.g. batch_size=32.")
        _check_int("num_workers", num_workers, 0, "Use 0 to load in the main process.")
        _check_int("seed", seed, 0, "Pass a non-negative integer seed.")
        if isinstance(val_fraction, bool) or not isinstance(val_fraction, (int, float)):
            raise ValueError(f"DigitsDataModule: `val_fraction` must be a float, got {val_fraction!r}.")
        # at least one sample of each class on each side, or the stratified split cannot be made
        n_samples, n_val_min = 1797, NUM_CLASSES
        low, high = n_val_min / n_samples, 1 - n_val_min / n_samples
        if not low <= val_fraction <= high:
            raise ValueError(
                f"DigitsDataModule: `val_fraction` must be in [{low:.3f}, {high:.3f}] so that both sides hold"
                f" every class, got {val_fraction!r}. Use e.g. val_fraction=0.2 (360 validation samples)."
            )
        self.batch_size = batch_size
        self.val_fraction = float(val_fraction)
        self.num_workers = num_workers
        self.seed = seed
        self.train_set: TensorDataset | None = None
        self.val_set: TensorDataset | None = None

    @override
    def setup(self, stage: str) -> None:
        if self.train_set is not None:
            return
        images, labels = load_digits(return_X_y=True)  # (1797, 64) float64 in 0..16, (1797,) int
        x = (images.astype(np.float32) / _PIXEL_MAX).reshape(-1, *IMAGE_SHAPE)
        y = labels.astype(np.int64)
        x_train, x_val, y_train, y_val = train_test_split(
            x, y, test_size=self.val_fraction, stratify=y, random_state=self.seed
        )
        self.train_set = TensorDataset(torch.from_numpy(x_train), torch.from_numpy(y_train))
        self.val_set = TensorDataset(torch.from_numpy(x_val), torch.from_numpy(y_val))

    def _require(self, dataset: TensorDataset | None) -> TensorDataset:
        if dataset is None:
            raise RuntimeError("DigitsDataModule: call `setup()` (or pass the module to a Trainer) first.")
        return dataset

    @override
    def train_dataloader(self) -> TRAIN_DATALOADERS:
        generator = torch.Generator().manual_seed(self.seed)  # single-process shuffle order follows `seed`
        return DataLoader(
            self._require(self.train_set),
            batch_size=self.batch_size,
            shuffle=True,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
            generator=generator,
        )

    @override
    def val_dataloader(self) -> EVAL_DATALOADERS:
        return DataLoader(
            self._require(self.val_set),
            batch_size=self.batch_size,
            shuffle=False,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )
