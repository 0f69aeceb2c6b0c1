"""The suite's tiers and shared pieces.

Tiers: ``pytest -m "not slow"`` is the fast tier, run after each change; ``pytest`` runs everything. A test that
launches anything is marked ``slow``: ranks (:func:`~lightning_dist.testing.run_ranks`, any multiprocessing
``Process``), a Lightning run (``Trainer.fit``/``validate``/``test``/``predict``, even in one process), a
subprocess (the training command, ``torchrun``, a notebook's kernel, a wheel build, a simulated cluster). The tier
keeps itself fast: while a test without the ``slow`` marker runs (its fixtures included, module-scoped ones too),
those three ways to launch raise ``LaunchInFastTier``, which names what was launched and says to mark the test
(a library call that starts a subprocess on the quiet counts too: ``platform.platform()`` runs ``uname -p``).

One exemption, by marker: ``@pytest.mark.subprocess_ok`` lets a fast test start short subprocesses (a
``--help``, ``ruff``), which are its very subject; it still may not start ranks or a Lightning run. A marker
rather than a guess from the command line: the test says what it does, and a new launched test cannot slip
through by looking like one.

Shared pieces live in :mod:`lightning_dist.testing`, where launched ranks, scripts and benchmarks import them
too: :func:`~lightning_dist.testing.quiet_trainer` (a CPU Trainer without logger, checkpointing, progress bar,
model summary or sanity validation) and :class:`~lightning_dist.testing.ToyClassifier` (the small MLP and its
data that most tests fit; a test's own behaviour, such as a NaN-injecting step, is a subclass of it).

The suite runs the codecs' plain torch path: compiling their kernels (lightning_dist.compression.kernels) costs
seconds per process, and every launched rank would pay it. One test compares the compiled kernels with it.
"""

import multiprocessing.process
import os
import subprocess
from typing import Any, Callable, Iterator

import pytest

os.environ.setdefault("LIGHTNING_DIST_COMPILE", "0")
# MKL's own allocator, off for the suite's processes. Ranks are forked from this process (run_ranks), which has run
# MKL on several threads at once (the single-process emulations of N ranks); a forked child that then multiplies
# matrices can spin forever inside that allocator (mkl_serv_allocate -> mm_account_ptr_by_tid: seen at 3-5% of
# children), and its peers wait for it until the deadline. MKL reads the variable when torch loads: before any test
# module imports torch. Plain malloc, which MKL then uses, is fork-safe.
os.environ.setdefault("MKL_DISABLE_FAST_MM", "1")


class LaunchInFastTier(RuntimeError):
    """A test of the fast tier launched something; mark it ``@pytest.mark.slow``."""


def _refuse(test: str, what: str) -> Callable[..., Any]:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise LaunchInFastTier(f"mark this test slow (@pytest.mark.slow): {test} launches {what}, and the fast "
                               f"tier (pytest -m 'not slow') launches nothing")
    return refuse


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: Any) -> Iterator[None]:
    """Around the setup, call and teardown of every test not marked slow: launching raises."""
    if item.get_closest_marker("slow") is not None:
        return (yield)
    import lightning.pytorch as pl  # every test module imports it already

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(multiprocessing.process.BaseProcess, "start",
                      _refuse(item.nodeid, "a process (run_ranks, multiprocessing, a DataLoader worker)"))
        if item.get_closest_marker("subprocess_ok") is None:
            patch.setattr(subprocess.Popen, "__init__", _refuse(item.nodeid, "a subprocess"))
        for entry in ("fit", "validate", "test", "predict"):
            patch.setattr(pl.Trainer, entry, _refuse(item.nodeid, f"a Lightning run (Trainer.{entry})"))
        return (yield)
