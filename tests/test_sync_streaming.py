"""Streaming DiLoCo (issue 32: fragments, a delay and mixing) on launched fork ranks, against a one-process replay.

The replay (``tests/test_sync.py``'s :func:`replay`, part 1's with these settings) writes the contract out on one
process: N workers (flat: a worker per rank), each a copy
of the model with its own inner optimizer. The parameters are cut into F fragments (:data:`CUTS`, written out by hand
from the model's parameter names and sizes); fragment ``f`` starts a sync after the steps where ``step % H == f H /
F``: the workers' mean pseudo-gradient ``theta_global - theta_worker`` over the fragment's parameters, and each
worker's parameters at that step are kept. ``tau`` steps later it lands: the gradient of one outer Nesterov SGD step on
the fragment's part of ``theta_global``, and each worker's fragment becomes ``p_now + mix (theta_global - p_at_s)``
(without a delay: ``theta_global``). At the end of the fit what is still in flight lands. Under a decaying inner
rate (``DecayingNet``) each fragment's outer step answers the mean inner rate of its own steps since its last sync,
over the highest such mean of any fragment's outer step so far (the default ``inner_rate="rise"``, written out in the
replay).

Streamed int8 exchanges on 2 hosts of 2 are checked exchange by exchange against the codec written out
(``tests/test_sync.py``'s :func:`check_exchanges`: each fragment's own residuals and noise, each host part's own).

One launched group of 2 flat ranks and one of 4 ranks posing as 2 hosts of 2 hold every fit; the assertions share them.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from test_sync import (
    CUTS,
    EVERY,
    DecayingNet,
    Exchanges,
    Net,
    Poison,
    _close,
    _fit,
    _flat,
    _strategy,
    check_exchanges,
    decay,
    replay,
)

from lightning_dist.callbacks import NaNRecovery
from lightning_dist.hetero import HeteroBatching
from lightning_dist.sync import DiLoCo
from lightning_dist.testing import RecordingLogger, launched_externally, run_ranks

pytestmark = pytest.mark.slow

# (fragments, delay, mix): each replayed at 2 flat ranks
CASES = ((2, 0, 0.5), (2, 1, 0.5), (1, 2, 1.0), (2, 3, 0.5))
DECAYING = {"fragments": 2, "delay": 1, "mix": 0.5}  # the fit under DecayingNet's rate


class LoggedNet(Net):
    """Net, logging its loss reduced over every rank."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("train/synced_loss", loss, sync_dist=True)
        return loss


class SavedInFlight(Callback):
    """The exchanges in flight when each checkpoint is written: ``(fragment, started after, lands after)``."""

    def __init__(self):
        self.inflight = []

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        inflight = trainer.strategy.features.sync.loop.inflight
        self.inflight.append([(ex.fragment.index, ex.step, ex.lands) for ex in inflight])


# -- the one-process replay -----------------------------------------------------------------------------------------
# -- the launched groups --------------------------------------------------------------------------------------------
def _run_flat(rank, world, ckpt_dir):
    out = {}
    with launched_externally(rank, world), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for fragments, delay, mix in CASES:
            for optimizer in ("sgd", "adamw"):
                trainer, record = _fit(_strategy(DiLoCo(every=EVERY, fragments=fragments, delay=delay, mix=mix)),
                                       world, model=Net(optimizer))
                out[("replay", fragments, delay, mix, optimizer)] = (record.params, record.end)
        sync = trainer.strategy.features.sync.loop
        out["counts"] = (sync.outer_steps, sync.skipped, len(sync.inflight))
        # a decaying inner rate, answered by the default inner_rate="rise", fragment by fragment
        _, record = _fit(_strategy(DiLoCo(every=EVERY, **DECAYING)), world, model=DecayingNet("adamw"))
        out["decay"] = (record.params, record.end)
        out["decay_outer_lrs"] = record.outer_lrs
        # delay=0 with one fragment is part 1's sync, bit for bit, whatever mix says
        for settings in ({"every": EVERY}, {"every": EVERY, "fragments": 1, "delay": 0, "mix": 0.3}):
            _, record = _fit(_strategy(DiLoCo(**settings)), world)
            out[("part1", len(settings))] = record.params
        # heterogeneous batches: each fragment's workers weighted by their samples since its last sync
        model = Net()
        _, record = _fit(_strategy(DiLoCo(every=EVERY, fragments=2, delay=1), hetero=HeteroBatching(
            batch_sizes=[12, 4])), world, model=model)
        out["hetero"] = (record.params, record.end, model.seen)
        # balance="steps": rank 0's share of 16 runs as 2 inner steps of 8, rank 1's 8 as one; streamed too. The model
        # logs its loss with sync_dist=True (a reduction of every rank) beside the per-step exchange hetero batching
        # makes: the ranks' collectives must meet in the same order whatever their inner steps
        for fragments, delay in ((1, 0), (2, 1)):
            model = LoggedNet()
            hetero = HeteroBatching(batch_sizes=[16, 8], global_batch_size=24)
            _, record = _fit(_strategy(DiLoCo(every=EVERY, fragments=fragments, delay=delay, balance="steps"),
                                       hetero=hetero), world, model=model, logger=RecordingLogger(),
                             log_every_n_steps=1)  # DistMetrics: the per-step exchange on every step
            out[("steps", fragments, delay)] = (record.params, record.end, model.seen)
        # a skip with a delay: rank 1 turns non-finite after step 5; the exchange started after step 8 lands skipped
        # after step 9, and every worker restarts that fragment from theta_global
        nan = NaNRecovery()
        trainer, record = _fit(_strategy(DiLoCo(every=EVERY, delay=1)), world, callbacks=[Poison(), nan])
        out["skip"] = (record.params, nan.skipped, trainer.strategy.features.sync.loop.skipped)
        # resume with an exchange in flight: the first epoch's 6 steps end after the second fragment's exchange
        # started (after step 6, landing after step 7); int8 residuals per fragment
        diloco = {"every": EVERY, "fragments": 2, "delay": 1, "compressor": "int8"}
        saved = SavedInFlight()
        checkpoints = ModelCheckpoint(dirpath=ckpt_dir, filename="epoch{epoch}", save_top_k=-1,
                                      save_on_train_epoch_end=True, enable_version_counter=False)
        _, record = _fit(_strategy(diloco), world, callbacks=[checkpoints, saved], enable_checkpointing=True)
        out["uninterrupted"] = (record.params, record.end)
        out["inflight_at_save"] = saved.inflight[0]
        _, record = _fit(_strategy(diloco), world, ckpt_path=f"{ckpt_dir}/epochepoch=0.ckpt")
        out["resumed"] = (record.params, record.end)
        # the sync/* metrics after every landing: bytes, the exchange's time and how long the loop waited for it
        logger = RecordingLogger()
        _fit(_strategy(DiLoCo(every=EVERY, fragments=2, delay=1)), world, epochs=1, logger=logger,
             log_every_n_steps=1)
        out["logged"] = logger.logged if rank == 0 else None
    return out


def _run_hosts(rank, world, ckpt_dir):
    out = {}
    with launched_externally(rank, world, hosts=2), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for compressor in (None, "int8"):
            with Exchanges() as exchanges:
                _, record = _fit(_strategy(DiLoCo(every=EVERY, fragments=2, delay=1, compressor=compressor),
                                           topology="two_tier"), world, hosts=2)
            out[("hosts", compressor)] = (record.params, record.end)
            out[("exchanges", compressor)] = exchanges.calls
    return out


@pytest.fixture(scope="module")
def flat2(tmp_path_factory):
    return run_ranks(_run_flat, 2, str(tmp_path_factory.mktemp("stream2")), deadline_s=240)


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    return run_ranks(_run_hosts, 4, str(tmp_path_factory.mktemp("stream4")), deadline_s=180)


def _check(runs, expected, workers, key):
    history, end = expected
    for w, ranks in enumerate(workers):
        for r in ranks:
            params, final = runs[r][key]
            assert len(params) == len(history[w])
            for step, (got, want) in enumerate(zip(params, history[w], strict=True)):
                assert _close(got, want), f"{key}: rank {r} differs from the replay after step {step + 1}"
            assert _close(final, end[w]), f"{key}: rank {r} differs from the replay at the end of the fit"
        first = runs[ranks[0]][key][0]
        for r in ranks[1:]:  # ranks of one worker: bit-identical after every step
            assert len(runs[r][key][0]) == len(first)
            assert all(torch.equal(a, b) for a, b in zip(first, runs[r][key][0], strict=True))


@pytest.mark.parametrize("optimizer", ("sgd", "adamw"))
@pytest.mark.parametrize("case", CASES, ids=[f"F{f}-tau{t}-mix{m}" for f, t, m in CASES])
def test_two_flat_ranks_replay_streaming(flat2, case, optimizer):
    fragments, delay, mix = case
    history, end, workers = replay(2, optimizer=optimizer, fragments=fragments, delay=delay, mix=mix)
    _check(flat2, (history, end), workers, ("replay", fragments, delay, mix, optimizer))
    if delay == 0:  # every rank bit-identical on the fragment that landed, after each landing step
        sizes = [512, 32, 160, 5]
        offsets = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
        for step in range(1, len(history[0]) + 1):
            if step % (EVERY // fragments) == 0:
                params = CUTS[fragments][(step % EVERY) // (EVERY // fragments)]
                span = slice(offsets[params[0]], offsets[params[-1] + 1])
                assert torch.equal(flat2[0][("replay", *case, optimizer)][0][step - 1][span],
                                   flat2[1][("replay", *case, optimizer)][0][step - 1][span])


def test_workers_differ_between_syncs_and_the_final_sync_lands_what_is_in_flight_first(flat2):
    # the last case (F=2, tau=3): 12 steps; 5 exchanges (after steps 2-10; the one due after step 12 is the final
    # sync's), of which the one started after step 10 is in flight at the end: it lands in the final sync, then
    # fragment 0 (last synced after step 8) and fragment 1 average their steps since: 7 syncs
    steps, skipped, inflight = flat2[0]["counts"]
    assert (steps, skipped, inflight) == (7, 0, 0)
    a, b = flat2[0][("replay", 2, 3, 0.5, "adamw")][0], flat2[1][("replay", 2, 3, 0.5, "adamw")][0]
    assert not torch.equal(a[-2], b[-2])  # mixing keeps each worker's own progress
    assert torch.equal(a[-1], b[-1]) and torch.equal(flat2[0][("replay", 2, 3, 0.5, "adamw")][1], a[-1])


def test_a_decaying_inner_rate_raises_each_fragments_outer_rate_as_the_replay_writes_it_out(flat2):
    lrs = []
    history, end, workers = replay(2, optimizer="adamw", decay=decay, outer_lrs=lrs, **DECAYING)
    _check(flat2, (history, end), workers, "decay")
    for rank in (0, 1):
        assert flat2[rank]["decay_outer_lrs"] == pytest.approx(lrs, rel=1e-12, abs=0), f"rank {rank}'s outer rates"
    # exchanges start after steps 2 (fragment 1: the peak so far), 4 (fragment 0), 6, 8 and 10 and land a step
    # later; each carries the mean rate of its fragment's last steps (2 for the first, then 4): the outer rate
    # 0.7 x the peak's mean over that mean, at most 1
    outer_lr, rate = DiLoCo.outer_lr, [decay(k) for k in range(12)]
    peak = (rate[0] + rate[1]) / 2
    want = [outer_lr] + [min(1.0, outer_lr * peak / (sum(rate[s - 4:s]) / 4)) for s in (4, 6, 8, 10)]
    assert [lrs[s] for s in (2, 4, 6, 8, 10)] == pytest.approx(want, rel=1e-9)
    assert outer_lr < want[1] < want[2] < want[3] < 1.0 == want[4]
    none = replay(2, optimizer="adamw", decay=decay, inner_rate="none", **DECAYING)[1]
    assert not _close(end[0], none[0]) and not _close(flat2[0]["decay"][1], none[0])


def test_no_delay_with_one_fragment_is_part_one_bit_for_bit(flat2):
    for rank in (0, 1):
        runs = flat2[rank]
        assert len(runs[("part1", 1)]) == len(runs[("part1", 4)]) == 12  # 2 epochs of 6 steps
        assert all(torch.equal(a, b) for a, b in zip(runs[("part1", 1)], runs[("part1", 4)], strict=True))


def test_hetero_batches_weigh_each_fragments_workers_by_samples(flat2):
    params, end, seen = flat2[0]["hetero"]
    batches = [flat2[r]["hetero"][2] for r in (0, 1)]
    assert {len(bx) for bx, _ in batches[0]} == {12} and {len(bx) for bx, _ in batches[1]} == {4}
    history, final, workers = replay(2, batches=batches, fragments=2, delay=1)
    for r in (0, 1):
        got, got_end, _ = flat2[r]["hetero"]
        assert len(got) == len(history[r]) > 0
        assert all(_close(a, b) for a, b in zip(got, history[r], strict=True))
        assert _close(got_end, final[r])


@pytest.mark.parametrize("fragments,delay", ((1, 0), (2, 1)))
def test_balance_steps_runs_more_inner_steps_on_the_faster_worker(flat2, fragments, delay):
    key = ("steps", fragments, delay)
    batches = [flat2[r][key][2] for r in (0, 1)]
    # 96 samples in global batches of 24: 4 training steps an epoch; rank 0 ran 2 inner steps of 8 in each
    assert [len(by) for _, by in batches[0]] == [8] * 16 and [len(by) for _, by in batches[1]] == [8] * 8
    history, final, _ = replay(2, batches=batches, fragments=fragments, delay=delay, steps=[2, 1])
    for r in (0, 1):
        got, got_end, _ = flat2[r][key]
        assert len(got) == len(history[r]) == 8
        assert all(_close(a, b) for a, b in zip(got, history[r], strict=True)), f"rank {r} differs from the replay"
        assert _close(got_end, final[r])


def test_a_delayed_non_finite_exchange_skips_and_every_worker_restarts_the_fragment(flat2):
    for rank in (0, 1):
        params, nan_skipped, sync_skipped = flat2[rank]["skip"]
        assert sync_skipped == 1
        assert nan_skipped == 1 or rank != 0  # NaNRecovery heard of it (rank 0 reports)
        # step 9 (index 8): the skipped exchange landed; the fragment (every parameter) restarted from theta_global
        assert torch.isfinite(params[8]).all()
    assert torch.equal(flat2[0]["skip"][0][8], flat2[1]["skip"][0][8])
    assert not torch.isfinite(flat2[1]["skip"][0][7]).all()  # before it landed, rank 1 was not finite


def test_resume_with_an_exchange_in_flight_ends_bit_identical(flat2):
    assert flat2[0]["inflight_at_save"] == [(1, 6, 7)]
    for rank in (0, 1):
        params, end = flat2[rank]["uninterrupted"]
        resumed, resumed_end = flat2[rank]["resumed"]
        assert len(resumed) == len(params) // 2 == 6
        assert all(torch.equal(a, b) for a, b in zip(resumed, params[len(params) // 2:], strict=True))
        assert torch.equal(resumed_end, end)


def test_sync_metrics_after_every_landing(flat2):
    logged = flat2[0]["logged"]
    syncs = [(step, m) for step, m in logged if "sync/waited_s" in m]
    # 6 steps of one epoch: exchanges land after steps 3 and 5 (fragment 1 from step 2, fragment 0 from step 4);
    # the final sync after step 6 averages fragment 0's steps since step 4, then fragment 1's (in place of its sync)
    assert [(step, m["sync/fragment"]) for step, m in syncs] == [(3, 1.0), (5, 0.0), (6, 1.0)]
    for _, m in syncs:
        assert m["sync/bytes_per_sync"] > 0 and 0 <= m["sync/waited_s"] <= m["sync/seconds"]


@pytest.mark.parametrize("compressor", (None, "int8"))
def test_two_hosts_of_two_stream_fragments_identically(hosts, compressor):
    key = ("hosts", compressor)
    for ranks in ((0, 1), (2, 3)):  # ranks of one host bit-identical after every step
        assert len(hosts[ranks[0]][key][0]) == len(hosts[ranks[1]][key][0]) == 6
        assert all(torch.equal(a, b) for a, b in zip(hosts[ranks[0]][key][0], hosts[ranks[1]][key][0], strict=True))
    if compressor is None:
        history, end, workers = replay(4, hosts=2, fragments=2, delay=1)
        _check(hosts, (history, end), workers, key)
    else:  # each fragment's int8 exchange, part by part across hosts, exactly as the codec written out sums it:
        # fragment 1 after step 2 and fragment 0 after step 4 (each landing a step later), then the final sync's two
        sums = check_exchanges(hosts, ("exchanges", compressor), compressor, {}, hosts=2)
        assert len(sums) == 4


# -- elastic workers: a restart at another size maps each worker by its node identity -------------------------------
class Identities(Callback):
    """What ElasticTraining sets at set-up (every rank's node identity), without a launcher that changes the world;
    and this rank's parameters once the fit starts (after the checkpoint's DiLoCo state was restored)."""

    def __init__(self, identities):
        self.identities, self.start = identities, None

    def setup(self, trainer, pl_module, stage):
        trainer.strategy.features.identities = list(self.identities)

    def on_train_start(self, trainer, pl_module):
        self.start = _flat(pl_module)


def _run_elastic_before(rank, world, ckpt_dir):
    with launched_externally(rank, world), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # 96 samples / (3 x 8): 4 steps; H = 3: the workers differ after step 4 (mid-cycle)
        trainer, record = _fit(_strategy(DiLoCo(every=3, final_sync=False)), world, epochs=1,
                               callbacks=[Identities("abc")])
        trainer.save_checkpoint(f"{ckpt_dir}/three.ckpt")
        theta = trainer.strategy.features.sync.loop.outer.theta
        return {"end": record.params[-1], "global": [g.clone() for g in theta]}


def _run_elastic_after(rank, world, ckpt_dir, identities):
    with launched_externally(rank, world), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ids = Identities(identities)
        _fit(_strategy(DiLoCo(every=3, final_sync=False)), world, epochs=2, callbacks=[ids],
             ckpt_path=f"{ckpt_dir}/three.ckpt")
        return ids.start


@pytest.fixture(scope="module")
def elastic(tmp_path_factory):
    ckpt_dir = str(tmp_path_factory.mktemp("elastic"))
    before = run_ranks(_run_elastic_before, 3, ckpt_dir, deadline_s=120)
    survivors = run_ranks(_run_elastic_after, 2, ckpt_dir, "ac", deadline_s=120)
    newcomer = run_ranks(_run_elastic_after, 2, ckpt_dir, "az", deadline_s=120)
    return before, survivors, newcomer


def test_a_restart_at_another_size_gives_each_survivor_its_own_worker_and_a_newcomer_theta_global(elastic):
    before, survivors, newcomer = elastic
    assert not torch.equal(before[0]["end"], before[2]["end"])  # mid-cycle: the workers differ
    assert torch.equal(survivors[0], before[0]["end"]) and torch.equal(survivors[1], before[2]["end"])
    theta = torch.cat([g.reshape(-1) for g in before[0]["global"]])
    assert torch.equal(newcomer[0], before[0]["end"]) and torch.equal(newcomer[1], theta)
