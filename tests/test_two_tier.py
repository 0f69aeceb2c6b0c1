"""Two-tier reduction (issue 24) on 4 local gloo ranks posing as 2 hosts of 2, the hosts read from torchrun's
variables: every compressor against the flat path, per-tier bytes, NaN, hetero weights, resume; int8's and top-k's
steps against the split written out (dense sums inside the host, the codec written out between hosts: ``ReferenceCodec``
of tests/test_compression_ranks.py).

One launched group holds every fit; the assertions below share it. The model's single bucket (709 elements) is odd,
so the reduce-scatter pads, and each host part holds a slice of every parameter (a row block of each matrix).
"""

import math
import warnings

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from test_compression_ranks import ReferenceCodec
from test_sync import _part

from lightning_dist import RingDDPStrategy
from lightning_dist.callbacks import NaNRecovery
from lightning_dist.comm import ring_bytes_sent
from lightning_dist.compression import BucketLayout, build_compressor
from lightning_dist.hetero import HeteroBatching
from lightning_dist.strategy import features_of
from lightning_dist.strategy.tiers import TwoTier
from lightning_dist.testing import RecordingLogger, ToyClassifier, launched_externally, quiet_trainer, run_ranks

pytestmark = pytest.mark.slow  # one launched group of 4 ranks holds every fit
WORLD, HOSTS = 4, 2
PER_HOST = WORLD // HOSTS
N_SAMPLES, BATCH = 96, 8  # 3 optimizer steps per epoch at 4 ranks
EPOCHS = 2
SETTINGS = {"topk": {"ratio": 0.05}, "threshold": {"threshold": 1e-3, "max_ratio": 0.2}, "powersgd": {"rank": 2}}
COMPRESSORS = ("none", "fp16", "bf16", "int8", "topk", "threshold", "powersgd")
WRITTEN_OUT = ("int8", "topk")  # two_tier's exchanges checked against the codec written out (ReferenceCodec)
DENSE_TOLERANCE = 1e-5  # two_tier against flat, uncompressed: float rounding of another summation order


class Net(ToyClassifier):
    """709 parameters in one bucket (16 -> 32 -> 5); ``inf_grad``: (rank, step) pairs whose gradient gets +Inf at
    ``net.0.weight[30, 5]`` (in host part 1, far from the sentinel in element 0)."""

    def __init__(self, inf_grad=()):
        super().__init__(features=16, hidden=(32,), classes=5, samples=N_SAMPLES, batch_size=BATCH, momentum=0.9,
                         distributed_sampler=True, seed=0)
        self.inf_grad = set(inf_grad)
        self.net[0].weight.register_hook(self._poison)

    def _poison(self, grad):
        if (self.global_rank, self.trainer.global_step) in self.inf_grad:
            grad = grad.clone()
            grad[30, 5] = float("inf")
        return grad


class Record(Callback):
    """Per optimizer step: this rank's parameters and its bytes per tier."""

    def __init__(self):
        self.params, self.tiers, self.sent, self.grads = [], [], [], []

    def on_train_batch_end(self, trainer, pl_module, *args):
        self.params.append(torch.cat([p.detach().reshape(-1) for p in pl_module.parameters()]).clone())

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        stats = trainer.strategy._hook_state.stats  # this step's, before the strategy resets them
        self.tiers.append((stats.tier_bytes.get("intra_host", 0), stats.tier_bytes.get("inter_host", 0)))
        self.sent.append(stats.bytes_sent)
        self.grads.append({name: p.grad.detach().reshape(-1).clone() for name, p in pl_module.named_parameters()})


class Tiers:
    """While open, what this rank's two-tier reduction does with every bucket (a launched rank's own copy of the class
    is patched): the bucket it is handed (this rank's weighted gradients) with its layout, and the part it carries
    across hosts, before and after the compressor."""

    def __init__(self):
        self.buckets, self.parts = [], []

    def __enter__(self):
        begin, finish, buckets, parts = TwoTier.begin, TwoTier.finish, self.buckets, self.parts

        def recording_begin(tiers, buffer, layout, slot=0):
            buckets.append((layout.names, layout.shapes, buffer.clone()))
            return begin(tiers, buffer, layout, slot)

        def recording_finish(tiers, flight, codec):
            return finish(tiers, flight, _Carried(codec, parts))

        TwoTier.begin, TwoTier.finish, self._real = recording_begin, recording_finish, (begin, finish)
        return self

    def __exit__(self, *exc):
        TwoTier.begin, TwoTier.finish = self._real


class _Carried:
    """A compressor that records the part it reduces across hosts, before and after."""

    def __init__(self, codec, log):
        self.codec, self.log = codec, log

    def reduce(self, flat, layout, transport):
        given = flat.clone()
        self.codec.reduce(flat, layout, transport)
        self.log.append((layout.names, given, flat.clone()))
        return flat


def _fit(strategy, model=None, callbacks=(), epochs=EPOCHS, ckpt_path=None, **kwargs):
    pl.seed_everything(0, verbose=False)
    record = Record()
    trainer = quiet_trainer(**{"devices": PER_HOST, "num_nodes": HOSTS, "strategy": strategy, "max_epochs": epochs,
                               "callbacks": [record, *callbacks], "use_distributed_sampler": False, **kwargs})
    trainer.fit(model or Net(), ckpt_path=ckpt_path)
    return trainer, record


def _strategy(name, topology, **kwargs):
    return RingDDPStrategy(compressor=build_compressor(name, **SETTINGS.get(name, {})), topology=topology,
                           timeout=60, start_method="fork", **kwargs)


def _layouts(trainer):
    return list(trainer.strategy._hook_state._layouts.values())


def _run(rank, world_size, ckpt_dir):
    out = {}
    with launched_externally(rank, world_size, hosts=HOSTS), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in COMPRESSORS:
            for topology in ("flat", "two_tier"):
                with Tiers() as tiers:
                    trainer, record = _fit(_strategy(name, topology))
                out[(name, topology)] = {"params": record.params, "tiers": record.tiers, "sent": record.sent}
                if name in WRITTEN_OUT and topology == "two_tier":
                    out[(name, "exchanges")] = (tiers.buckets, tiers.parts, record.grads)
        trainer, _ = _fit(_strategy("none", "auto"), epochs=1)
        topo = features_of(trainer.strategy).topology
        out["auto"] = (topo.kind, topo.hosts, [(layout.numel, layout.names) for layout in _layouts(trainer)])
        # a non-finite gradient on rank 3, in host part 1: every rank skips the step together
        for name in ("none", "topk"):
            cb = NaNRecovery()
            _, record = _fit(_strategy(name, "two_tier"), Net(inf_grad={(3, 2)}), [cb])
            out[("nan", name)] = (record.params, cb.skipped)
        # hetero weights: uneven batches, the same sum as flat
        for topology in ("flat", "two_tier"):
            strategy = _strategy("none", topology, hetero=HeteroBatching(batch_sizes=[12, 4, 10, 6]))
            _, record = _fit(strategy, epochs=1)
            out[("hetero", topology)] = record.params
        # resume at the epoch's end: error-feedback residuals per part restored, the run continues exactly
        trainer, _ = _fit(_strategy("topk", "two_tier"), epochs=1)
        path = f"{ckpt_dir}/two_tier.ckpt"
        trainer.save_checkpoint(path)
        _, record = _fit(_strategy("topk", "two_tier"), epochs=EPOCHS, ckpt_path=path)
        out["resumed"] = record.params
        # logged per-tier metrics
        logger = RecordingLogger()
        _fit(_strategy("none", "two_tier"), epochs=1, logger=logger, log_every_n_steps=1)
        out["logged"] = logger.logged if rank == 0 else None
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_ranks(_run, WORLD, str(tmp_path_factory.mktemp("two_tier")), deadline_s=240)


def test_auto_reads_the_hosts_from_torchruns_variables(runs):
    for kind, hosts, _ in (r["auto"] for r in runs):
        assert kind == "two_tier" and hosts == ((0, 1), (2, 3))


@pytest.mark.parametrize("name", COMPRESSORS)
def test_ranks_bit_identical_after_every_step(runs, name):
    steps = runs[0][(name, "two_tier")]["params"]
    assert len(steps) == 3 * EPOCHS
    for r in range(1, WORLD):
        assert len(runs[r][(name, "two_tier")]["params"]) == len(steps)
        for step, (mine, theirs) in enumerate(zip(steps, runs[r][(name, "two_tier")]["params"], strict=True)):
            assert torch.equal(mine, theirs), f"{name}: rank {r} differs from rank 0 after step {step}"


@pytest.mark.parametrize("name", ("none", "fp16", "bf16"))
def test_uncompressed_and_cast_equal_flat_within_rounding(runs, name):
    flat, tiered = runs[0][(name, "flat")]["params"], runs[0][(name, "two_tier")]["params"]
    tolerance = DENSE_TOLERANCE if name == "none" else 2e-2  # casts round twice as often on two tiers
    assert len(flat) == len(tiered) == 3 * EPOCHS
    for step, (a, b) in enumerate(zip(flat, tiered, strict=True)):
        assert (a - b).abs().max() <= tolerance * a.abs().max(), f"{name} step {step}"


@pytest.mark.parametrize("name", WRITTEN_OUT)
def test_two_tier_sums_dense_inside_the_host_and_compresses_between_hosts_as_written_out(runs, name):
    """Every step: the part rank i of a host carries is the dense sum of its host's ranks' part i (bit for bit: two
    ranks); across hosts it comes back as the codec written out sums the hosts' parts (each part's own residuals and
    noise); the gradient every rank steps on is those parts gathered back."""
    buckets, parts, grads = zip(*(out[(name, "exchanges")] for out in runs), strict=True)
    assert [len(b) for b in buckets] == [len(p) for p in parts] == [len(g) for g in grads] == [3 * EPOCHS] * WORLD
    reference = ReferenceCodec(name, **SETTINGS.get(name, {}))
    for step in range(3 * EPOCHS):
        names, shapes, _ = buckets[0][step]
        assert all(b[step][0] == names for b in buckets)  # one bucket a step, laid out alike on every rank
        want = torch.empty(sum(math.prod(shape) for shape in shapes))
        for i in range(PER_HOST):
            host_sums = []
            for h in range(HOSTS):
                ranks = range(h * PER_HOST, (h + 1) * PER_HOST)
                pieces, sizes, _, where = _part(buckets[ranks[0]][step][2], names, shapes, i, PER_HOST)
                host_sum = sum(_part(buckets[r][step][2], names, shapes, i, PER_HOST)[2] for r in ranks)
                carried_names, carried, _ = parts[h * PER_HOST + i][step]
                assert carried_names == tuple(pieces)
                assert torch.equal(carried, host_sum), f"step {step}: host {h}'s part {i} is not its dense sum"
                host_sums.append(host_sum)
            total = reference.reduce(host_sums, pieces, sizes, [(i, h) for h in range(HOSTS)])
            for h in range(HOSTS):
                got = parts[h * PER_HOST + i][step][2]
                assert torch.equal(got, total), f"step {step} part {i}: {(got - total).abs().max():.3g} off"
            at = 0
            for a, b in where:
                want[a:b] = total[at:at + b - a]
                at += b - a
        for rank in range(WORLD):  # the parts back in the bucket: each parameter's gradient
            stepped = grads[rank][step]
            for name_, (start, end) in zip(names, _spans(shapes), strict=True):
                match = [g for n, g in stepped.items() if n == name_ or name_.endswith("." + n)]
                assert len(match) == 1 and torch.equal(match[0], want[start:end]), (rank, step, name_)


def _spans(shapes):
    at = [0]
    for shape in shapes:
        at.append(at[-1] + math.prod(shape))
    return list(zip(at[:-1], at[1:], strict=True))


@pytest.mark.parametrize("name", ("int8", "topk", "threshold", "powersgd"))
def test_compressed_two_tier_trains_like_flat(runs, name):
    # not the same arithmetic (a host's partial sum is compressed, not each rank's gradient), but the same descent
    start = Net()
    initial = torch.cat([p.detach().reshape(-1) for p in start.parameters()])
    flat, tiered = runs[0][(name, "flat")]["params"][-1], runs[0][(name, "two_tier")]["params"][-1]
    moved_flat, moved_tiered = flat - initial, tiered - initial
    cosine = torch.nn.functional.cosine_similarity(moved_flat, moved_tiered, dim=0)
    assert cosine > 0.8, f"{name}: two_tier's update points elsewhere than flat's (cosine {cosine:.3f})"


def _parts(runs):
    """The bucket's layout (one bucket; DDP's rebuild may reorder it) and its host parts."""
    (numel, names), *_ = runs[0]["auto"][2]
    shapes = {n: p.shape for n, p in Net().named_parameters()}
    layout = BucketLayout.of([(n, shapes[n]) for n in names])
    return layout, [part for part, _ in layout.split(PER_HOST)]


def test_dense_bytes_per_tier_exact(runs):
    layout, parts = _parts(runs)
    width = max(part.numel for part in parts)
    for rank, out in enumerate(runs):
        intra = 2 * (PER_HOST - 1) * width * 4  # reduce-scatter and all-gather, the ring's count
        inter = ring_bytes_sent(parts[rank % PER_HOST].numel, HOSTS, rank // PER_HOST, 4)
        assert set(out[("none", "two_tier")]["tiers"]) == {(intra, inter)}
        # flat on 2 hosts: one group spanning them (auto's tree at 4 ranks), all of it counted between hosts
        flat = out[("none", "flat")]
        assert [inter for _, inter in flat["tiers"]] == flat["sent"] and {intra for intra, _ in flat["tiers"]} == {0}
        assert sum(out[("none", "two_tier")]["tiers"][0]) == out[("none", "two_tier")]["sent"][0]


def _sparse_payload(k):
    return 4 * k + -(-2 * k // 4) * 4  # int32 indices, then bf16 values padded to a word


def test_topk_crosses_hosts_once_per_part(runs):
    layout, parts = _parts(runs)
    codec = build_compressor("topk", **SETTINGS["topk"]).inner
    width = max(part.numel for part in parts)
    flat_payload = _sparse_payload(sum(codec.counts(layout)))
    for rank, out in enumerate(runs):
        payload = _sparse_payload(sum(codec.counts(parts[rank % PER_HOST])))
        intra = 2 * (PER_HOST - 1) * width * 4
        assert set(out[("topk", "two_tier")]["tiers"]) == {(intra, (HOSTS - 1) * payload)}
        assert set(out[("topk", "flat")]["tiers"]) == {(0, (WORLD - 1) * flat_payload)}


@pytest.mark.parametrize("name", ("none", "topk"))
def test_a_non_finite_gradient_in_another_part_skips_the_step_on_every_rank(runs, name):
    for rank, out in enumerate(runs):
        params, skipped = out[("nan", name)]
        assert skipped == 1, f"rank {rank}"
        assert all(torch.isfinite(p).all() for p in params)
        assert torch.equal(params[-1], runs[0][("nan", name)][0][-1])


def test_hetero_weights_hold_on_two_tiers(runs):
    flat, tiered = runs[0][("hetero", "flat")], runs[0][("hetero", "two_tier")]
    assert len(flat) == len(tiered) == 3  # one epoch
    for a, b in zip(flat, tiered, strict=True):
        assert (a - b).abs().max() <= DENSE_TOLERANCE * a.abs().max()
    assert all(torch.equal(tiered[-1], out[("hetero", "two_tier")][-1]) for out in runs)


def test_resume_restores_each_parts_state_exactly(runs):
    straight = runs[0][("topk", "two_tier")]["params"][-1]
    for out in runs:
        assert torch.equal(out["resumed"][-1], straight)


def test_per_tier_bytes_are_logged_summed_over_ranks(runs):
    _, parts = _parts(runs)
    width = max(part.numel for part in parts)
    logged = [m for _, m in runs[0]["logged"] if "dist/bytes_inter_host" in m]
    assert logged
    inter = sum(ring_bytes_sent(parts[r % PER_HOST].numel, HOSTS, r // PER_HOST, 4) for r in range(WORLD))
    for metrics in logged:
        assert metrics["dist/bytes_inter_host"] == inter
        assert metrics["dist/bytes_intra_host"] == WORLD * 2 * (PER_HOST - 1) * width * 4
    assert math.isfinite(logged[-1]["dist/step_time_ms"])
