"""A host that gets notice leaves at an agreed step, and the others go on without it (elastic runs under torchrun).

Spot and preemptible machines get notice before they are taken: usually SIGTERM to the host's processes (up to 120 s
ahead on one cloud, about 30 s on another), or a flag in the cloud's metadata service. Under ``torchrun --nnodes
MIN:MAX`` (c10d rendezvous) the way out is narrow (torch 2.13's agent, read in ``torch/distributed/elastic``):

- a node whose workers all exit 0 counts as finished: its agent closes the rendezvous, and no new round can start;
- a node whose workers exit with any other code is restarted by its agent, which rejoins;
- an agent that receives SIGTERM ends its workers (SIGTERM, then SIGKILL after ``--shutdown-timeout``, 30 s by
  default) and exits without closing the rendezvous: its node drops out once its keep-alives stop.

So, once every rank has agreed on a stop step and the checkpoint is written (:class:`~lightning_dist.callbacks.
FaultTolerance`), :func:`decide` says who leaves. Which hosts are leaving comes from every rank's own request on the
strategy's per-step exchange, not from rank 0 alone. The leaving hosts' ranks exit with :data:`EXIT_LEFT` once their
agent has SIGTERM (the notice's own signal, or :func:`signal_agent` for a notice that did not come as one). Every other
rank exits with :data:`EXIT_RESHAPE`, on which its agent restarts it at the smaller size (each leave uses one of
``--max-restarts``). A request on every host is the whole job ending (SLURM's preemption, a scheduler's stop), and
every rank exits 0 as before. A stop of the whole job reaches every host within seconds but not at the same step (the
SIGTERM torchrun's agents send every worker when a host joins, a scheduler's preemption), so once a request from some
hosts only has appeared, the ranks wait ``FaultTolerance(settle_s=...)`` for the others' before any host leaves.

:class:`Notice` watches for a notice that does not come as a signal: a file that appears, or a command (the user's,
reading the cloud's metadata endpoint) that succeeds, polled every ``poll_s`` seconds on a thread of its own.
"""

from __future__ import annotations

import logging
import os
import shlex
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from typing import Optional, Sequence

# Exit codes after an agreed leave. Never 0 for either: a node whose workers exit 0 closes the rendezvous if its agent
# has not yet handled its SIGTERM (it handles it within --monitor-interval; the fit's teardown takes longer).
EXIT_RESHAPE = 75  # a staying host's rank: its agent restarts it at the new size (EX_TEMPFAIL: try again)
EXIT_LEFT = 76  # a leaving host's rank: its agent, signalled, ends and exits 1 whatever its workers return


@dataclass(frozen=True)
class StopDecision:
    """What an agreed stop means for every rank (the same on every rank: it is read from the exchange's rows)."""

    requested_by: tuple[int, ...]  # the ranks that asked to stop (a signal or a notice)
    leaving_hosts: tuple[int, ...]  # the hosts (node ranks) that leave; every host when the whole job ends
    hosts: tuple[int, ...]  # every host of the run

    @property
    def whole_job(self) -> bool:
        """Every host asked (or the run cannot go on without them): every rank stops and exits 0."""
        return set(self.leaving_hosts) == set(self.hosts)

    def leaves(self, node: int) -> bool:
        return node in self.leaving_hosts

    def exit_code(self, node: int) -> Optional[int]:
        """What a rank on host ``node`` exits with after the fit: None (the process ends as it would: 0) when the whole
        job ends, :data:`EXIT_LEFT` on a leaving host, :data:`EXIT_RESHAPE` on a staying one."""
        if self.whole_job:
            return None
        return EXIT_LEFT if self.leaves(node) else EXIT_RESHAPE


def decide(requests: Sequence[bool], nodes: Sequence[int], elastic: bool) -> Optional[StopDecision]:
    """Every rank's stop request and host (node rank), as the exchange carried them: who leaves. None: no request.
    Without elastic training (``elastic=False``: nowhere to go on at another size) every request ends the whole job."""
    asked = tuple(r for r, wants in enumerate(requests) if wants)
    if not asked:
        return None
    hosts = tuple(sorted(set(int(n) for n in nodes)))
    leaving = tuple(sorted({int(nodes[r]) for r in asked})) if elastic else hosts
    return StopDecision(requested_by=asked, leaving_hosts=leaving, hosts=hosts)


def signal_agent(reason: str) -> bool:
    """Send SIGTERM to this worker's torchrun agent (its parent process), so that the agent leaves the rendezvous
    without closing it. Only under torchrun (``TORCHELASTIC_RUN_ID`` set), and from the host's first local rank only (a
    second SIGTERM while the agent ends its workers would cut that short); returns whether it was sent."""
    if not os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get("LOCAL_RANK", "0") != "0":
        return False
    parent = os.getppid()
    if parent <= 1:
        return False
    logging.getLogger(__name__).warning("lightning_dist: %s: SIGTERM to this host's torchrun agent (pid %d)", reason,
                                        parent)
    os.kill(parent, signal.SIGTERM)
    return True


def exit_when_main_ends(code: int) -> threading.Thread:
    """End the process with ``code`` once the main thread has returned (after Lightning's teardown and every
    callback's, whatever the script does after ``fit``), before the interpreter's exit handlers: a script that ends
    normally would exit 0, which a torchrun agent takes for the end of the job. Returns the (non-daemon) thread."""

    def wait_then_exit() -> None:
        threading.main_thread().join()  # released when the main thread finishes, before atexit handlers run
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)

    thread = threading.Thread(target=wait_then_exit, name="lightning_dist-exit", daemon=False)
    thread.start()
    return thread


class Notice:
    """A notice that does not come as a signal: ``source`` is a file path to watch (it fires once the file exists) or
    ``cmd:<command>`` to poll (it fires when the command exits 0), every ``poll_s`` seconds on a daemon thread.
    :attr:`fired` says whether it has; :attr:`detail` what fired it."""

    def __init__(self, source: str, poll_s: float = 5.0) -> None:
        self.source, self.poll_s = source, float(poll_s)
        self.command = shlex.split(source[len("cmd:"):]) if source.startswith("cmd:") else None
        if self.command is not None and not self.command:
            raise ValueError(f"notice={source!r}: write the command after 'cmd:', e.g. 'cmd:/usr/local/bin/notice'")
        self.fired, self.detail = False, ""
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def check(self) -> bool:
        """Look once; True once it has fired."""
        if self.fired:
            return True
        if self.command is None:
            self.fired = os.path.exists(self.source)
            self.detail = f"notice file {self.source}"
        else:
            try:
                done = subprocess.run(self.command, capture_output=True, text=True, timeout=max(self.poll_s, 1.0))
            except (OSError, subprocess.SubprocessError):
                return False
            self.fired = done.returncode == 0
            self.detail = f"notice command {self.source[4:]!r}: {done.stdout.strip()[:200]}"
        return self.fired

    def start(self) -> None:
        if self._thread is not None:
            return
        self._stop.clear()

        def poll() -> None:
            while not self._stop.is_set() and not self.check():
                self._stop.wait(self.poll_s)

        self._thread = threading.Thread(target=poll, name="lightning_dist-notice", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread = None
