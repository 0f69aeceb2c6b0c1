"""Elastic training's logic without ranks: the same global batches at any world size, the ledger's replay of attempts,
per-rank state mapped by node identity, survivors' own state from their emergency checkpoints, the checks that run
before any process group starts."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

import lightning_dist.train  # noqa: F401 - registers the training command's config schema
from lightning_dist.callbacks.elastic import launch_problems
from lightning_dist.config import resolve_num_nodes, validate
from lightning_dist.elastic import (
    LedgerWriter,
    complete_from_siblings,
    lost_state_message,
    read_ledger,
    state_norm,
)
from lightning_dist.fault import rng
from lightning_dist.fault.checkpoint import CheckpointInfo, save_checkpoint
from lightning_dist.hetero import BatchPlan, HeteroBatching, HeteroBatchSampler
from lightning_dist.hetero.loader import HeteroDataLoader
from lightning_dist.identities import map_ranks, node_identity
from lightning_dist.launch import LaunchEnv
from lightning_dist.strategy.checkpoint import compressor_entry, restore_compressor


def _epoch(dataset: int, world: int, batch: int, epoch: int = 1, weights=None) -> list[list[int]]:
    """Every global batch of ``epoch``, as the union of every rank's pieces in rank order."""
    plan = BatchPlan(world, weights or [1.0] * world)
    samplers = [HeteroBatchSampler(dataset, world, r, batch, plan, seed=7, elastic=True) for r in range(world)]
    for sampler in samplers:
        sampler.set_epoch(epoch)
    return [[i for piece in pieces for i in piece] for pieces in zip(*samplers, strict=True)]


@pytest.mark.parametrize("dataset,batch", [(1437, 96), (101, 8), (64, 64)])
def test_elastic_batches_are_the_same_at_every_world_size_and_each_sample_comes_once(dataset, batch):
    reference = _epoch(dataset, 1, batch)
    assert sorted(i for b in reference for i in b) == list(range(dataset))  # once each, no padding
    for world, weights in ((2, None), (3, [3.0, 1.0, 2.0]), (5, None)):
        batches = _epoch(dataset, world, batch, weights=weights)
        assert [sorted(b) for b in batches] == [sorted(b) for b in reference], world
    assert _epoch(dataset, 3, batch, epoch=2) != reference  # another epoch, another permutation


def test_stock_batches_pad_and_elastic_refuses_a_last_batch_smaller_than_the_world():
    plan = BatchPlan(3, [1.0] * 3)
    stock = HeteroBatchSampler(100, 3, 0, 30, plan)
    assert stock.total_size == 102  # stock DDP's padding: depends on the world size
    with pytest.raises(ValueError, match=r"last global batch would hold 1 samples.*mod B = 0 or >= 3"):
        HeteroBatchSampler(61, 3, 0, 30, plan, elastic=True)


def test_the_ledger_sees_what_the_loader_drew():
    sampler = HeteroBatchSampler(50, 2, 1, 10, BatchPlan(2, [1.0, 1.0]), elastic=True)
    drawn = list(sampler)
    assert sampler.take_drawn(0, 3) == drawn[3] and sampler.take_drawn(0, 3) == []


def test_hetero_elastic_needs_a_fixed_global_batch_and_no_per_rank_lists():
    with pytest.raises(ValueError, match="elastic=true needs a fixed global_batch_size"):
        HeteroBatching(elastic=True)
    with pytest.raises(ValueError, match="per-rank lists"):
        HeteroBatching(elastic=True, global_batch_size=96, speeds=[1.0, 2.0])


def test_a_plan_carried_over_keeps_each_survivors_weight_and_gives_a_newcomer_the_mean():
    plan = BatchPlan(3, [1.0, 1.0, 1.0])
    saved = {"changes": [[0, [1.0, 1.0]], [15, [3.0, 1.0]]]}
    plan.carry_over(saved, ["a/0", "b/0"], ["b/0", "a/0", "c/0"])
    assert plan.weights_at(0) == (1.0, 3.0, 2.0)
    plan.carry_over(saved, None, ["b/0", "a/0", "c/0"])
    assert plan.weights_at(7) == (1.0, 1.0, 1.0)


def _loader(world: int, rank: int, identities, elastic: bool = True) -> HeteroDataLoader:
    sampler = HeteroBatchSampler(96, world, rank, 24, BatchPlan(world, [1.0] * world), elastic=elastic)
    loader = HeteroDataLoader(list(range(96)), batch_sampler=sampler)
    loader.identities = identities
    return loader


def test_loader_state_resumes_the_same_global_batch_at_another_world_size():
    before = _loader(3, 0, ["a/0", "b/0", "c/0"])
    before.batch_sampler.completed = (0, 2)
    state = before.state_dict()
    after = _loader(2, 1, ["a/0", "b/0"])
    after.load_state_dict(state)
    assert after.batch_sampler.completed == after.batch_sampler.consumed == (0, 2)  # what the ledger starts from
    first = next(iter(after.batch_sampler))
    whole = _loader(1, 0, ["a/0"]).batch_sampler.global_order()
    assert first == whole[2 * 24 + 12: 3 * 24]  # batch 2's second half: rank 1 of 2
    stock = _loader(2, 0, None, elastic=False)
    with pytest.raises(ValueError, match="needs elastic batching"):
        stock.load_state_dict(state)


def test_a_lost_diloco_workers_samples_since_the_sync_train_again_in_the_same_epoch():
    # 3 ranks drew batches 0-2 of epoch 0 (4 batches of 24); the last sync started after step 1, the emergency
    # checkpoints are at step 3; old rank 2 is gone with its pieces of batches 1 and 2
    old = [list(_loader(3, r, None).batch_sampler) for r in range(3)]
    before = _loader(3, 0, ["a/0", "b/0", "c/0"])
    before.batch_sampler.completed = (0, 3)
    state = before.state_dict()
    survivors = []
    for rank in range(2):
        loader = _loader(2, rank, ["a/0", "b/0"])
        loader.lost_workers = (1, [2])
        loader.load_state_dict(state)
        survivors.append(loader.batch_sampler)
    sampler = survivors[0]
    assert sampler.lost == {1: old[2][1], 2: old[2][2]}
    # both lost pieces (8 + 8) join the epoch's last batch (the only one left): 24 + 16 split in two
    assert sampler.makeup == (0, {3: old[2][1] + old[2][2]}) and sampler.sizes(0, 3) == [20, 20]
    last = [next(iter(s)) for s in survivors]
    assert [len(piece) for piece in last] == [20, 20]
    # the epoch: what the old world kept, and the survivors' last batch: every sample exactly once
    kept = [i for r in range(3) for b in range(3) for i in old[r][b] if not (r == 2 and b in (1, 2))]
    assert sorted(kept + last[0] + last[1]) == list(range(96))
    # with two batches left the lost samples spread over both; a lost sample of an earlier epoch is only reported
    before.batch_sampler.completed = (0, 2)
    state = before.state_dict()
    loader = _loader(2, 0, ["a/0", "b/0"])
    loader.lost_workers = (1, [2])
    loader.load_state_dict(state)
    assert loader.batch_sampler.makeup == (0, {2: old[2][1]}) and loader.batch_sampler.lost_elsewhere == []
    before.batch_sampler.completed = (1, 0)
    state = before.state_dict()
    loader = _loader(2, 0, ["a/0", "b/0"])
    loader.lost_workers = (3, [2])
    loader.load_state_dict(state)
    assert loader.batch_sampler.makeup == (-1, {}) and loader.batch_sampler.lost_elsewhere == sorted(old[2][3])


def test_ranks_map_by_identity_and_lost_state_is_named_with_its_norm():
    assert map_ranks(["a/0", "b/0", "c/0"], ["c/0", "a/0", "d/0"]) == [2, 0, None]
    assert map_ranks(None, ["a/0"]) == [None]
    residual = {"residual": {"w": torch.tensor([3.0, 4.0])}, "count": 7}
    assert state_norm(residual) == pytest.approx(5.0)
    message = lost_state_message("residuals", ["a/0", "b/0", "c/0"], ["a/0", "b/0"], [residual, None, residual])
    assert "old rank 2 (c/0, left the run): norm 5" in message
    assert "old rank 1 (b/0, still here): not in a checkpoint of the step resumed from" in message
    assert "old rank 0" not in message
    assert lost_state_message("residuals", ["a/0"], ["a/0", "b/0"], [residual]) is None  # only a newcomer


def test_node_identity_prefers_the_configured_name():
    assert node_identity({"LIGHTNING_DIST_NODE": "n7", "LOCAL_RANK": "3"}) == "n7/3"
    assert node_identity({"LOCAL_RANK": "1"}).endswith("/1")


class _Codec:
    lossy = True

    def __init__(self):
        self.loaded = None

    def describe(self):
        return "codec"

    def load_state_dict(self, state, shared_only=False):
        self.loaded = (state, shared_only)


def test_compressor_and_generator_state_follow_the_identity():
    entry = compressor_entry(_Codec(), 3, [{"r": 0}, {"r": 1}, {"r": 2}], ["a/0", "b/0", "c/0"])
    codec = _Codec()
    restore_compressor(codec, entry, rank=0, world_size=2, identities=["c/0", "a/0"])
    assert codec.loaded == ({"r": 2}, False)
    restore_compressor(codec, entry, rank=1, world_size=2, identities=["d/0", "e/0"])
    assert codec.loaded == ({"r": 0}, True)  # a newcomer: shared state only
    state = rng.capture()
    torch.manual_seed(123)
    assert rng.restore_entry({"world_size": 2, "ranks": [None, state], "identities": ["x/0", "y/0"]}, 0, 1, ["y/0"])
    assert torch.equal(torch.get_rng_state(), state["torch"])
    assert not rng.restore_entry({"world_size": 2, "ranks": [state, None], "identities": ["x/0", "y/0"]}, 0, 1,
                                 ["y/0"])


@pytest.mark.parametrize("name", ["int8", "topk", "powersgd"])
def test_every_stateful_compressors_state_follows_the_identity_to_a_smaller_world(name):
    """Each real compressor's own state after 3 emulated ranks stepped, restored at 2 ranks by identity: a survivor
    gets its own residuals (and generators, factors) back, a newcomer the shared part only (the end-to-end restart
    under a kill is tests/test_elastic.py's, with PowerSGD)."""
    from lightning_dist.compression import BucketLayout, build_compressor
    from lightning_dist.compression.emulate import emulate_reduce

    layout = BucketLayout.of([("w", (16, 12)), ("b", (16,))])
    codecs = [build_compressor(name) for _ in range(3)]
    gen = torch.Generator().manual_seed(0)
    for _ in range(2):
        emulate_reduce(codecs, [torch.randn(layout.numel, generator=gen) for _ in range(3)], layout)
        for codec in codecs:
            codec.commit()
    entry = compressor_entry(codecs[0], 3, [c.state_dict() for c in codecs], ["a/0", "b/0", "c/0"])
    survivor, newcomer = build_compressor(name), build_compressor(name)
    restore_compressor(survivor, entry, rank=0, world_size=2, identities=["c/0", "z/0"])
    restore_compressor(newcomer, entry, rank=1, world_size=2, identities=["c/0", "z/0"])
    mine, theirs = survivor.state_dict(), codecs[2].state_dict()
    assert mine["steps"] == 2 and len(mine["residuals"]) == 2
    assert all(torch.equal(mine["residuals"][k], theirs["residuals"][k]) for k in theirs["residuals"])
    fresh = newcomer.state_dict()
    assert fresh["steps"] == 2 and len(fresh["residuals"]) == 0  # per-rank state starts afresh
    if name == "powersgd":  # the factors every rank holds alike come back for a newcomer too
        assert torch.equal(fresh["inner"]["q"]["w"], theirs["inner"]["q"]["w"])


def test_survivors_find_their_own_state_in_the_emergency_checkpoints_beside_the_chosen_one(tmp_path):
    def emergency(rank: int, step: int) -> str:
        ranks = [None] * 3
        ranks[rank] = {"residual": torch.full((2,), float(rank))}
        checkpoint = {"global_step": step, **compressor_entry(_Codec(), 3, list(ranks), ["a/0", "b/0", "c/0"]),
                      rng.RNG_KEY: {"world_size": 3, "ranks": list(ranks), "identities": ["a/0", "b/0", "c/0"]}}
        path = str(tmp_path / f"emergency-rank{rank}-step={step}.ckpt")
        save_checkpoint(checkpoint, path, meta={"kind": "emergency", "rank": rank})
        return path

    chosen = emergency(0, 21)
    emergency(1, 21)
    emergency(2, 20)  # an older step: not the same state
    checkpoint = torch.load(chosen, weights_only=True)
    assert complete_from_siblings(checkpoint, chosen) == [1]
    ranks = checkpoint["lightning_dist"]["compressor"]["ranks"]
    assert ranks[2] is None and torch.equal(ranks[1]["residual"], torch.ones(2))
    assert checkpoint[rng.RNG_KEY]["ranks"][1] is not None
    regular = str(tmp_path / "last.ckpt")
    save_checkpoint({"global_step": 21}, regular, meta={"kind": "regular"})
    assert complete_from_siblings(torch.load(regular, weights_only=True), regular) == []


def _write(directory, attempt, started, resumed_from, world, rank, batches, unended=(), lost=None):
    writer = LedgerWriter(str(directory), attempt, rank, world, f"h{rank}/0", resumed_from, started, lost=lost)
    for position, indices in batches:
        writer.started(position, position, 0, position, indices)
        if position not in unended:
            writer.finished(position, float(position), stepped=True)
    writer.close()


def test_the_ledger_replays_attempts_and_drops_what_a_lost_attempt_did_after_the_resumed_state(tmp_path):
    # attempt A on 2 ranks did batches 0-3; its state was saved at 2; rank 1 died inside batch 3 before ending it
    _write(tmp_path, "A", 100.0, 0, 2, 0, [(p, [2 * p]) for p in range(4)])
    _write(tmp_path, "A", 100.5, 0, 2, 1, [(p, [2 * p + 1]) for p in range(4)], unended=(3,))
    # attempt B resumed from batch 2 on 1 rank
    _write(tmp_path, "B", 200.0, 2, 1, 0, [(p, [2 * p, 2 * p + 1]) for p in (2, 3, 4)])
    ledger = read_ledger(str(tmp_path))
    assert list(ledger) == [0, 1, 2, 3, 4]
    assert [s.attempt for s in ledger.values()] == ["A", "A", "B", "B", "B"]
    assert ledger[1].indices == [2, 3] and ledger[1].complete and ledger[1].loss == 1.0
    assert ledger[3].indices == [6, 7] and ledger[3].world_size == 1
    # without B, A's batch 3 counts: both pieces started, one ended (its loss is over what ended)
    for path in tmp_path.glob("B-*"):
        path.unlink()
    assert read_ledger(str(tmp_path))[3].indices == [6, 7] and read_ledger(str(tmp_path))[3].loss == 3.0


def test_the_ledger_moves_a_lost_diloco_workers_samples_to_where_they_trained_again(tmp_path):
    # attempt A on 2 ranks did batches 0-3; rank 1's worker died after batch 3 with its progress since batch 2
    _write(tmp_path, "A", 100.0, 0, 2, 0, [(p, [2 * p]) for p in range(4)])
    _write(tmp_path, "A", 100.5, 0, 2, 1, [(p, [2 * p + 1]) for p in range(4)])
    # attempt B resumed from batch 4 on rank 0's state; rank 1's samples 5 and 7 train again in batch 4
    _write(tmp_path, "B", 200.0, 4, 1, 0, [(4, [8, 9, 5, 7]), (5, [10, 11])], lost={2: [5], 3: [7]})
    ledger = read_ledger(str(tmp_path))
    assert [s.indices for s in ledger.values()] == [[0, 1], [2, 3], [4], [6], [8, 9, 5, 7], [10, 11]]
    assert ledger[2].lost == [5] and ledger[3].lost == [7] and ledger[2].complete
    assert sorted(i for s in ledger.values() for i in s.indices) == list(range(12))


def test_checkpoints_written_after_an_agreed_stop_lose_to_the_stop_at_the_same_step():
    def info(kind, mtime):
        return CheckpointInfo("x", 26, 1, kind, None, mtime, {})

    newest = max([info("regular", 1.0), info("after_stop", 2.0), info("emergency", 3.0)], key=CheckpointInfo.sort_key)
    assert newest.kind == "regular"
    assert max([info("after_stop", 2.0), info("emergency", 3.0)], key=CheckpointInfo.sort_key).kind == "after_stop"


ELASTIC_ENV = {"TORCHELASTIC_RUN_ID": "r", "RANK": "0", "WORLD_SIZE": "6", "LOCAL_WORLD_SIZE": "2",
               "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "40000", "TORCHELASTIC_USE_AGENT_STORE": "False"}


def test_the_launch_says_how_many_nodes_and_who_hosts_the_store(monkeypatch):
    env = LaunchEnv.current(ELASTIC_ENV)
    assert env.num_nodes == 3 and env.hosts_store and env.world_size == 6
    assert not LaunchEnv.current({**ELASTIC_ENV, "RANK": "1"}).hosts_store
    shared = LaunchEnv.current({**ELASTIC_ENV, "TORCHELASTIC_USE_AGENT_STORE": "True"})
    assert not shared.hosts_store and "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in launch_problems(shared)[0]
    assert launch_problems(env) == [] and LaunchEnv.current({}).num_nodes is None
    # a store per round: no attempt number in keys (a joining host's agent counts its restarts from 0)
    assert env.key("resume") == LaunchEnv.current({**ELASTIC_ENV, "TORCHELASTIC_RESTART_COUNT": "2"}).key("resume")
    assert shared.key("resume") != LaunchEnv.current({**ELASTIC_ENV, "TORCHELASTIC_RESTART_COUNT": "2",
                                                       "TORCHELASTIC_USE_AGENT_STORE": "True"}).key("resume")
    for key, value in ELASTIC_ENV.items():
        monkeypatch.setenv(key, value)
    assert resolve_num_nodes(1) == 3 and resolve_num_nodes(2) == 3


def test_the_training_command_refuses_an_elastic_run_that_cannot_work(monkeypatch):
    from hydra import compose, initialize_config_module

    with initialize_config_module("lightning_dist.conf", version_base="1.3"):
        cfg = compose("config", overrides=["callbacks=[checkpoint,elastic]"])
    with pytest.raises(ValueError) as err:
        validate(cfg)
    text = str(err.value)
    assert "hetero=elastic" in text and "fault_tolerance" in text and "resume=auto" in text
    with initialize_config_module("lightning_dist.conf", version_base="1.3"):
        cfg = compose("config", overrides=["callbacks=[checkpoint,fault_tolerance,elastic]", "hetero=elastic",
                                           "hetero.global_batch_size=96", "resume=auto"])
    validate(cfg)
    for key, value in {**ELASTIC_ENV, "TORCHELASTIC_USE_AGENT_STORE": "True", "LOCAL_WORLD_SIZE": "2",
                       "WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ValueError, match="TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"):
        validate(cfg)
    assert OmegaConf.select(cfg, "hetero.elastic") is True


def test_the_benchmark_judges_plans_and_reports_without_a_cluster(tmp_path):
    from lightning_dist.benchmarks import elastic as bench
    from lightning_dist.elastic import LedgerStep

    trials = bench.plan_trials(20, seed=0)
    assert len(trials) == 20 and {t.kind for t in trials} == set(bench.KINDS) and {t.host for t in trials} == {1, 2}
    total = bench.EPOCHS * bench.POSITIONS_PER_EPOCH
    assert all(4 <= t.position <= total - (bench.JOIN_ROOM if t.kind == "join" else 4) for t in trials)

    def ledger(world_of, loss_shift=0.0):
        steps = {}
        for p in range(bench.EPOCHS * bench.POSITIONS_PER_EPOCH):
            epoch, batch = divmod(p, bench.POSITIONS_PER_EPOCH)
            start = batch * bench.GLOBAL_BATCH
            steps[p] = LedgerStep(p, p, epoch, batch, list(range(start, min(start + bench.GLOBAL_BATCH,
                                                                               bench.TRAIN_SAMPLES))),
                                  loss=1.0 + loss_shift, world_size=world_of(p), attempt="A" if p < 9 else "B",
                                  attempt_started=100.0 if p < 9 else 130.0, finished=101.0 + p + 30 * (p >= 9))
        return steps

    def record(kind, steps, struck, codes=(0, 0), acc=0.97):
        out = {"trial": vars(bench.Trial(kind, 2, 9)), "problems": [], "codes": list(codes), "workers_left": [],
               "ledger": steps, "summary": {"metrics": {"val/acc": acc}}, "struck": struck, "wall_s": 60.0,
               "resumed_from": []}
        out["attempts"] = bench._attempts(steps)
        out["recovery_s"], out["phases"] = bench._recovery(out), bench.phases(out)
        return out

    reference = record("none", ledger(lambda p: 3), None)
    assert bench.judge(reference, None) == []
    good = record("kill", ledger(lambda p: 3 if p < 9 else 2), struck=115.0)
    assert bench.judge(good, reference) == [] and good["phases"]["until_training_s"] == 15.0
    bad = record("kill", ledger(lambda p: 3 if p < 9 else 2, loss_shift=0.5), struck=115.0, codes=(0, 1), acc=0.9)
    del bad["ledger"][20]
    problems = " | ".join(bench.judge(bad, reference))
    for expected in ("exited [0, 1]", "lacks global batches [20]", "val/acc 0.9000", "loss at the first resumed"):
        assert expected in problems, problems
    late = record("join", ledger(lambda p: 2), struck=115.0)
    for step in late["ledger"].values():
        step.attempt = "A"
    late["attempts"] = bench._attempts(late["ledger"])
    late["recovery_s"], late["resumed_from"] = bench._recovery(late), [f"x/preempted-step={total}.ckpt: regular"]
    assert bench.late_join(late) and bench.judge(late, reference) == []  # the job was over before the host got in
    good["verdict"], bad["verdict"] = [], ["x"]
    text = bench.report([good, bad], reference, {"codes": [1], "resumed_from": [], "global_step": 59,
                                                  "world_size": 2, "val_acc": 0.95, "wall_s": 80.0})
    assert "1 of 2" in text and "kill: recovery median" in text and "anchor" in text
    bench.plot([good, bad]).savefig(tmp_path / "elastic.png")


def test_a_script_whose_num_nodes_the_launcher_no_longer_has_is_told_what_to_pass(monkeypatch):
    import lightning.pytorch as L

    from lightning_dist import RingDDPStrategy

    for key, value in {**ELASTIC_ENV, "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1", "LOCAL_RANK": "0",
                       "GROUP_RANK": "0"}.items():
        monkeypatch.setenv(key, value)
    told = r"num_nodes=3\) but torchrun runs 2 node\(s\).*LaunchEnv.current\(\).num_nodes"
    with pytest.raises(ValueError, match=told):
        L.Trainer(accelerator="cpu", devices=1, num_nodes=3, strategy=RingDDPStrategy(), logger=False)
