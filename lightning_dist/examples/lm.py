"""A small byte-level causal language model (``ByteLM``) on the Python standard library's own sources (``StdlibText``).

The workload where syncing every H steps (DiLoCo, Douillard et al. 2023) is tested as its users run it: a decoder-only
transformer (Radford et al. 2019, GPT-2's pre-LayerNorm blocks) trained with AdamW on text, measured by held-out loss.
The text is on every machine with Python: the ``.py`` files of the interpreter's standard library, read as bytes, so
nothing is downloaded and the vocabulary is the 256 byte values (no tokenizer). Ranks on different machines see the
same text only when their Pythons are the same version (the standard library changes between versions).

Layers, for a batch of B windows of T bytes and the defaults ``width=160, depth=4, heads=4, context=128``::

    (B, T) bytes -> token embedding + learned position embedding    (B, T, 160)        61,440 parameters
                 -> [LN -> causal self-attention -> +,
                     LN -> linear 4x -> GELU -> linear -> +] x 4    (B, T, 160)     1,236,480
                 -> LN -> linear (untied head)                      (B, T, 256)        41,536

1.34 M parameters. No dropout and no BatchNorm: both are per-rank state or randomness, and the distributed tests
compare ranks bit for bit.
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
import sysconfig
from pathlib import Path
from typing import Optional

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.utilities.types import EVAL_DATALOADERS, TRAIN_DATALOADERS, OptimizerLRScheduler
from torch import nn
from torch.utils.data import DataLoader, Dataset
from torchmetrics.classification import MulticlassAccuracy
from typing_extensions import override

from lightning_dist.examples.schedules import check_schedule, lightning_scheduler

VOCAB_SIZE = 256  # byte values
# directories of the standard library left out: installed third-party packages, and the test suites (large, generated
# data files, and not what a user's code looks like)
SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})


@functools.cache
def stdlib_sources(root: Optional[str] = None) -> tuple[tuple[str, bytes], ...]:
    """Every ``.py`` file under the standard library ``root`` (default: this interpreter's), as ``(relative posix path,
    bytes)`` sorted by path, without the :data:`SKIPPED_DIRS`. Read once per process (12 MB, ~0.1 s on Python 3.11)."""
    base = Path(root or sysconfig.get_paths()["stdlib"])
    files = []
    for directory, subdirs, names in os.walk(base):
        subdirs[:] = [d for d in subdirs if d not in SKIPPED_DIRS]
        for name in names:
            if name.endswith(".py"):
                path = Path(directory, name)
                files.append((path.relative_to(base).as_posix(), path.read_bytes()))
    if not files:
        raise FileNotFoundError(f"StdlibText: no .py files under {base}; pass root= the standard library's directory")
    return tuple(sorted(files))


def _file_key(seed: int, relative_path: str) -> bytes:
    """A stable hash of a file's path (Python's own ``hash`` is salted per process): it places the file in the split
    and orders the files in the byte stream."""
    return hashlib.sha256(f"{seed}:{relative_path}".encode()).digest()


def split_by_file(files: tuple[tuple[str, bytes], ...], val_fraction: float, seed: int) -> tuple[list[str], list[str]]:
    """``(train paths, validation paths)``: a file is held out when its hash, read as a number in [0, 1), is below
    ``val_fraction``. Each side is in hash order, so a prefix of it is a spread of the library, not its first
    packages alphabetically."""
    ordered = sorted(files, key=lambda item: _file_key(seed, item[0]))
    held_out = [int.from_bytes(_file_key(seed, path)[:8], "big") / 2**64 < val_fraction for path, _ in ordered]
    return ([path for (path, _), val in zip(ordered, held_out) if not val],
            [path for (path, _), val in zip(ordered, held_out) if val])


def _stream(files: dict[str, bytes], paths: list[str], max_bytes: Optional[int]) -> bytes:
    """The files' bytes joined in order, cut at ``max_bytes`` (None: all of them)."""
    out, size = [], 0
    for path in paths:
        if max_bytes is not None and size >= max_bytes:
            break
        out.append(files[path])
        size += len(files[path])
    data = b"".join(out)
    return data if max_bytes is None else data[:max_bytes]


class ByteWindows(Dataset):
    """Non-overlapping windows of ``context + 1`` bytes: sample ``i`` is ``(window[:-1], window[1:])``, int64."""

    def __init__(self, data: bytes, context: int) -> None:
        count = len(data) // (context + 1)
        self.windows = torch.frombuffer(bytearray(data[:count * (context + 1)]), dtype=torch.uint8).view(
            count, context + 1)  # (windows, context + 1), uint8: an eighth of int64's memory

    def __len__(self) -> int:
        return self.windows.shape[0]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        window = self.windows[index].long()
        return window[:-1], window[1:]


def _check_int(owner: str, name: str, value: object, minimum: int, hint: str, allow_none: bool = False) -> None:
    if allow_none and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{owner}: `{name}` must be an int >= {minimum}{' or None' if allow_none else ''}, got "
                         f"{value!r}. {hint}")


class StdlibText(L.LightningDataModule):
    """The standard library's ``.py`` sources as byte windows, held out by file.

    Every file gets a stable hash of ``(seed, relative path)``: the files whose hash falls below ``val_fraction`` are
    the validation side (about that fraction of the files), the rest training. Each side is the bytes of its files
    joined in hash order, cut at its byte cap, then cut into non-overlapping windows of ``context + 1`` bytes (a window
    may span the end of one file and the start of the next, as GPT-style training streams do). A smaller cap gives a
    prefix of the larger one's stream, so runs with different caps see the same first files.

    The loaders are plain ``DataLoader``s: under DDP Lightning replaces the sampler with a ``DistributedSampler``
    itself, and ``batch_size`` is per rank.

    Args:
        context: bytes the model sees per sample (the window is one longer: inputs and next-byte targets).
        batch_size: windows per batch on each rank; the global batch is ``batch_size * world_size``.
        val_fraction: fraction of the files held out, in (0, 1).
        max_train_bytes: cap of the training stream. The default 1 MiB (8,128 windows of 129 bytes: 508 batches of
            16) keeps an epoch a few minutes on a 2-core CPU and an epoch count meaningful; None takes all ~10.8 MB
            (Python 3.11).
        max_val_bytes: cap of the validation stream; the default 128 KiB (1,016 windows) keeps a validation pass a
            few seconds. None takes all ~1.2 MB.
        seed: seed of the split by file and of the single-process shuffle order. Under DDP the shuffle comes from
            Lightning's ``DistributedSampler`` instead.
        num_workers: ``DataLoader`` worker processes per rank; 0 loads in the main process (the windows are in
            memory already).
        root: the standard library's directory; None is this interpreter's (``sysconfig``).
    """

    def __init__(self, context: int = 128, batch_size: int = 16, val_fraction: float = 0.1,
                 max_train_bytes: Optional[int] = 2**20, max_val_bytes: Optional[int] = 2**17, seed: int = 0,
                 num_workers: int = 0, root: Optional[str] = None) -> None:
        super().__init__()
        owner = "StdlibText"
        _check_int(owner, "context", context, 1, "Pass the bytes per sample, e.g. context=128.")
        _check_int(owner, "batch_size", batch_size, 1, "Pass the per-rank batch size, e.g. batch_size=16.")
        _check_int(owner, "max_train_bytes", max_train_bytes, context + 1, "Give room for one window at least.",
                   allow_none=True)
        _check_int(owner, "max_val_bytes", max_val_bytes, context + 1, "Give room for one window at least.",
                   allow_none=True)
        _check_int(owner, "seed", seed, 0, "Pass a non-negative integer seed.")
        _check_int(owner, "num_workers", num_workers, 0, "Use 0 to load in the main process.")
        if isinstance(val_fraction, bool) or not isinstance(val_fraction, (int, float)) or not 0 < val_fraction < 1:
            raise ValueError(f"StdlibText: `val_fraction` must be a float in (0, 1), got {val_fraction!r}. Use e.g. "
                             "val_fraction=0.1 (about 70 files held out).")
        self.context, self.batch_size, self.val_fraction = context, batch_size, float(val_fraction)
        self.max_train_bytes, self.max_val_bytes = max_train_bytes, max_val_bytes
        self.seed, self.num_workers, self.root = seed, num_workers, root
        self.train_files: list[str] = []  # relative paths, in stream order
        self.val_files: list[str] = []
        self.train_set: Optional[ByteWindows] = None
        self.val_set: Optional[ByteWindows] = None

    @override
    def setup(self, stage: str) -> None:
        if self.train_set is not None:
            return
        files = stdlib_sources(self.root)
        self.train_files, self.val_files = split_by_file(files, self.val_fraction, self.seed)
        if not self.train_files or not self.val_files:
            raise ValueError(f"StdlibText: val_fraction={self.val_fraction} leaves one side of the {len(files)} files "
                             "empty; use a value nearer 0.1")
        contents = dict(files)
        self.train_set = ByteWindows(_stream(contents, self.train_files, self.max_train_bytes), self.context)
        self.val_set = ByteWindows(_stream(contents, self.val_files, self.max_val_bytes), self.context)

    def _require(self, dataset: Optional[ByteWindows]) -> ByteWindows:
        if dataset is None:
            raise RuntimeError("StdlibText: call `setup()` (or pass the module to a Trainer) first.")
        return dataset

    @override
    def train_dataloader(self) -> TRAIN_DATALOADERS:
        generator = torch.Generator().manual_seed(self.seed)  # single-process shuffle order follows `seed`
        return DataLoader(self._require(self.train_set), batch_size=self.batch_size, shuffle=True,
                          num_workers=self.num_workers, persistent_workers=self.num_workers > 0, generator=generator)

    @override
    def val_dataloader(self) -> EVAL_DATALOADERS:
        return DataLoader(self._require(self.val_set), batch_size=self.batch_size, shuffle=False,
                          num_workers=self.num_workers, persistent_workers=self.num_workers > 0)


class Block(nn.Module):
    """One pre-LayerNorm transformer block: ``x + attn(LN(x))``, then ``x + mlp(LN(x))``."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.attn_norm = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.attn_out = nn.Linear(width, width)
        self.mlp_norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        # (B, T, 3C) -> three (B, heads, T, C / heads)
        q, k, v = self.qkv(self.attn_norm(x)).view(batch, length, 3, self.heads, width // self.heads).permute(
            2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, heads, T, C / heads)
        x = x + self.attn_out(attended.transpose(1, 2).reshape(batch, length, width))
        return x + self.mlp(self.mlp_norm(x))


class ByteLM(L.LightningModule):
    """A byte-level causal transformer trained with AdamW on next-byte cross-entropy.

    The output head is untied from the input embedding: with 256 symbols tying would save only 41 k parameters (3%),
    while untied every parameter belongs to one layer, which keeps per-parameter state (compressor residuals,
    DiLoCo's copies) one entry per tensor use. Initialisation is GPT-2's (normal, std 0.02; the residual projections
    scaled by ``1/sqrt(2 depth)``) from torch's global generator, so ``torch.manual_seed`` fixes it; with it the
    first loss is close to ``ln 256 = 5.55`` nats.

    Args:
        lr: AdamW's peak learning rate.
        width: the model width (``d_model``): embedding and residual stream size.
        depth: transformer blocks.
        heads: attention heads; ``width`` must be a multiple of it.
        context: the longest input (positions learned); the data's ``context`` must not exceed it.
        weight_decay: AdamW's decoupled weight decay, applied to the weight matrices and embeddings only (not to
            biases and LayerNorm gains, as in GPT-2 and nanoGPT).
        warmup_steps: optimizer steps of linear warm-up from ``lr / warmup_steps`` to ``lr`` (0: none), stepped per
            optimizer step.
        schedule: the rate after the warm-up (:mod:`lightning_dist.examples.schedules`): ``"constant"`` (so a run's
            length does not change its first steps), ``"cosine"`` to a tenth of ``lr`` at the fit's last step, or
            ``"wsd"`` (stable, then a linear decay to a tenth over the last fifth).
        schedule_steps: the optimizer steps the schedule spans (0: the fit's own, Lightning's
            ``trainer.estimated_stepping_batches``); a fit that goes on past them stays at the schedule's last rate
            (the sync benchmark's: every method on one schedule, at equal samples).

    Logged metrics (losses in nats per byte; divide by ln 2 for bits per byte):
        ``train/loss``: mean cross-entropy of this rank's batch, every step (not synced: no collective per step).
        ``val/loss``: mean validation cross-entropy over the epoch, averaged across ranks.
        ``val/acc``: next-byte top-1 accuracy over the whole validation set, all ranks (unitless; the name the
            command's checkpoint callback and summary read, as for the digits CNN).
    """

    def __init__(self, lr: float = 2e-3, width: int = 160, depth: int = 4, heads: int = 4, context: int = 128,
                 weight_decay: float = 0.1, warmup_steps: int = 50, schedule: str = "constant",
                 schedule_steps: int = 0) -> None:
        super().__init__()
        check_schedule("ByteLM", schedule, warmup_steps)
        _check_int("ByteLM", "schedule_steps", schedule_steps, 0, "0: the fit's own length.")
        for name, value, minimum in (("width", width, 1), ("depth", depth, 1), ("heads", heads, 1),
                                     ("context", context, 1)):
            _check_int("ByteLM", name, value, minimum, "")
        if width % heads:
            raise ValueError(f"ByteLM: `width`={width} must be a multiple of `heads`={heads}, e.g. width=160 heads=4")
        for name, value in (("lr", lr), ("weight_decay", weight_decay)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"ByteLM: `{name}` must be a finite float, got {value!r}.")
        if lr <= 0:
            raise ValueError(f"ByteLM: `lr` must be > 0, got {lr!r}. The default is 2e-3.")
        if weight_decay < 0:
            raise ValueError(f"ByteLM: `weight_decay` must be >= 0, got {weight_decay!r}. Use 0 to disable it.")
        # plain Python types only, so checkpoints load under torch.load(weights_only=True)
        self.save_hyperparameters({"lr": float(lr), "width": int(width), "depth": int(depth), "heads": int(heads),
                                   "context": int(context), "weight_decay": float(weight_decay),
                                   "warmup_steps": int(warmup_steps), "schedule": str(schedule),
                                   "schedule_steps": int(schedule_steps)})
        self.token_embedding = nn.Embedding(VOCAB_SIZE, width)
        self.position_embedding = nn.Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(depth))
        self.final_norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, VOCAB_SIZE)
        self.val_acc = MulticlassAccuracy(num_classes=VOCAB_SIZE, average="micro")
        self.apply(self._init_weights)
        for block in self.blocks:  # each residual branch adds to the stream: keep its sum's variance bounded in depth
            for projection in (block.attn_out, block.mlp[2]):
                nn.init.normal_(projection.weight, std=0.02 / math.sqrt(2 * depth))
        self.example_input_array = torch.zeros(2, context, dtype=torch.long)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    @override
    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Next-byte logits of shape (B, T, 256) for int64 bytes of shape (B, T), T <= ``context``."""
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.token_embedding(tokens) + self.position_embedding(positions)  # (B, T, width)
        for block in self.blocks:
            x = block(x)
        return self.head(self.final_norm(x))

    def loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Mean next-byte cross-entropy of a batch ``(inputs, targets)``, both (B, T), in nats per byte."""
        inputs, targets = batch
        return F.cross_entropy(self(inputs).flatten(0, 1), targets.flatten())

    @override
    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        self.log("train/loss", loss, on_step=True, on_epoch=False, prog_bar=True)
        return loss

    @override
    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        inputs, targets = batch
        logits = self(inputs).flatten(0, 1)  # (B * T, 256)
        self.val_acc(logits, targets.flatten())
        # epoch-level mean of per-batch losses, then one all-reduce across ranks at epoch end
        self.log("val/loss", F.cross_entropy(logits, targets.flatten()), on_step=False, on_epoch=True, sync_dist=True,
                 prog_bar=True)
        self.log("val/acc", self.val_acc, on_step=False, on_epoch=True)

    @override
    def configure_optimizers(self) -> OptimizerLRScheduler:
        decayed = [p for p in self.parameters() if p.dim() >= 2]
        plain = [p for p in self.parameters() if p.dim() < 2]
        optimizer = torch.optim.AdamW(
            [{"params": decayed, "weight_decay": self.hparams["weight_decay"]}, {"params": plain, "weight_decay": 0.0}],
            lr=self.hparams["lr"], betas=(0.9, 0.95))
        hp = self.hparams
        schedule = lightning_scheduler(optimizer, hp["schedule"], hp["warmup_steps"],
                                       lambda: hp["schedule_steps"] or int(self.trainer.estimated_stepping_batches))
        return optimizer if schedule is None else {"optimizer": optimizer, "lr_scheduler": schedule}
