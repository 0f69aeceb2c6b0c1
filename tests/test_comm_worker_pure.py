"""The communication worker alone, without a process group: order, failures, thread lifetime, running a job on
the caller when idle. Its place in the overlapped hook, on launched ranks, is tests/test_overlap.py."""

import threading
import time

import pytest
import torch

from lightning_dist.strategy.comm_worker import THREAD_NAME, CommWorker, CommWorkerError


def test_jobs_run_in_order_on_the_worker_thread():
    worker = CommWorker("t").start()
    seen = []

    def job(i):
        def run():
            seen.append((i, threading.current_thread().name))
            return torch.tensor([float(i)])
        return run

    futures = [worker.submit(job(i)) for i in range(20)]
    assert [float(f.wait()) for f in futures] == [float(i) for i in range(20)]
    assert [i for i, _ in seen] == list(range(20))
    assert {name for _, name in seen} == {f"{THREAD_NAME}-t"}
    assert worker.stop(5.0) and not worker.alive


def test_a_job_that_returns_a_future_is_followed_until_it_completes():
    worker = CommWorker().start()
    later: torch.futures.Future = torch.futures.Future()
    fut = worker.submit(lambda: later.then(lambda f: f.value() * 2))
    time.sleep(0.05)
    assert not fut.done()  # the worker went on; the result waits for the asynchronous part
    later.set_result(torch.ones(2))
    assert torch.equal(fut.wait(), torch.full((2,), 2.0))
    assert worker.stop(5.0)


def test_a_failing_job_fails_its_future_and_every_later_one_with_the_cause():
    worker = CommWorker().start()
    ok = worker.submit(lambda: torch.zeros(1))
    bad = worker.submit(lambda: (_ for _ in ()).throw(ValueError("compressor exploded")), what="bucket 3")
    after = worker.submit(lambda: torch.zeros(1), what="bucket 4")
    ok.wait()
    with pytest.raises(RuntimeError, match=r"(?s)bucket 3 failed .*ValueError: compressor exploded"):
        bad.wait()
    with pytest.raises(RuntimeError, match=r"(?s)bucket 4 was not sent: an earlier job failed.*compressor exploded"):
        after.wait()
    assert worker.failed
    assert worker.stop(5.0)
    with pytest.raises(RuntimeError, match="not running"):
        worker.submit(lambda: torch.zeros(1))


def test_an_asynchronous_part_that_fails_fails_the_job():
    worker = CommWorker().start()
    later: torch.futures.Future = torch.futures.Future()

    def explode(f):
        raise ConnectionError("peer went away")

    fut = worker.submit(lambda: later.then(explode), what="bucket 0")
    later.set_result(None)
    with pytest.raises(RuntimeError, match="(?s)bucket 0 failed.*peer went away"):
        fut.wait()
    assert worker.failed and worker.stop(5.0)


def test_here_if_idle_runs_on_the_caller_only_when_nothing_is_pending():
    worker = CommWorker().start()
    names = []

    def job():
        names.append(threading.current_thread().name)
        return torch.zeros(1)

    worker.submit(job, here_if_idle=True).wait()
    assert names == [threading.current_thread().name]  # idle: ran right here
    release = threading.Event()
    blocking = worker.submit(lambda: release.wait(10) and torch.ones(1))
    queued = worker.submit(job, here_if_idle=True)  # something is pending: queued behind it, order kept
    assert not queued.done()
    release.set()
    blocking.wait(), queued.wait()
    assert names[-1].startswith(THREAD_NAME)
    deadline = time.monotonic() + 5  # the worker counts a job done just after completing its Future
    while worker._pending and time.monotonic() < deadline:
        time.sleep(0.001)
    with pytest.raises(CommWorkerError, match="(?s)bucket 7 failed.*boom"):
        worker.submit(lambda: (_ for _ in ()).throw(OSError("boom")), what="bucket 7", here_if_idle=True)
    with pytest.raises(RuntimeError, match="(?s)was not sent: an earlier job failed.*boom"):
        worker.submit(job, here_if_idle=False).wait()
    assert worker.stop(5.0)


def test_stop_gives_up_on_a_job_that_never_returns_and_a_start_failure_reaches_the_jobs():
    release = threading.Event()
    worker = CommWorker().start()
    worker.submit(lambda: release.wait(10) and torch.zeros(1))
    assert worker.stop(0.2) is False  # blocked, as in a collective whose peer stalled
    release.set()
    worker._thread.join(5)
    assert not worker.alive

    def no_device():
        raise RuntimeError("no such CUDA device")

    broken = CommWorker(on_start=no_device).start()
    with pytest.raises(RuntimeError, match="(?s)failed to start.*no such CUDA device"):
        broken.submit(lambda: torch.zeros(1)).wait()
    assert broken.stop(5.0)


def test_worker_errors_are_runtime_errors():
    assert issubclass(CommWorkerError, RuntimeError)
