"""FaultTolerance under real faults: how fast every rank is gone after a fault, what was saved, and whether the
job resumes.

Each trial (:func:`plan_trials`) injects ``raise``, ``kill`` or ``stall`` into a rank of the default training command
at a random step (:class:`~lightning_dist.testing.InjectFault`, watched by :func:`~lightning_dist.testing.watch_job`),
then resumes it with ``resume=auto``; :func:`judge_trial`. Target: every trial with every rank gone within its bound
(:func:`bound_s`) and nothing lost. Method and results: docs/benchmarks.md.
"""

from __future__ import annotations

import json
import math
import random
import re
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

from lightning_dist.benchmarks import _common as bench
from lightning_dist.fault.checkpoint import META_SUFFIX, CheckpointError, verify
from lightning_dist.testing import JobRun, ProcSeen, free_port, watch_job

KINDS = ("raise", "kill", "stall")
STEPS = (3, 18)  # the fault's global step is drawn from this range, both ends included
WORLD_SIZE = 2
EPOCH_STEPS = 23  # the digits job's optimizer steps in one epoch (1437 training samples, 32 per rank, 2 ranks)
TIMEOUT_S, POLL_S = 10.0, 1.0  # the watchdog's defaults here
STALL_SLACK_S = 15.0  # the stall bound: timeout_s + 3 * poll_s + this
EXIT_BOUND_S = 30.0  # the bound after an exception or a SIGKILL
DEADLINE_S = 120.0  # per launched job: after this the session is killed and the trial fails
SCAN_S = 0.05  # how often the job's processes are looked at
QUICK_TRIALS = (("raise", 1, 5), ("kill", 0, 6), ("stall", 1, 4))  # --quick: one of each kind, fixed
LOG_TAIL = 4000  # characters of a failed trial's logs kept in the JSON
WATCHDOG_LINE = "[lightning_dist watchdog]"  # how the watchdog's verdicts begin
STALL_VERDICT = "no rank has made progress for"  # the verdict a stall should get on every rank

FAULT_LINE = re.compile(r"\[InjectFault\] rank (\d+): (\w+) at global step (\d+)")
RESUME_LINE = re.compile(r"resume=auto: resuming from (?P<path>.+?): (?P<kind>\w+)(?: \(rank (?P<rank>\d+)\))?, "
                         r"global step (?P<step>-?\d+)")
CKPT_NAME = re.compile(r"emergency-rank(\d+)-step=(\d+)\.ckpt$")


# -- the job ---------------------------------------------------------------------------------------------------
def rank_pids(seen: dict[int, ProcSeen], launcher: int) -> list[int]:
    """The ranks: the launcher's children running its very command line (forked), in creation order (rank 0
    first: Lightning's fork launcher starts them in rank order)."""
    parent = seen.get(launcher)
    if parent is None:
        return []
    children = [p for p in seen.values() if p.ppid == launcher and p.cmdline == parent.cmdline]
    return [p.pid for p in sorted(children, key=lambda p: (p.create_time, p.pid))]


def job_command(run_dir: Path, timeout_s: float, poll_s: float, fault: Optional[tuple[str, int, int]] = None,
                resume: bool = False) -> list[str]:
    """The default training job with FaultTolerance, one epoch, and ``fault=(kind, rank, step)`` injected."""
    args = [sys.executable, "-m", "lightning_dist.train", "strategy.start_method=fork", "trainer.max_epochs=1",
            "callbacks=[checkpoint,fault_tolerance]", f"callbacks.fault_tolerance.timeout_s={timeout_s:g}",
            f"callbacks.fault_tolerance.poll_s={poll_s:g}", "trainer.enable_progress_bar=false"]
    if fault is not None:
        args += ["+callbacks.inject._target_=lightning_dist.testing.InjectFault",
                 *(f"+callbacks.inject.{key}={value}" for key, value in zip(("kind", "rank", "step"), fault))]
    return args + ["resume=auto"] * resume + [f"hydra.run.dir={run_dir}"]


def plan_trials(n: int, seed: int, quick: bool = False) -> list[tuple[str, int, int]]:
    """``(kind, victim rank, step)`` per trial, or ``--quick``'s fixed three. The (kind, victim) pairs come in
    rounds of all six, each round shuffled (so every kind and every victim gets its share, in a random order);
    the step is drawn uniformly from :data:`STEPS`. Seeded."""
    if quick:
        return list(QUICK_TRIALS)
    rng = random.Random(seed)
    combos = [(kind, rank) for kind in KINDS for rank in range(WORLD_SIZE)]
    drawn = [pair for _ in range(math.ceil(n / len(combos))) for pair in rng.sample(combos, len(combos))]
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
            if match := CKPT_NAME.search(name):
                emergency.append({"file": rel, "rank": meta.get("rank", int(match.group(1))),
                                  "step": meta.get("global_step", int(match.group(2))), "verified": error is None,
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
    try:
        global_step = json.loads((run_dir / "summary.json").read_text()).get("global_step")
    except (OSError, json.JSONDecodeError):  # the run wrote no summary, or not all of it
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
    # each job a port of its own: another job may be starting beside this one (the tests run two at a time)
    job = watch_job(job_command(run_dir, timeout_s, poll_s, fault), deadline_s, SCAN_S,
                    env={"MASTER_PORT": str(free_port())})
    fault_at, _ = job.line_time(FAULT_LINE)
    ranks = rank_pids(job.procs, job.launcher)
    victim_gone = job.procs[ranks[victim]].gone_at if victim < len(ranks) else None
    if fault_at is not None and victim_gone is not None:
        # the victim prints the fault line before it dies, but the watcher may see it gone before the reader
        # thread stamps that line: the fault happened no later than the victim's end
        fault_at = min(fault_at, victim_gone)
    gone: list[Optional[float]] = [None] * WORLD_SIZE
    for rank, pid in enumerate(ranks[:WORLD_SIZE]):
        at = job.procs[pid].gone_at
        gone[rank] = None if fault_at is None or at is None else at - fault_at
    record: dict[str, Any] = {
        "kind": kind, "victim": victim, "step": step, "rc": job.rc, "timed_out": job.timed_out,
        "fault_seen": fault_at is not None,
        "fault_after_launch_s": None if fault_at is None else fault_at - job.started,
        "rank_gone_s": gone, "all_gone_s": None if fault_at is None else job.ended - fault_at,
        "bound_s": bound_s(kind, timeout_s, poll_s), "job_s": job.ended - job.started,
        "rank_pids": ranks, "processes_seen": len(job.procs),
        "watchdog_fired": WATCHDOG_LINE in job.log,
        "verdicts": watchdog_verdicts(job.log),
        "checkpoints": inspect_checkpoints(run_dir / "checkpoints"),
    }
    resumed = watch_job(job_command(run_dir, timeout_s, poll_s, resume=True), deadline_s, SCAN_S,
                        env={"MASTER_PORT": str(free_port())})
    record["resume"] = read_resume(resumed, run_dir)
    record.update(judge_trial(record))
    if not record["ok"]:
        record["log_tail"] = job.log[-LOG_TAIL:]
        record["resume_log_tail"] = resumed.log[-LOG_TAIL:]
    return record


# -- the plot ---------------------------------------------------------------------------------------------------
COLORS = {"raise": "tab:blue", "kill": "tab:red", "stall": "tab:green"}


def plot(records: Sequence[dict[str, Any]]) -> Any:
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
    bench.style(ax, "y", xlabel="trial", ylabel="seconds from the fault until every process was gone",
                title=f"FaultTolerance: {len(records)} faults on {WORLD_SIZE} CPU ranks (small dots: each rank)",
                xticks=range(1, len(records) + 1),
                ylim=(min(0.0, *[g for r in records for g in r["rank_gone_s"] if g is not None]) - 0.5, None))
    ax.legend(fontsize="small", loc="upper left")
    return fig


# -- main -------------------------------------------------------------------------------------------------------
def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    cli = bench.parser("faults", __doc__, "3 trials, one per kind, fixed steps",
                       seed="seeds the kinds, ranks and steps drawn")
    cli.add_argument("--trials", type=int, default=20)
    cli.add_argument("--timeout", type=float, default=TIMEOUT_S, help="FaultTolerance(timeout_s=...)")
    cli.add_argument("--deadline", type=float, default=DEADLINE_S, help="seconds a launched job may run")
    cli.add_argument("--keep-runs", action="store_true", help="keep the run directories (path printed)")
    args = cli.parse_args(argv)
    bench.check_counts(cli, trials=args.trials)
    if args.timeout < 2 * POLL_S:
        cli.error(f"--timeout {args.timeout}: must be at least twice poll_s={POLL_S:g}")
    faults = plan_trials(args.trials, args.seed, args.quick)
    started = time.perf_counter()
    records = []
    with bench.scratch("faults", args.keep_runs) as workdir:
        bench.progress(f"[faults] {len(faults)} trials, timeout_s={args.timeout:g}, poll_s={POLL_S:g}; "
                       f"runs in {workdir}")
        for i, fault in enumerate(faults, start=1):
            records.append(record := run_trial(fault, workdir / f"trial-{i:02d}", args.timeout, POLL_S,
                                               args.deadline))
            bench.progress(f"  trial {i}/{len(faults)}: {fault[0]} on rank {fault[1]} at step {fault[2]}: "
                           f"exit {record['rc']}, ranks gone {' / '.join(_secs(g) for g in record['rank_gone_s'])} s, "
                           f"all gone {_secs(record['all_gone_s'])} s (bound {record['bound_s']:.0f}), checkpoints "
                           f"{len(record['found_ranks'])}/{len(record['expected_ranks'])}, resume "
                           f"{'ok' if record['resume_ok'] else 'FAILED'} ({record['resume']['seconds']:.1f} s)"
                           + ("" if record["ok"] else f": {'; '.join(record['problems'])}"))
    summary, goal = summarize_kinds(records), target(records)
    return bench.finish("faults", args.out, started, [report(records, summary, goal)],
                        {"records": records, "summary": summary, "target": goal}, lambda: plot(records),
                        world_size=WORLD_SIZE, seed=args.seed, quick=args.quick, timeout_s=args.timeout, poll_s=POLL_S,
                        deadline_s=args.deadline, epoch_steps=EPOCH_STEPS,
                        bounds_s={kind: bound_s(kind, args.timeout, POLL_S) for kind in KINDS})


if __name__ == "__main__":
    main()
