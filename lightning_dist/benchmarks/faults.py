"""FaultTolerance under real faults: how fast every rank is gone after a fault, what was saved, and whether the
job resumes.

Run ``python -m lightning_dist.benchmarks.faults``; ``--quick`` is a smoke run of 3 trials. Each of ``--trials``
trials (default 20; ``--seed`` fixes the random choices) draws a fault kind (``raise``: a RuntimeError in the
training step; ``kill``: SIGKILL, no cleanup at all; ``stall``: the rank sleeps at the start of a step, alive with
its sockets open), a victim rank, 0 or 1 (a fault on rank 0 matters as much: it hosts the rendezvous TCPStore under
Lightning's launchers), and a global step in [3, 18]; the (kind, victim) pairs come in shuffled rounds of all six,
so that every kind and every victim gets its share. It launches the default training job
(``python -m lightning_dist.train``: the digits CNN on 2 CPU ranks, ``strategy.start_method=fork``,
``trainer.max_epochs=1``, which is 23 optimizer steps) with ``callbacks=[checkpoint,fault_tolerance]``, the
watchdog's ``timeout_s=--timeout`` (default 10) and ``poll_s=1``, and the fault injected by
:class:`lightning_dist.testing.InjectFault`. Every job runs in a session of its own under a hard deadline
(``--deadline``, default 120 s), after which the session is SIGKILLed and the trial fails.

What is measured, per trial:

* **Fault time**: when InjectFault's line ``[InjectFault] rank R: KIND at global step N`` (printed, flushed,
  just before the fault) reaches the benchmark, read line by line on a thread with ``time.monotonic()``.
* **Seconds from the fault until each rank is gone**: the job's session is polled every 50 ms (every process
  whose session id is the job's); a process counts as gone when it no longer exists or is a zombie. The ranks
  are the launcher's forked children (the launcher's own command line), rank 0 first (the launcher starts
  them in rank order). **all gone**: when no process of the session is left, the launcher included (it exits
  last), minus the fault time.
* **Within the bound**: every process gone within ``timeout_s + 3 * poll_s + 15`` s of a stall (the
  watchdog's bound: no progress for ``timeout_s``, noticed within a poll on every rank, then an emergency
  checkpoint and exit) and within 30 s of an exception or a SIGKILL (the survivor's collective fails within
  seconds; ``exit_grace_s``, 15 s, ends a process whose teardown hangs). The job's exit code must not be 0.
* **Nothing lost**: every rank that survives the fault (raise and stall: both ranks; kill: the other one) wrote
  an emergency checkpoint (``checkpoints/emergency/emergency-rank{r}-step={N}.ckpt``) that passes
  :func:`lightning_dist.fault.checkpoint.verify` (size and SHA-256 against its sidecar), and the checkpoint
  directory holds nothing else that fails verification, no checkpoint without its sidecar and no temporary
  file of an unfinished write (``.*.tmp*``). ``ckpts`` shows verified emergency checkpoints found / expected.
* **Resume**: the same job again in the same run directory with ``resume=auto`` and no fault. It matches when
  it exits 0, says ``resume=auto: resuming from`` an emergency checkpoint at the fault's step (or, were there
  none at that step, at the nearest step one was written), and its ``summary.json`` has ``global_step`` 23:
  the rest of the epoch was trained. The result is not compared bit for bit with an uninterrupted run: an
  emergency checkpoint holds one rank's state at the fault, so the other ranks' compressor residuals and random
  generators restart (a regular checkpoint does resume bit-identically; ``tests/test_fault_tolerance.py``).

The table has a row per trial, then per kind the median and maximum of the slowest rank's time and of the
all-gone time; under them every problem of a failed trial, and every watchdog verdict other than the stall
verdict (a rank that ended because the store or the launcher was gone; all are in the JSON's ``verdicts``). The
target: every trial with every rank gone within its bound and nothing lost. Times are upper bounds by up to one
50 ms poll.

Writes ``faults.json`` (every trial, with the tail of the logs of a trial that failed), ``faults.txt`` (the
table) and ``faults.png`` (per trial the all-gone time, by kind, against the bounds) to ``--out`` (default
``bench_results/faults/``).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

import psutil

from lightning_dist.benchmarks import _common as bench
from lightning_dist.fault.checkpoint import META_SUFFIX, CheckpointError, verify

KINDS = ("raise", "kill", "stall")
STEPS = (3, 18)  # the fault's global step is drawn from this range, both ends included
WORLD_SIZE = 2
EPOCH_STEPS = 23  # the digits job's optimizer steps in one epoch (1437 training samples, 32 per rank, 2 ranks)
TIMEOUT_S, POLL_S = 10.0, 1.0  # the watchdog's defaults here
STALL_SLACK_S = 15.0  # the stall bound: timeout_s + 3 * poll_s + this
EXIT_BOUND_S = 30.0  # the bound after an exception or a SIGKILL
DEADLINE_S = 120.0  # per launched job: after this the session is killed and the trial fails
SCAN_S = 0.05  # how often the session's processes are looked at
QUICK_TRIALS = (("raise", 1, 5), ("kill", 0, 6), ("stall", 1, 4))  # --quick: one of each kind, fixed
LOG_TAIL = 4000  # characters of a failed trial's logs kept in the JSON
WATCHDOG_LINE = "[lightning_dist watchdog]"  # how the watchdog's verdicts begin
STALL_VERDICT = "no rank has made progress for"  # the verdict a stall should get on every rank

FAULT_LINE = re.compile(r"\[InjectFault\] rank (\d+): (\w+) at global step (\d+)")
RESUME_LINE = re.compile(r"resume=auto: resuming from (?P<path>.+?): (?P<kind>\w+)(?: \(rank (?P<rank>\d+)\))?, "
                         r"global step (?P<step>-?\d+)")
CKPT_NAME = re.compile(r"emergency-rank(\d+)-step=(\d+)\.ckpt$")


# -- launching and watching one job ------------------------------------------------------------------------------
@dataclass
class ProcSeen:
    """One process of the job's session: when it was first seen, last seen alive, and seen gone."""

    pid: int
    ppid: int
    cmdline: tuple[str, ...]
    create_time: float
    first_seen: float
    last_seen: float
    gone_at: Optional[float] = None


@dataclass
class JobRun:
    """What one launched job did, times on the benchmark's monotonic clock."""

    rc: Optional[int]
    started: float
    ended: float  # when no process of the session was left (or when it was killed)
    timed_out: bool
    lines: list[tuple[float, str]]
    procs: dict[int, ProcSeen]
    launcher: int
    rank_pids: list[int] = field(default_factory=list)

    @property
    def log(self) -> str:
        return "".join(line for _, line in self.lines)

    def line_time(self, pattern: re.Pattern) -> tuple[Optional[float], Optional[re.Match]]:
        """When the first line matching ``pattern`` arrived, and its match."""
        for stamp, line in self.lines:
            match = pattern.search(line)
            if match:
                return stamp, match
        return None, None


def _read_lines(stream: Any, lines: list[tuple[float, str]]) -> None:
    for line in iter(stream.readline, ""):
        lines.append((time.monotonic(), line))
    stream.close()


def _session_members(sid: int) -> dict[int, psutil.Process]:
    """Live (not zombie) processes whose session id is ``sid``."""
    found = {}
    for pid in psutil.pids():
        try:
            if os.getsid(pid) != sid:
                continue
            proc = psutil.Process(pid)
            if proc.status() != psutil.STATUS_ZOMBIE:
                found[pid] = proc
        except (OSError, psutil.Error):
            continue
    return found


def _kill_session(sid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(sid, signal.SIGKILL)
    for pid in _session_members(sid):  # anything that left the process group but not the session
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def watch_job(args: Sequence[str], deadline_s: float, scan_s: float = SCAN_S) -> JobRun:
    """Run ``args`` in a session of its own, stdout and stderr merged and stamped line by line, watching every
    process of the session until none is left; SIGKILL the session after ``deadline_s`` seconds."""
    started = time.monotonic()
    proc = subprocess.Popen(list(args), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            encoding="utf-8", errors="replace", start_new_session=True, bufsize=1)
    sid = proc.pid
    lines: list[tuple[float, str]] = []
    reader = threading.Thread(target=_read_lines, args=(proc.stdout, lines), daemon=True)
    reader.start()
    seen: dict[int, ProcSeen] = {}
    timed_out = False
    while True:
        proc.poll()  # reaps the launcher once it exits: a zombie launcher counts as gone anyway
        now = time.monotonic()
        alive = _session_members(sid)
        for pid, member in alive.items():
            record = seen.get(pid)
            if record is None:
                try:
                    cmdline, ppid, created = tuple(member.cmdline()), member.ppid(), member.create_time()
                except psutil.Error:
                    continue
                seen[pid] = ProcSeen(pid, ppid, cmdline, created, now, now)
            else:
                record.last_seen = now
        for pid, record in seen.items():
            if pid not in alive and record.gone_at is None:
                record.gone_at = now
        if not alive and proc.returncode is not None:
            ended = now
            break
        if now - started > deadline_s:
            timed_out = True
            _kill_session(sid)
            proc.wait()
            ended = time.monotonic()
            for record in seen.values():
                if record.gone_at is None:
                    record.gone_at = ended
            break
        time.sleep(scan_s)
    reader.join(timeout=10)
    run = JobRun(proc.returncode, started, ended, timed_out, lines, seen, sid)
    run.rank_pids = rank_pids(seen, sid)
    return run


def rank_pids(seen: dict[int, ProcSeen], launcher: int) -> list[int]:
    """The ranks: the launcher's children running its very command line (forked), in creation order (rank 0
    first: Lightning's fork launcher starts them in rank order)."""
    parent = seen.get(launcher)
    if parent is None:
        return []
    children = [p for p in seen.values() if p.ppid == launcher and p.cmdline == parent.cmdline]
    return [p.pid for p in sorted(children, key=lambda p: (p.create_time, p.pid))]


# -- the job ---------------------------------------------------------------------------------------------------
def job_command(run_dir: Path, timeout_s: float, poll_s: float, fault: Optional[tuple[str, int, int]] = None,
                resume: bool = False) -> list[str]:
    """The default training job with FaultTolerance, one epoch, and ``fault=(kind, rank, step)`` injected."""
    args = [sys.executable, "-m", "lightning_dist.train", "strategy.start_method=fork", "trainer.max_epochs=1",
            "callbacks=[checkpoint,fault_tolerance]", f"callbacks.fault_tolerance.timeout_s={timeout_s:g}",
            f"callbacks.fault_tolerance.poll_s={poll_s:g}", "trainer.enable_progress_bar=false"]
    if fault is not None:
        kind, rank, step = fault
        node = "+callbacks.inject"
        args += [f"{node}._target_=lightning_dist.testing.InjectFault", f"{node}.kind={kind}", f"{node}.rank={rank}",
                 f"{node}.step={step}"]
    if resume:
        args.append("resume=auto")
    return args + [f"hydra.run.dir={run_dir}"]


def plan_trials(n: int, seed: int, quick: bool = False) -> list[tuple[str, int, int]]:
    """``(kind, victim rank, step)`` per trial, or ``--quick``'s fixed three. The (kind, victim) pairs come in
    rounds of all six, each round shuffled (so every kind and every victim gets its share, in a random order);
    the step is drawn uniformly from :data:`STEPS`. Seeded."""
    if quick:
        return list(QUICK_TRIALS)
    rng = random.Random(seed)
    combos = [(kind, rank) for kind in KINDS for rank in range(WORLD_SIZE)]
    drawn: list[tuple[str, int]] = []
    while len(drawn) < n:  # rounds of every (kind, rank) pair, each round in a random order
        drawn += rng.sample(combos, len(combos))
    return [(kind, rank, rng.randint(*STEPS)) for kind, rank in drawn[:n]]


def bound_s(kind: str, timeout_s: float, poll_s: float) -> float:
    """Seconds after the fault by which every process must be gone."""
    return timeout_s + 3 * poll_s + STALL_SLACK_S if kind == "stall" else EXIT_BOUND_S


def expected_ranks(kind: str, victim: int, world_size: int = WORLD_SIZE) -> list[int]:
    """The ranks that must write an emergency checkpoint: every rank, except a SIGKILLed one."""
    return [r for r in range(world_size) if not (kind == "kill" and r == victim)]


def inspect_checkpoints(directory: Path) -> dict[str, Any]:
    """The run's checkpoint directory after the fault: every emergency checkpoint (verified or why not) and
    every file that should not be there (a temporary file, a checkpoint failing verification or lacking its
    sidecar, a sidecar without its checkpoint)."""
    emergency, bad = [], []
    if directory.is_dir():
        for path in sorted(p for p in directory.rglob("*") if p.is_file()):
            name, rel = path.name, str(path.relative_to(directory))
            if name.startswith(".") and ".tmp" in name:
                bad.append({"file": rel, "why": "temporary file of an unfinished write"})
                continue
            if name.endswith(META_SUFFIX):
                if not path.with_name(name[: -len(META_SUFFIX)]).exists():
                    bad.append({"file": rel, "why": "sidecar without its checkpoint"})
                continue
            if not name.endswith(".ckpt"):
                continue
            try:
                meta = verify(path)
                error = None if meta.get("verified") else "no sidecar: not verifiable"
            except CheckpointError as err:
                meta, error = {}, str(err)
            match = CKPT_NAME.search(name)
            if match:
                rank = meta.get("rank", int(match.group(1)))
                step = meta.get("global_step", int(match.group(2)))
                emergency.append({"file": rel, "rank": rank, "step": step, "verified": error is None,
                                  "error": error})
            if error is not None:
                bad.append({"file": rel, "why": error})
    return {"emergency": emergency, "bad": bad}


def watchdog_verdicts(log: str) -> list[str]:
    """The watchdog's messages in a job's log, one per rank that it ended (two ranks' lines may have been
    written into one line of the shared pipe)."""
    parts = log.split(WATCHDOG_LINE)[1:]
    return [(WATCHDOG_LINE + part.split("\n", 1)[0]).strip()[:300] for part in parts]


def nearest_step(fault_step: int, steps: Sequence[int]) -> Optional[int]:
    """The step among ``steps`` closest to the fault's (the later one on a tie); None when there is none."""
    if not steps:
        return None
    return min(steps, key=lambda s: (abs(s - fault_step), -s))


def read_resume(run: JobRun, run_dir: Path) -> dict[str, Any]:
    """What the ``resume=auto`` run did: its exit code, which checkpoint it resumed from, its final step."""
    _, match = run.line_time(RESUME_LINE)
    summary_path = run_dir / "summary.json"
    global_step = None
    if summary_path.exists():
        try:
            global_step = json.loads(summary_path.read_text()).get("global_step")
        except (OSError, json.JSONDecodeError):
            global_step = None
    return {"rc": run.rc, "timed_out": run.timed_out, "seconds": run.ended - run.started,
            "resumed_from": match.group("path") if match else None,
            "resumed_kind": match.group("kind") if match else None,
            "resumed_step": int(match.group("step")) if match else None,
            "global_step": global_step}


# -- judging (pure) ----------------------------------------------------------------------------------------------
def judge_trial(record: dict[str, Any], epoch_steps: int = EPOCH_STEPS,
                world_size: int = WORLD_SIZE) -> dict[str, Any]:
    """The verdicts on one trial's record: ``within_bound``, ``nothing_lost``, ``resume_ok``, ``ok`` (all three)
    and ``problems`` (a sentence each). ``record`` holds ``kind``, ``victim``, ``step``, ``rc``, ``timed_out``,
    ``fault_seen``, ``rank_gone_s`` (one entry per rank, None if unknown), ``all_gone_s``, ``bound_s``,
    ``checkpoints`` (:func:`inspect_checkpoints`) and ``resume`` (:func:`read_resume`)."""
    problems = []
    kind, victim, step = record["kind"], record["victim"], record["step"]
    if record.get("timed_out"):
        problems.append("the job ran past its deadline and was killed")
    if not record.get("fault_seen"):
        problems.append("the fault's line never appeared")
    if record.get("rc") == 0:
        problems.append("the faulty job exited 0")
    gone = record.get("rank_gone_s") or []
    if len(gone) != world_size or any(g is None for g in gone):
        problems.append(f"{len([g for g in gone if g is not None])} of {world_size} rank processes were timed")
    bound, all_gone = record["bound_s"], record.get("all_gone_s")
    within = (not problems and all_gone is not None and all_gone <= bound
              and all(g <= bound for g in gone))
    if all_gone is not None and all_gone > bound:
        problems.append(f"the last process was gone {all_gone:.1f} s after the fault, over the {bound:.0f} s bound")

    ckpts = record.get("checkpoints") or {"emergency": [], "bad": []}
    expected = expected_ranks(kind, victim, world_size)
    found = sorted({c["rank"] for c in ckpts["emergency"] if c["verified"]})
    missing = [r for r in expected if r not in found]
    if missing:
        problems.append(f"no verified emergency checkpoint from rank{'s' if len(missing) > 1 else ''} "
                        f"{', '.join(map(str, missing))}")
    for item in ckpts["bad"]:
        problems.append(f"{item['file']}: {item['why']}")
    nothing_lost = not missing and not ckpts["bad"]

    resume = record.get("resume") or {}
    steps = sorted({c["step"] for c in ckpts["emergency"] if c["verified"]})
    want_step = nearest_step(step, steps)
    resume_problems = []
    if resume.get("timed_out"):
        resume_problems.append("the resumed run ran past its deadline")
    if resume.get("rc") != 0:
        resume_problems.append(f"the resumed run exited {resume.get('rc')}")
    if resume.get("resumed_kind") != "emergency":
        resume_problems.append(f"the resumed run did not resume from an emergency checkpoint "
                               f"(from {resume.get('resumed_from')!r})")
    elif want_step is None or resume.get("resumed_step") != want_step:
        resume_problems.append(f"the resumed run started at step {resume.get('resumed_step')}, not {want_step}")
    if resume.get("global_step") != epoch_steps:
        resume_problems.append(f"the resumed run ended at global step {resume.get('global_step')}, not {epoch_steps}")
    problems += resume_problems
    resume_ok = not resume_problems
    return {"within_bound": bool(within), "expected_ranks": expected, "found_ranks": found, "missing_ranks": missing,
            "nothing_lost": nothing_lost, "resume_ok": resume_ok, "ok": bool(within and nothing_lost and resume_ok),
            "problems": problems}


def summarize_kinds(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per fault kind: trials, how many were within the bound, lost nothing, resumed; median and maximum of the
    slowest rank's seconds from the fault until gone (``detect``) and of the all-gone seconds."""
    out = []
    for kind in [k for k in KINDS if any(r["kind"] == k for r in records)]:
        mine = [r for r in records if r["kind"] == kind]
        detect = [max(r["rank_gone_s"]) for r in mine
                  if r["rank_gone_s"] and all(g is not None for g in r["rank_gone_s"])]
        gone = [r["all_gone_s"] for r in mine if r["all_gone_s"] is not None]
        out.append({"kind": kind, "trials": len(mine), "bound_s": max(r["bound_s"] for r in mine),
                    "within": sum(r["within_bound"] for r in mine), "intact": sum(r["nothing_lost"] for r in mine),
                    "resumed": sum(r["resume_ok"] for r in mine),
                    "detect_median_s": bench.median(detect), "detect_max_s": max(detect) if detect else None,
                    "all_gone_median_s": bench.median(gone), "all_gone_max_s": max(gone) if gone else None})
    return out


def target(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The target: every trial with every rank gone within its bound and nothing lost."""
    n = len(records)
    k = sum(1 for r in records if r["within_bound"] and r["nothing_lost"])
    resumed = sum(1 for r in records if r["resume_ok"])
    met = n > 0 and k == n
    line = (f"Target: {n} of {n} trials with every rank gone within the bound and nothing lost: "
            f"{'MET' if met else 'MISSED'} ({k} of {n})")
    return {"met": met, "k": k, "n": n, "resumed": resumed, "line": line,
            "resume_line": f"Resume from the emergency checkpoints matched in {resumed} of {n} trials"}


def _secs(value: Optional[float]) -> str:
    return bench.cell(value, ".2f")


def _yes(value: bool) -> str:
    return "yes" if value else "NO"


def trial_table(records: Sequence[dict[str, Any]], world_size: int = WORLD_SIZE) -> str:
    headers = ["#", "kind", "victim", "step", "exit", *[f"rank {r} s" for r in range(world_size)], "all gone s",
               "bound s", "within", "ckpts", "intact", "resume"]
    rows = []
    for i, r in enumerate(records, start=1):
        gone = list(r["rank_gone_s"] or []) + [None] * world_size
        rows.append([i, r["kind"], r["victim"], r["step"], "-" if r["rc"] is None else r["rc"],
                     *[_secs(g) for g in gone[:world_size]], _secs(r["all_gone_s"]), f"{r['bound_s']:.0f}",
                     _yes(r["within_bound"]), f"{len(r['found_ranks'])}/{len(r['expected_ranks'])}",
                     _yes(r["nothing_lost"]), _yes(r["resume_ok"])])
    return bench.format_table(headers, rows)


def kind_table(summary: Sequence[dict[str, Any]]) -> str:
    headers = ["kind", "trials", "bound s", "within", "intact", "resumed", "every rank gone: median s", "max s",
               "all gone: median s", "max s"]
    rows = [[s["kind"], s["trials"], f"{s['bound_s']:.0f}", s["within"], s["intact"], s["resumed"],
             _secs(s["detect_median_s"]), _secs(s["detect_max_s"]), _secs(s["all_gone_median_s"]),
             _secs(s["all_gone_max_s"])] for s in summary]
    return bench.format_table(headers, rows)


def report(records: Sequence[dict[str, Any]], summary: Sequence[dict[str, Any]], goal: dict[str, Any]) -> str:
    lines = [trial_table(records), "", kind_table(summary), "", goal["line"], goal["resume_line"]]
    for i, r in enumerate(records, start=1):
        trial = f"trial {i} ({r['kind']} on rank {r['victim']} at step {r['step']})"
        for problem in r["problems"]:
            lines.append(f"  {trial}: {problem}")
        for verdict in r.get("verdicts", []):
            if STALL_VERDICT not in verdict:
                lines.append(f"  note, {trial}: not the stall verdict: {verdict}")
    return "\n".join(lines)


# -- one trial --------------------------------------------------------------------------------------------------
def run_trial(fault: tuple[str, int, int], run_dir: Path, timeout_s: float, poll_s: float,
              deadline_s: float) -> dict[str, Any]:
    kind, victim, step = fault
    job = watch_job(job_command(run_dir, timeout_s, poll_s, fault), deadline_s)
    fault_at, _ = job.line_time(FAULT_LINE)
    gone: list[Optional[float]] = []
    for pid in job.rank_pids[:WORLD_SIZE]:
        at = job.procs[pid].gone_at
        gone.append(None if fault_at is None or at is None else at - fault_at)
    gone += [None] * (WORLD_SIZE - len(gone))
    record: dict[str, Any] = {
        "kind": kind, "victim": victim, "step": step, "rc": job.rc, "timed_out": job.timed_out,
        "fault_seen": fault_at is not None,
        "fault_after_launch_s": None if fault_at is None else fault_at - job.started,
        "rank_gone_s": gone, "all_gone_s": None if fault_at is None else job.ended - fault_at,
        "bound_s": bound_s(kind, timeout_s, poll_s), "job_s": job.ended - job.started,
        "rank_pids": job.rank_pids, "processes_seen": len(job.procs),
        "watchdog_fired": WATCHDOG_LINE in job.log,
        "verdicts": watchdog_verdicts(job.log),
        "checkpoints": inspect_checkpoints(run_dir / "checkpoints"),
    }
    resumed = watch_job(job_command(run_dir, timeout_s, poll_s, resume=True), deadline_s)
    record["resume"] = read_resume(resumed, run_dir)
    record.update(judge_trial(record))
    if not record["ok"]:
        record["log_tail"] = job.log[-LOG_TAIL:]
        record["resume_log_tail"] = resumed.log[-LOG_TAIL:]
    return record


# -- the plot ---------------------------------------------------------------------------------------------------
COLORS = {"raise": "tab:blue", "kill": "tab:red", "stall": "tab:green"}


def plot(records: Sequence[dict[str, Any]], path: Path) -> Path:
    fig, (ax,) = bench.figure_row(1, max(6.0, 0.35 * len(records) + 3.0))
    for kind in KINDS:
        mine = [(i, r) for i, r in enumerate(records, start=1) if r["kind"] == kind]
        if not mine:
            continue
        ok = [(i, r["all_gone_s"]) for i, r in mine if r["all_gone_s"] is not None and r["ok"]]
        bad = [(i, r["all_gone_s"] if r["all_gone_s"] is not None else r["job_s"]) for i, r in mine if not r["ok"]]
        if ok:
            ax.plot(*zip(*ok), "o", color=COLORS[kind], label=f"{kind}")
        if bad:
            ax.plot(*zip(*bad), "x", color=COLORS[kind], ms=9, mew=2, label=f"{kind}: failed")
        ranks = [(i, g) for i, r in mine for g in r["rank_gone_s"] if g is not None]
        if ranks:
            ax.plot(*zip(*ranks), ".", color=COLORS[kind], alpha=0.35, ms=5)
    for value in sorted({r["bound_s"] for r in records}):
        kinds = sorted({r["kind"] for r in records if r["bound_s"] == value})
        ax.axhline(value, color="gray", ls="--", lw=1)
        ax.annotate(f"bound {value:.0f} s ({', '.join(kinds)})", (0.5, value), xycoords=("axes fraction", "data"),
                    ha="center", va="bottom", fontsize="small", color="gray")
    ax.set(xlabel="trial", ylabel="seconds from the fault until every process was gone",
           title=f"FaultTolerance: {len(records)} faults on {WORLD_SIZE} CPU ranks (small dots: each rank)")
    ax.set_xticks(range(1, len(records) + 1))
    ax.set_ylim(bottom=min(0.0, *[g for r in records for g in r["rank_gone_s"] if g is not None]) - 0.5)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize="small", loc="upper left")
    fig.savefig(path, dpi=110)
    return path


# -- main -------------------------------------------------------------------------------------------------------
def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    cli = bench.parser("faults", __doc__)
    cli.add_argument("--trials", type=int, default=20)
    cli.add_argument("--seed", type=int, default=0, help="seeds the kinds, ranks and steps drawn")
    cli.add_argument("--timeout", type=float, default=TIMEOUT_S, help="FaultTolerance(timeout_s=...)")
    cli.add_argument("--deadline", type=float, default=DEADLINE_S, help="seconds a launched job may run")
    cli.add_argument("--quick", action="store_true", help="smoke run: 3 trials, one per kind, fixed steps")
    cli.add_argument("--keep-runs", action="store_true", help="keep the run directories (path printed)")
    args = cli.parse_args(argv)
    if args.trials < 1:
        cli.error(f"--trials {args.trials}: need at least 1")
    if args.timeout < 2 * POLL_S:
        cli.error(f"--timeout {args.timeout}: must be at least twice poll_s={POLL_S:g}")
    out = bench.output_dir(args.out, "faults")
    faults = plan_trials(args.trials, args.seed, args.quick)
    workdir = Path(tempfile.mkdtemp(prefix="lightning_dist_faults_"))
    started = time.monotonic()
    records = []
    try:
        bench.progress(f"[faults] {len(faults)} trials, timeout_s={args.timeout:g}, poll_s={POLL_S:g}; "
                       f"runs in {workdir}")
        for i, fault in enumerate(faults, start=1):
            record = run_trial(fault, workdir / f"trial-{i:02d}", args.timeout, POLL_S, args.deadline)
            records.append(record)
            resume = record["resume"]
            bench.progress(f"  trial {i}/{len(faults)}: {fault[0]} on rank {fault[1]} at step {fault[2]}: "
                           f"exit {record['rc']}, "
                           f"ranks gone {' / '.join(_secs(g) for g in record['rank_gone_s'])} s, all gone "
                           f"{_secs(record['all_gone_s'])} s (bound {record['bound_s']:.0f}), checkpoints "
                           f"{len(record['found_ranks'])}/{len(record['expected_ranks'])}, resume "
                           f"{'ok' if record['resume_ok'] else 'FAILED'} ({resume['seconds']:.1f} s)"
                           + ("" if record["ok"] else f": {'; '.join(record['problems'])}"))
    finally:
        if args.keep_runs:
            bench.progress(f"[faults] run directories kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    wall_s = time.monotonic() - started
    summary = summarize_kinds(records)
    goal = target(records)
    text = report(records, summary, goal)
    print(text)
    bench.progress(f"[faults] {len(records)} trials in {wall_s:.0f} s")
    payload = {"meta": {**bench.environment(), "benchmark": "faults", "world_size": WORLD_SIZE, "seed": args.seed,
                        "quick": args.quick, "timeout_s": args.timeout, "poll_s": POLL_S, "deadline_s": args.deadline,
                        "epoch_steps": EPOCH_STEPS, "wall_s": wall_s,
                        "bounds_s": {kind: bound_s(kind, args.timeout, POLL_S) for kind in KINDS}},
               "records": records, "summary": summary, "target": goal}
    bench.write_results(out, "faults", text, payload, lambda path: plot(records, path))
    return payload


if __name__ == "__main__":
    main()
