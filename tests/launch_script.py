"""A user's own training script, launched by the tests under torchrun, as two "nodes", and as SLURM tasks.

Usage: ``python launch_script.py OUT_PATH DEVICES NUM_NODES STRATEGY``. Rank zero writes the final weights and
what the run saw (world size, strategy, launcher) to ``OUT_PATH`` with ``torch.save``.
"""

import sys

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_dist  # noqa: F401 - registers ring_ddp*


class Tiny(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 3))

    def training_step(self, batch, batch_idx):
        return nn.functional.cross_entropy(self.net(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def train_dataloader(self):
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(96, 10, generator=gen)
        return DataLoader(TensorDataset(x, x[:, :3].argmax(1)), batch_size=8)


if __name__ == "__main__":
    out, devices, num_nodes, strategy = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    pl.seed_everything(0)
    model = Tiny()
    trainer = pl.Trainer(accelerator="cpu", devices=devices, num_nodes=num_nodes, strategy=strategy, max_epochs=2,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(model)
    if trainer.is_global_zero:
        torch.save({"state": model.state_dict(), "world_size": trainer.world_size, "steps": trainer.global_step,
                    "strategy": type(trainer.strategy).__name__,
                    "launcher": type(trainer.strategy.launcher).__name__,
                    "environment": type(trainer.strategy.cluster_environment).__name__}, out)
