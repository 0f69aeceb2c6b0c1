"""A user's own training script, launched by the tests under torchrun, as two "nodes", and as SLURM tasks.

Usage: ``python launch_script.py OUT_PATH DEVICES NUM_NODES STRATEGY``. Rank zero writes the final weights and
what the run saw (world size, strategy, launcher) to ``OUT_PATH`` with ``torch.save``.
"""

import sys

import lightning.pytorch as pl
import torch

import lightning_dist  # noqa: F401 - registers ring_ddp*
from lightning_dist.testing import ToyClassifier, quiet_trainer

if __name__ == "__main__":
    out, devices, num_nodes, strategy = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    pl.seed_everything(0)
    # Linear-Tanh-Linear on 96 samples: 6 steps an epoch on 2 ranks
    model = ToyClassifier(features=10, hidden=(32,), classes=3, samples=96, batch_size=8, momentum=0.9)
    trainer = quiet_trainer(devices=devices, num_nodes=num_nodes, strategy=strategy, max_epochs=2)
    trainer.fit(model)
    if trainer.is_global_zero:
        torch.save({"state": model.state_dict(), "world_size": trainer.world_size, "steps": trainer.global_step,
                    "strategy": type(trainer.strategy).__name__,
                    "launcher": type(trainer.strategy.launcher).__name__,
                    "environment": type(trainer.strategy.cluster_environment).__name__}, out)
