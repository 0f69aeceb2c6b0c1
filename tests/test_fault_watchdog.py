"""The progress watchdog and FaultTolerance's pieces without launching anything: a shared in-memory store, two
"ranks" as threads, timeouts of a fraction of a second."""

from __future__ import annotations

import io
import random
import signal
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from lightning_dist.callbacks import FaultTolerance
from lightning_dist.callbacks.fault_tolerance import check_settings
from lightning_dist.fault import rng
from lightning_dist.fault.watchdog import Fault, Watchdog
from lightning_dist.testing import ToyClassifier, quiet_trainer


class Store:
    """What the watchdog uses of a torch.distributed Store (``add``, ``multi_get``); ``broken`` makes it fail like a
    dead host."""

    def __init__(self):
        self.values, self.lock, self.broken = {}, threading.Lock(), False

    def add(self, key, delta):
        if self.broken:
            raise RuntimeError("Connection reset by peer")
        with self.lock:
            self.values[key] = self.values.get(key, 0) + delta
            return self.values[key]

    def multi_get(self, keys):
        if self.broken:
            raise RuntimeError("Connection reset by peer")
        with self.lock:
            return [str(self.values[key]).encode() for key in keys]  # a missing key: KeyError, as a store would block


def _watchdogs(store, n=2, timeout=0.4, poll=0.05, pause_timeout=5.0, check=None):
    found = [[] for _ in range(n)]
    dogs = [Watchdog(store, r, n, "test", timeout, poll, pause_timeout, found[r].append, backstop=False, check=check)
            for r in range(n)]
    return dogs, found


def _wait(found, seconds=3.0):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not all(found):
        time.sleep(0.02)


def test_a_stall_is_seen_by_every_rank_and_the_first_to_stop_is_named():
    dogs, found = _watchdogs(Store())
    for dog in dogs:
        dog.start()
    # both make progress for a while; then rank 1 stops first (its step), rank 0 one tick later (its collective)
    for step in range(5):
        for dog in dogs:
            dog.tick(step)
        time.sleep(0.06)
    dogs[0].tick(5)
    _wait(found)
    for dog in dogs:
        dog.stop()
    for r in range(2):
        (fault,) = found[r]
        assert fault.kind == "stall" and fault.culprits == (1,) and fault.step == 4
        assert "rank 1 (step 4) stopped making progress first" in fault.message and f"this is rank {r}" in fault.message


def test_progress_keeps_the_watch_quiet():
    dogs, found = _watchdogs(Store(), timeout=0.3)
    for dog in dogs:
        dog.start()
    until = time.monotonic() + 1.2  # four timeouts
    step = 0
    while time.monotonic() < until:
        step += 1
        for dog in dogs:
            dog.tick(step)
        time.sleep(0.03)
    for dog in dogs:
        dog.stop()
    assert found == [[], []]


def test_a_pause_holds_the_verdict_until_it_lasts_too_long():
    dogs, found = _watchdogs(Store(), timeout=0.3, pause_timeout=1.0)
    for dog in dogs:
        dog.start()
    with dogs[0].paused("writing a checkpoint"):
        time.sleep(0.7)  # no progress anywhere for more than the timeout, but rank 0 is in a known long operation
        assert found == [[], []]
        _wait(found, 1.5)  # ... until the pause itself overstays
    for dog in dogs:
        dog.stop()
    (fault,) = found[0]
    assert fault.kind == "paused_too_long" and "writing a checkpoint" in fault.message
    assert found[1] == [] or found[1][0].kind == "stall"  # rank 1 then sees no progress (the pause ended with it)


def test_a_collective_pause_holds_the_verdict_only_while_every_rank_is_inside_it():
    # a slow sync: every rank inside it, longer than the timeout, shorter than pause_timeout
    dogs, found = _watchdogs(Store(), timeout=0.3, pause_timeout=5.0)
    for dog in dogs:
        dog.start()
    with dogs[0].paused("a sync", every_rank=True), dogs[1].paused("a sync", every_rank=True):
        time.sleep(0.9)
    time.sleep(0.1)
    for dog in dogs:
        dog.stop()
    assert found == [[], []]
    # rank 1 stalled before the sync: rank 0 waiting inside it does not hide that (a pause of rank 0's own would)
    dogs, found = _watchdogs(Store(), timeout=0.3, pause_timeout=5.0)
    for dog in dogs:
        dog.start()
    for step in range(3):
        for dog in dogs:
            dog.tick(step)
        time.sleep(0.06)
    dogs[0].tick(3)
    with dogs[0].paused("a sync", every_rank=True):
        _wait(found)
    for dog in dogs:
        dog.stop()
    for r in range(2):
        (fault,) = found[r]
        assert fault.kind == "stall" and fault.culprits == (1,) and fault.step == 2, fault


def test_a_pause_an_earlier_fits_watchdog_ended_in_does_not_hold_the_next_ones_verdict():
    store = Store()
    dogs, _ = _watchdogs(store)
    for dog in dogs:
        dog.start()
    with dogs[0].paused("the preemption checkpoint"), dogs[1].paused("the final sync", every_rank=True):
        time.sleep(0.2)  # published; the fit ends before the pauses' ends are
        for dog in dogs:
            dog.stop()
    dogs, found = _watchdogs(store)  # the next fit in this process: the same keys in the same store
    for dog in dogs:
        dog.start()
    for dog in dogs:
        dog.tick(1)
    _wait(found)
    for dog in dogs:
        dog.stop()
    assert [fault.kind for faults in found for fault in faults] == ["stall", "stall"]


def test_an_unreachable_store_and_a_vanished_launcher_are_faults(monkeypatch):
    store = Store()
    dogs, found = _watchdogs(store, n=1)
    dogs[0].start()
    dogs[0].tick(1)
    store.broken = True
    _wait(found)
    dogs[0].stop()
    assert found[0][0].kind == "store_unreachable" and "Connection reset" in found[0][0].message
    dogs, found = _watchdogs(Store(), n=1)
    monkeypatch.setattr("os.getppid", lambda: -1)  # the launcher (this process's parent) is gone
    dogs[0].start()
    _wait(found)
    dogs[0].stop()
    assert found[0][0].kind == "launcher_gone"


def test_a_check_can_raise_its_own_fault():
    fault = Fault("stop_timeout", "SIGTERM arrived 61 s ago")
    dogs, found = _watchdogs(Store(), n=1, check=lambda: fault)
    dogs[0].start()
    _wait(found)
    dogs[0].stop()
    assert found[0] == [fault]


def test_generators_round_trip_through_a_weights_only_checkpoint():
    torch.manual_seed(3)
    random.seed(3)
    np.random.seed(3)
    buffer = io.BytesIO()
    torch.save(rng.capture(), buffer)
    want = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    buffer.seek(0)
    rng.restore(torch.load(buffer, weights_only=True))
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == want


def test_settings_and_the_signal_flag():
    assert check_settings(timeout_s=60, poll_s=2, pause_timeout_s=600, agree_every_n_steps=1, stop_timeout_s=60,
                          exit_grace_s=15) == []
    problems = check_settings(timeout_s=2, poll_s=2, pause_timeout_s=0, agree_every_n_steps=0, stop_timeout_s=-1,
                              exit_grace_s=True)
    assert any("pause_timeout_s=0" in p for p in problems) and any("agree_every_n_steps=0" in p for p in problems)
    assert any("exit_grace_s=True" in p for p in problems)
    with pytest.raises(ValueError, match="poll_s=5 must be at most half of timeout_s=6"):
        FaultTolerance(timeout_s=6, poll_s=5)
    callback = FaultTolerance(stop_timeout_s=0.05)
    assert callback._stop_overdue() is None
    callback._signals.record(signal.SIGTERM, None)
    callback._signals.record(signal.SIGUSR1, None)  # the first signal is the one kept
    assert callback._signals.signum == signal.SIGTERM and callback._stop_overdue() is None
    time.sleep(0.1)
    fault = callback._stop_overdue()
    assert fault is not None and fault.kind == "stop_timeout" and "SIGTERM" in fault.message
    callback.stopped_by = "SIGTERM on rank 0"  # the ranks agreed: nothing overdue
    assert callback._stop_overdue() is None


def test_a_watchdog_fault_lets_the_training_threads_emergency_write_finish(monkeypatch):
    from lightning_dist.callbacks import fault_tolerance as ft

    exits = []
    monkeypatch.setattr(ft.os, "_exit", exits.append)
    monkeypatch.setattr(ft, "exit_later", lambda seconds, code: None)
    callback = FaultTolerance()
    callback._trainer = SimpleNamespace(strategy=None)  # a stand-in: its emergency write fails, the exit follows
    callback._emergency.arm()
    callback._emergency.writing = True  # the training thread failed first and is writing its emergency checkpoint
    watchdog = threading.Thread(target=callback._on_fault, args=(Fault("store_unreachable", "store gone"),))
    watchdog.start()
    watchdog.join(0.3)
    assert exits == []  # still waiting for the write, not cutting it off
    callback._emergency._done.set()
    watchdog.join(5)
    assert exits == [ft.EXIT_STALL]


@pytest.mark.slow  # a Lightning run
def test_the_signal_handlers_from_before_the_fit_are_in_force_after_it(tmp_path):
    before = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGUSR1)}
    trainer = quiet_trainer(devices=1, max_steps=2, default_root_dir=tmp_path, callbacks=[FaultTolerance()])
    trainer.fit(ToyClassifier())
    assert {signum: signal.getsignal(signum) for signum in before} == before
