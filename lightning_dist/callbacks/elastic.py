"""``ElasticTraining``: a run that goes on when hosts leave or join, with the same global batch and every sample once.

Under ``torchrun --nnodes MIN:MAX --max-restarts K --rdzv-backend c10d`` (docs/elastic.md), torchrun ends
every worker when a host is lost (the survivors get out within :class:`FaultTolerance`'s bound, each writing an
emergency checkpoint of the step it reached) or when a new host waits to join (every worker gets SIGTERM, and the
ranks stop together at one step with a checkpoint), and starts them again at the new size; ``resume=auto`` takes the
newest consistent state. This callback makes the resumed run the same run (:mod:`lightning_dist.elastic`):

- every rank's node identity is gathered at set-up, so checkpoints record which rank was where and a restart maps
  per-rank state (error-feedback residuals, random generators, the batch plan's measured speeds) to the ranks that
  were there before; what belonged to a lost host is named in one warning, with its norm;
- the global batch is :class:`~lightning_dist.hetero.HeteroBatching`'s fixed ``global_batch_size`` under
  ``elastic=true``: the same block of the epoch's permutation at any world size, split over those who are there;
- the sample ledger: every rank appends, per global batch, the indices its loader drew and its loss
  (``<checkpoint dir>/ledger/``; read it with :func:`lightning_dist.elastic.read_ledger`).

Needs ``RingDDPStrategy`` with ``hetero=elastic`` and a fixed ``hetero.global_batch_size``, and
:class:`FaultTolerance`; under torchrun, ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (:mod:`lightning_dist.launch` says
why). All of it is checked before the process group starts (``lightning-dist-train``) or at set-up.
"""

from __future__ import annotations

import time
from typing import Any, Optional

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_dist.callbacks.fault_tolerance import FaultTolerance
from lightning_dist.elastic import (
    PER_RANK_ENTRIES,
    LedgerWriter,
    attempt_token,
    ledger_dir,
    lost_state_message,
    per_rank_entry,
)
from lightning_dist.fault.checkpoint import checkpoint_dir
from lightning_dist.identities import node_identity
from lightning_dist.launch import LaunchEnv
from lightning_dist.strategy import features_of

STORE_FIX = ("start torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its environment (every rendezvous round then "
             "has a store of its own; torchrun's shared store is keyed by a restart count that ranks can disagree on "
             "after a host joins or a peer's agent re-joins first)")


def launch_problems(env: Optional[LaunchEnv] = None) -> list[str]:
    """What is wrong with this launch for elastic training (empty: nothing), each with its fix."""
    env = env or LaunchEnv.current()
    if env.launcher == "torchrun" and env.agent_store:
        return [f"elastic training under torchrun's shared store: {STORE_FIX}"]
    return []


class ElasticTraining(Callback):
    """Same global batch, each sample once, per-rank state mapped by node identity across elastic restarts.

    Args:
        ledger: keep the sample ledger (``<checkpoint dir>/ledger/``, one line per rank and global batch).
    """

    def __init__(self, ledger: bool = True) -> None:
        self.ledger = ledger
        self.identities: list[str] = []  # every rank's node identity, in rank order (set up per fit)
        self.attempt = ""  # this attempt's name, rank 0's (set up per fit)
        self._writer: Optional[LedgerWriter] = None
        self._hetero: Any = None
        self._batch: Optional[tuple[int, int]] = None  # the batch under way: (position, global step before)

    # -- set-up ---------------------------------------------------------------------------------------------
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        features = features_of(trainer.strategy)
        hetero = features.hetero if features is not None else None
        problems = launch_problems()
        if features is None:
            problems.append(f"ElasticTraining needs RingDDPStrategy, not {type(trainer.strategy).__name__} "
                            "(strategy=ring_ddp)")
        elif hetero is None or not hetero.elastic:
            problems.append("ElasticTraining needs elastic batching: RingDDPStrategy(hetero=HeteroBatching("
                            "elastic=True, global_batch_size=B)) (hetero=elastic hetero.global_batch_size=B)")
        if not any(isinstance(cb, FaultTolerance) for cb in trainer.callbacks):
            problems.append("ElasticTraining needs FaultTolerance (callbacks=[checkpoint,fault_tolerance,elastic]): "
                            "without it a host whose link is cut leaves the survivors hanging")
        if problems:
            raise ValueError("ElasticTraining: " + "; ".join(problems))
        # one exchange: every rank's identity, and rank 0's name for the attempt
        mine = (node_identity(), attempt_token())
        everyone: list[Any] = [mine]
        if trainer.world_size > 1 and dist.is_initialized():
            everyone = [None] * trainer.world_size
            dist.all_gather_object(everyone, mine)
        identities = [identity for identity, _ in everyone]
        if len(set(identities)) != len(identities):
            raise ValueError(f"ElasticTraining: node identities {identities} are not unique: several nodes have the "
                             "same host name; give each node a name in LIGHTNING_DIST_NODE")
        self.identities, self.attempt, self._hetero = identities, everyone[0][1], hetero
        features.identities = hetero.identities = self.identities  # type: ignore[union-attr]

    # -- the ledger ---------------------------------------------------------------------------------------------
    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        sampler = self._hetero.sampler  # the training loader's, made before training starts
        epoch, next_batch = sampler.completed
        position = epoch * sampler.steps_per_epoch + next_batch
        sizes = sampler.sizes(epoch, next_batch) if next_batch < sampler.steps_per_epoch else None
        rank_zero_info(f"ElasticTraining: attempt {self.attempt} on {trainer.world_size} ranks "
                       f"({', '.join(self.identities)}) from global batch {position} (epoch {epoch}, batch "
                       f"{next_batch}, global step {trainer.global_step}); per-rank sizes {sizes}")
        if sampler.lost:
            count = sum(len(v) for v in sampler.lost.values())
            rank_zero_info(f"ElasticTraining: {count} samples of global batches {sorted(sampler.lost)} reached no "
                           "model for good (a DiLoCo worker lost since its last sync): they train again in global "
                           f"batches {[epoch * sampler.steps_per_epoch + b for b in sorted(sampler.makeup[1])]}")
        elsewhere = sampler.lost_elsewhere
        if elsewhere:
            rank_zero_warn(f"ElasticTraining: {len(elsewhere)} samples a lost DiLoCo worker trained in an earlier "
                           "epoch since its last sync cannot train again in that epoch: that epoch misses them")
        if self.ledger:
            self._writer = LedgerWriter(ledger_dir(checkpoint_dir(trainer)), self.attempt, trainer.global_rank,
                                        trainer.world_size, self.identities[trainer.global_rank],
                                        resumed_from=position, started=time.time(), lost=sampler.lost)

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        sampler = self._hetero.sampler
        epoch = trainer.current_epoch
        self._batch = (epoch * sampler.steps_per_epoch + batch_idx, trainer.global_step)
        if self._writer is not None:
            indices = sampler.take_drawn(epoch, batch_idx)
            if not indices:  # the loop counts another batch than the loader drew: the ledger would be wrong
                rank_zero_warn(f"ElasticTraining: the training loop is at batch {batch_idx} of epoch {epoch}, but the "
                               f"loader drew {sorted(sampler.drawn)}: the ledger records this batch as empty")
            self._writer.started(*self._batch, epoch, batch_idx, indices)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._writer is None or self._batch is None:
            return
        position, step = self._batch
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        value = float(loss.detach()) if isinstance(loss, torch.Tensor) else float("nan")
        self._writer.finished(position, value, stepped=trainer.global_step > step)
        self._batch = None

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit" and self._writer is not None:
            self._writer.close()
            self._writer = None

    # -- a restart at another world size ------------------------------------------------------------------------
    @override
    def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        # after the strategy and FaultTolerance restored what maps (the checkpoint's per-rank entries were completed
        # from the survivors' own emergency checkpoints when it was loaded): say, once, what did not
        features = features_of(trainer.strategy)
        new = self.identities or []
        parts, worlds = [], set()
        for keys, what in PER_RANK_ENTRIES.items():
            entry = per_rank_entry(checkpoint, keys)
            if entry is None or not entry.get("identities"):
                continue
            residuals = keys == ("lightning_dist", "compressor")
            if residuals and features is not None and not features.compressor.lossy:
                continue  # a lossless compressor keeps nothing per rank
            worlds.add(len(entry["identities"]))
            message = lost_state_message(what, entry["identities"], new, entry["ranks"], with_norm=residuals)
            if message:
                parts.append(message)
        if parts:
            rank_zero_warn(f"ElasticTraining: elastic restart on {len(new)} ranks (was {', '.join(map(str, worlds))}): "
                           + " ".join(parts))


