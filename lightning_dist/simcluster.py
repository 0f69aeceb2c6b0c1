"""A simulated cluster on one machine, for tests and benchmarks (not on any product code path).

``SimCluster(hosts=2, rate_mbit=100, delay_ms=0.5)`` makes N Linux network namespaces ("hosts"), each with its
loopback up and one interface, ``eth0``, a veth pair whose other end joins a bridge in the root namespace; every
host gets an address on a private /24 (10.77.<k>.<i+1>). Each link is shaped in both directions (``tc netem``: rate
and delay; where the kernel lacks netem, ``tbf``: the rate only), so traffic between hosts crosses a real network
hop at a real rate, unlike loopback. :meth:`SimCluster.popen` starts a process inside a host (``ip netns exec``) in
its own session; :meth:`SimCluster.torchrun` builds the multi-node ``torchrun`` command for one host (static
rendezvous on host 0's address; ``GLOO_SOCKET_IFNAME=eth0``, since a host's name resolves to 127.0.0.1).
:meth:`SimCluster.cut` takes a host's link down without a reset being sent, as a pulled cable would;
:meth:`SimCluster.kill` kills everything running in a host, as when the machine dies. ``torchrun(...,
nnodes="MIN:MAX")`` builds an elastic job's command instead (c10d rendezvous on host 0; docs/elastic.md).
Several ranks in one host talk over its loopback, unshaped (a host's fast local links); inside a host,
:func:`link_bytes_sent` reads what left it through ``eth0``, so a benchmark can weigh what crossed the slow network.

Leaving the context removes every process it started, every namespace, link and the bridge, also when the body
raised. Only the namespaces' own private addresses are used: no traffic leaves them. It needs root and iproute2
(``ip``, ``tc``); :func:`unavailable` says why not where it cannot run.
"""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Optional, Sequence

_COUNTER = itertools.count(1)  # next() is atomic: clusters made on several threads at once get distinct names


# SimCluster.torchrun(go_file=...)'s agent: torchrun imported, then run as ``python -m`` would once the file exists
_RUN_ON_FILE = """import os, runpy, sys, time, torch.distributed.run
while not os.path.exists(sys.argv[1]):
    time.sleep(0.05)
del sys.argv[1]
runpy.run_module("torch.distributed.run", run_name="__main__", alter_sys=True)
"""


# ip and tc run with PATH alone: they need nothing else, and a variable a test tags its jobs' processes with (to kill
# them all on a failure: lightning_dist.testing) must not reach the commands that take a cluster apart
def _admin_env() -> dict[str, str]:
    return {"PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")}


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30, env=_admin_env())


def _pids_inside(namespace: str) -> list[int]:
    listed = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True, check=False,
                            env=_admin_env()).stdout
    return [int(pid) for pid in listed.split() if pid.isdigit()]


def _kill_inside(namespace: str) -> None:
    for pid in _pids_inside(namespace):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def link_bytes_sent(interface: str = "eth0") -> int:
    """Inside a host: bytes that have left it through ``interface`` so far (the kernel's counter, headers included;
    ``ip netns exec`` gives the host its own ``/sys``, so every process in the host reads the same counter)."""
    with open(f"/sys/class/net/{interface}/statistics/tx_bytes") as fh:
        return int(fh.read())


def unavailable() -> Optional[str]:
    """None when namespaces can be made here, else the reason (for a test's skip message)."""
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"iproute2 is not installed ({', '.join(missing)} missing): apt-get install iproute2"
    name = f"ldprobe{os.getpid() % 100000}"
    made = _ip("netns", "add", name, check=False)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    _ip("netns", "del", name, check=False)
    return None


def _exit_on_sigterm() -> Any:
    """While a cluster is up, SIGTERM ends the process through ``SystemExit`` (143), so that ``with`` blocks and
    :meth:`SimCluster.close` run: the default action ends it at once and leaves the namespaces, their links and the
    bridge behind. Only from the main thread (a thread cannot set a handler) and over the default handler (a handler
    of the caller's is theirs); returns the handler to put back, None where none was set."""
    main = threading.current_thread() is threading.main_thread()
    if not main or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return None

    def exit_cleanly(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, exit_cleanly)
    return signal.SIG_DFL


class SimCluster:
    """N shaped hosts; use as a context manager (see the module docstring)."""

    def __init__(self, hosts: int, rate_mbit: float = 1000.0, delay_ms: float = 0.25, queue_ms: float = 100.0) -> None:
        if hosts < 1:
            raise ValueError(f"hosts={hosts} must be >= 1")
        count = next(_COUNTER)
        tag = f"{os.getpid() % 100000:05d}{count % 100:02d}"  # fixed widths: two tags never read alike
        # queue_ms: how long a packet may wait in tbf's queue before it is dropped (its "latency"). The ring and
        # native all-reduce reach the line rate with 100 ms and with 500 ms alike (2 hosts, 100 Mbit/s)
        self.hosts, self.rate_mbit, self.delay_ms, self.queue_ms = hosts, rate_mbit, delay_ms, queue_ms
        self.bridge = f"ldb{tag}"[:15]
        self.namespaces = [f"ld{tag}h{i}" for i in range(hosts)]
        self.links = [f"ld{tag}v{i}"[:15] for i in range(hosts)]
        self.subnet = 10 + (os.getpid() + count) % 200
        self.addresses = [f"10.77.{self.subnet}.{i + 1}" for i in range(hosts)]
        self._procs: list[subprocess.Popen] = []
        # what this cluster made, and so may remove: a name that clashed with another cluster's is never its own
        self._made_namespaces: list[str] = []
        self._made_links: list[str] = []
        self._up = False
        self.delay_applied = False
        self._sigterm: Any = None  # the SIGTERM handler to put back at close (_exit_on_sigterm)

    # -- life cycle ------------------------------------------------------------------------------------------
    def __enter__(self) -> SimCluster:
        self._sigterm = _exit_on_sigterm()
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _build(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        self._up = True
        _ip("link", "set", self.bridge, "up")
        for ns, link, addr in zip(self.namespaces, self.links, self.addresses):
            _ip("netns", "add", ns)
            self._made_namespaces.append(ns)
            _ip("link", "add", link, "type", "veth", "peer", "name", f"{link}p")
            self._made_links.append(link)
            _ip("link", "set", f"{link}p", "netns", ns)
            _ip("-n", ns, "link", "set", f"{link}p", "name", "eth0")
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("link", "set", link, "master", self.bridge)
            _ip("link", "set", link, "up")
        self.shape(self.rate_mbit, self.delay_ms)

    def close(self) -> None:
        """Kill what was started, remove the namespaces (their ends of the links go with them), the bridge."""
        for proc in self._procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for proc in self._procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        self._procs = []
        for ns in self._made_namespaces:
            _kill_inside(ns)  # anything still running inside (a process that escaped its session) goes first
            _ip("netns", "del", ns, check=False)
        for link in self._made_links:
            _ip("link", "del", link, check=False)
        if self._up:
            _ip("link", "del", self.bridge, check=False)
        self._made_namespaces, self._made_links, self._up = [], [], False
        if self._sigterm is not None:
            signal.signal(signal.SIGTERM, self._sigterm)
            self._sigterm = None

    # -- links -------------------------------------------------------------------------------------------------
    def _qdisc(self, host: int, *spec: str) -> subprocess.CompletedProcess:
        last = None
        for args in (["-n", self.namespaces[host]], []):  # both directions: the host's egress and the bridge's
            dev = "eth0" if args else self.links[host]
            last = subprocess.run(["tc", *args, "qdisc", "replace", "dev", dev, "root", *spec],
                                  capture_output=True, text=True, check=False, timeout=30, env=_admin_env())
            if last.returncode != 0:
                return last
        assert last is not None
        return last

    def shape(self, rate_mbit: float, delay_ms: float, host: Optional[int] = None) -> None:
        """Every link (or one host's) at ``rate_mbit`` each way, with ``delay_ms`` one way per direction where the
        kernel has ``netem`` (:attr:`delay_applied` says; without it, ``tbf`` shapes the rate only)."""
        rate_bytes = rate_mbit * 1e6 / 8
        for i in ([host] if host is not None else range(self.hosts)):
            # netem's queue must hold a bandwidth-delay product of full segments, or it drops instead of delaying
            limit = max(1000, int(rate_bytes * max(delay_ms, 1.0) / 1e3 / 1500) * 4)
            done = self._qdisc(i, "netem", "rate", f"{rate_mbit}mbit", "delay", f"{delay_ms}ms", "limit", str(limit))
            self.delay_applied = done.returncode == 0
            if not self.delay_applied:  # no netem in this kernel: a token bucket, 10 ms of burst
                burst = str(max(int(rate_bytes / 100), 15000))
                queue = f"{self.queue_ms}ms"
                done = self._qdisc(i, "tbf", "rate", f"{rate_mbit}mbit", "burst", burst, "latency", queue)
                if done.returncode != 0:
                    raise RuntimeError(f"cannot shape host {i}'s link: {done.stderr.strip()}")
        if host is None:
            self.rate_mbit, self.delay_ms = rate_mbit, delay_ms

    def cut(self, host: int) -> None:
        """Take ``host``'s link down on the bridge's side: its packets vanish, and nobody is sent a reset (TCP on
        both sides just retransmits), as with a pulled cable or a dead switch port."""
        _ip("link", "set", self.links[host], "down")

    # -- processes ------------------------------------------------------------------------------------------
    def popen(self, host: int, cmd: Sequence[str], env: Optional[dict[str, str]] = None,
              **kwargs: Any) -> subprocess.Popen:
        """Start ``cmd`` inside ``host``, in a session of its own (killed as a whole on close)."""
        proc = subprocess.Popen(["ip", "netns", "exec", self.namespaces[host], *cmd],
                                env={**os.environ, **(env or {})}, start_new_session=True, **kwargs)
        self._procs.append(proc)
        return proc

    def torchrun(self, host: int, args: Sequence[str], port: int = 29500, nproc: int = 1,
                 nnodes: Optional[str] = None, max_restarts: int = 0, rdzv: Sequence[str] = (),
                 go_file: Optional[str] = None) -> list[str]:
        """The command that starts ``nproc`` ranks on ``host`` of a multi-node torchrun job: a static rendezvous on
        host 0's address, or with ``nnodes="MIN:MAX"`` an elastic one (c10d, its store hosted by host 0's agent;
        every host gives its own address, which decides the node order; ``rdzv``: more ``--rdzv-conf`` settings).
        ``go_file``: the agent's Python starts and imports torchrun now, and runs it once that file exists (a host
        that is up with its launcher loaded: the moment it enters the rendezvous is the caller's, not its start's)."""
        if nnodes is None:
            launch = ["--nnodes", str(self.hosts), "--node-rank", str(host), "--nproc-per-node", str(nproc),
                      "--master-addr", self.addresses[0], "--master-port", str(port), "--max-restarts",
                      str(max_restarts), *args]
        else:
            conf = ",".join([f"is_host={int(host == 0)}", *rdzv])
            launch = ["--nnodes", nnodes, "--nproc-per-node", str(nproc), "--max-restarts", str(max_restarts),
                      "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{self.addresses[0]}:{port}", "--rdzv-id",
                      f"sim{self.namespaces[0]}", "--rdzv-conf", conf, "--local-addr", self.addresses[host], *args]
        if go_file is None:
            return [sys.executable, "-m", "torch.distributed.run", *launch]
        return [sys.executable, "-c", _RUN_ON_FILE, go_file, *launch]

    @staticmethod
    def env(host: Optional[int] = None) -> dict[str, str]:
        """What every rank inside a host needs: gloo on the host's interface (its name resolves to 127.0.0.1); a
        store of its own for every rendezvous round (elastic runs; :mod:`lightning_dist.launch`); with ``host``,
        the node's name (every namespace shares this machine's host name)."""
        env = {"GLOO_SOCKET_IFNAME": "eth0", "TP_SOCKET_IFNAME": "eth0", "NCCL_SOCKET_IFNAME": "eth0",
               "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
        if host is not None:
            env["LIGHTNING_DIST_NODE"] = f"host{host}"
        return env

    def kill(self, host: int) -> None:
        """Every process inside ``host`` killed at once (SIGKILL), as when the machine dies: the launcher's agent and
        its workers, which run in sessions of their own."""
        _kill_inside(self.namespaces[host])

    def pids(self, host: int) -> list[int]:
        """Every process running inside ``host``."""
        return _pids_inside(self.namespaces[host])

    def wait(self, procs: Sequence[subprocess.Popen], timeout: float) -> list[Optional[int]]:
        """Wait for ``procs`` until ``timeout`` seconds in all; the exit codes (None: still running)."""
        deadline = time.monotonic() + timeout
        codes: list[Optional[int]] = []
        for proc in procs:
            try:
                codes.append(proc.wait(timeout=max(0.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append(None)
        return codes
