"""``resume=auto``: the newest complete, valid checkpoint of a run, chosen once and used by every rank.

Candidates are every ``*.ckpt`` under the run's checkpoint directory (regular ones, ``emergency/`` ones),
newest by global step; at the same step a regular checkpoint beats an emergency one. The newest that verifies
is taken (:func:`lightning_dist.fault.checkpoint.newest_valid`: a checksum mismatch or a truncated file is
skipped with a warning, and the older ones are not read).

Every rank must resume from the same file, although the files may change while ranks start. So one process
decides: under a Lightning launcher the launching process, before any rank starts (it passes the choice to the
ranks it starts in ``LIGHTNING_DIST_RESUME``); under torchrun, rank 0 of each attempt, which publishes it in
the launcher's store under the attempt's key (:mod:`lightning_dist.launch`), where the other ranks read it.
"""

from __future__ import annotations

import os
from typing import Optional

from lightning_dist.fault.checkpoint import CheckpointInfo, newest_valid
from lightning_dist.launch import LaunchEnv, connect_store

ENV = "LIGHTNING_DIST_RESUME"
ENV_DIR = "LIGHTNING_DIST_RESUME_DIR"  # the checkpoint directory the choice in ENV was made for
CHOICE_TIMEOUT_S = 300.0  # how long the other ranks wait for rank 0's choice (it verifies checksums first)


def describe(info: CheckpointInfo) -> str:
    kind = info.kind if info.rank is None else f"{info.kind} (rank {info.rank})"
    return f"{info.path}: {kind}, global step {info.global_step}"


def choose(checkpoint_dir: str, may_host_store: bool = True) -> Optional[str]:
    """The checkpoint every rank of this launch resumes from (None: start afresh).

    ``may_host_store=False``: the strategy will start the launch's store itself (Lightning's own strategies under
    torchrun with a store per rendezvous round, :mod:`lightning_dist.launch`), so rank 0 must not start it first;
    every rank then chooses for itself (the same file, unless one is written meanwhile)."""
    if ENV in os.environ and os.environ.get(ENV_DIR) == os.path.abspath(checkpoint_dir):
        return os.environ[ENV] or None  # a rank started by a launcher that already chose (not a sweep's next job)
    launch = LaunchEnv.current()
    if launch.launcher == "torchrun" and launch.store_address is not None and (may_host_store or launch.agent_store):
        store = connect_store(CHOICE_TIMEOUT_S, launch)
        key = launch.key("resume")
        if launch.rank == 0:
            info = newest_valid([checkpoint_dir])
            store.set(key, info.path if info is not None else "")
            _say(info)
        chosen = store.get(key).decode()
        return chosen or None
    info = newest_valid([checkpoint_dir])
    os.environ[ENV] = info.path if info is not None else ""  # what the ranks this process starts will use
    os.environ[ENV_DIR] = os.path.abspath(checkpoint_dir)
    _say(info)
    return info.path if info is not None else None


def _say(info: Optional[CheckpointInfo]) -> None:
    if info is None:
        print("[lightning_dist] resume=auto: no valid checkpoint yet, starting afresh", flush=True)
        return
    print(f"[lightning_dist] resume=auto: resuming from {describe(info)}", flush=True)
    if info.kind == "emergency":
        print("[lightning_dist] an emergency checkpoint holds the state of one rank at the fault: the other ranks' "
              "compressor residuals and random generators restart (elastic runs: unless their own emergency "
              "checkpoints of the same step lie beside it), and a fault inside a step may have left that step half "
              "done",
              flush=True)
