"""A host that gets notice leaves (lightning_dist.fault.leave) without a cluster: who leaves, the exit codes, the
notice file and command, the SIGTERM to the agent, the exit after the main thread."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from lightning_dist.callbacks.fault_tolerance import check_settings
from lightning_dist.fault import leave
from lightning_dist.fault.leave import EXIT_LEFT, EXIT_RESHAPE, Notice, decide

NODES = [0, 0, 1, 1, 2, 2]  # 3 hosts of 2 ranks


def test_the_hosts_that_asked_leave_and_the_others_restart():
    assert decide([False] * 6, NODES, elastic=True) is None  # nobody asked
    one = decide([False, False, False, False, True, False], NODES, elastic=True)  # rank 4 only: host 2
    assert one.requested_by == (4,) and one.leaving_hosts == (2,) and not one.whole_job
    assert [one.exit_code(n) for n in NODES] == [EXIT_RESHAPE] * 4 + [EXIT_LEFT] * 2
    assert EXIT_LEFT != 0 and EXIT_RESHAPE != 0  # exit 0 would close torchrun's rendezvous
    two = decide([False, True, False, False, True, True], NODES, elastic=True)
    assert two.leaving_hosts == (0, 2) and [two.exit_code(n) for n in (0, 1, 2)] == [EXIT_LEFT, EXIT_RESHAPE, EXIT_LEFT]


def test_a_request_on_every_host_or_outside_an_elastic_run_ends_the_whole_job_as_before():
    every = decide([True, False, False, True, True, False], NODES, elastic=True)
    assert every.whole_job and all(every.exit_code(n) is None for n in NODES)
    fixed = decide([False, False, False, False, True, False], NODES, elastic=False)  # no elastic: nowhere to go on
    assert fixed.whole_job and fixed.leaving_hosts == (0, 1, 2) and fixed.exit_code(2) is None


def test_a_notice_file_fires_once_it_exists(tmp_path):
    path = tmp_path / "notice"
    notice = Notice(str(path), poll_s=0.02)
    notice.start()
    try:
        time.sleep(0.1)
        assert not notice.fired
        path.write_text("terminate")
        deadline = time.monotonic() + 5
        while not notice.fired and time.monotonic() < deadline:
            time.sleep(0.02)
        assert notice.fired and notice.detail == f"notice file {path}"
    finally:
        notice.stop()


@pytest.mark.subprocess_ok
def test_a_notice_command_fires_when_it_succeeds():
    assert not Notice("cmd:false").check()
    fired = Notice(f"cmd:{sys.executable} -c \"print('preempted at 12:00')\"")
    assert fired.check() and "preempted at 12:00" in fired.detail
    with pytest.raises(ValueError, match="write the command after 'cmd:'"):
        Notice("cmd:")
    assert any("notice=''" in p for p in check_settings(timeout_s=60, poll_s=2, pause_timeout_s=600,
                                                         stop_timeout_s=60, exit_grace_s=15, agree_every_n_steps=1,
                                                         notice=""))
    assert any("notice_poll_s=0" in p for p in check_settings(timeout_s=60, poll_s=2, pause_timeout_s=600,
                                                               stop_timeout_s=60, exit_grace_s=15,
                                                               agree_every_n_steps=1, notice_poll_s=0))


@pytest.mark.subprocess_ok
def test_a_leaving_worker_signals_its_agent_and_a_script_that_ends_exits_with_the_code():
    got = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: got.append(signum))
    try:  # this process plays the torchrun agent: the child is its worker
        # the module alone, by its path (it needs only the standard library): the package's import would take seconds
        code = ("import importlib.util, sys\n"
                f"spec = importlib.util.spec_from_file_location('leave', {leave.__file__!r})\n"
                "leave = sys.modules['leave'] = importlib.util.module_from_spec(spec); spec.loader.exec_module(leave)\n"
                "assert leave.signal_agent('test')\nleave.exit_when_main_ends(76)\nprint('main ends')\n")
        env = {**os.environ, "TORCHELASTIC_RUN_ID": "test", "LOCAL_RANK": "0"}
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
        deadline = time.monotonic() + 5
        while not got and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert got == [signal.SIGTERM]
    assert done.returncode == 76 and "main ends" in done.stdout, done.stderr


def test_only_a_hosts_first_local_rank_signals_its_agent(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert not leave.signal_agent("x")  # returns before any signal: this process is no worker of an agent
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert not leave.signal_agent("x")  # not under torchrun


def test_an_exception_that_says_a_peer_is_gone_is_known_anywhere_in_its_chain():
    from lightning_dist.fault.emergency import peer_gone

    closed = RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [10.77.103.2]:18150")
    try:
        try:
            raise closed
        except RuntimeError as err:
            raise ValueError("gradient bucket 0 failed on MainThread") from err
    except ValueError as wrapped:
        assert peer_gone(wrapped)
    assert not peer_gone(RuntimeError("injected fault on rank 1 at global step 5"))
