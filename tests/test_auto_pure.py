"""``sync="auto"``'s decision rule on recorded measurements (lightning_dist.sync.auto_rule), and its settings' checks:
no rank is launched.

The measurements are the shape of the sync benchmark's LM on 4 ranks (one 1.9 MB bucket of fp32 gradients, a 40 ms
compute-only step), with each codec's bytes as the codecs send them and the wire time of a ring all-reduce at each link
speed: what the fit would record on such links. Each link speed and optimizer maps to the choice a reader of the
benchmark's tables expects.
"""

from __future__ import annotations

import pytest

from lightning_dist.sync import Auto, as_sync
from lightning_dist.sync.auto_bound import measure_what_can_win
from lightning_dist.sync.auto_rule import (
    ADAM,
    ADAM_LOSS_BOUND,
    DENSE_MARGIN,
    DILOCO_CANDIDATES,
    MIN_SYNCS,
    OTHER,
    SGD,
    Limits,
    Row,
    candidate_rows,
    decide,
    predict_step,
    table,
)

BUCKET = 1.9e6  # bytes of fp32 gradients
RANKS = 4
COMPUTE_S = 0.040
# bytes each codec puts on the wire per byte of fp32 gradient, and its coding seconds per bucket
CODECS = {"none": (1.0, 0.0), "fp16": (0.5, 0.001), "int8": (0.26, 0.006), "int4": (0.14, 0.007),
          "powersgd": (0.03, 0.012), "topk": (0.02, 0.008), "sign": (0.035, 0.004)}
RATES = {"10Mbit": 10e6, "100Mbit": 100e6, "1Gbit": 1e9, "unshaped": 40e9}


def recorded(rate_bit_s: float) -> tuple[dict, dict]:
    """The dense step and every codec's figures at this link speed: a ring all-reduce moves 2 (n-1)/n of the payload
    through each rank's link."""
    measured = {"compute_s": COMPUTE_S, "ready_s": [0.030]}
    codecs = {}
    for name, (ratio, coding) in CODECS.items():
        sent = BUCKET * ratio * 2 * (RANKS - 1) / RANKS
        codecs[name] = {"coding_s": [coding], "wire_s": [sent * 8 / rate_bit_s], "bytes": [sent]}
    return measured, codecs


def choice(rate: str, optimizer: str, limits: Limits = Limits(), **kwargs) -> str:
    measured, codecs = recorded(RATES[rate])
    rows = candidate_rows(measured, codecs, optimizer, compressors=("fp16", "int8", "powersgd", "topk"), **kwargs)
    return decide(rows, limits).choice


@pytest.mark.parametrize(("rate", "optimizer", "expected"), [
    # dense spends ~2.3 s on the wire per step: int8 pseudo-gradients every 50 steps cost 12 ms a step, and even at
    # 1.24 steps per dense step DiLoCo is 2x ahead of OneBitAdam's 1 bit of momentum every step
    ("10Mbit", ADAM, "diloco50/int8"),
    ("100Mbit", ADAM, "diloco50/int8"),  # 51 ms against OneBitAdam's 54: the closest call of the table
    ("1Gbit", ADAM, "onebit_adam"),  # the wire no longer pays for DiLoCo's 1.23 steps; OneBitAdam's 5 ms does
    ("unshaped", ADAM, "dense"),  # nothing pays on a local link
    # under SGD the digits job's factors: DiLoCo reaches dense's loss in fewer steps (0.43 at H=10, 0.69 at H=50), so
    # it pays even on a local link; at 10 Mbit/s H=10's sync every 10 steps (60 ms a step) tips it to H=50
    ("10Mbit", SGD, "diloco50/int8"),
    ("100Mbit", SGD, "diloco10/int8"),
    ("1Gbit", SGD, "diloco10/int8"),
    ("unshaped", SGD, "diloco10/int8"),
])
def test_each_link_speed_and_optimizer_to_its_choice(rate, optimizer, expected):
    assert choice(rate, optimizer) == expected


@pytest.mark.parametrize("rate", RATES)
def test_under_adam_never_a_per_step_compressor_above_the_bound(rate):
    measured, codecs = recorded(RATES[rate])
    # top-k sends the fewest bytes of all: it would win on bytes alone
    rows = candidate_rows(measured, codecs, ADAM, compressors=("topk", "int8", "fp16", "powersgd"))
    decision = decide(rows)
    chosen = decision.row()
    assert chosen.kind != "compressor"
    topk = decision.row("topk")
    assert topk.excluded is not None and "above the 1% bound" in topk.excluded
    assert ADAM_LOSS_BOUND == 0.01
    # an unmeasured compressor is excluded under Adam too
    assert "never measured" in decision.row("int8").excluded


def test_limits_narrow_the_candidates():
    measured, codecs = recorded(RATES["10Mbit"])
    rows = candidate_rows(measured, codecs, SGD, compressors=("fp16", "int8", "topk"))
    assert decide(rows, Limits(exact=True)).choice == "fp16"  # the lossless cast, not DiLoCo
    exact = decide(rows, Limits(exact=True))
    assert exact.row("diloco50").excluded.startswith("exact=True")
    # a bytes budget under dense's and int8's: what remains is under it
    budget = 0.2 * BUCKET
    decision = decide(rows, Limits(max_bytes_per_step=budget))
    assert decision.row().bytes_per_step <= budget
    assert decision.row("dense").excluded.startswith(f"{decision.row('dense').bytes_per_step:.0f} bytes per step")
    assert "dense excluded" in decision.why
    assert decide(rows, Limits(methods=("int8",))).choice == "int8"
    none = decide(rows, Limits(max_bytes_per_step=1.0, exact=True))  # the fit goes on dense, and the log says why
    assert none.choice == "dense" and none.why.startswith("no candidate is allowed (dense: ")


def test_dense_is_kept_within_the_margin():
    rows = [Row("dense", "dense", 0.100, 1e6), Row("int8", "compressor", 0.100 / (1 + DENSE_MARGIN / 2), 2.5e5)]
    decision = decide(rows)
    assert decision.choice == "dense" and "margin" in decision.why
    rows[1] = Row("int8", "compressor", 0.100 / (1 + 2 * DENSE_MARGIN), 2.5e5)
    assert decide(rows).choice == "int8"


def test_the_steps_factor_weighs_diloco():
    # a DiLoCo step 20% faster than dense but needing 1.23 steps per dense step loses to dense
    rows = [Row("dense", "dense", 0.100, 1e6), Row("diloco50", "diloco", 0.080, 2e4, factor=1.23, every=50)]
    assert decide(rows).choice == "dense"
    rows[1] = Row("diloco50", "diloco", 0.050, 2e4, factor=1.23, every=50)
    decision = decide(rows)
    assert decision.choice == "diloco50" and decision.row().score == pytest.approx(0.0615)


def test_diloco_needs_enough_syncs_left():
    measured, codecs = recorded(RATES["10Mbit"])
    rows = candidate_rows(measured, codecs, ADAM, remaining_steps=50 * (MIN_SYNCS[ADAM]["flat"] - 1))
    assert "syncs" in next(r for r in rows if r.label == "diloco50").excluded
    assert next(r for r in rows if r.label == "diloco10/int8").excluded is None
    assert decide(rows).choice == "onebit_adam"  # (133 ms a step against diloco10/int8's 1.6 x 100 ms)
    # the digits job's H=50 reached dense's loss at 16 syncs: under SGD the bound is 16 on flat workers too
    for syncs, excluded in ((MIN_SYNCS[SGD]["flat"] - 1, True), (MIN_SYNCS[SGD]["flat"], False)):
        rows = candidate_rows(measured, codecs, SGD, remaining_steps=50 * syncs)
        assert (next(r for r in rows if r.label == "diloco50").excluded is not None) == excluded, syncs


def test_hosts_workers_need_fewer_syncs_left_than_flat_ones():
    measured, codecs = recorded(RATES["10Mbit"])
    across = {n: {k: [v[0] / 2] for k, v in codecs[n].items()} for n in ("none", "int8")}
    left = 50 * MIN_SYNCS[ADAM]["two_tier"] - 4  # 16 syncs of H=50 (the last at the fit's end): enough for 2 hosts'
    # workers, not for 4 flat ones (under Adam: the LM's)
    hosts = candidate_rows(measured, codecs, ADAM, workers="two_tier", across=across, remaining_steps=left)
    flat = candidate_rows(measured, codecs, ADAM, remaining_steps=left)
    assert next(r for r in hosts if r.label == "diloco50").excluded is None
    assert "fewer than the 24" in next(r for r in flat if r.label == "diloco50").excluded
    assert MIN_SYNCS[ADAM]["two_tier"] < MIN_SYNCS[ADAM]["flat"]


def test_two_tier_uses_the_sync_across_hosts_and_the_host_factor():
    measured, codecs = recorded(RATES["10Mbit"])
    across = {n: {k: [v[0] / 2] for k, v in codecs[n].items()} for n in ("none", "int8")}  # half the buckets each
    rows = candidate_rows(measured, codecs, ADAM, workers="two_tier", across=across, bytes_scale=2.0)
    diloco = next(r for r in rows if r.label == "diloco50")
    assert diloco.factor == 1.0  # the LM's on 2 hosts' workers (1.23 on 4 flat ones)
    assert diloco.bytes_per_step == pytest.approx(2.0 * across["none"]["bytes"][0] / 50)
    assert diloco.predicted_step_s == pytest.approx(COMPUTE_S + (across["none"]["wire_s"][0]) / 50)


def test_the_steps_factor_is_the_optimizer_familys_own_job():
    """Under SGD DiLoCo's factors are the digits job's, under Adam the LM's, and another family counts as Adam."""
    measured, codecs = recorded(RATES["1Gbit"])
    factors = {family: {r.label: (r.factor, r.quality) for r in candidate_rows(measured, codecs, family)
                        if r.kind == "diloco"} for family in (ADAM, SGD, OTHER)}
    assert factors[SGD]["diloco10/int8"][0] == 0.43 and factors[SGD]["diloco10/int8"][1].startswith("digits")
    assert factors[ADAM]["diloco10/int8"][0] == 1.6 and factors[ADAM]["diloco10/int8"][1].startswith("LM")
    assert factors[OTHER] == factors[ADAM]
    assert {d.label: d.factor(SGD).of("two_tier") for d in DILOCO_CANDIDATES} == {
        "diloco50": 0.69, "diloco50/int8": 0.69, "diloco10/int8": 0.43}


COMPRESSORS = ("fp16", "int8", "powersgd", "topk")


def bounded(rate: str, optimizer: str, workers: str = "flat", limits: Limits = Limits()):
    """The rows :func:`measure_what_can_win` leaves, and the measurements it made in order, on the recorded figures
    (across hosts: half of every codec's, a host's part), beside the rows of every candidate measured."""
    measured, codecs = recorded(RATES[rate])
    across = {n: {k: [v[0] / 2] for k, v in codecs[n].items()} for n in ("none", "int8")}
    figures = {**{("flat", c): f for c, f in codecs.items()},
               **({("across", c): f for c, f in across.items()} if workers == "two_tier" else {})}
    made = []

    def rows_of(known):
        flat = {c: f for (where, c), f in known.items() if where == "flat"}
        hosts = {c: f for (where, c), f in known.items() if where == "across"} if workers == "two_tier" else None
        return candidate_rows(measured, flat, optimizer, workers, hosts, compressors=COMPRESSORS)

    def measure(unit):
        made.append(unit)
        return figures[unit]

    zeros = {u: {k: [0.0] * len(v) for k, v in f.items()} for u, f in figures.items()}
    rows, known = measure_what_can_win(rows_of, zeros, measure, workers, limits)
    assert list(known) == made and len(set(made)) == len(made)  # each measurement once
    return rows, made, rows_of(figures)


LIMITS = (Limits(), Limits(exact=True), Limits(max_bytes_per_step=0.2 * BUCKET), Limits(methods=("int8",)),
          Limits(methods=("diloco50",)))


@pytest.mark.parametrize("workers", ["flat", "two_tier"])
@pytest.mark.parametrize("optimizer", [ADAM, SGD, OTHER])
@pytest.mark.parametrize("rate", RATES)
def test_measuring_only_what_can_win_makes_every_measured_choice(rate, optimizer, workers):
    """The pruned measurement's choice, and its row, are those of every candidate measured, under every limit; what
    it left out is excluded with its bound."""
    for limits in LIMITS:
        rows, made, full = bounded(rate, optimizer, workers, limits)
        ours, every = decide(rows, limits), decide(full, limits)
        assert ours.choice == every.choice, (limits, made)
        assert ours.row().predicted_step_s == every.row().predicted_step_s
        for r in rows:
            if r.predicted_step_s is None and r.kind != "compressor":  # (compressors unmeasured by quality, as ever)
                assert "not measured" in r.excluded, r


def test_under_sgd_diloco_rules_out_every_per_step_method_unmeasured():
    """DiLoCo's steps factor under SGD (0.43 at H=10) puts its bound below every per-step method's: once its own sync
    is measured, nothing else can win, dense included."""
    rows, made, _ = bounded("100Mbit", SGD)
    assert made == [("flat", "int8")]
    decision = decide(rows)
    assert decision.choice == "diloco10/int8"
    assert decision.row("dense").excluded.startswith("not measured: at least 40.0 ms per dense step, above "
                                                     "diloco10/int8's")
    assert "dense excluded (not measured" in decision.why
    _, made, _ = bounded("100Mbit", SGD, "two_tier")  # hosts' workers: their sync across hosts alone
    assert made == [("across", "int8")]


def test_on_a_local_link_dense_alone_is_measured_under_adam():
    """Every Adam candidate's bound is the compute-only step (factor 1 or more): with dense within the margin of it,
    nothing else can pay for its risk."""
    rows, made, _ = bounded("unshaped", ADAM)
    assert made == [("flat", "none")]
    assert decide(rows).choice == "dense"
    assert "within the 5% margin of dense's" in decide(rows).row("onebit_adam").excluded
    _, made, _ = bounded("10Mbit", ADAM)  # a slow link: every candidate that could beat dense is measured
    assert ("flat", "none") in made and ("flat", "sign") in made


def test_the_prediction_replays_the_queue():
    assert predict_step(0.04, [0.01, 0.02], [0.005, 0.030]) == pytest.approx(0.04 + 0.030)
    measured, codecs = recorded(RATES["1Gbit"])
    rows = candidate_rows(measured, codecs, SGD)
    dense = next(r for r in rows if r.kind == "dense")
    assert dense.predicted_step_s == pytest.approx(COMPUTE_S + codecs["none"]["wire_s"][0])


def test_the_table_names_the_choice_and_every_exclusion():
    measured, codecs = recorded(RATES["1Gbit"])
    decision = decide(candidate_rows(measured, codecs, ADAM, compressors=("topk",)))
    text = table(decision)
    assert text.splitlines()[-1].startswith("auto chose onebit_adam: ")
    assert "*onebit_adam" in text and "excluded: +34.65% held-out loss" in text
    assert decision.as_dict()["choice"] == "onebit_adam"


def test_the_settings_check_their_values():
    assert as_sync("auto") == Auto()
    assert as_sync({"name": "auto", "drift": 3.0}).drift == 3.0
    for bad, match in ((dict(steps=0), "steps=0"), (dict(compressors=["zip"]), "unknown"),
                       (dict(methods=["diloco7"]), "diloco7"), (dict(drift=0.5), "drift=0.5"),
                       (dict(max_bytes_per_step=-1), "max_bytes_per_step")):
        with pytest.raises(ValueError, match=match):
            Auto(**bad)
    from lightning_dist.compression import build_compressor

    with pytest.raises(ValueError, match="auto chooses the compressor itself"):
        Auto().check(compressor=build_compressor("int8"), hetero=None, topology="auto")


@pytest.mark.slow  # four interpreters importing the package: seconds each
def test_every_rank_measures_the_candidates_in_one_order():
    """Each candidate's measurement is a collective: ranks that ordered them differently would wait on each other
    forever (a set's order follows the process's hash seed, which differs between torchrun's processes)."""
    import subprocess
    import sys

    code = ("from lightning_dist.sync.auto_rule import diloco_codecs; from lightning_dist.sync.auto import AutoDriver; "
            "print(diloco_codecs())")
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                              env={**__import__("os").environ, "PYTHONHASHSEED": str(seed)}) for seed in range(4)]
    try:  # side by side: each interpreter's seconds are its imports
        orders = {proc.communicate(timeout=120)[0] for proc in procs}
    finally:
        for proc in procs:
            proc.kill()
    assert [proc.returncode for proc in procs] == [0] * 4
    assert len(orders) == 1, orders


def test_a_flush_adds_whole_parameters_residuals_and_drops_two_tiers_parts():
    """OwedResiduals on one process: residuals keyed by parameter go into the gradient in the step's loss scale;
    two_tier's, keyed by parts of parameters, are dropped with a message (not flushed as zeros)."""
    from types import SimpleNamespace

    import torch

    from lightning_dist.compression import build_compressor
    from lightning_dist.sync.auto_flush import OwedResiduals

    module = torch.nn.Linear(3, 2)
    step_scale = SimpleNamespace(grad_scale=4.0)  # the step's compressor: loss scale 4
    context = SimpleNamespace(module=module, world_size=1, exchange_group=None, compressor=lambda: step_scale,
                              agree=lambda flag: flag)  # (SyncContext.agree without peers)
    for key, flushed in (("weight", True), ("weight#0/2", False)):
        compressor = build_compressor("int8")
        compressor.grad_scale = 2.0  # its residuals' units
        owed = torch.arange(6.0).view(2, 3) if flushed else torch.arange(3.0)
        compressor.residuals.load_state_dict({key: owed})
        flush = OwedResiduals(context)
        flush.hold(compressor, "int8")
        assert flush.pending
        for p in module.parameters():
            p.grad = torch.ones_like(p)
        if flushed:
            flush.gather()
        else:
            with pytest.warns(UserWarning, match="drops its error feedback's residuals"):
                flush.gather()
        flush.add_to_grads()
        assert not flush.pending
        expected = 1 + 2 * owed if flushed else torch.ones(2, 3)  # x 4 / 2: from its scale to the step's
        assert torch.equal(module.weight.grad, expected) and torch.equal(module.bias.grad, torch.ones(2))


def test_the_measuring_ends_early_on_a_slow_links_wire_not_on_a_slow_compute():
    """After the first timed step, the measuring ends when the communication left exposed after backward took longer
    than ``long_s`` on some rank; a step slow by its compute (a big model, a loaded machine) measures on."""
    from types import SimpleNamespace

    from lightning_dist.sync.auto import AutoDriver

    driver = object.__new__(AutoDriver)  # the rule's state only: no context to bind
    driver.settings, driver.phase, driver.measure_from = Auto(long_s=0.25), AutoDriver.MEASURING, 0
    driver.context = SimpleNamespace(agree=lambda flag: flag)  # (SyncContext.agree without peers)
    first = driver.settings.warmup_steps + 1
    driver._steps = [{"step_s": 2.0, "exposed_s": 0.01}]  # 2 s of compute, 10 ms exposed
    assert not driver._long_step(first)
    driver._steps = [{"step_s": 0.5, "exposed_s": 0.3}]  # 300 ms of wire past backward
    assert driver._long_step(first)
    assert not driver._long_step(first + 1)  # only the first timed step decides it
