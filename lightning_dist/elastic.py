"""Elastic training's mechanisms: node identities, the sample ledger, and what state survives a change of world.

An elastic run (``torchrun --nnodes MIN:MAX --max-restarts K --rdzv-backend c10d``, docs/elastic.md)
goes on when a host is lost for good or a new one joins: torchrun ends every worker and starts them again at the
new size, and every worker resumes from the newest consistent state (``resume=auto``). What makes the resumed run
the same run, and how this package keeps it so:

- **the global batch** ``B`` stays fixed and global batch ``i`` of an epoch is the same block of the epoch's
  permutation at any world size (:class:`~lightning_dist.hetero.sampler.HeteroBatchSampler` with
  ``elastic=True``); only its split into per-rank pieces follows the world (the measured speeds of those who are
  left, :meth:`~lightning_dist.hetero.plan.BatchPlan.carry_over`);
- **a node identity** (:func:`~lightning_dist.identities.node_identity`: ``$LIGHTNING_DIST_NODE`` or the host name,
  and the local rank) says which rank of the old world a rank of the new one was, since torchrun renumbers ranks at
  every restart: a survivor gets its own error-feedback residuals and generators back
  (:func:`~lightning_dist.identities.map_ranks`), a newcomer starts afresh, and what belonged to a lost host is
  named in one warning with its norm (:func:`lost_state_message`);
- **the sample ledger** (:class:`LedgerWriter`, :func:`read_ledger`): every rank appends, per global batch, the
  dataset indices its loader actually drew for it and its loss, one file per process under
  ``<checkpoint dir>/ledger/``; :func:`read_ledger` replays the attempts in order, dropping the batches an attempt
  did after the state the next one resumed from (they were redone), and returns per global batch the samples that
  reached the model. Syncing every H steps (DiLoCo), a worker lost with its host takes its progress since the last
  sync with it; the next attempt names those samples in its header (``lost``) and trains them again in its first
  batches, and the ledger moves them there.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

LEDGER_DIR = "ledger"


def state_norm(state: Any) -> float:
    """The L2 norm over every floating-point tensor in a (nested) state: what a lost residual weighed."""
    total = 0.0
    stack = [state]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            if item.is_floating_point():
                total += float(item.double().pow(2).sum())
        elif isinstance(item, Mapping):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return math.sqrt(total)


def lost_state_message(what: str, old: Sequence[str], new: Sequence[str], states: Sequence[Any],
                       with_norm: bool = True) -> Optional[str]:
    """What of one per-rank state did not survive a change of world, for the restart's warning (None: nothing).

    ``old`` and ``new`` are the two worlds' node identities in rank order; ``states[r]`` is old rank ``r``'s saved
    state (None: in no checkpoint of the step resumed from: its process ended before writing one, or wrote its own
    emergency checkpoint at another step, as a rank a local step behind under DiLoCo does); ``with_norm`` adds what a
    lost state weighed (error-feedback residuals; a generator's norm means nothing)."""
    staying = set(new)
    lost = []
    for rank, identity in enumerate(old):
        state = states[rank] if rank < len(states) else None
        if identity in staying and state is not None:
            continue
        where = "left the run" if identity not in staying else "still here"
        if state is None:
            weight = ("not in a checkpoint of the step resumed from (its process ended first, or saved at another "
                      "step: a rank a local step behind under DiLoCo)")
        else:
            weight = f"norm {state_norm(state):.4g}" if with_norm else "saved, but its host is gone"
        lost.append(f"old rank {rank} ({identity}, {where}): {weight}")
    if not lost:
        return None
    return f"{what} lost for {'; '.join(lost)} (the rest restored; a newcomer's starts afresh)."


# ---- the sample ledger -------------------------------------------------------------------------------------------

def ledger_dir(checkpoint_dir: str) -> str:
    """Where a run's ledger lives: beside its checkpoints, which decide what it keeps."""
    return os.path.join(checkpoint_dir, LEDGER_DIR)


class LedgerWriter:
    """One process's ledger file: a header line, then two lines per training batch (its start, its end).

    The header names the attempt (a token every rank of one attempt shares), the global batch it resumed from, the
    world size, this rank and its identity. Each batch gets two lines: when it starts, the global batch's position in
    the run (``epoch x batches per epoch + batch``: the same at any world size under elastic batching), the optimizer
    steps before it, the epoch and batch index and the dataset indices this rank's loader drew for it; when it ends,
    the mean loss on them and whether an optimizer step followed (a step NaNRecovery skipped does not; nor, under
    gradient accumulation, does a batch before the window's last)."""

    def __init__(self, directory: str, attempt: str, rank: int, world_size: int, identity: str,
                 resumed_from: int, started: float, lost: Optional[Mapping[int, Sequence[int]]] = None) -> None:
        os.makedirs(directory, exist_ok=True)
        self.path = os.path.join(directory, f"{attempt}-rank{rank}.jsonl")
        self._file = open(self.path, "a", buffering=1)  # noqa: SIM115 - kept open for the fit, closed by close()
        header = {"attempt": attempt, "rank": rank, "world_size": world_size, "identity": identity,
                  "resumed_from": resumed_from, "started": started}
        if lost:  # DiLoCo: samples earlier attempts trained that reached no model for good (they train again)
            header["lost"] = {str(p): list(v) for p, v in lost.items()}
        self._write(header)

    def _write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record, separators=(",", ":")) + "\n")
        self._file.flush()

    def started(self, position: int, step: int, epoch: int, batch: int, indices: Sequence[int]) -> None:
        """A batch begins: its indices are written before any collective of its step, so that a rank that dies
        inside the step has still said what it contributed, if the survivors finish that step."""
        self._write({"position": position, "step": step, "epoch": epoch, "batch": batch, "indices": list(indices),
                     "t0": time.time()})

    def finished(self, position: int, loss: float, stepped: bool) -> None:
        self._write({"position": position, "loss": loss, "stepped": stepped, "t1": time.time()})

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()


@dataclass
class LedgerStep:
    """One global batch of the run as it reached the model: every rank's piece, and the loss over all of them."""

    position: int  # epoch x batches per epoch + batch
    step: int  # optimizer steps before it
    epoch: int
    batch: int
    indices: list[int] = field(default_factory=list)  # the global batch, rank pieces in rank order
    lost: list[int] = field(default_factory=list)  # samples of it a later attempt declared lost (trained again)
    loss: float = math.nan  # the mean loss over the pieces whose end was recorded
    stepped: bool = True  # an optimizer step followed it on every rank that recorded its end
    complete: bool = True  # every rank of the attempt recorded its piece
    world_size: int = 0
    attempt: str = ""
    attempt_started: float = math.nan  # wall-clock time the attempt's first rank began training (restored)
    started: float = math.nan  # wall-clock time the first rank started it
    finished: float = math.nan  # wall-clock time the last rank that recorded its end ended it


def read_ledger(directory: str) -> dict[int, LedgerStep]:
    """The run's global batches as they reached the model, by position: attempts are replayed in the order they
    started, each first dropping every batch at or after the one it resumed from (done by an attempt whose state was
    not kept, and redone), then adding its own."""
    attempts: dict[str, dict[str, Any]] = {}
    for path in sorted(Path(directory).glob("*.jsonl")):
        lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        if not lines:
            continue
        header = lines[0]
        attempt = attempts.setdefault(header["attempt"], {"started": header["started"], "resumed_from":
                                                          header["resumed_from"], "world_size": header["world_size"],
                                                          "pieces": {}, "lost": {}})
        for position, indices in header.get("lost", {}).items():
            attempt["lost"][int(position)] = indices
        attempt["started"] = min(attempt["started"], header["started"])
        for record in lines[1:]:
            attempt["pieces"].setdefault(record["position"], {}).setdefault(header["rank"], {}).update(record)
    batches: dict[int, LedgerStep] = {}
    for name, attempt in sorted(attempts.items(), key=lambda item: item[1]["started"]):
        for position in [p for p in batches if p >= attempt["resumed_from"]]:
            del batches[position]
        for position, indices in attempt["lost"].items():  # DiLoCo: a lost worker's pieces, trained again later
            if position in batches:
                gone = set(indices)
                batches[position].lost += [i for i in batches[position].indices if i in gone]
                batches[position].indices = [i for i in batches[position].indices if i not in gone]
        for position, pieces in sorted(attempt["pieces"].items()):
            ranks = [r for r in sorted(pieces) if "indices" in pieces[r]]
            if not ranks:
                continue
            first = pieces[ranks[0]]
            ended = [pieces[r] for r in ranks if "loss" in pieces[r]]
            count = sum(len(piece["indices"]) for piece in ended)
            batches[position] = LedgerStep(
                position=position, step=first["step"], epoch=first["epoch"], batch=first["batch"],
                indices=[i for r in ranks for i in pieces[r]["indices"]],
                loss=sum(p["loss"] * len(p["indices"]) for p in ended) / count if count else math.nan,
                stepped=all(piece["stepped"] for piece in ended), complete=len(ranks) == attempt["world_size"],
                world_size=attempt["world_size"], attempt=name, attempt_started=attempt["started"],
                started=min(pieces[r].get("t0", math.nan) for r in ranks),
                finished=max((piece.get("t1", math.nan) for piece in ended), default=math.nan))
    return dict(sorted(batches.items()))


def attempt_token() -> str:
    """A name for this attempt (rank 0 makes it, every rank gets it): when it started, and rank 0's process."""
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"


# ---- per-rank state across a change of world --------------------------------------------------------------------

# the checkpoint entries that hold one state per rank ({"ranks": [...], "identities": [...]}), and what a lost one is
# called: the compressor's (lightning_dist.strategy.checkpoint; its norm says what a lost residual weighed), the
# random generators' (lightning_dist.fault.rng) and DiLoCo's (each worker's own parameters and inner optimizer state)
PER_RANK_ENTRIES: dict[tuple[str, ...], str] = {
    ("lightning_dist", "compressor"): "compressor state (error-feedback residuals, generators)",
    ("lightning_dist_rng",): "random generators",
    ("lightning_dist", "sync"): "DiLoCo worker state (inner progress since the last sync)",
}


def per_rank_entry(checkpoint: Mapping[str, Any], keys: Sequence[str]) -> Optional[dict[str, Any]]:
    entry: Any = checkpoint
    for key in keys:
        entry = entry.get(key) if isinstance(entry, Mapping) else None
    return entry if isinstance(entry, dict) and isinstance(entry.get("ranks"), list) else None


def complete_from_siblings(checkpoint: dict[str, Any], path: str) -> list[int]:
    """Fill the per-rank states an emergency checkpoint lacks from the emergency checkpoints the other ranks wrote at
    the same step beside it (every survivor of a fault writes its own); returns the old ranks filled in. A regular
    checkpoint holds every rank's state already and is left as it is."""
    from lightning_dist.fault.checkpoint import find_checkpoints

    here = os.path.abspath(path)
    emergency = find_checkpoints([os.path.dirname(here)], "emergency-rank*-step=*.ckpt", recursive=False)
    chosen = next((info for info in emergency if os.path.abspath(info.path) == here), None)
    if chosen is None or chosen.kind != "emergency":
        return []
    filled = []
    for info in emergency:
        if info.global_step != chosen.global_step or info.rank is None or info is chosen:
            continue
        wanted = [keys for keys in PER_RANK_ENTRIES if (entry := per_rank_entry(checkpoint, keys)) is not None
                  and info.rank < len(entry["ranks"]) and entry["ranks"][info.rank] is None]
        if not wanted:
            continue
        other = torch.load(info.path, map_location="cpu", weights_only=True, mmap=True)
        for keys in wanted:
            theirs = per_rank_entry(other, keys)
            if theirs is not None and info.rank < len(theirs["ranks"]) and theirs["ranks"][info.rank] is not None:
                per_rank_entry(checkpoint, keys)["ranks"][info.rank] = theirs["ranks"][info.rank]  # type: ignore[index]
                filled.append(info.rank)
    return sorted(set(filled))
