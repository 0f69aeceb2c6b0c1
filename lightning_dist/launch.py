"""The launch environment: which launcher started this process, which restart attempt it is, and one client to the
launcher's store.

Ranks are started by Lightning's own launchers on one machine and by ``torchrun`` or SLURM's ``srun`` across
machines (DESIGN.md). :meth:`LaunchEnv.current` reads what they set:

- ``launcher``: ``"torchrun"`` where ``TORCHELASTIC_RUN_ID`` is set (torchrun's agent sets it in every worker, also
  inside an ``srun`` task), else ``"slurm"`` where ``SLURM_JOB_ID`` and ``SLURM_PROCID`` are (an ``srun`` task),
  else None (Lightning's launchers, or a plain process);
- ``restart_count``: torchrun's ``TORCHELASTIC_RESTART_COUNT`` (``--max-restarts``), 0 elsewhere;
- ``local_world_size``: the processes the launcher started on this node (torchrun's ``LOCAL_WORLD_SIZE``, else
  SLURM's ``SLURM_NTASKS_PER_NODE``), None where no launcher says;
- ``run_id``: a name every process of one launch shares, restarts included: ``torchrun-<rdzv id>``, else
  ``slurm-<job id>.<step id>``, else None (a static torchrun rendezvous without ``--rdzv-id`` has the id "none").

The store. Every process of a launch reaches one ``TCPStore`` at ``MASTER_ADDR:MASTER_PORT``: torchrun's agent hosts
it (``TORCHELASTIC_USE_AGENT_STORE=True``), under Lightning's launchers rank 0's process group does, and under
torchrun with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (elastic runs, see below) rank 0's process does, from the
first time any code of this package asks for it (:attr:`LaunchEnv.hosts_store`): the agent then gives every
rendezvous round a fresh port, so each attempt has a store of its own. :func:`connect_store` is the one client to
it; every key lightning_dist puts there follows one scheme,
:meth:`LaunchEnv.key`, ``lightning_dist/<purpose>/attempt_<restart_count>`` for what belongs to one attempt and
``lightning_dist/<purpose>`` for what every attempt of the run shares:

- ``lightning_dist/process_group/attempt_<n>/...``: the default process group's own keys (:func:`attempt_store`);
- ``lightning_dist/watchdog/attempt_<n>/<rank>/{ticks,step,paused}``: the progress watchdog's counters;
- ``lightning_dist/resume/attempt_<n>``: the checkpoint rank 0 chose for ``resume=auto``;
- ``lightning_dist/run_dir``: the run directory's name, given by the first attempt's rank 0 (restarts find it).

Why per attempt: torchrun's c10d rendezvous keeps one store for the agent's life, while torch 2.13 initialises the
default group on it without a per-attempt prefix (it assumes a new store per attempt). After a restart a rank could
read the previous attempt's peer addresses and fail with "Gloo connectFullMesh failed ... Connection refused", a
watchdog could read dead ranks' counters, and a resume choice could be stale.

Why elastic runs need a store per round instead: ``TORCHELASTIC_RESTART_COUNT`` is each agent's own count of the
failures it saw, and a restart for a membership change (a node joining, or a peer's agent re-joining first) does not
count. So under ``--nnodes MIN:MAX`` the ranks of one attempt can disagree on it (a joining node always starts at 0),
and keys named after it would not meet. With ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` every round has a store of its
own at a new port, hosted by its rank 0, and nothing of an earlier attempt can be read (:mod:`lightning_dist.elastic`).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional

import torch.distributed as dist

# what each purpose's keys belong to: one restart attempt (True) or the whole run (False)
PER_ATTEMPT = {"process_group": True, "watchdog": True, "resume": True, "run_dir": False}


class LaunchStoreError(RuntimeError):
    """The launcher's store has no address here, or did not answer in time; the message says which and what to do."""


def _positive(environ: Mapping[str, str], name: str) -> Optional[int]:
    value = environ.get(name, "")
    return int(value) if value.isdigit() and int(value) > 0 else None


@dataclass(frozen=True)
class LaunchEnv:
    """What the launcher of this process says about it (see the module docstring); :meth:`current` reads it."""

    launcher: Optional[str] = None  # "torchrun", "slurm", or None: Lightning's own launchers, or none
    restart_count: int = 0  # torchrun's restart attempt, 0 for the first (and under every other launcher)
    local_world_size: Optional[int] = None  # processes the launcher started on this node; None: no launcher says
    run_id: Optional[str] = None  # shared by every process of the launch, restarts included
    rank: int = 0  # the global rank the launcher gave this process (SLURM_PROCID under srun, else RANK)
    store_address: Optional[tuple[str, int]] = None  # MASTER_ADDR, MASTER_PORT
    agent_store: bool = False  # torchrun's agent hosts the store (TORCHELASTIC_USE_AGENT_STORE=True)
    world_size: Optional[int] = None  # WORLD_SIZE (SLURM_NTASKS under srun), None where no launcher says

    @classmethod
    def current(cls, environ: Optional[Mapping[str, str]] = None) -> LaunchEnv:
        """Read from ``environ`` (default: this process's environment, as it is now)."""
        env = os.environ if environ is None else environ
        torchrun_id = env.get("TORCHELASTIC_RUN_ID")
        in_slurm = "SLURM_JOB_ID" in env and "SLURM_PROCID" in env
        launcher = "torchrun" if torchrun_id is not None else "slurm" if in_slurm else None
        if torchrun_id and torchrun_id != "none":
            run_id: Optional[str] = f"torchrun-{torchrun_id}"
        elif in_slurm:
            run_id = f"slurm-{env['SLURM_JOB_ID']}.{env.get('SLURM_STEP_ID', '0')}"
        else:
            run_id = None
        rank = env.get("SLURM_PROCID" if launcher == "slurm" else "RANK", "0")
        port = env.get("MASTER_PORT", "")
        return cls(
            launcher=launcher,
            restart_count=_positive(env, "TORCHELASTIC_RESTART_COUNT") or 0,
            local_world_size=_positive(env, "LOCAL_WORLD_SIZE") or _positive(env, "SLURM_NTASKS_PER_NODE"),
            run_id=run_id,
            rank=int(rank) if rank.isdigit() else 0,
            store_address=(env["MASTER_ADDR"], int(port)) if env.get("MASTER_ADDR") and port.isdigit() else None,
            agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
            world_size=_positive(env, "SLURM_NTASKS" if launcher == "slurm" else "WORLD_SIZE") if launcher else None,
        )

    def check_num_nodes(self, num_nodes: int) -> None:
        """Under torchrun, ``Trainer(num_nodes=...)`` must be the nodes torchrun runs now; Lightning's own check would
        say only that the product does not match, so say what to pass."""
        if self.launcher == "torchrun" and self.num_nodes is not None and num_nodes != self.num_nodes:
            raise ValueError(
                f"Trainer(num_nodes={num_nodes}) but torchrun runs {self.num_nodes} node(s) now (world size "
                f"{self.world_size}, {self.local_world_size} per node); under torchrun --nnodes MIN:MAX the count "
                "changes between restarts: pass Trainer(num_nodes=lightning_dist.launch.LaunchEnv.current().num_nodes, "
                "devices=LaunchEnv.current().local_world_size) (lightning-dist-train reads both from the launcher)")

    @property
    def num_nodes(self) -> Optional[int]:
        """The nodes this launch has now (world size / processes per node): what ``Trainer(num_nodes=...)`` must say
        for Lightning's check against the launcher. Under ``torchrun --nnodes MIN:MAX`` it changes between restarts."""
        if self.world_size is None or self.local_world_size is None or self.world_size % self.local_world_size:
            return None
        return self.world_size // self.local_world_size

    @property
    def hosts_store(self) -> bool:
        """This process hosts the launch's store: rank 0 under torchrun without its agent's store (the module
        docstring), from the first :func:`connect_store` before the default group exists (ring_ddp gives the group
        that store); where Lightning's own strategies start the group, torch's ``env://`` starts it there."""
        return self.store_per_round and self.rank == 0 and self.store_address is not None

    @property
    def store_per_round(self) -> bool:
        """Every rendezvous round has a store of its own (torchrun without its agent's store): nothing in it outlives
        the attempt, and the attempt needs no number in its keys (the ranks' restart counts may differ)."""
        return self.launcher == "torchrun" and not self.agent_store

    def key(self, purpose: str) -> str:
        """The store key (or key prefix) of ``purpose``: ``lightning_dist/<purpose>/attempt_<n>`` for a purpose of one
        attempt, ``lightning_dist/<purpose>`` for one of the whole run (:data:`PER_ATTEMPT`) and for every purpose
        where the store itself belongs to one attempt (:attr:`store_per_round`)."""
        if purpose not in PER_ATTEMPT:
            raise ValueError(f"store key purpose {purpose!r}: use one of {sorted(PER_ATTEMPT)} (add a new one to "
                             "lightning_dist.launch.PER_ATTEMPT, saying whether it belongs to one restart attempt)")
        base = f"lightning_dist/{purpose}"
        return f"{base}/attempt_{self.restart_count}" if PER_ATTEMPT[purpose] and not self.store_per_round else base


def connect_store(timeout_s: float, env: Optional[LaunchEnv] = None) -> dist.TCPStore:
    """A client to the launcher's store at ``MASTER_ADDR:MASTER_PORT``.

    ``timeout_s`` bounds the connection (torch's own connect retries with a back-off that can overrun it by seconds,
    so it runs on a thread that is waited for ``timeout_s`` at most; a process that exits right after a timeout waits
    for that thread to end) and every later ``get`` or ``wait`` on the client. Raises :class:`LaunchStoreError` when
    there is no address or the store did not answer in time.
    """
    env = env or LaunchEnv.current()
    if env.hosts_store and not dist.is_initialized():  # once the default group is up, its store is there already
        _host_store(env)
    if env.store_address is None:
        raise LaunchStoreError("no launcher store: MASTER_ADDR and MASTER_PORT (a port number) are not set; torchrun, "
                               "Lightning's launchers and Lightning under srun set them for every rank")
    host, port = env.store_address
    box: dict[str, Any] = {}

    def connect() -> None:
        try:
            box["store"] = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s),
                                         wait_for_workers=False)
        except Exception as err:  # noqa: BLE001 - handed to the caller's thread
            box["error"] = err

    # Not a daemon: after a timeout the thread is still inside torch's constructor (its back-off, or a reverse DNS
    # lookup of the address that a resolver can stall for seconds) until torch's own timeout ends it. A daemon thread
    # there when the interpreter exits aborts the process ("terminate called without an active exception", SIGABRT):
    # the interpreter now waits for it instead, at most those few seconds.
    thread = threading.Thread(target=connect, name="lightning_dist-store-connect", daemon=False)
    thread.start()
    thread.join(timeout_s)
    if "store" in box:
        return box["store"]
    why = f"{type(box['error']).__name__}: {box['error']}" if "error" in box else "no answer"
    raise LaunchStoreError(f"the launcher's store at {host}:{port} (MASTER_ADDR:MASTER_PORT) did not answer within "
                           f"{timeout_s:g} s ({why}): the process hosting it (torchrun's agent, or rank 0 under "
                           "Lightning's launchers) is gone or not up yet, or MASTER_ADDR/MASTER_PORT point elsewhere")


_HOSTED: dict[tuple[str, int], dist.TCPStore] = {}  # the store this process hosts (rank 0), kept for its life


def _host_store(env: LaunchEnv) -> None:
    """Start the launch's store in this process (once): rank 0 under torchrun without its agent's store."""
    assert env.store_address is not None
    if env.store_address not in _HOSTED:
        _HOSTED[env.store_address] = dist.TCPStore("0.0.0.0", env.store_address[1], is_master=True,
                                                   wait_for_workers=False)


def attempt_store(timeout: timedelta) -> Optional[dist.Store]:
    """Under torchrun, a view of the launch's store private to this restart attempt (None elsewhere: the default group
    makes its own store), for ``init_process_group(store=...)``; see the module docstring for why."""
    env = LaunchEnv.current()
    if env.launcher != "torchrun" or env.store_address is None:
        return None
    return dist.PrefixStore(env.key("process_group"), connect_store(timeout.total_seconds(), env))
