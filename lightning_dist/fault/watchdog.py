"""A progress watchdog: every rank's progress published through the rendezvous store, a job that stopped
moving caught within a bounded time, on every rank, the stalled one included.

Why not a collective timeout: a stalled rank (alive, sockets open, making no progress: a stuck data loader, a
deadlock) leaves its peers blocked in a collective for the process group's timeout (30 minutes by default),
and aborting the group from another thread does not unblock them. A short collective timeout also kills
legitimate long waits (checkpoint barriers, validation on one rank).

How: the training thread counts *ticks* (a plain integer increment in callback hooks: batch start and end,
backward, optimizer step, validation batches, checkpoints). A daemon thread publishes this rank's ticks and
step every ``poll_s`` seconds with ``store.add`` (which never blocks on a missing key, unlike ``get``) and
reads every rank's the same way. When *no* rank's ticks changed for ``timeout_s`` seconds, judged on this
rank's own monotonic clock, and no rank is inside a known long operation (:meth:`Watchdog.paused`: one rank's,
a checkpoint write; or one every rank takes part in, a sync of the workers, which holds the verdict only while every
rank is inside it, so that peers waiting in it for a rank that stalled before it do not hide the stall), the job
is stuck: every rank sees it within one poll of the others, names the rank(s) with the fewest ticks (the one
that stopped first: its peers went on to the collective it never reached), and calls ``on_fault``, which
writes an emergency checkpoint and exits the process. A rank whose own watchdog thread cannot run (a hang
that holds the GIL) is ended by ``faulthandler.dump_traceback_later(..., exit=True)``, re-armed every poll,
which prints every thread's stack first. The store itself is reached through a connection of the
watchdog's own with a short timeout (a link that goes down sends no reset); a store that stays unreachable
(the process hosting it is gone) and a launcher parent that went away are faults too.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch.distributed as dist

from lightning_dist.launch import LaunchStoreError, connect_store

STORE_FAILURES = 3  # consecutive failed polls before the store counts as gone
# a rank's published pause: in an operation of its own (any rank's holds the verdict), in a collective of every rank
# (holds it while every rank is in one)
ALONE, TOGETHER = 1, 2


@dataclass(frozen=True)
class Fault:
    """What the watchdog found: a one-line ``kind`` and a sentence for the log."""

    kind: str  # "stall", "paused_too_long", "store_unreachable", "launcher_gone"
    message: str
    culprits: tuple[int, ...] = ()
    step: int = -1


def open_store(timeout_s: float) -> Any:
    """A store connection of the watchdog's own: a client to the launcher's store
    (:func:`lightning_dist.launch.connect_store`; Lightning's launchers and torchrun both put one at
    ``MASTER_ADDR:MASTER_PORT``) with a short timeout; else the default group's store (a FileStore in tests), used
    only through ``add``, which does not block."""
    try:
        return connect_store(timeout_s)
    except LaunchStoreError:  # no address, or not reachable: fall back to the group's own store
        return dist.distributed_c10d._get_default_store()


class Watchdog:
    """Publishes this rank's progress and watches every rank's; see the module docstring.

    Args:
        store: a ``torch.distributed.Store`` (only ``add`` is used).
        rank, world_size: this rank and the job's size.
        prefix: the keys' namespace (``LaunchEnv.key("watchdog")``: one per attempt, torchrun restarts reuse
            the store).
        timeout_s: seconds without progress on any rank before the job counts as stuck.
        poll_s: seconds between polls.
        pause_timeout_s: the longest a known long operation may pause the watch.
        on_fault: called once, on the watchdog thread, with the :class:`Fault`; it should end the process.
        backstop: arm ``faulthandler`` to end the process if this thread cannot run for ``timeout_s`` + slack.
        check: called every poll; a :class:`Fault` it returns is raised (a stop request nobody agreed on).
    """

    def __init__(self, store: Any, rank: int, world_size: int, prefix: str, timeout_s: float, poll_s: float,
                 pause_timeout_s: float, on_fault: Callable[[Fault], None], backstop: bool = True,
                 check: Optional[Callable[[], Optional[Fault]]] = None) -> None:
        self.store, self.rank, self.world_size, self.prefix = store, rank, world_size, prefix
        self.timeout_s, self.poll_s, self.pause_timeout_s = timeout_s, poll_s, pause_timeout_s
        self.on_fault, self.backstop, self.check = on_fault, backstop, check
        self.ticks = 0  # bumped by the training thread: a plain int, no lock needed (one writer)
        self.step = 0
        # what this rank is doing that may take long, and whether every rank takes part (a stack: nested pauses)
        self._paused: list[tuple[str, bool]] = []
        self._paused_since = 0.0
        self._published = {"ticks": 0, "step": 0, "paused": 0}
        self._keys_made = False  # every rank's keys exist (made by add(key, 0)): one multi_get reads them all
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._io: Optional[threading.Thread] = None  # the store call in flight (a dead link can block it)
        self._parent = os.getppid()
        self.fault: Optional[Fault] = None
        # every rank's (ticks, step, paused) at the last poll; paused: ALONE | TOGETHER bits (0: neither)
        self.last_seen: list[tuple[int, int, int]] = []

    # -- the training thread's side -------------------------------------------------------------------------
    def tick(self, step: Optional[int] = None) -> None:
        self.ticks += 1
        if step is not None:
            self.step = step

    @contextlib.contextmanager
    def paused(self, what: str, every_rank: bool = False) -> Iterator[None]:
        """A known long operation (a checkpoint write, a barrier around it): the watch waits, up to
        ``pause_timeout_s``. ``every_rank``: a collective every rank takes part in (a sync of the workers); the watch
        waits only while every rank is inside one."""
        if not self._paused:
            self._paused_since = time.monotonic()
        self._paused.append((what, every_rank))
        try:
            yield
        finally:
            self._paused.pop()
            self.tick()

    # -- the thread ---------------------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="lightning_dist-watchdog", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self.backstop:
            faulthandler.cancel_dump_traceback_later()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.poll_s + 5.0)
        self._thread = None

    def _key(self, rank: int, name: str) -> str:
        return f"{self.prefix}/{rank}/{name}"

    def _publish_and_read(self) -> list[tuple[int, int, int]]:
        keys = [self._key(r, name) for r in range(self.world_size) for name in ("ticks", "step", "paused")]
        if not self._keys_made:  # a key no rank has written yet would block multi_get until it is
            for key in keys:
                value = self.store.add(key, 0)
                rank, name = key.rsplit("/", 2)[-2:]
                if int(rank) == self.rank:  # what an earlier fit's watchdog in this process left (a pause it ended in)
                    self._published[name] = int(value)
            self._keys_made = True
        mine = {"ticks": self.ticks, "step": self.step, "paused": self._pause_bits()}
        for name, value in mine.items():
            delta = value - self._published[name]
            if delta:
                self.store.add(self._key(self.rank, name), delta)
                self._published[name] = value
        values = [int(value) for value in self.store.multi_get(keys)]  # one round trip, not 3 per rank
        return [tuple(values[3 * r: 3 * r + 3]) for r in range(self.world_size)]

    def _pause_bits(self) -> int:
        """This rank's pause as published: :data:`ALONE` (a pause of its own), :data:`TOGETHER` (a collective's)."""
        return ((ALONE if any(not together for _, together in self._paused) else 0)
                | (TOGETHER if any(together for _, together in self._paused) else 0))

    def _poll_store(self) -> list[tuple[int, int, int]]:
        """One publish-and-read on a daemon thread of its own, waited for at most ``2 * poll_s`` (at least 2 s): a
        link that went down without a reset can block a store call far beyond the store's own timeout."""
        if self._io is not None and self._io.is_alive():
            raise TimeoutError("the previous store call has not returned")  # still stuck: do not pile up more
        box: dict[str, Any] = {}

        def call() -> None:
            try:
                box["seen"] = self._publish_and_read()
            except BaseException as err:  # noqa: BLE001 - handed to the watchdog thread
                box["error"] = err

        self._io = threading.Thread(target=call, name="lightning_dist-watchdog-store", daemon=True)
        self._io.start()
        self._io.join(max(2.0, 2 * self.poll_s))
        if self._io.is_alive():
            raise TimeoutError(f"the store did not answer within {max(2.0, 2 * self.poll_s):.0f} s")
        if "error" in box:
            raise box["error"]
        return box["seen"]

    def _run(self) -> None:
        last_change, last, failures = time.monotonic(), None, 0
        while not self._stop.wait(self.poll_s):
            if self.backstop:  # if this thread cannot run (the GIL held by a hang), faulthandler ends the process
                faulthandler.dump_traceback_later(self.timeout_s + 2 * self.poll_s + 10.0, exit=True)
            found = self.check() if self.check is not None else None
            if found is not None:
                self._raise(found)
                return
            if os.getppid() != self._parent:
                self._raise(Fault("launcher_gone", f"rank {self.rank}: the process that launched it (pid "
                                                   f"{self._parent}) is gone; ending this rank too"))
                return
            now = time.monotonic()
            try:
                seen = self._poll_store()
                failures = 0
            except Exception as err:  # noqa: BLE001 - the store's process died or the link is down
                now = time.monotonic()
                failures += 1
                if now - last_change > self.timeout_s and not self._paused:
                    # the stall verdict was due anyway (a peer that reached it first took the store with it)
                    self._raise(self._stall(self.last_seen, now - last_change) if self.last_seen else
                                Fault("stall", f"rank {self.rank}: no progress for {now - last_change:.0f} s"))
                    return
                if failures >= STORE_FAILURES:
                    self._raise(Fault("store_unreachable", f"rank {self.rank}: the rendezvous store has not answered "
                                                           f"{failures} polls in a row ({type(err).__name__}: {err}); "
                                                           "the process hosting it (rank 0 or the launcher) is gone, "
                                                           "or the link to it is down"))
                    return
                continue
            self.last_seen = seen
            if seen != last:
                last, last_change = seen, now
            if any(paused & ALONE for _, _, paused in seen) or all(paused & TOGETHER for _, _, paused in seen):
                if self._paused and now - self._paused_since > self.pause_timeout_s:
                    self._raise(Fault("paused_too_long", f"rank {self.rank}: {self._paused[-1][0]} has taken more than "
                                                         f"{self.pause_timeout_s:.0f} s", (self.rank,), self.step))
                    return
                last_change = now  # a peer (or this rank) is in a known long operation: no verdict meanwhile
                continue
            if now - last_change > self.timeout_s:
                self._raise(self._stall(seen, now - last_change))
                return

    def _stall(self, seen: list[tuple[int, int, int]], idle_s: float) -> Fault:
        ticks = [t for t, _, _ in seen]
        least = min(ticks)
        culprits = tuple(r for r, t in enumerate(ticks) if t == least)
        steps = {r: seen[r][1] for r in culprits}
        if len(culprits) == len(seen):
            who = f"every rank stopped at the same point (step {seen[0][1]}): a collective none of them completed"
        else:
            who = "rank" + ("s " if len(culprits) > 1 else " ") + ", ".join(
                f"{r} (step {steps[r]})" for r in culprits) + " stopped making progress first " \
                f"({least} progress ticks against up to {max(ticks)} on the others)"
        return Fault("stall", f"no rank has made progress for {idle_s:.0f} s (timeout {self.timeout_s:.0f} s): {who}; "
                              f"this is rank {self.rank}, ending it", culprits, steps[culprits[0]])

    def _raise(self, fault: Fault) -> None:
        self.fault = fault
        print(f"[lightning_dist watchdog] {fault.message}", file=sys.stderr, flush=True)
        self.on_fault(fault)
