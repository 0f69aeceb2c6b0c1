"""The communication worker: one thread per DDP model that reduces gradient buckets while backward goes on.

A blocking DDP comm hook stalls the autograd thread until its bucket has travelled, so no communication
overlaps computation. Stock DDP avoids that with asynchronous work handles; Horovod with one background
thread that drives every collective. We do the latter, because our ring and tree are Python loops over
point-to-point operations, not a single asynchronous call:

1. the hook (autograd thread) wraps the bucket's work in a closure and calls :meth:`CommWorker.submit`,
   which queues it and returns a pending :class:`torch.futures.Future` at once;
2. the worker thread takes jobs first in, first out, and runs each (weight -> compress -> transport ->
   decompress). A job returns the reduced buffer, or a Future of it when its transport was issued
   asynchronously (the backend's native all-reduce): the worker then goes straight on to the next job and
   the bucket's Future completes on the backend's thread. Blocking in the worker until each collective is
   done costs dearly when backward keeps every core busy: each hand-off waits for the scheduler to give
   the worker a core (docs/strategy.md has the figures);
3. DDP waits for every bucket's Future at the end of backward, then copies the results into ``.grad``.

Order: DDP hands buckets over in index order on every rank and one thread runs (or issues) them in that
order, so the point-to-point messages of the ring and the tree, and the backend's collectives, stay
matched across ranks. A job submitted with ``here_if_idle=True`` runs on the submitting thread when nothing
is queued or running: every earlier job has then been issued, so the order is the same. The hook does so
for work that never blocks (issuing the backend's asynchronous all-reduce of a bucket whose compressor is
light) and for the last bucket, behind which nothing is left to overlap. The worker thread then runs only
what would block backward: our ring's and tree's point-to-point loops, heavy compressors. Work handed to
it needlessly costs more than the hand-off: py-spy showed the autograd thread waiting for the GIL (pybind
releases it inside ``Future.then``) while the worker ran Python.

The worker's collectives run on a process group of their own (the strategy makes it), never the default
group, on which DDP and Lightning issue collectives from the main thread: two threads interleaving on one
group can issue operations in a different order on different ranks, a mismatch or a hang.

Failure: an exception in a job (or in its asynchronous part) completes that job's Future with an error that
carries the original exception's type, message and traceback, so ``loss.backward()`` on the main thread
raises it. The worker is then *failed*: every later job is refused at once with the same cause rather than
run, because a rank whose bucket ``k`` failed would otherwise send bucket ``k + 1`` while its peers still
wait in bucket ``k``. It stays failed until it is stopped; the strategy starts a fresh one at the next fit.

Exit: the thread is a daemon, so an idle worker never holds the interpreter open, but a daemon thread must not be
inside a collective when the interpreter shuts down. :meth:`CommWorker.stop` gives up after its timeout when a job is
blocked in a collective whose peer has not come (the thread is then left running, GIL released, in gloo's C++); if
that collective returns while the interpreter finalizes (a rank's shutdown takes seconds: module teardown and a full
collection of the heap), the thread's attempt to retake the GIL makes Python ``pthread_exit`` it inside a C++
``noexcept`` frame, and the process dies with SIGABRT, "terminate called without an active exception" (issue 40's
abort, from a store thread). So every worker whose thread was started is ended at interpreter exit, before
finalization (:func:`_end_workers_at_exit`, an ``atexit`` hook): asked to stop and waited for while its collective
ends (a peer exiting ends it at once; the group's timeout at the latest), for up to :data:`EXIT_WAIT_S`, with a line
on stderr from every rank that waits; one still blocked after that is named on stderr and left to the interpreter.
"""

from __future__ import annotations

import atexit
import os
import queue
import sys
import threading
import traceback
import weakref
from typing import Any, Callable, Optional, Union

import torch

from lightning_dist.comm import completed_future, future_devices, release_scratch

THREAD_NAME = "lightning_dist-comm"  # every worker thread's name starts with this (tests look for it)
_STOP = None  # the sentinel that ends the loop
# At interpreter exit, how long a worker still inside a collective is waited for (its peer exiting or the group's
# timeout ends the collective) before it is left to the interpreter's shutdown.
EXIT_WAIT_S = 60.0
_STARTED: weakref.WeakSet = weakref.WeakSet()  # workers whose thread was started (ended at exit if still running)
_exit_hook = False


class CommWorkerError(RuntimeError):
    """A job on the communication worker raised; the message holds the original error and its traceback."""


def _unwrap(fut: torch.futures.Future) -> Any:
    # ``Future.set_exception`` stores the exception as the value and raises it only from Python's
    # ``wait()``; DDP waits in C++ and would try to cast it to a Tensor. Raising it inside a ``then``
    # callback turns it into a real error of the chained Future, which C++ rethrows with its message.
    return fut.value()


class CommWorker:
    """A FIFO queue of communication jobs, run by one daemon thread.

    Args:
        name: the thread's name (prefixed with :data:`THREAD_NAME`), shown in tracebacks and traces.
        on_start: called first thing on the worker thread (e.g. to select the CUDA device there).
    """

    def __init__(self, name: str = "", on_start: Optional[Callable[[], None]] = None) -> None:
        self.name = f"{THREAD_NAME}{'-' + name if name else ''}"
        self._on_start = on_start
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: Optional[threading.Thread] = None
        self._failure: Optional[str] = None  # the first job's error, once one failed
        self._pending = 0  # jobs queued or running on the thread (their asynchronous parts not counted)
        self._pending_lock = threading.Lock()
        self._accepting = self._stopped = False
        self._stop_sent = False  # the sentinel is queued (once)

    # -- life cycle -----------------------------------------------------------------------------------
    def start(self) -> CommWorker:
        """Accept jobs from now on. The thread itself starts with the first job that has to be queued: when
        every bucket is issued on the calling thread (the backend's asynchronous all-reduce, the last
        bucket), no thread is made at all."""
        if self._accepting or self._stopped:
            raise RuntimeError(f"{self.name} was already started; make a new CommWorker per fit")
        self._accepting = True
        return self

    @property
    def alive(self) -> bool:
        """Whether jobs are accepted (started and not stopped); the thread may not exist yet."""
        return self._accepting

    @property
    def failed(self) -> bool:
        return self._failure is not None

    def stop(self, timeout_s: float = 10.0) -> bool:
        """Let queued jobs finish (or be refused), end the thread and join it; returns whether it ended.

        A job blocked in a collective whose peer stalls cannot be interrupted from here: after ``timeout_s``
        the (daemon) thread is left to end with the process and ``False`` is returned.
        """
        self._accepting, self._stopped = False, True
        if self._thread is None:
            return True
        if not self._stop_sent:
            self._stop_sent = True
            self._jobs.put(_STOP)
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def _end_at_exit(self, wait_s: float) -> None:
        """At interpreter exit, before it finalizes: stop the thread, waiting up to ``wait_s`` for a job still inside
        a collective (the module docstring says why the thread must not be running when the interpreter finalizes)."""
        thread = self._thread
        if thread is None or not thread.is_alive():
            return
        if not self.stop(min(wait_s, 2.0)):
            _say(f"{self.name} is still inside a collective as this process exits (a peer has not joined it); "
                 f"waiting up to {wait_s:.0f} s for it to end before the interpreter shuts down.")
            thread.join(max(0.0, wait_s - 2.0))
        if thread.is_alive():
            _say(f"{self.name} is still blocked in a collective {wait_s:.0f} s after this process began to exit; if "
                 "it returns while the interpreter shuts down, the process aborts (SIGABRT, 'terminate called "
                 "without an active exception').")

    # -- jobs -----------------------------------------------------------------------------------------
    def submit(self, job: Callable[[], Union[torch.Tensor, torch.futures.Future]], what: str = "job",
               here_if_idle: bool = False, devices: Optional[list[torch.device]] = None) -> torch.futures.Future:
        """Queue ``job`` and return a Future of its result (``job`` may return a Future itself, which the
        result then follows); ``what`` names it in an error message. ``devices``: the CUDA devices the result lives
        on (:func:`~lightning_dist.comm.future_devices` of the bucket): the Future records an event on each as its
        result is set, so a waiter (DDP) waits for the kernels that made it; without them it would wait for nothing.

        With ``here_if_idle`` the job runs on the calling thread instead when no other job is queued or
        running (every earlier job has then been issued, so the order is kept): for work that does not
        block, such as issuing an asynchronous collective, and for the last bucket of a backward pass,
        behind which nothing is left to overlap. That saves two thread hand-offs and, more, keeps the
        calling (autograd) thread from waiting for the GIL while this thread runs Python. A job run here
        that raises marks the worker failed and raises :class:`CommWorkerError` right away.
        """
        if not self.alive:
            raise RuntimeError(f"{self.name} is not running (it was never started, or it was stopped)")
        with self._pending_lock:
            here = here_if_idle and self._pending == 0
            if not here:
                self._pending += 1
        devices = [] if devices is None else list(devices)
        if here:
            return self._run_here(job, what, devices)
        if self._thread is None:  # only the submitting thread gets here: no race
            self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
            _ended_at_exit(self)
            self._thread.start()
        fut: torch.futures.Future = torch.futures.Future(devices=devices)
        self._jobs.put((job, fut, what))
        return fut.then(_unwrap)

    def _run_here(self, job: Callable[[], Any], what: str, devices: list[torch.device]) -> torch.futures.Future:
        if self._failure is not None:
            raise CommWorkerError(f"{what} was not sent: an earlier job failed.\n{self._failure}")
        try:
            result = job()
        except BaseException as exc:
            self._failure = f"{what} failed on {threading.current_thread().name}: {type(exc).__name__}: {exc}\n" \
                            f"{traceback.format_exc()}"
            raise CommWorkerError(self._failure) from exc
        if isinstance(result, torch._C.Future):  # an error in its chain is already a real error
            return result
        return completed_future(result, devices or future_devices(result))

    def _loop(self) -> None:
        try:
            if self._on_start is not None:
                self._on_start()
        except BaseException:  # noqa: BLE001 - reported through every job's Future instead
            self._failure = f"{self.name} failed to start:\n{traceback.format_exc()}"
        while True:
            item = self._jobs.get()
            if item is _STOP:
                break
            self._run(*item)
            with self._pending_lock:
                self._pending -= 1
        _release_thread_buffers()

    def _run(self, job: Callable[[], Any], fut: torch.futures.Future, what: str) -> None:
        """Run ``job`` (or refuse it once the worker failed) and complete ``fut`` from its outcome."""
        if self._failure is not None:
            fut.set_exception(CommWorkerError(f"{what} was not sent: an earlier job failed.\n{self._failure}"))
            return
        try:
            result = job()
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting main thread
            self._fail(fut, what, exc)
            return
        if isinstance(result, torch._C.Future):  # what `then` and the backends return
            result.add_done_callback(lambda done: self._settle(fut, what, done))
        else:
            fut.set_result(result)

    def _settle(self, fut: torch.futures.Future, what: str, done: torch.futures.Future) -> None:
        """Complete ``fut`` from an asynchronous job's Future (on the thread that completed that one)."""
        try:
            value = done.value()
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting main thread
            self._fail(fut, what, exc)
        else:
            fut.set_result(value)

    def _fail(self, fut: torch.futures.Future, what: str, exc: BaseException) -> None:
        """Called inside the ``except`` that caught ``exc``: fail the worker (the first cause is kept)."""
        message = f"{what} failed on {self.name}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}"
        if self._failure is None:
            self._failure = message
        fut.set_exception(CommWorkerError(message))


def _release_thread_buffers() -> None:
    release_scratch()  # the worker's own scratch buffers (thread-local)


def _ended_at_exit(worker: CommWorker) -> None:
    """Have ``worker`` ended at interpreter exit (:func:`_end_workers_at_exit`, registered once per process)."""
    global _exit_hook
    _STARTED.add(worker)
    if not _exit_hook:
        _exit_hook = True
        atexit.register(_end_workers_at_exit)


def _end_workers_at_exit() -> None:
    """``atexit``: runs while the interpreter is still whole (before it finalizes), so a worker whose collective
    returns now retakes the GIL normally and ends (the module docstring says why it must not be left running)."""
    for worker in list(_STARTED):
        worker._end_at_exit(EXIT_WAIT_S)


def _say(message: str) -> None:
    """A line on this process's stderr, from any rank (at exit no logger is left to trust)."""
    try:
        sys.stdout.flush()
        sys.stderr.write(f"lightning_dist (pid {os.getpid()}): {message}\n")
        sys.stderr.flush()
    except (OSError, ValueError):  # a closed stream at exit
        pass
