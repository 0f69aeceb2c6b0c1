"""``FaultTolerance``: no hung ranks (stalls included), emergency checkpoints, a clean preemption stop, resume.

What goes wrong without it (2 CPU ranks, gloo, Lightning 2.6): a rank that raises or dies makes its peers fail
within seconds, but a rank that *stalls* leaves the whole job hanging until the collective timeout (30
minutes); Lightning's SIGTERM handler runs a collective inside the signal handler; its "atomic" checkpoint
save copies a temporary file across filesystems without fsync; on a fault nothing is saved.

With ``FaultTolerance()`` (any strategy; every rank):

1. **A rank raises**: it writes an emergency checkpoint of its own state, with no collective
   (``<dirpath>/emergency/emergency-rank{r}-step={N}.ckpt``: a temporary file in the same directory, fsync,
   ``os.replace``, a SHA-256 sidecar; :mod:`lightning_dist.fault.emergency`), and the exception goes on to
   Lightning and the launcher with its traceback. If the process has not ended ``exit_grace_s`` seconds later
   (a teardown or ``atexit`` handler stuck on a dead peer), it is ended with exit code 1. Under Lightning's popen
   launcher, whose rank 0 kills every rank within 5 s of one failing, that kill waits for the ranks' own ends
   (:func:`lightning_dist.upstream.defer_observer_kill`).
2. **A stall or a vanished peer**: the progress watchdog (:mod:`lightning_dist.fault.watchdog`) sees that no
   rank has made progress for ``timeout_s`` seconds (or that the store or the launcher is gone), logs which
   rank stopped first and at which step, writes this rank's emergency checkpoint and exits with code
   :data:`EXIT_STALL` (124): every rank, the stalled one included, within ``timeout_s`` plus a few polls.
   Checkpoint writes pause the watch (up to ``pause_timeout_s``), and so do the strategy's long collectives while
   every rank is inside one (a sync driver's sync: ``sync=DiLoCo``'s, a model's worth of bytes over slow links, through
   :meth:`~lightning_dist.strategy.features.RingFeatures.long_collective`): a rank that stalled outside it is still
   named after ``timeout_s``. Wrap other known long operations in ``with fault_tolerance.paused("why"):``.
3. **SIGTERM or SIGUSR1** (preemption, SLURM's warning signal): the handler only sets a flag
   (:mod:`lightning_dist.fault.signals`; Lightning's handler, which runs a collective inside the signal handler, is
   replaced for the fit). On every step where the workers meet (every step when syncing every step; under a sync
   driver its sync steps: ``sync=DiLoCo(every=H)`` every H steps), or every ``agree_every_n_steps`` optimizer steps
   when given, every rank's flag reaches every rank (on ring_ddp's per-step exchange, beside the last gradient bucket;
   under other strategies in one small all-gather, every step by default), so every rank learns of a stop request at
   the same step: every rank saves a regular checkpoint (``preempted-step=N.ckpt``) and training ends cleanly. If that
   has not happened ``stop_timeout_s`` after the signal (a peer stuck, or under DiLoCo more than that until the next
   sync), the rank writes an emergency checkpoint and exits with code 143.
   **SLURM's requeue**: where Lightning would requeue the job on that signal (its ``SLURMEnvironment`` with
   ``auto_requeue``, the requeue signal SIGUSR1 by default), rank zero runs ``scontrol requeue <job id>`` once the
   agreed checkpoint is written (:func:`lightning_dist.fault.signals.requeue_slurm_job`), as Lightning's own handler
   would have; the requeued job resumes with ``resume=auto``.
   **A notice to some hosts only** (an elastic run under torchrun, with :class:`ElasticTraining`): the signalled
   hosts leave and the others go on at the smaller size (:mod:`lightning_dist.fault.leave`). The same agreed stop
   and checkpoint, then the leaving hosts' ranks exit with 76 after their torchrun agent has SIGTERM (so it leaves
   the rendezvous without closing it), and every other rank exits with 75, on which its agent restarts it; the new
   attempt resumes from that checkpoint. A notice can also be a file that appears or a command that succeeds
   (``notice=``, polled every ``notice_poll_s``): a cloud's metadata endpoint read by a command of the user's.
4. **Checkpoints**: every checkpoint the Trainer writes goes through
   :class:`~lightning_dist.fault.checkpoint.AtomicCheckpointIO` (same-directory temporary file, fsync, rename,
   checksum), and carries every rank's random generators (Python, NumPy, torch; :mod:`lightning_dist.fault.rng`),
   restored when training resumes from it, so a resumed run draws what an uninterrupted one would have.

Exit codes: 1 (an exception), 124 (the watchdog: no progress, the store or the launcher gone), 143 (a stop
request every rank could not agree on in time), 75 (another host left: restart at the smaller size), 76 (this host
left on notice). ``lightning-dist-train resume=auto`` resumes from the newest
valid checkpoint, regular or emergency (:mod:`lightning_dist.fault.resume`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
import traceback
from typing import Any, Callable, Iterator, Optional

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_dist.callbacks.rank_values import RankValues
from lightning_dist.fault import rng
from lightning_dist.fault.checkpoint import AtomicCheckpointIO, checkpoint_dir
from lightning_dist.fault.emergency import (
    EXIT_EXCEPTION,
    EXIT_STALL,
    EXIT_STOP_TIMEOUT,
    PEER_GONE_GRACE_S,
    EmergencyCheckpoint,
    exit_later,
    guard_fit_loop,
    peer_gone,
    unguard_fit_loop,
)
from lightning_dist.fault.leave import Notice, StopDecision, decide, exit_when_main_ends, signal_agent
from lightning_dist.fault.signals import StopSignals, requeue_signal, requeue_slurm_job
from lightning_dist.fault.watchdog import Fault, Watchdog, open_store
from lightning_dist.launch import LaunchEnv
from lightning_dist.strategy import features_of
from lightning_dist.upstream import defer_observer_kill, launcher_observer


class FaultTolerance(Callback):
    """No hung ranks, emergency checkpoints, agreed preemption stops, resumable random state.

    Args:
        timeout_s: seconds without progress on any rank before every rank exits (default 60: raise it if one
            optimizer step or one validation batch can take longer).
        poll_s: seconds between the watchdog's looks at the store.
        pause_timeout_s: the longest a checkpoint write, a sync (or another ``paused`` operation) may take.
        agree_every_n_steps: optimizer steps between the ranks' exchanges of stop requests (ring_ddp: on its
            per-step exchange; other strategies: one tiny all-gather each time); None: on every step where the workers
            meet (every step, and under a sync driver such as ``sync=DiLoCo(every=H)`` its sync steps only).
        stop_timeout_s: seconds after a stop signal before a rank gives up on agreement and exits with an
            emergency checkpoint.
        exit_grace_s: seconds after an exception before a process still running is ended.
        dirpath: where checkpoints go (None: the ModelCheckpoint's directory, else
            ``<default_root_dir>/checkpoints``); emergency checkpoints go to its ``emergency/`` subdirectory.
        watchdog: False turns the progress watchdog off (emergency checkpoints and signals stay).
        notice: a notice that does not come as a signal: a file path (it fires once the file exists) or
            ``"cmd:<command>"`` (it fires when the command exits 0); None: signals only.
        notice_poll_s: seconds between looks at ``notice``.
        settle_s: in an elastic run, how long the ranks wait, once a stop request has appeared, for the other hosts'
            before the hosts that asked leave alone: a stop of the whole job (SLURM's preemption, the SIGTERM torchrun's
            agents send every worker when a host joins) reaches every host within seconds, a notice to one host never.
    """

    def __init__(self, timeout_s: float = 60.0, poll_s: float = 2.0, pause_timeout_s: float = 600.0,
                 agree_every_n_steps: Optional[int] = None, stop_timeout_s: float = 60.0, exit_grace_s: float = 15.0,
                 dirpath: Optional[str] = None, watchdog: bool = True, notice: Optional[str] = None,
                 notice_poll_s: float = 5.0, settle_s: float = 3.0) -> None:
        problems = check_settings(timeout_s=timeout_s, poll_s=poll_s, pause_timeout_s=pause_timeout_s,
                                  agree_every_n_steps=agree_every_n_steps, stop_timeout_s=stop_timeout_s,
                                  exit_grace_s=exit_grace_s, notice=notice, notice_poll_s=notice_poll_s,
                                  settle_s=settle_s)
        if problems:
            raise ValueError("FaultTolerance: " + "; ".join(problems))
        self.timeout_s, self.poll_s, self.pause_timeout_s = float(timeout_s), float(poll_s), float(pause_timeout_s)
        self.agree_every_n_steps, self.stop_timeout_s = agree_every_n_steps, float(stop_timeout_s)
        self.exit_grace_s, self.dirpath, self.use_watchdog = float(exit_grace_s), dirpath, watchdog
        self.stopped_by: Optional[str] = None  # "SIGTERM on rank 1" once an agreed stop happened
        self.stop_checkpoint: Optional[str] = None
        self._trainer: Any = None  # set only in a rank's process (a fork or spawn launcher's parent is not a rank)
        self._watchdog: Optional[Watchdog] = None
        self._signals = StopSignals()
        self._emergency = EmergencyCheckpoint()
        self._handled = False  # this fit's exception was handled (by the fit loop's guard or on_exception)
        # every rank's stop request (a signal's number, a notice), its host, and how long it has seen a request
        self._values = RankValues("ft", ("signal", "notice", "node", "waited"))
        self._notice = Notice(notice, notice_poll_s) if notice else None
        self.settle_s = float(settle_s)
        self._node = 0  # this rank's host (node rank), set up per fit
        self._requeue_on: Optional[int] = None  # the signal on which Lightning would requeue this SLURM job, if any
        self._undo_defer: Optional[Callable[[], None]] = None  # gives the popen launcher's observer its kill back
        self._requested_at: Optional[float] = None  # when this rank first saw a stop request on the exchange
        self.decision: Optional[StopDecision] = None  # who left at the agreed stop, once there was one

    @property
    def emergency_checkpoints(self) -> list[str]:
        """The emergency checkpoints this rank wrote in this process."""
        return self._emergency.paths

    # -- set-up and teardown --------------------------------------------------------------------------------
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._trainer, self._handled, self._node, self.decision = trainer, False, trainer.node_rank, None
        self._requested_at = None
        self._emergency.arm()
        self._signals.remember()
        self._values.setup(trainer, self.agree_every_n_steps or 1, when_workers_meet=self.agree_every_n_steps is None)
        self._requeue_on = requeue_signal(trainer.strategy)  # the signal Lightning would requeue a SLURM job on
        # rank 0 of a popen launch: Lightning kills every rank within 5 s of one failing, which would cut the
        # survivors' emergency saves short (once, on a loaded machine, rank 0 -9 right after its save instead of 1):
        # the kill waits for the bound within which every rank ends itself
        observer = launcher_observer()
        if observer is not None:
            self._undo_defer = defer_observer_kill(observer, self.timeout_s + 3 * self.poll_s + self.exit_grace_s)
        features = features_of(trainer.strategy)
        if features is not None:
            features.collective_guard = self._collective_paused  # a sync driver's long sync is not a stall
        if type(trainer.strategy.checkpoint_io) is TorchCheckpointIO:  # Lightning's default: make it atomic
            trainer.strategy.checkpoint_io = AtomicCheckpointIO()
        if isinstance(trainer.strategy.checkpoint_io, AtomicCheckpointIO):
            trainer.strategy.checkpoint_io.guard = self.paused  # a long write is not a stall
            trainer.strategy.checkpoint_io.kind = "regular"

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        guard_fit_loop(trainer, lambda exception: self._handle_exception(trainer, exception))
        if self.use_watchdog and trainer.world_size > 1:
            store, prefix = open_store(max(self.poll_s * 2, 5.0)), LaunchEnv.current().key("watchdog")
            self._watchdog = Watchdog(store, trainer.global_rank, trainer.world_size, prefix, self.timeout_s,
                                      self.poll_s, self.pause_timeout_s, self._on_fault, check=self._stop_overdue)
            self._watchdog.start()

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._signals.install()
        if self._notice is not None:
            self._notice.start()
        self._tick(trainer)

    def _release(self) -> None:
        self._signals.restore()
        if self._notice is not None:
            self._notice.stop()
        self._stop_watchdog()

    def _stop_watchdog(self) -> None:
        if self._watchdog is not None:
            self._watchdog.stop()
            self._watchdog = None

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._release()
            self._values.teardown(trainer)
            features = features_of(trainer.strategy)
            if features is not None and features.collective_guard == self._collective_paused:
                features.collective_guard = None
            unguard_fit_loop(trainer)
            if self._undo_defer is not None:
                self._undo_defer()
                self._undo_defer = None
            self._trainer = None

    # -- progress ---------------------------------------------------------------------------------------------
    def _tick(self, trainer: pl.Trainer) -> None:
        if self._watchdog is not None:
            self._watchdog.tick(trainer.global_step)

    @contextlib.contextmanager
    def paused(self, what: str, every_rank: bool = False) -> Iterator[None]:
        """Wrap a known long operation (all ranks' or one's) so that the watchdog waits for it; ``every_rank``: a
        collective every rank takes part in, waited for only while every rank is inside one (a rank that stalled
        before it is still a stall)."""
        if self._watchdog is None:
            yield
            return
        with self._watchdog.paused(what, every_rank=every_rank):
            yield

    def _collective_paused(self, what: str) -> contextlib.AbstractContextManager[None]:
        return self.paused(what, every_rank=True)

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self._tick(trainer)
        self._values.fill(trainer, self._request)

    @override
    def on_before_backward(self, trainer: pl.Trainer, *args: Any) -> None:
        self._tick(trainer)

    @override
    def on_after_backward(self, trainer: pl.Trainer, *args: Any) -> None:
        self._tick(trainer)

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, *args: Any) -> None:
        self._tick(trainer)
        self._values.capture(trainer)

    @override
    def on_validation_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self._tick(trainer)

    @override
    def on_validation_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self._tick(trainer)

    @override
    def on_validation_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self._tick(trainer)

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self._tick(trainer)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self._tick(trainer)
        rows = self._values.collect(trainer, self._request)
        if rows is None or self.stopped_by is not None:
            return  # not an agreement step (the same on every rank), or stopped already (min_steps holds the loop)
        signums, notices, nodes, waits = zip(*rows)
        decision = decide([bool(s or n) for s, n in zip(signums, notices)], [int(n) for n in nodes],
                          elastic=_elastic(trainer))
        if decision is None:
            return
        if self._requested_at is None:
            self._requested_at = time.monotonic()
        # some hosts only: wait (by the waits every rank reported, the same rows everywhere) for the others' requests,
        # but not past the fit's last step (the survivors must still exit so that their agents restart them)
        if decision.whole_job or max(waits) >= self.settle_s or _last_step(trainer):
            requeue = decision.whole_job and self._requeue_on is not None and self._requeue_on in map(int, signums)
            self._stop(trainer, _describe(rows, decision), decision, requeue)

    # -- stop signals: a flag, then agreement at a step every rank shares ---------------------------------------
    def _request(self) -> list[float]:
        """This rank's stop request: the signal's number (0 for none), whether a notice fired, its host, and the seconds
        since it first saw a request of any rank's."""
        noticed = self._notice is not None and self._notice.fired
        waited = time.monotonic() - self._requested_at if self._requested_at is not None else 0.0
        return [float(self._signals.signum or 0), float(noticed), float(self._node), waited]

    def _stop(self, trainer: pl.Trainer, requested: str, decision: StopDecision, requeue: bool = False) -> None:
        path = os.path.join(checkpoint_dir(trainer, self.dirpath), f"preempted-step={trainer.global_step}.ckpt")
        after = "" if decision.whole_job else (f"; host(s) {list(decision.leaving_hosts)} leave, the others restart "
                                               "at the smaller size from it")
        rank_zero_warn(f"FaultTolerance: {requested}: every rank stops at global step {trainer.global_step} after "
                       f"saving {path}{after}")
        with self.paused("the preemption checkpoint"):
            trainer.save_checkpoint(path)  # every rank calls it; rank zero writes (atomically)
        self.stopped_by, self.stop_checkpoint, self.decision = requested, path, decision
        if requeue and trainer.is_global_zero:  # what Lightning's SLURM handler, which ours replaced, would have done
            requeued, line = requeue_slurm_job()
            (rank_zero_info if requeued else rank_zero_warn)(f"FaultTolerance: {line}")
        trainer.should_stop = True
        if isinstance(trainer.strategy.checkpoint_io, AtomicCheckpointIO):
            # Lightning will call the stopped epoch finished: what it writes from now on must not be resumed from
            trainer.strategy.checkpoint_io.kind = "after_stop"
        code = decision.exit_code(self._node)
        if code is None:
            return  # the whole job ends: every rank exits as it would
        if decision.leaves(self._node) and self._signals.signum is None:
            signal_agent(f"host {self._node} leaves on {self._notice.detail if self._notice else 'notice'}")
        exit_when_main_ends(code)  # after Lightning's and every callback's teardown

    def _stop_overdue(self) -> Optional[Fault]:
        """Polled by the watchdog: a stop signal that has waited longer than ``stop_timeout_s`` for agreement."""
        if self._signals.signum is None or self.stopped_by is not None:
            return None
        waited = self._signals.waited_s()
        if waited <= self.stop_timeout_s:
            return None
        return Fault("stop_timeout", f"{self._signals.name} arrived {waited:.0f} s ago and the ranks have not agreed "
                                     f"to stop (stop_timeout_s={self.stop_timeout_s:.0f}): this rank saves its own "
                                     "state and exits")

    # -- faults ---------------------------------------------------------------------------------------------
    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if self._trainer is trainer:  # in a rank (not a launcher's parent), unless the fit loop's guard saw it first
            self._handle_exception(trainer, exception)

    def _handle_exception(self, trainer: pl.Trainer, exception: BaseException) -> None:
        if self._handled:
            return
        self._handled = True
        if isinstance(exception, KeyboardInterrupt) and trainer.world_size == 1:
            self._release()
            return
        text = "".join(traceback.format_exception(type(exception), exception, exception.__traceback__))
        print(f"[lightning_dist] rank {trainer.global_rank} failed at global step {trainer.global_step}:\n{text}",
              file=sys.stderr, flush=True)
        self._emergency.write(trainer, self.dirpath, f"{type(exception).__name__}: {exception}",
                              _strategy_entry(trainer))
        # the process is ending; the flag-only signal handlers stay (Lightning's would run a collective against the
        # dead peer when the launcher sends SIGTERM)
        self._stop_watchdog()
        if trainer.world_size > 1:
            # if a teardown or atexit handler hangs on a dead peer. When a peer is known gone, nothing left to do can
            # finish with it: a survivor whose collective failed because another rank's watchdog ended it (a host cut
            # off) spent exit_grace_s in the comm worker's join and the process group's teardown, waiting on the cut
            # host (the elastic benchmark's slow mode of cuts: 36-38 s against 22-24 s)
            grace = min(self.exit_grace_s, PEER_GONE_GRACE_S) if peer_gone(exception) else self.exit_grace_s
            exit_later(grace, EXIT_EXCEPTION)

    def _on_fault(self, fault: Fault) -> None:
        """On the watchdog thread: the job is stuck (or its store or launcher is gone). Save, then end."""
        code = EXIT_STOP_TIMEOUT if fault.kind == "stop_timeout" else EXIT_STALL
        trainer = self._trainer
        if trainer is not None:
            self._emergency.wait(self.pause_timeout_s)  # the training thread failed first and is writing its own
            exit_later(max(self.exit_grace_s, 10.0), code)  # the emergency write itself must not hang us
            self._emergency.write(trainer, self.dirpath, f"watchdog: {fault.message}", _strategy_entry(trainer))
        os._exit(code)

    # -- random generators in every checkpoint ------------------------------------------------------------------
    @override
    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        # every rank is here (Lightning dumps the checkpoint on every rank) unless this is an emergency write
        gather = not self._emergency.writing and trainer.world_size > 1 and dist.is_initialized()
        features = features_of(trainer.strategy)
        checkpoint[rng.RNG_KEY] = rng.checkpoint_entry(trainer.global_rank, trainer.world_size, gather,
                                                       features.exchange_group if features is not None else None,
                                                       features.identities if features is not None else None)
        self._tick(trainer)

    @override
    def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        # now, before the fit loop creates its data iterator (which draws a seed from torch's generator, as the
        # uninterrupted run's did after this checkpoint); the sanity check in between runs under isolate_rng
        if rng.RNG_KEY in checkpoint:
            features = features_of(trainer.strategy)
            rng.restore_entry(checkpoint[rng.RNG_KEY], trainer.global_rank, trainer.world_size,
                              features.identities if features is not None else None)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"emergency_checkpoints": list(self.emergency_checkpoints), "stopped_by": self.stopped_by}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.stopped_by = None  # a resumed run is not stopped; what stopped the last one is in its log
        previous = state_dict.get("stopped_by")
        if previous:
            rank_zero_info(f"FaultTolerance: the run being resumed had stopped on {previous}")


def _elastic(trainer: pl.Trainer) -> bool:
    """Whether the run can go on at another size without the hosts that leave: an elastic run (ElasticTraining set
    every rank's identity on the strategy's seam) under torchrun, whose agents restart the others."""
    features = features_of(trainer.strategy)
    return features is not None and features.identities is not None and LaunchEnv.current().launcher == "torchrun"


def _last_step(trainer: pl.Trainer) -> bool:
    """Whether the step that just ended is the fit's last (``max_steps``, or the last batch of ``max_epochs``); the
    same on every rank."""
    if 0 <= trainer.max_steps <= trainer.global_step:
        return True
    return bool(trainer.is_last_batch and trainer.max_epochs is not None and trainer.max_epochs >= 0
                and trainer.current_epoch + 1 >= trainer.max_epochs)


def _describe(rows: list[list[float]], decision: StopDecision) -> str:
    """``SIGTERM on rank 2 (host 2)``: what asked to stop, where."""
    asked = decision.requested_by
    signums = [int(rows[r][0]) for r in asked if rows[r][0]]
    what = signal.Signals(signums[0]).name if signums else "a notice"
    hosts = sorted({int(rows[r][2]) for r in asked})
    return (f"{what} on rank{'s' if len(asked) > 1 else ''} {', '.join(map(str, asked))} "
            f"(host{'s' if len(hosts) > 1 else ''} {', '.join(map(str, hosts))})")


def _strategy_entry(trainer: pl.Trainer) -> Optional[Callable[[], dict[str, Any]]]:
    """What the strategy adds to this rank's emergency checkpoint (its compressor state, no collective), or None
    under a strategy without the seam."""
    features = features_of(trainer.strategy)
    return None if features is None else features.local_checkpoint_state


def check_settings(**settings: Any) -> list[str]:
    """What is wrong with FaultTolerance's arguments (empty: nothing), each with its fix."""
    problems = []
    for name in ("timeout_s", "poll_s", "pause_timeout_s", "stop_timeout_s", "exit_grace_s"):
        value = settings.get(name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            problems.append(f"{name}={value!r} must be a positive number of seconds")
    timeout, poll = settings.get("timeout_s"), settings.get("poll_s")
    if not problems and poll * 2 > timeout:
        problems.append(f"poll_s={poll} must be at most half of timeout_s={timeout} (the watchdog needs several "
                        "looks within the timeout)")
    settle = settings.get("settle_s", 3.0)
    if isinstance(settle, bool) or not isinstance(settle, (int, float)) or settle < 0:
        problems.append(f"settle_s={settle!r} must be a number of seconds >= 0")
    notice, notice_poll = settings.get("notice"), settings.get("notice_poll_s", 5.0)
    if notice is not None and not (isinstance(notice, str) and notice.strip() and notice.strip() != "cmd:"):
        problems.append(f"notice={notice!r} must be a file path to watch or 'cmd:<command>' to poll, or None")
    if isinstance(notice_poll, bool) or not isinstance(notice_poll, (int, float)) or not notice_poll > 0:
        problems.append(f"notice_poll_s={notice_poll!r} must be a positive number of seconds")
    every = settings.get("agree_every_n_steps")
    if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
        problems.append(f"agree_every_n_steps={every!r} must be an integer >= 1, or None for every step where the "
                        "workers meet")
    return problems
