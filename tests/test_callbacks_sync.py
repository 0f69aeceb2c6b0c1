"""FaultTolerance and MemoryMonitor under ``sync=DiLoCo``, and SLURM's requeue after FaultTolerance's agreed stop, on 2
launched fork ranks (one launched group holds every fit; the assertions share it):

- what crosses every rank per step at the callbacks' defaults: the strategy's exchange only on DiLoCo's sync steps
  (it was every step: FaultTolerance's ``agree_every_n_steps=1``); an interval given is kept exactly;
- a SIGTERM on one rank is agreed at the next sync: every rank stops at the same step, after one checkpoint;
- a sync slower than the watchdog's timeout is waited for, while a rank that stalls outside a sync is still named;
- SIGUSR1 under Lightning's ``SLURMEnvironment`` (auto-requeue): the agreed checkpoint, then ``scontrol requeue <job
  id>`` exactly once (a stand-in ``scontrol`` first on ``PATH`` records its arguments).
"""

from __future__ import annotations

import faulthandler
import os
import signal
import time
import warnings
from unittest import mock

import lightning.pytorch as pl
import pytest
import torch.distributed as dist
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.callbacks import Callback

from lightning_dist import DistMetrics, FaultTolerance, MemoryMonitor, RingDDPStrategy
from lightning_dist.fault.checkpoint import verify
from lightning_dist.strategy import features_of
from lightning_dist.sync import DiLoCo
from lightning_dist.sync.diloco_exchange import Exchanges as DiLoCoExchanges
from lightning_dist.testing import InjectFault, ToyClassifier, launched_externally, quiet_trainer, run_ranks

pytestmark = pytest.mark.slow  # one launched group of 2 ranks serves every test

EVERY = 4  # DiLoCo's H: the workers meet after global steps 4, 8, ... (the strategy's steps 3, 7, ...)
SLOW_S, TIMEOUT_S = 4.0, 2.0  # a sync (or a stall) twice as long as the watchdog's timeout
JOB = "4242"


def _net():
    # 96 samples, 8 a batch on each of 2 ranks: 6 steps an epoch
    return ToyClassifier(features=16, hidden=(32,), classes=4, samples=96, batch_size=8, distributed_sampler=True,
                         seed=0)


class Exchanges(Callback):
    """The strategy's steps (``features.step``) whose per-step exchange ran: every rank's collective on the
    strategy's gloo group, the one the callbacks' values ride."""

    def __init__(self):
        self.steps = []

    def on_before_optimizer_step(self, trainer, *args):
        features = features_of(trainer.strategy)
        if features.exchange_step == features.step:  # the exchange completes before the optimizer steps
            self.steps.append(features.step)


class Faults(FaultTolerance):
    """FaultTolerance whose watchdog records what it found instead of ending the process."""

    def __init__(self, **kwargs):
        super().__init__(timeout_s=TIMEOUT_S, poll_s=0.25, **kwargs)
        self.faults = []

    def _on_fault(self, fault):
        faulthandler.cancel_dump_traceback_later()  # the watchdog's thread ends here: nothing re-arms it
        self.faults.append((fault.kind, fault.culprits, fault.step))


class SlurmHere(SLURMEnvironment):
    """Lightning's SLURM environment (auto-requeue on SIGUSR1) over the one host's ranks :func:`run_ranks` started."""

    def world_size(self):
        return dist.get_world_size()

    def global_rank(self):
        return dist.get_rank()

    def local_rank(self):
        return dist.get_rank()

    def node_rank(self):
        return 0


def _fit(sync, callbacks, **kwargs):
    pl.seed_everything(0, verbose=False)
    trainer = quiet_trainer(devices=2, strategy=RingDDPStrategy(sync=sync, timeout=60, start_method="fork"),
                            callbacks=callbacks, use_distributed_sampler=False, **kwargs)
    trainer.fit(_net())
    return trainer


def _slow_first_sync():
    """The first sync's reduction takes SLOW_S longer on every rank (a model's worth of bytes over a slow link)."""
    real, calls = DiLoCoExchanges._reduce_all, []

    def slow(self, fragment, recorder):
        if not calls:
            calls.append(time.monotonic())
            time.sleep(SLOW_S)
        return real(self, fragment, recorder)

    DiLoCoExchanges._reduce_all = slow
    return lambda: setattr(DiLoCoExchanges, "_reduce_all", real)


def _run(rank, world, tmp):
    out = {}
    with launched_externally(rank, world), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # the defaults under DiLoCo; SIGTERM on rank 1 at the start of the step to global step 6 (no DistMetrics
        # exchange: log_every_n_steps=0 withdraws its request, and Lightning's default 50 is MemoryMonitor's interval)
        ft, monitor, seen = FaultTolerance(dirpath=f"{tmp}/defaults"), MemoryMonitor(), Exchanges()
        trainer = _fit(DiLoCo(every=EVERY), [DistMetrics(log_every_n_steps=0), ft, monitor, seen,
                                             InjectFault("signal", rank=1, step=5)], max_epochs=2)
        out["defaults"] = dict(exchanges=seen.steps, step=trainer.global_step, stopped_by=ft.stopped_by,
                               checkpoint=ft.stop_checkpoint, readings=monitor.readings)
        # intervals given are kept exactly
        seen = Exchanges()
        _fit(DiLoCo(every=EVERY), [DistMetrics(log_every_n_steps=0), FaultTolerance(agree_every_n_steps=2),
                                   MemoryMonitor(every_n_steps=3), seen], max_steps=8)
        out["given"] = seen.steps
        # the first sync (after global step 4) takes SLOW_S on every rank, twice the watchdog's timeout
        ft, restore = Faults(), _slow_first_sync()
        started = time.monotonic()
        try:
            trainer = _fit(DiLoCo(every=EVERY), [ft], max_steps=6)
        finally:
            restore()
        out["slow_sync"] = dict(faults=ft.faults, step=trainer.global_step, seconds=time.monotonic() - started)
        # rank 1 stalls SLOW_S at the start of the step to global step 3, between syncs
        ft = Faults()
        trainer = _fit(DiLoCo(every=EVERY), [ft, InjectFault("stall", rank=1, step=2, stall_s=SLOW_S)], max_steps=6)
        out["stall"] = dict(faults=ft.faults, step=trainer.global_step)
        # SLURM: SIGUSR1 on every rank (as `sbatch --signal=USR1@90` sends it) under Lightning's auto-requeue
        with mock.patch.dict(os.environ, PATH=f"{tmp}/bin{os.pathsep}{os.environ['PATH']}", SLURM_JOB_ID=JOB):
            os.environ.pop("SLURM_ARRAY_JOB_ID", None)  # (the environment as it was comes back after the block)
            ft = FaultTolerance(dirpath=f"{tmp}/slurm", watchdog=False)
            usr1 = [InjectFault("signal", rank=r, step=2, signum=int(signal.SIGUSR1)) for r in range(world)]
            trainer = _fit(None, [ft, *usr1], max_steps=8, plugins=[SlurmHere()])
        out["slurm"] = dict(step=trainer.global_step, stopped_by=ft.stopped_by, checkpoint=ft.stop_checkpoint)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("callbacks_sync")
    (tmp / "bin").mkdir()
    scontrol = tmp / "bin" / "scontrol"  # a stand-in: records its arguments, one call a line
    scontrol.write_text(f'#!/bin/sh\necho "$@" >> "{tmp}/scontrol.calls"\n')
    scontrol.chmod(0o755)
    return run_ranks(_run, 2, str(tmp), deadline_s=150), tmp


def test_at_their_defaults_the_callbacks_exchange_only_where_diloco_syncs(runs):
    results, _ = runs
    for rank in range(2):
        # before: one exchange across every rank on each of the 8 steps (FaultTolerance's agree_every_n_steps=1)
        assert results[rank]["defaults"]["exchanges"] == [3, 7]  # the steps to global steps 4 and 8: the syncs
        assert results[rank]["defaults"]["readings"] == 1  # MemoryMonitor's interval (50 steps) at its first sync


def test_a_stop_asked_on_one_rank_is_agreed_at_the_next_sync_by_every_rank(runs):
    results, _ = runs
    for rank in range(2):
        got = results[rank]["defaults"]
        assert got["step"] == 8 and got["stopped_by"] == "SIGTERM on rank 1 (host 0)"  # signalled before step 6
        assert got["checkpoint"].endswith("defaults/preempted-step=8.ckpt")
    assert verify(results[0]["defaults"]["checkpoint"])["verified"]


def test_intervals_given_are_kept_exactly(runs):
    results, _ = runs
    for rank in range(2):
        assert results[rank]["given"] == [0, 2, 3, 4, 6]  # agree_every_n_steps=2 and every_n_steps=3


def test_the_watchdog_waits_for_a_sync_slower_than_its_timeout(runs):
    results, _ = runs
    for rank in range(2):
        got = results[rank]["slow_sync"]
        assert got["seconds"] > SLOW_S and got["step"] == 6
        assert got["faults"] == []  # before: a stall, every rank ended (exit 124) in a healthy sync


def test_a_rank_that_stalls_between_syncs_is_still_named(runs):
    results, _ = runs
    for rank in range(2):
        assert results[rank]["stall"]["faults"] == [("stall", (1,), 2)]


def test_sigusr1_under_slurms_auto_requeue_requeues_once_after_the_agreed_checkpoint(runs):
    results, tmp = runs
    for rank in range(2):
        got = results[rank]["slurm"]
        # at the start of the step to global step 3, after its values were filled: the next step's exchange carries it
        assert got["step"] == 4 and got["stopped_by"] == "SIGUSR1 on ranks 0, 1 (host 0)"
    assert verify(results[0]["slurm"]["checkpoint"])["verified"]
    assert (tmp / "scontrol.calls").read_text() == f"requeue {JOB}\n"  # rank zero, once

