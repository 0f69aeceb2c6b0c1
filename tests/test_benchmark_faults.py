"""The faults benchmark's pure judging and summaries, on hand-made records; its quick run (3 launched jobs with a
fault and 3 resumed runs) in the benchmark tier (``pytest -m benchmark``)."""

import json

import pytest
import torch

from lightning_dist.benchmarks import faults
from lightning_dist.benchmarks.faults import (
    EPOCH_STEPS,
    KINDS,
    QUICK_TRIALS,
    STEPS,
    ProcSeen,
    bound_s,
    expected_ranks,
    inspect_checkpoints,
    judge_trial,
    nearest_step,
    plan_trials,
    rank_pids,
    report,
    summarize_kinds,
    target,
    trial_table,
    watchdog_verdicts,
)
from lightning_dist.fault.checkpoint import save_checkpoint


# -- hand-made records ------------------------------------------------------------------------------------------
def _ckpt(rank, step=7, verified=True):
    return {"file": f"emergency/emergency-rank{rank}-step={step}.ckpt", "rank": rank, "step": step,
            "verified": verified, "error": None if verified else "checkpoint is truncated"}


def _record(kind="raise", victim=1, step=7, gone=(0.4, 0.1), all_gone=1.2, ranks=(0, 1), bad=(), resume=None,
            **extra):
    record = {"kind": kind, "victim": victim, "step": step, "rc": 1, "timed_out": False, "fault_seen": True,
              "rank_gone_s": list(gone), "all_gone_s": all_gone, "bound_s": bound_s(kind, 10, 1),
              "checkpoints": {"emergency": [_ckpt(r, step) for r in ranks], "bad": list(bad)},
              "resume": {"rc": 0, "timed_out": False, "resumed_from": f"/run/emergency-rank0-step={step}.ckpt",
                         "resumed_kind": "emergency", "resumed_step": step, "global_step": EPOCH_STEPS,
                         **(resume or {})}}
    record.update(extra)
    return record


def _judged(**kwargs):
    record = _record(**kwargs)
    record.update(judge_trial(record))
    return record


def test_bounds_and_expected_checkpoints():
    assert bound_s("stall", 10, 1) == 28 and bound_s("stall", 6, 1) == 24
    assert bound_s("raise", 10, 1) == bound_s("kill", 10, 1) == 30
    assert expected_ranks("raise", 1) == [0, 1] and expected_ranks("stall", 0) == [0, 1]
    assert expected_ranks("kill", 0) == [1] and expected_ranks("kill", 1) == [0]


def test_a_good_trial_is_ok():
    verdict = judge_trial(_record())
    assert verdict["ok"] and verdict["within_bound"] and verdict["nothing_lost"] and verdict["resume_ok"]
    assert verdict["problems"] == [] and verdict["found_ranks"] == verdict["expected_ranks"] == [0, 1]
    killed = judge_trial(_record(kind="kill", victim=0, ranks=(1,)))  # the victim of a SIGKILL cannot save
    assert killed["ok"] and killed["expected_ranks"] == [1]


def test_over_the_bound_fails():
    late = judge_trial(_record(all_gone=30.5))
    assert not late["within_bound"] and not late["ok"] and late["nothing_lost"]
    assert any("over the 30 s bound" in p for p in late["problems"])
    stall = judge_trial(_record(kind="stall", gone=(11.0, 29.0), all_gone=29.1))  # the stall bound is 28 s
    assert not stall["within_bound"]
    assert judge_trial(_record(kind="stall", gone=(11.0, 11.2), all_gone=12.0))["within_bound"]


@pytest.mark.parametrize("change", [
    {"timed_out": True}, {"rc": 0}, {"fault_seen": False, "all_gone_s": None}, {"rank_gone_s": [0.1, None]},
    {"rank_gone_s": [0.1]},
])
def test_a_killed_job_a_clean_exit_or_an_unseen_fault_is_not_within_the_bound(change):
    record = _record()
    record.update(change)
    verdict = judge_trial(record)
    assert not verdict["within_bound"] and not verdict["ok"] and verdict["problems"]


def test_a_missing_or_unverified_checkpoint_or_a_stray_file_loses_something():
    missing = judge_trial(_record(ranks=(1,)))
    assert not missing["nothing_lost"] and missing["missing_ranks"] == [0] and not missing["ok"]
    assert any("no verified emergency checkpoint from rank 0" in p for p in missing["problems"])
    record = _record()
    record["checkpoints"]["emergency"][1] = _ckpt(1, verified=False)
    unverified = judge_trial(record)
    assert not unverified["nothing_lost"] and unverified["missing_ranks"] == [1]
    stray = judge_trial(_record(bad=[{"file": "emergency/.x.ckpt.tmp-1-ab", "why": "temporary file"}]))
    assert not stray["nothing_lost"] and stray["within_bound"] and not stray["ok"]
    # a SIGKILL whose survivor saved nothing
    assert not judge_trial(_record(kind="kill", victim=1, ranks=()))["nothing_lost"]


@pytest.mark.parametrize("resume, why", [
    ({"rc": 1}, "exited 1"),
    ({"timed_out": True}, "deadline"),
    ({"global_step": 20}, "global step 20"),
    ({"resumed_kind": "regular", "resumed_step": 23}, "did not resume from an emergency"),
    ({"resumed_kind": None, "resumed_from": None, "resumed_step": None}, "did not resume from an emergency"),
    ({"resumed_step": 5}, "started at step 5, not 7"),
])
def test_a_failed_resume_is_reported(resume, why):
    verdict = judge_trial(_record(resume=resume))
    assert not verdict["resume_ok"] and not verdict["ok"] and verdict["within_bound"] and verdict["nothing_lost"]
    assert any(why in p for p in verdict["problems"]), verdict["problems"]


def test_resume_from_the_nearest_step_when_none_was_written_at_the_fault():
    record = _record(step=7)
    record["checkpoints"]["emergency"] = [_ckpt(0, step=8), _ckpt(1, step=8)]
    record["resume"]["resumed_step"] = 8
    assert judge_trial(record)["resume_ok"]
    assert nearest_step(7, [5, 8]) == 8 and nearest_step(7, [6, 8]) == 8 and nearest_step(7, [3]) == 3
    assert nearest_step(7, []) is None


def test_summary_target_and_table():
    records = [_judged(kind="raise", gone=(0.1, 0.3), all_gone=1.0), _judged(kind="raise", gone=(0.2, 0.5),
                                                                              all_gone=1.4),
               _judged(kind="raise", gone=(0.1, 2.0), all_gone=3.0),
               _judged(kind="stall", gone=(11.0, 12.0), all_gone=13.0),
               _judged(kind="stall", gone=(11.0, 40.0), all_gone=41.0),  # over the bound
               _judged(kind="kill", victim=0, ranks=(), gone=(0.0, 0.2), all_gone=1.1)]  # nothing saved
    by_kind = {s["kind"]: s for s in summarize_kinds(records)}
    assert list(by_kind) == ["raise", "kill", "stall"]
    assert by_kind["raise"]["detect_median_s"] == pytest.approx(0.5)  # slowest ranks 0.3, 0.5, 2.0
    assert by_kind["raise"]["detect_max_s"] == pytest.approx(2.0)
    assert by_kind["raise"]["all_gone_median_s"] == pytest.approx(1.4)
    assert by_kind["stall"]["within"] == 1 and by_kind["stall"]["all_gone_max_s"] == pytest.approx(41.0)
    assert by_kind["stall"]["bound_s"] == 28
    assert by_kind["kill"]["intact"] == 0 and by_kind["kill"]["within"] == 1
    goal = target(records)
    assert not goal["met"] and goal["k"] == 4 and goal["n"] == 6
    assert goal["line"] == ("Target: 6 of 6 trials with every rank gone within the bound and nothing lost: "
                            "MISSED (4 of 6)")
    assert target(records[:4])["met"] and "MET (4 of 4)" in target(records[:4])["line"]
    assert not target([])["met"]
    text = report(records, list(by_kind.values()), goal)
    table = trial_table(records)
    assert table.count("\n") == len(records) + 1 and "0/1" in table and "NO" in table
    assert "trial 5 (stall on rank 1 at step 7)" in text and "MISSED" in text and "note" not in text
    records[3]["verdicts"] = ["[lightning_dist watchdog] no rank has made progress for 10 s: ...; this is rank 0",
                              "[lightning_dist watchdog] rank 1: the rendezvous store has not answered 3 polls"]
    text = report(records, list(by_kind.values()), goal)
    assert "note, trial 4 (stall on rank 1 at step 7): not the stall verdict: [lightning_dist watchdog] rank 1: " \
           "the rendezvous store" in text and text.count("note,") == 1


def test_plan_is_seeded_and_within_range():
    plan = plan_trials(40, seed=3)
    assert plan == plan_trials(40, seed=3) and plan != plan_trials(40, seed=4)
    assert all(k in KINDS and r in (0, 1) and STEPS[0] <= s <= STEPS[1] for k, r, s in plan)
    pairs = [(k, r) for k, r, _ in plan]
    assert all(pairs.count((k, r)) in (6, 7) for k in KINDS for r in (0, 1))  # 40 = 6 rounds of 6 and 4 more
    assert sorted((k, r) for k, r, _ in plan_trials(6, seed=1)) == sorted((k, r) for k in KINDS for r in (0, 1))
    assert len({s for _, _, s in plan}) > 5
    assert plan_trials(20, seed=0, quick=True) == list(QUICK_TRIALS)
    assert sorted(k for k, _, _ in QUICK_TRIALS) == sorted(KINDS)


def test_inspect_checkpoints_verifies_and_flags_stray_files(tmp_path):
    emergency = tmp_path / "emergency"
    emergency.mkdir()
    state = {"global_step": 7, "w": torch.zeros(3)}
    for rank in (0, 1):
        save_checkpoint(state, emergency / f"emergency-rank{rank}-step=7.ckpt", meta={"kind": "emergency",
                                                                                        "rank": rank})
    good = inspect_checkpoints(tmp_path)
    assert good["bad"] == [] and [(c["rank"], c["step"], c["verified"]) for c in good["emergency"]] == [
        (0, 7, True), (1, 7, True)]
    damaged = emergency / "emergency-rank1-step=7.ckpt"
    damaged.write_bytes(damaged.read_bytes()[:-10])  # truncated
    (emergency / ".emergency-rank0-step=8.ckpt.tmp-123-abcd").write_bytes(b"half")
    (tmp_path / "orphan.ckpt.meta.json").write_text("{}")
    torch.save({"global_step": 3}, tmp_path / "nosidecar.ckpt")
    found = inspect_checkpoints(tmp_path)
    assert [(c["rank"], c["verified"]) for c in found["emergency"]] == [(0, True), (1, False)]
    why = {item["file"]: item["why"] for item in found["bad"]}
    assert "truncated" in why["emergency/emergency-rank1-step=7.ckpt"]
    assert "temporary" in why["emergency/.emergency-rank0-step=8.ckpt.tmp-123-abcd"]
    assert "without its checkpoint" in why["orphan.ckpt.meta.json"] and "no sidecar" in why["nosidecar.ckpt"]
    assert inspect_checkpoints(tmp_path / "absent") == {"emergency": [], "bad": []}


def test_rank_pids_are_the_launchers_forked_children_in_creation_order():
    cmd = ("python", "-m", "lightning_dist.train")
    seen = {pid: ProcSeen(pid, ppid, c, created, 0.0, 0.0) for pid, ppid, c, created in [
        (100, 1, cmd, 0.0), (120, 100, cmd, 5.01), (110, 100, cmd, 5.0),  # pid order disagrees: creation wins
        (130, 100, ("python", "-c", "from multiprocessing.resource_tracker import main"), 4.0),
        (140, 120, cmd, 6.0)]}  # a rank's own child is not a rank
    assert rank_pids(seen, 100) == [110, 120]
    assert rank_pids(seen, 999) == []


def test_watchdog_verdicts_are_split_per_rank():
    log = ("noise\n[lightning_dist watchdog] no rank has made progress: this is rank 1, ending it"
           "[lightning_dist watchdog] no rank has made progress: this is rank 0, ending it\nmore\n")
    assert watchdog_verdicts(log) == ["[lightning_dist watchdog] no rank has made progress: this is rank 1, ending it",
                                      "[lightning_dist watchdog] no rank has made progress: this is rank 0, ending it"]
    assert watchdog_verdicts("nothing here\n") == []


# -- python -m lightning_dist.benchmarks.faults --quick ----------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.benchmark
@pytest.mark.timeout(600)  # the benchmark's own deadline per job (120 s) is well inside it
def test_the_faults_benchmarks_quick_run_writes_json_table_and_plot(tmp_path):
    out = tmp_path / "bench"
    payload = faults.main(["--quick", "--timeout", "6", "--out", str(out)])
    saved = json.loads((out / "faults.json").read_text())
    records = saved["records"]
    assert [(r["kind"], r["victim"], r["step"]) for r in records] == list(faults.QUICK_TRIALS)
    for r in records:
        assert r["ok"], (r["kind"], r["problems"], r.get("log_tail", "")[-2000:])
        assert r["rc"] not in (0, None) and not r["timed_out"] and len(r["rank_pids"]) == 2
        assert all(0 <= g <= r["bound_s"] for g in r["rank_gone_s"]) and r["all_gone_s"] <= r["bound_s"]
        assert r["resume"]["global_step"] == faults.EPOCH_STEPS and r["resume"]["resumed_step"] == r["step"]
        assert r["found_ranks"] == r["expected_ranks"]
    stall = records[2]
    assert stall["watchdog_fired"] and stall["rank_gone_s"][0] >= 6  # the watchdog's timeout, not a crash
    assert payload["target"]["met"] and payload["target"]["k"] == 3
    text = (out / "faults.txt").read_text()
    assert "Target: 3 of 3 trials" in text and "MET (3 of 3)" in text and "stall" in text
    assert (out / "faults.png").read_bytes().startswith(b"\x89PNG")
