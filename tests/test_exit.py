"""How a rank's process ends with gloo work still in flight: never by an abort as the interpreter shuts down.

A daemon thread that is in C++ with the GIL released when the interpreter finalizes, and that then returns into
Python, is ``pthread_exit``-ed by CPython inside a C++ ``noexcept`` frame: the process dies with SIGABRT,
"terminate called without an active exception" (issue 40: the store thread; issue 49: a rank that aborted at the end of
a top-k fit). Two such threads can be left at a rank's exit: :class:`~lightning_dist.strategy.comm_worker.CommWorker`'s,
once ``stop()`` has given up on a job blocked in a collective, and gloo's own, which take the GIL to release a finished
collective's tensors. Both are now ended at interpreter exit, before it finalizes: the worker by an ``atexit`` hook of
its own, gloo's threads by :func:`lightning_dist.comm.destroy_at_exit` (every group destroyed, its threads joined).
"""

from __future__ import annotations

import os
import re
import sys
import threading

import pytest
import torch

import lightning_dist
from lightning_dist.strategy import comm_worker
from lightning_dist.strategy.comm_worker import CommWorker
from lightning_dist.testing import free_port, watch_job


def test_a_worker_blocked_at_exit_is_waited_for_before_the_interpreter_finalizes():
    release = threading.Event()
    worker = CommWorker("exit").start()
    worker.submit(lambda: release.wait(30) and torch.ones(1))
    assert worker.stop(0.2) is False  # blocked, as in a collective whose peer has not come
    assert worker in comm_worker._STARTED and comm_worker._exit_hook  # the atexit hook will see it
    threading.Timer(0.5, release.set).start()  # the peer comes (or exits) while the process is exiting
    worker._end_at_exit(wait_s=20.0)  # what the atexit hook runs for every started worker
    assert not worker._thread.is_alive()
    worker._end_at_exit(wait_s=20.0)  # an ended worker: nothing to do


# One rank of a 2-rank job (the package's modules alone, without Lightning: the test's time is the ranks'). Rank 1 ends
# with gloo work in flight, as a rank can at the end of a fit. Scenario "worker": its communication worker inside an
# all-gather (stop() gave up on it, as at a teardown whose peer has not come); rank 1's interpreter then shuts down,
# slowly (a launched rank's shutdown took 3-7 s here: module teardown and a full collection of the heap), and rank 0
# joins once rank 1's own code has ended, so the all-gather returns while rank 1 is exiting. Scenario "gloo": an
# all-reduce of the default group whose tensor only gloo's thread still holds (as it does, briefly, after any
# collective); rank 0 joins while rank 1's last code runs, so gloo's thread is waiting for the GIL when rank 1's
# interpreter begins to finalize (in a real rank that wait lasts a switch interval, here until the end).
RANK = r"""
import atexit, os, sys, time, types
root, scenario, rank, port, marker = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
if scenario == "gloo" and rank == 1:
    def last_code():  # registered first, so the last exit hook to run: the interpreter finalizes right after it
        sys.setswitchinterval(100.0)  # no switch on request: the GIL stays here until this returns
        until = time.monotonic() + 3.5
        while time.monotonic() < until:  # rank 0 joins meanwhile; gloo's thread waits for the GIL to release
            pass

    atexit.register(last_code)
for name, path in (("lightning_dist", root), ("lightning_dist.strategy", os.path.join(root, "strategy"))):
    package = sys.modules[name] = types.ModuleType(name)  # their __init__ would import Lightning
    package.__path__ = [path]
import torch
import torch.distributed as dist
from lightning_dist.comm import destroy_at_exit
from lightning_dist.strategy.comm_worker import CommWorker

dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
destroy_at_exit()  # as RingDDPStrategy.setup_distributed does
group = dist.new_group()
mine, gathered = torch.full((1000,), float(rank)), torch.empty(2 * 1000)
if rank == 1:
    if scenario == "worker":
        def last_bucket(group=group):
            dist.all_gather_into_tensor(gathered, mine, group=group)
            return gathered

        worker = CommWorker("rank1").start()
        worker.submit(last_bucket, what="the last bucket")
        print(f"worker: rank 1's worker stopped={worker.stop(0.5)}", flush=True)  # False: blocked in the collective
        dist.destroy_process_group(group)  # the strategy's teardown (the blocked job holds the last reference)
        del group, last_bucket
    else:
        dist.all_reduce(torch.ones(4), async_op=True)  # gloo's thread holds the only reference to its tensor

    class SlowShutdown:
        def __del__(self, sleep=time.sleep):  # runs as the interpreter clears modules, after it began to finalize
            sleep(4)  # (the GIL released meanwhile: a thread waiting for it wakes, in a finalizing interpreter)

    # in a module of its own: __main__'s objects are not torn down while a daemon thread lives, other modules' are
    holder = sys.modules["slow_shutdown"] = types.ModuleType("slow_shutdown")
    holder.obj = SlowShutdown()
    open(marker, "w").close()  # on to the exit hooks ("gloo": last_code the last of them)
else:
    while not os.path.exists(marker):
        time.sleep(0.05)
    time.sleep(1.5)  # rank 1 is shutting down by now
    if scenario == "worker":
        dist.all_gather_into_tensor(gathered, mine, group=group)  # rank 1's collective returns
    else:
        dist.all_reduce(torch.ones(4))
    print(f"{scenario}: rank 0 joined", flush=True)
"""

# Starts both scenarios' ranks side by side and reports each one's exit code and output (watch_job watches every
# process, its deadline included).
LAUNCH = r"""
import os, subprocess, sys
rank_code, root, tmp = sys.argv[1:4]
procs = {(scenario, rank): subprocess.Popen(
             [sys.executable, "-c", rank_code, root, scenario, str(rank), port, os.path.join(tmp, scenario)],
             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
         for scenario, port in zip(("worker", "gloo"), sys.argv[4:6]) for rank in range(2)}
for (scenario, rank), proc in procs.items():
    out, _ = proc.communicate()
    print(f"=== {scenario} rank {rank} exit {proc.returncode}\n{out}", flush=True)
"""


@pytest.mark.slow
def test_a_rank_that_exits_with_gloo_work_in_flight_ends_cleanly(tmp_path):
    root = os.path.dirname(lightning_dist.__file__)
    run = watch_job([sys.executable, "-c", LAUNCH, RANK, root, str(tmp_path), str(free_port()), str(free_port())],
                    deadline_s=120.0)
    assert not run.timed_out, run.log[-4000:]
    codes = {(scenario, int(rank)): int(code)
             for scenario, rank, code in re.findall(r"=== (\w+) rank (\d) exit (-?\d+)", run.log)}
    assert "rank 1's worker stopped=False" in run.log, run.log[-4000:]  # the worker was left in its collective
    assert "worker: rank 0 joined" in run.log and "gloo: rank 0 joined" in run.log, run.log[-4000:]
    # before: rank 1 exited -6 (SIGABRT, "terminate called without an active exception") in both scenarios, every
    # run; without only the worker's exit hook, in "worker"; without only destroy_at_exit, in "gloo"
    assert codes == {("worker", 0): 0, ("worker", 1): 0, ("gloo", 0): 0, ("gloo", 1): 0}, run.log[-4000:]
    assert "terminate called" not in run.log, run.log[-4000:]
