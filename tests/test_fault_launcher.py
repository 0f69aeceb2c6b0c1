"""The popen launcher's kill held for the ranks' own ends (``lightning_dist.upstream.defer_observer_kill``), on
Lightning's own observer with stand-in processes: a "rank" that failed (exit 1) and a "rank 0" that is still saving
(a sleep)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver

from lightning_dist.upstream import defer_observer_kill, launcher_observer

pytestmark = pytest.mark.subprocess_ok


def _observer():
    """Lightning's observer over one failed child, its "main process" a stand-in that would run for a minute."""
    failed = subprocess.Popen([sys.executable, "-c", "raise SystemExit(1)"])
    failed.wait(timeout=60)
    main = subprocess.Popen(["sleep", "60"])
    return _ChildProcessObserver(main_pid=main.pid, child_processes=[failed], sleep_period=0), main


def _gone_after(main, within_s):
    try:
        main.wait(timeout=within_s)
        return True
    except subprocess.TimeoutExpired:
        return False


def test_lightnings_observer_kills_at_once_and_the_deferred_one_after_its_grace():
    observer, main = _observer()
    try:
        observer.start()  # Lightning's own: the failed child seen, the main process SIGKILLed at once
        assert _gone_after(main, 10) and main.returncode == -9
    finally:
        main.kill()
    observer, main = _observer()
    try:
        defer_observer_kill(observer, grace_s=1.5)
        started = time.monotonic()
        observer.start()
        assert not _gone_after(main, 1.0)  # held: rank 0 still saving
        assert _gone_after(main, 10) and main.returncode == -9  # then killed, as Lightning would
        assert time.monotonic() - started >= 1.5
    finally:
        main.kill()


def test_undo_gives_the_observer_its_kill_back_and_only_a_live_observer_is_found():
    observer, main = _observer()
    try:
        undo = defer_observer_kill(observer, grace_s=60)
        undo()
        assert launcher_observer() is None  # none of this process's threads (the stand-in is not started)
        observer.start()
        assert _gone_after(main, 10) and main.returncode == -9
    finally:
        main.kill()
