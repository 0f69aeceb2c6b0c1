"""``DigitsCNN``: a ~22k-parameter convolutional classifier for the 8x8 digits, with no BatchNorm.

The default model of the training command and of the end-to-end tests. It has no BatchNorm (its running
statistics are per rank, and ``SyncBatchNorm`` does not run on CPU) and no dropout (its mask is per-rank
randomness), so a DDP step over N ranks gives exactly the gradient of one process over the union of their
batches, and the tests can check that. GroupNorm (Wu & He, 2018) normalises within each sample instead.

Layers, with shapes for a batch of B images and the defaults ``channels=16, hidden=32``::

    (B, 1, 8, 8) -> conv3x3 -> GroupNorm -> ReLU          (B, 16, 8, 8)
                 -> conv3x3 -> GroupNorm -> ReLU -> pool2  (B, 32, 4, 4)
                 -> flatten -> linear -> ReLU              (B, 32)
                 -> linear                                 (B, 10) logits
"""

from __future__ import annotations

import math

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.utilities.types import OptimizerLRScheduler
from torch import nn
from torchmetrics.classification import MulticlassAccuracy
from typing_extensions import override

from lightning_dist.examples.digits import IMAGE_SHAPE, NUM_CLASSES
from lightning_dist.examples.schedules import check_schedule, lightning_scheduler

_MAX_NORM_GROUPS = 4  # GroupNorm groups per conv layer (fewer when `channels` is not a multiple of 4)
OPTIMIZERS = ("adam", "sgd")  # DigitsCNN(optimizer=...): torch's Adam, or SGD with momentum SGD_MOMENTUM
SGD_MOMENTUM = 0.9


def _conv_block(in_channels: int, out_channels: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(in_channels, out_channels, kernel_size=3, padding=1),
        nn.GroupNorm(math.gcd(_MAX_NORM_GROUPS, out_channels), out_channels),
        nn.ReLU(),
    )


class DigitsCNN(L.LightningModule):
    """Two conv blocks and a two-layer head, trained with Adam (or SGD) and cross-entropy.

    Args:
        lr: the learning rate. Under Adam 3e-3 reaches 97% validation accuracy in a few epochs at a global batch of
            32-64.
        channels: output channels of the first conv; the second has twice as many.
        hidden: width of the hidden linear layer.
        weight_decay: the optimizer's L2 penalty (coupled, as in ``torch.optim.Adam`` and ``torch.optim.SGD``).
        schedule: the rate after ``warmup_steps`` optimizer steps of linear warm-up
            (:mod:`lightning_dist.examples.schedules`): ``"constant"`` (the default, with no warm-up: Adam at ``lr``
            throughout, as before), ``"cosine"`` to a tenth of ``lr`` at the fit's last step, or ``"wsd"``.
        warmup_steps: optimizer steps of linear warm-up (0: none).
        optimizer: ``"adam"`` (the default) or ``"sgd"``: ``torch.optim.SGD`` with momentum 0.9 at ``lr`` (2e-3
            trains it steadily over 800 steps at a global batch of 128: the auto benchmark's digits job).

    Logged metrics (all unitless):
        ``train/loss``: cross-entropy of this rank's batch, every step (not synced: no collective per step).
        ``train/acc``: accuracy over the epoch's training batches of all ranks (torchmetrics syncs at
            epoch end).
        ``val/loss``: mean validation cross-entropy over the epoch, averaged across ranks.
        ``val/acc``: validation accuracy over the whole validation set, all ranks.
    """

    def __init__(self, lr: float = 3e-3, channels: int = 16, hidden: int = 32, weight_decay: float = 0.0,
                 schedule: str = "constant", warmup_steps: int = 0, optimizer: str = "adam"):
        super().__init__()
        check_schedule("DigitsCNN", schedule, warmup_steps)
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"DigitsCNN: `optimizer` must be one of {', '.join(OPTIMIZERS)}, got {optimizer!r}.")
        for name, value in (("channels", channels), ("hidden", hidden)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"DigitsCNN: `{name}` must be an int >= 1, got {value!r}.")
        for name, value in (("lr", lr), ("weight_decay", weight_decay)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"DigitsCNN: `{name}` must be a finite float, got {value!r}.")
        if lr <= 0:
            raise ValueError(f"DigitsCNN: `lr` must be > 0, got {lr!r}. The default is 3e-3.")
        if weight_decay < 0:
            raise ValueError(
                f"DigitsCNN: `weight_decay` must be >= 0, got {weight_decay!r}. Use 0 to disable it."
            )
        # plain Python types only, so checkpoints load under torch.load(weights_only=True)
        self.save_hyperparameters(
            {"lr": float(lr), "channels": int(channels), "hidden": int(hidden),
             "weight_decay": float(weight_decay), "schedule": str(schedule), "warmup_steps": int(warmup_steps),
             "optimizer": str(optimizer)}
        )

        height, width = IMAGE_SHAPE[1:]
        self.features = nn.Sequential(
            _conv_block(IMAGE_SHAPE[0], channels),
            _conv_block(channels, 2 * channels),
            nn.MaxPool2d(2),  # 8x8 -> 4x4
        )
        self.head = nn.Sequential(
            nn.Flatten(),
            nn.Linear(2 * channels * (height // 2) * (width // 2), hidden),
            nn.ReLU(),
            nn.Linear(hidden, NUM_CLASSES),
        )
        self.train_acc = MulticlassAccuracy(num_classes=NUM_CLASSES, average="micro")
        self.val_acc = MulticlassAccuracy(num_classes=NUM_CLASSES, average="micro")
        self.example_input_array = torch.zeros(2, *IMAGE_SHAPE)

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of shape (B, 10) for images of shape (B, 1, 8, 8)."""
        return self.head(self.features(x))

    def loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Mean cross-entropy of a batch ``(images, labels)``, in nats."""
        x, y = batch
        return F.cross_entropy(self(x), y)

    @override
    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        self.train_acc(logits, y)
        self.log("train/loss", loss, on_step=True, on_epoch=False, prog_bar=True)
        # a Metric object: torchmetrics accumulates over the epoch and syncs its state across ranks itself
        self.log("train/acc", self.train_acc, on_step=False, on_epoch=True)
        return loss

    @override
    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.val_acc(logits, y)
        # epoch-level mean of per-batch losses, then one all-reduce across ranks at epoch end
        self.log("val/loss", F.cross_entropy(logits, y), on_step=False, on_epoch=True, sync_dist=True)
        self.log("val/acc", self.val_acc, on_step=False, on_epoch=True, prog_bar=True)

    @override
    def configure_optimizers(self) -> OptimizerLRScheduler:
        hp = self.hparams
        if hp["optimizer"] == "sgd":
            optimizer = torch.optim.SGD(self.parameters(), lr=hp["lr"], momentum=SGD_MOMENTUM,
                                        weight_decay=hp["weight_decay"])
        else:
            optimizer = torch.optim.Adam(self.parameters(), lr=hp["lr"], weight_decay=hp["weight_decay"])
        schedule = lightning_scheduler(optimizer, hp["schedule"], hp["warmup_steps"],
                                       lambda: int(self.trainer.estimated_stepping_batches))
        return optimizer if schedule is None else {"optimizer": optimizer, "lr_scheduler": schedule}
