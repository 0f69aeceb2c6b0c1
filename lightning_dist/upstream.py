"""Every private name of Lightning and torch that lightning_dist reaches, in this one module.

The package builds on hooks Lightning keeps private: the strategy's DDP hook registration and launcher choice, the
profiler's construction, the name of the hook running, the training loop's SIGTERM broadcast, the trainer's results
and checkpoint connector, the popen launcher's kill of every rank. A Lightning release may move any of them, hence the
``lightning>=2.6,<2.7`` pin (``pyproject.toml``; docs/strategy.md lists these names). Everything else in the package
reaches them here, under names of its own: :class:`DDPBase` and :class:`ProfilerBase` turn the private methods a
subclass overrides into public ones, the functions below read and set the private attributes.
``tests/test_upstream.py`` checks that every name this module reaches still exists where it looks, so an upgrade fails
that test, by name, before it fails a fit.
"""

from __future__ import annotations

import contextlib
import threading
import time
from datetime import timedelta
from typing import Any, Callable, Iterator, Optional

import torch
from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver
from lightning.fabric.utilities.distributed import _init_dist_connection
from lightning.pytorch.profilers import PyTorchProfiler
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher

# Every private name reached below: (its owner, as a dotted path, the name). An instance attribute's owner is the class
# whose instances carry it. tests/test_upstream.py checks each on a live object; docs/strategy.md names each.
REACHED: tuple[tuple[str, str], ...] = (
    ("lightning.pytorch.strategies.DDPStrategy", "_register_ddp_hooks"),
    ("lightning.pytorch.strategies.DDPStrategy", "_configure_launcher"),
    ("lightning.pytorch.strategies.DDPStrategy", "_get_process_group_backend"),
    ("lightning.pytorch.strategies.DDPStrategy", "_process_group_backend"),
    ("lightning.pytorch.strategies.DDPStrategy", "_timeout"),
    ("lightning.pytorch.strategies.DDPStrategy", "_start_method"),
    ("lightning.pytorch.strategies.DDPStrategy", "_launcher"),
    ("lightning.pytorch.strategies.launchers", "_SubprocessScriptLauncher"),
    ("lightning.fabric.strategies.launchers.subprocess_script", "_ChildProcessObserver"),
    ("lightning.fabric.strategies.launchers.subprocess_script._ChildProcessObserver", "_terminate_all"),
    ("lightning.fabric.utilities.distributed", "_init_dist_connection"),
    ("lightning.pytorch.profilers.PyTorchProfiler", "_create_profiler"),
    ("lightning.pytorch.profilers.PyTorchProfiler", "_profiler_kwargs"),
    ("lightning.pytorch.LightningModule", "_current_fx_name"),
    ("lightning.pytorch.LightningModule", "_trainer"),
    ("lightning.pytorch.Trainer", "_results"),
    ("lightning.pytorch.Trainer", "_checkpoint_connector"),
    ("lightning.pytorch.loops.training_epoch_loop._TrainingEpochLoop", "_broadcast_sigterm_tensor"),
    ("lightning.pytorch.loops.fit_loop._FitLoop", "_can_stop_early"),
    ("torch.autograd.profiler", "_is_profiler_enabled"),
    ("torch._C._profiler", "_ExperimentalConfig"),
)


for _name in ("_register_ddp_hooks", "_configure_launcher", "_get_process_group_backend"):
    if not callable(getattr(DDPStrategy, _name, None)):  # pragma: no cover - tests/test_upstream.py fails first
        raise ImportError(f"lightning_dist needs DDPStrategy.{_name}, which this Lightning release does not have; "
                          "install lightning>=2.6,<2.7 (the range in lightning_dist's pyproject.toml)")


class DDPBase(DDPStrategy):
    """Lightning's :class:`~lightning.pytorch.strategies.DDPStrategy` with the private hooks a subclass of it needs,
    under public names: override :meth:`register_comm_hooks` and :meth:`configure_launcher` instead."""

    def _register_ddp_hooks(self) -> None:
        self.register_comm_hooks()

    def register_comm_hooks(self) -> None:
        """Register the wrapped model's communication hooks (Lightning: only on CUDA; a subclass may do more)."""
        super()._register_ddp_hooks()

    def _configure_launcher(self) -> None:
        self.configure_launcher()

    def configure_launcher(self) -> None:
        """Choose the launcher (Lightning's choice by ``start_method``)."""
        super()._configure_launcher()

    def launch_nothing(self) -> None:
        """The launcher for processes another launcher created (torchrun, SLURM): it starts none of its own."""
        self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    @property
    def collective_timeout(self) -> Optional[timedelta]:
        """The timeout of the strategy's process groups."""
        return self._timeout

    @property
    def start_method(self) -> str:
        """``popen``, ``spawn``, ``forkserver`` or ``fork``."""
        return self._start_method

    def init_process_group(self, store: Any, device_id: Optional[torch.device]) -> None:
        """What ``DDPStrategy.setup_distributed`` does once ranks are set, with ``store`` given (the default group)."""
        self._process_group_backend = self._get_process_group_backend()
        _init_dist_connection(self.cluster_environment, self._process_group_backend, timeout=self._timeout,
                              device_id=device_id, store=store)


class ProfilerBase(PyTorchProfiler):
    """Lightning's :class:`~lightning.pytorch.profilers.PyTorchProfiler` with its profiler's construction under a
    public name: override :meth:`make_profiler`."""

    def _create_profiler(self, profiler: type) -> Any:
        return self.make_profiler(profiler)

    def make_profiler(self, profiler: type) -> Any:
        """The torch profiler object, built from :attr:`profiler_kwargs` (Lightning's)."""
        return super()._create_profiler(profiler)

    @property
    def profiler_kwargs(self) -> dict[str, Any]:
        """The keyword arguments the torch profiler is built with (mutable: Lightning reads them at construction)."""
        return self._profiler_kwargs


def trainer_of(module: Any) -> Optional[Any]:
    """The module's trainer, or None when it is attached to none (``module.trainer`` raises then)."""
    return getattr(module, "_trainer", None)


@contextlib.contextmanager
def running_hook(module: Any, name: str) -> Iterator[None]:
    """Lightning's name of the hook running (what ``self.log`` checks and keys its values by) set to ``name``, as its
    trainer sets it around each hook it calls."""
    previous, module._current_fx_name = module._current_fx_name, name
    try:
        yield
    finally:
        module._current_fx_name = previous


def logged_results(trainer: Any) -> Optional[Any]:
    """The trainer's result collection (its ``batch`` and ``batch_size``: what ``self.log`` infers a batch size
    from), or None outside a loop."""
    return getattr(trainer, "_results", None)


def dump_checkpoint(trainer: Any) -> dict[str, Any]:
    """The checkpoint Lightning would save now (every callback's and the loops' state), as a dict."""
    return trainer._checkpoint_connector.dump_checkpoint(weights_only=False)


def can_stop_early(trainer: Any) -> bool:
    """Whether the fit loop would stop at a ``should_stop`` now (Lightning waits for ``min_steps``/``min_epochs``)."""
    return getattr(trainer.fit_loop, "_can_stop_early", True)


def wrap_sigterm_broadcast(trainer: Any, wrap: Callable[[Callable[[], None]], Callable[[], None]]) -> None:
    """Replace the training loop's broadcast of rank zero's SIGTERM flag (a collective of every rank before every
    training batch) by ``wrap(broadcast)``, for this trainer's loop only."""
    loop = trainer.fit_loop.epoch_loop
    broadcast = type(loop)._broadcast_sigterm_tensor.__get__(loop)
    loop._broadcast_sigterm_tensor = wrap(broadcast)


def all_threads_profiler_config() -> Any:
    """Kineto's experimental config with ``profile_all_threads`` on (None on a torch without the switch)."""
    try:
        from torch._C._profiler import _ExperimentalConfig

        return _ExperimentalConfig(profile_all_threads=True)
    except (ImportError, TypeError):  # torch before the switch existed
        return None


def profiler_enabled() -> bool:
    """Whether torch's profiler is recording (its record_function ranges cost nothing otherwise)."""
    return bool(torch.autograd.profiler._is_profiler_enabled)


def launcher_observer() -> Optional[Any]:
    """The popen launcher's observer in this process (rank 0 of a ``start_method="popen"`` launch), or None: a thread
    that polls the ranks it started every 5 s and, once one has exited non-zero, SIGKILLs every other rank and rank 0
    itself."""
    return next((t for t in threading.enumerate() if isinstance(t, _ChildProcessObserver) and t.is_alive()), None)


def defer_observer_kill(observer: Any, grace_s: float) -> Callable[[], None]:
    """Hold ``observer``'s kill of every rank for ``grace_s`` seconds after it decided on it, then let it run (what is
    left, rank 0 among them, as Lightning would have at once); rank 0 ending on its own ends the wait, the observer
    being one of its threads. Returns what gives the observer its kill back."""
    terminate = observer._terminate_all

    def terminate_after_grace() -> None:
        time.sleep(grace_s)
        terminate()

    observer._terminate_all = terminate_after_grace

    def undo() -> None:
        observer._terminate_all = terminate

    return undo
