"""``FaultTolerance``: no hung ranks (stalls included), emergency checkpoints, a clean preemption stop, resume.

What goes wrong without it (2 CPU ranks, gloo, Lightning 2.6): a rank that raises or dies makes its peers fail
within seconds, but a rank that *stalls* leaves the whole job hanging until the collective timeout (30
minutes); Lightning's SIGTERM handler runs a collective inside the signal handler; its "atomic" checkpoint
save copies a temporary file across filesystems without fsync; on a fault nothing is saved.

With ``FaultTolerance()`` (any strategy; every rank):

1. **A rank raises**: it writes an emergency checkpoint of its own state, with no collective
   (``<dirpath>/emergency/emergency-rank{r}-step={N}.ckpt``: a temporary file in the same directory, fsync,
   ``os.replace``, a SHA-256 sidecar; :mod:`lightning_dist.fault.checkpoint`), and the exception goes on to
   Lightning and the launcher with its traceback. If the process has not ended ``exit_grace_s`` seconds later
   (a teardown or ``atexit`` handler stuck on a dead peer), it is ended with exit code 1.
2. **A stall or a vanished peer**: the progress watchdog (:mod:`lightning_dist.fault.watchdog`) sees that no
   rank has made progress for ``timeout_s`` seconds (or that the store or the launcher is gone), logs which
   rank stopped first and at which step, writes this rank's emergency checkpoint and exits with code
   :data:`EXIT_STALL` (124): every rank, the stalled one included, within ``timeout_s`` plus a few polls.
   Checkpoint writes pause the watch (up to ``pause_timeout_s``); wrap other known long operations in
   ``with fault_tolerance.paused("why"):``.
3. **SIGTERM or SIGUSR1** (preemption, SLURM's warning signal): the handler only sets a flag (Lightning's
   handler, which runs a collective inside the signal handler, is replaced for the fit). Every
   ``agree_every_n_steps`` optimizer steps every rank's flag reaches every rank (on ring_ddp's per-step control
   exchange, beside the last gradient bucket; under other strategies in one small all-gather), so every rank
   learns of a stop request at the same step: every rank saves a regular checkpoint
   (``preempted-step=N.ckpt``) and training ends cleanly. If that has not happened ``stop_timeout_s`` after the
   signal (a peer stuck), the rank writes an emergency checkpoint and exits with code 143.
4. **Checkpoints**: every checkpoint the Trainer writes goes through
   :class:`~lightning_dist.fault.checkpoint.AtomicCheckpointIO` (same-directory temporary file, fsync, rename,
   checksum), and carries every rank's random generators (Python, NumPy, torch), restored when training
   resumes from it, so a resumed run draws what an uninterrupted one would have.

Exit codes: 1 (an exception), 124 (the watchdog: no progress, the store or the launcher gone), 143 (a stop
request every rank could not agree on in time). ``lightning-dist-train resume=auto`` resumes from the newest
valid checkpoint, regular or emergency (:mod:`lightning_dist.fault.resume`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
import traceback
import warnings
from typing import Any, Iterator, Optional

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_dist.callbacks.rank_values import RankValues
from lightning_dist.fault import rng
from lightning_dist.fault.checkpoint import AtomicCheckpointIO, save_checkpoint
from lightning_dist.fault.watchdog import Fault, Watchdog, open_store

EXIT_EXCEPTION, EXIT_STALL, EXIT_STOP_TIMEOUT = 1, 124, 143
RNG_KEY = "lightning_dist_rng"  # the checkpoint's entry for every rank's random generators
_SIGNALS = ("SIGTERM", "SIGUSR1")


def _signums() -> list[int]:
    """The numbers of :data:`_SIGNALS` this platform has."""
    return [signum for name in _SIGNALS if (signum := getattr(signal, name, None)) is not None]


class FaultTolerance(Callback):
    """No hung ranks, emergency checkpoints, agreed preemption stops, resumable random state.

    Args:
        timeout_s: seconds without progress on any rank before every rank exits (default 60: raise it if one
            optimizer step or one validation batch can take longer).
        poll_s: seconds between the watchdog's looks at the store.
        pause_timeout_s: the longest a checkpoint write (or another ``paused`` operation) may take.
        agree_every_n_steps: optimizer steps between the ranks' exchanges of stop requests (ring_ddp: on its
            control exchange; other strategies: one tiny all-gather each time).
        stop_timeout_s: seconds after a stop signal before a rank gives up on agreement and exits with an
            emergency checkpoint.
        exit_grace_s: seconds after an exception before a process still running is ended.
        dirpath: where checkpoints go (None: the ModelCheckpoint's directory, else
            ``<default_root_dir>/checkpoints``); emergency checkpoints go to its ``emergency/`` subdirectory.
        watchdog: False turns the progress watchdog off (emergency checkpoints and signals stay).
    """

    def __init__(self, timeout_s: float = 60.0, poll_s: float = 2.0, pause_timeout_s: float = 600.0,
                 agree_every_n_steps: int = 1, stop_timeout_s: float = 60.0, exit_grace_s: float = 15.0,
                 dirpath: Optional[str] = None, watchdog: bool = True) -> None:
        problems = check_settings(timeout_s=timeout_s, poll_s=poll_s, pause_timeout_s=pause_timeout_s,
                                  agree_every_n_steps=agree_every_n_steps, stop_timeout_s=stop_timeout_s,
                                  exit_grace_s=exit_grace_s)
        if problems:
            raise ValueError("FaultTolerance: " + "; ".join(problems))
        self.timeout_s, self.poll_s, self.pause_timeout_s = float(timeout_s), float(poll_s), float(pause_timeout_s)
        self.agree_every_n_steps, self.stop_timeout_s = agree_every_n_steps, float(stop_timeout_s)
        self.exit_grace_s, self.dirpath, self.use_watchdog = float(exit_grace_s), dirpath, watchdog
        self.emergency_checkpoints: list[str] = []  # written by this rank in this process
        self.stopped_by: Optional[str] = None  # "SIGTERM from rank 1" once an agreed stop happened
        self.stop_checkpoint: Optional[str] = None
        self._trainer: Any = None
        self._watchdog: Optional[Watchdog] = None
        self._signal: Optional[int] = None  # set by the handler: the only thing it does
        self._signal_at = 0.0
        self._previous_handlers: dict[int, Any] = {}  # what _release puts back: the handlers from before the fit
        self._original_handlers: dict[int, Any] = {}
        self._handled = False
        self._emergency = False  # dumping an emergency checkpoint: no collective anywhere
        self._emergency_done: Optional[threading.Event] = None  # made in setup, set when that write has ended
        self._values = RankValues("ft", ("signal",))  # every rank's stop request, every N steps
        self._fault_lock: Optional[threading.Lock] = None  # made in setup: the callback is pickled for spawn

    # -- set-up and teardown --------------------------------------------------------------------------------
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._trainer = trainer  # set only in a rank's process (a fork or spawn launcher's parent is not a rank)
        self._handled = False
        self._fault_lock = threading.Lock()
        self._emergency_done = threading.Event()
        # before Lightning registers its own (Lightning restores these at its teardown, which runs before ours)
        self._original_handlers = {signum: signal.getsignal(signum) for signum in _signums()}
        self._values.setup(trainer, self.agree_every_n_steps)
        if type(trainer.strategy.checkpoint_io) is TorchCheckpointIO:  # Lightning's default: make it atomic
            trainer.strategy.checkpoint_io = AtomicCheckpointIO()
        if isinstance(trainer.strategy.checkpoint_io, AtomicCheckpointIO):
            trainer.strategy.checkpoint_io.guard = self.paused  # a long write is not a stall

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.dirpath is None:  # every ModelCheckpoint's dirpath is resolved by now
            callback = trainer.checkpoint_callback
            self.dirpath = getattr(callback, "dirpath", None) or os.path.join(trainer.default_root_dir, "checkpoints")
        # Lightning's fork and spawn launchers run the fit in their children without its exception handling (the
        # parent calls on_exception, in a process that is not a rank): catch what escapes the fit loop here
        loop, run = trainer.fit_loop, trainer.fit_loop.run

        def guarded_run(*args: Any, **kwargs: Any) -> Any:
            try:
                return run(*args, **kwargs)
            except BaseException as exception:
                self._handle_exception(trainer, exception)
                raise

        loop.run = guarded_run
        if self.use_watchdog and trainer.world_size > 1:
            attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            self._watchdog = Watchdog(open_store(max(self.poll_s * 2, 5.0)), trainer.global_rank, trainer.world_size,
                                      f"lightning_dist/ft/{attempt}", self.timeout_s, self.poll_s,
                                      self.pause_timeout_s, self._on_fault, check=self._stop_overdue)
            self._watchdog.start()

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # after Lightning registered its own handlers (just before the fit loop), so ours are the ones in force
        if threading.current_thread() is threading.main_thread():
            for signum in _signums():
                in_force = signal.signal(signum, self._on_signal)
                self._previous_handlers[signum] = self._original_handlers.get(signum, in_force)
        self._tick(trainer)

    def _release(self) -> None:
        for signum, handler in self._previous_handlers.items():
            with contextlib.suppress(ValueError, TypeError):
                signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        self._previous_handlers = {}
        if self._watchdog is not None:
            self._watchdog.stop()
            self._watchdog = None

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._release()
            self._values.teardown(trainer)
            trainer.fit_loop.__dict__.pop("run", None)  # the class's own run again
            self._trainer = None

    # -- progress ---------------------------------------------------------------------------------------------
    def _tick(self, trainer: pl.Trainer) -> None:
        if self._watchdog is not None:
            self._watchdog.tick(trainer.global_step)

    @contextlib.contextmanager
    def paused(self, what: str) -> Iterator[None]:
        """Wrap a known long operation (all ranks' or one's) so that the watchdog waits for it."""
        if self._watchdog is None:
            yield
            return
        with self._watchdog.paused(what):
            yield

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
        if rows is None:
            return  # not an agreement step: the same on every rank
        senders = [r for r, (value,) in enumerate(rows) if value]
        if senders:
            name = signal.Signals(int(rows[senders[0]][0])).name
            self._stop(trainer, f"{name} on rank{'s' if len(senders) > 1 else ''} {', '.join(map(str, senders))}")

    # -- signals: a flag, then agreement at a step every rank shares ------------------------------------------
    def _on_signal(self, signum: int, frame: Any) -> None:
        if self._signal is None:
            self._signal, self._signal_at = signum, time.monotonic()

    def _request(self) -> list[float]:
        """This rank's stop request: the signal's number, 0 for none."""
        return [float(self._signal or 0)]

    def _stop(self, trainer: pl.Trainer, requested: str) -> None:
        path = os.path.join(self.dirpath or trainer.default_root_dir, f"preempted-step={trainer.global_step}.ckpt")
        rank_zero_warn(f"FaultTolerance: {requested}: every rank stops at global step {trainer.global_step} after "
                       f"saving {path}")
        with self.paused("the preemption checkpoint"):
            trainer.save_checkpoint(path)  # every rank calls it; rank zero writes (atomically)
        self.stopped_by, self.stop_checkpoint = requested, path
        trainer.should_stop = True

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
        self._write_emergency(trainer, f"{type(exception).__name__}: {exception}")
        if self._watchdog is not None:  # the process is ending; the flag-only signal handlers stay (Lightning's
            self._watchdog.stop()       # would run a collective against the dead peer when the launcher SIGTERMs)
            self._watchdog = None
        if trainer.world_size > 1:
            _exit_later(self.exit_grace_s, EXIT_EXCEPTION)  # if a teardown or atexit handler hangs on a dead peer

    def _on_fault(self, fault: Fault) -> None:
        """On the watchdog thread: the job is stuck (or its store or launcher is gone). Save, then end."""
        code = EXIT_STOP_TIMEOUT if fault.kind == "stop_timeout" else EXIT_STALL
        trainer = self._trainer
        if trainer is not None:
            if self._emergency and self._emergency_done is not None:
                # the training thread is writing its own (it failed first): let that write finish, not cut it off
                self._emergency_done.wait(self.pause_timeout_s)
            _exit_later(max(self.exit_grace_s, 10.0), code)  # the emergency write itself must not hang us
            self._write_emergency(trainer, f"watchdog: {fault.message}")
        os._exit(code)

    def _stop_overdue(self) -> Optional[Fault]:
        """Polled by the watchdog: a stop signal that has waited longer than ``stop_timeout_s`` for agreement."""
        if self._signal is None or self.stopped_by is not None:
            return None
        waited = time.monotonic() - self._signal_at
        if waited <= self.stop_timeout_s:
            return None
        name = signal.Signals(self._signal).name
        return Fault("stop_timeout", f"{name} arrived {waited:.0f} s ago and the ranks have not agreed to stop "
                                     f"(stop_timeout_s={self.stop_timeout_s:.0f}): this rank saves its own state and "
                                     "exits")

    def _write_emergency(self, trainer: pl.Trainer, reason: str) -> Optional[str]:
        """This rank's own state, no collective: model, optimizer, loops, callbacks, compressor, generators."""
        with self._fault_lock or contextlib.nullcontext():
            if self._emergency:
                return None
            self._emergency = True
        rank = trainer.global_rank
        path = os.path.join(self.dirpath or os.path.join(trainer.default_root_dir, "checkpoints"), "emergency",
                            f"emergency-rank{rank}-step={trainer.global_step}.ckpt")
        try:
            checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
            local = getattr(trainer.strategy, "local_checkpoint_state", None)
            if callable(local):
                checkpoint.update(local())
            os.makedirs(os.path.dirname(path), exist_ok=True)
            save_checkpoint(checkpoint, path, meta={"kind": "emergency", "rank": rank, "reason": reason,
                                                    "world_size": trainer.world_size})
            self.emergency_checkpoints.append(path)
            print(f"[lightning_dist] rank {rank}: emergency checkpoint {path} ({reason})", file=sys.stderr, flush=True)
            return path
        except Exception as err:  # noqa: BLE001 - the process is failing already: say why the save failed too
            print(f"[lightning_dist] rank {rank}: the emergency checkpoint could not be written: "
                  f"{type(err).__name__}: {err}", file=sys.stderr, flush=True)
            return None
        finally:
            if self._emergency_done is not None:
                self._emergency_done.set()

    # -- random generators in every checkpoint ------------------------------------------------------------------
    @override
    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        mine = rng.capture()
        world, rank = trainer.world_size, trainer.global_rank
        if self._emergency or world == 1 or not dist.is_initialized():
            ranks: list[Any] = [None] * world
            ranks[rank] = mine
        else:  # every rank is here (Lightning dumps the checkpoint on every rank): gather them
            ranks = [None] * world
            group = getattr(trainer.strategy, "control_group", None)
            dist.all_gather_object(ranks, mine, group=group)
        checkpoint[RNG_KEY] = {"world_size": world, "ranks": ranks}
        self._tick(trainer)

    @override
    def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        saved = checkpoint.get(RNG_KEY)
        if saved is None:
            return
        if saved["world_size"] != trainer.world_size or saved["ranks"][trainer.global_rank] is None:
            warnings.warn(f"rank {trainer.global_rank}: the checkpoint holds no random-generator state for this rank "
                          f"(written by {saved['world_size']} ranks, or an emergency checkpoint of another rank): "
                          "its generators continue from the seed, so the run is not bit-identical to an "
                          "uninterrupted one", stacklevel=2)
            return
        # now, before the fit loop creates its data iterator (which draws a seed from torch's generator, as the
        # uninterrupted run's did after this checkpoint); the sanity check in between runs under isolate_rng
        rng.restore(saved["ranks"][trainer.global_rank])

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"emergency_checkpoints": list(self.emergency_checkpoints), "stopped_by": self.stopped_by}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.stopped_by = None  # a resumed run is not stopped; what stopped the last one is in its log
        previous = state_dict.get("stopped_by")
        if previous:
            rank_zero_info(f"FaultTolerance: the run being resumed had stopped on {previous}")


def _exit_later(seconds: float, code: int) -> None:
    """End the process with ``code`` in ``seconds`` unless it has ended by then (a daemon thread)."""
    def end() -> None:
        time.sleep(seconds)
        print(f"[lightning_dist] the process did not end within {seconds:.0f} s of the fault; ending it "
              f"(exit code {code})", file=sys.stderr, flush=True)
        os._exit(code)

    threading.Thread(target=end, name="lightning_dist-exit", daemon=True).start()


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
    every = settings.get("agree_every_n_steps")
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        problems.append(f"agree_every_n_steps={every!r} must be an integer >= 1")
    return problems
