"""OneBitAdam (issue 42) on launched fork ranks, against a one-process replay of its contract.

The replay (:func:`replay`) writes the contract out on one process, with none of the product's codecs, emulation or
splits: every rank's gradient of its own batch, weighted by its share of the step's samples; on the warm-up's steps
their sum is the gradient of the user's own AdamW; on a refresh it is their sum through ``int4`` (the refresh's codec,
written out in ``test_onebit_adam_pure.Int4Reference``: its stochastic rounding replayed from the codec's seeds); on
the others each rank's preconditioned momentum ``mask (a_r beta1 m + (1 - beta1) g_r) / d`` goes through the ``sign``
codec with both error feedbacks (written out in ``test_sign_compressor.sign_reduce``: each rank's residual, each
region owner's residual, carried from step to step); under two_tier the host's dense sum of part ``i`` (the split
written out in ``test_onebit_adam_pure.host_parts``) goes across hosts between the ``i``-th ranks. ``u``, the sum,
gives ``m = mask u d`` and the update ``lr clamp(mask u / (1 - beta1^t), -bound, bound)`` after AdamW's decay. Both
pure modules check their reference against the product's codec and split bit for bit.

The launched runs must match the replay within :data:`TOLERANCE` at every step, every rank bit-identical after every
step, and the warm-up bit-identical to ring_ddp + AdamW. Not bit for bit: the ranks sum gradients in gloo's order,
the driver computes the momentum and the update with foreach kernels in its own order of operations, and the replay
with plain tensor arithmetic, so float32 rounding separates them (measured: at most 3e-8 of parameters below 1, not
growing over the 12 steps; the codecs themselves are matched bit for bit in the pure modules). A codec's error is of
another size: a sign scale, a residual or a refresh's rounding gone wrong moves a coordinate by about a learning rate
times ``u`` (1e-3 to 1e-2).

Two launched groups (2 flat ranks; 4 ranks posing as 2 hosts of 2) hold every fit; the assertions share them.
"""

from __future__ import annotations

import math
import warnings

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from test_onebit_adam_pure import Int4Reference, host_parts, int4_reduce
from test_sign_compressor import SignGroup

from lightning_dist import RingDDPStrategy
from lightning_dist.callbacks import NaNRecovery
from lightning_dist.hetero import HeteroBatching
from lightning_dist.sync import OneBitAdam
from lightning_dist.testing import ToyClassifier, launched_externally, quiet_trainer, run_ranks

pytestmark = pytest.mark.slow

N_SAMPLES, BATCH = 96, 8
STEPS_DENSE, EVERY, BOUND = 3, 3, 2.0  # the warm-up: steps 0, 1, 2; refreshes at 6 and 9
TOLERANCE = 1e-6  # relative to the parameters' largest value (at least 1): 30x the rounding measured (docstring)


class Net(ToyClassifier):
    """16 -> 32 -> 5 on 96 samples, AdamW (decay 0.01) or Adam; the batches it trained on kept in ``seen``."""

    def __init__(self, optimizer="adamw", batch_size=BATCH):
        super().__init__(features=16, hidden=(32,), classes=5, samples=N_SAMPLES, batch_size=batch_size,
                         optimizer=optimizer, lr=0.01, distributed_sampler=True, seed=0, keep_batches=True)

    def loss(self, x, y):
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def training_step(self, batch, batch_idx):
        self.seen.append((batch[0].clone(), batch[1].clone()))
        return self.loss(*batch)

    def schedulers(self, optimizer):
        return []


class Recipe(Net):
    """The recipe users train with: a frozen layer inside the forward, a layer no forward uses
    (``find_unused_parameters=True``), AdamW in two param groups (their own learning rate and weight decay) and a
    scheduler stepped every optimizer step; fitted with ``accumulate_grad_batches=2`` of micro-batches of 4."""

    def __init__(self):
        super().__init__(batch_size=BATCH // 2)
        self.frozen = torch.nn.Linear(16, 16).requires_grad_(False)
        self.unused = torch.nn.Linear(16, 5)

    def loss(self, x, y):
        return torch.nn.functional.cross_entropy(self.net(torch.tanh(self.frozen(x))), y)

    def configure_optimizers(self):
        opt = self.optimizer_only()
        return [opt], [{"scheduler": self.schedulers(opt)[0], "interval": "step"}]

    def optimizer_only(self):
        return torch.optim.AdamW([
            {"params": list(self.net[0].parameters()), "lr": 0.02, "weight_decay": 0.0},
            {"params": [*self.net[2].parameters(), *self.unused.parameters()], "lr": 0.01, "weight_decay": 0.05}])

    def schedulers(self, optimizer):
        return [torch.optim.lr_scheduler.MultiplicativeLR(optimizer, lambda _: 0.9)]


class NanLoss(Net):
    """Rank 1's loss is NaN at global step 7 (a compressed step): every rank skips it."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if (self.global_rank, self.trainer.global_step) == (1, 7) else loss


class Manual(Net):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False


class SGDNet(Net):
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Record(Callback):
    """The parameters after every optimizer step (once per step under accumulation)."""

    def __init__(self):
        self.params = []

    def on_train_batch_end(self, trainer, pl_module, *args):
        if trainer.global_step > len(self.params) + self.resumed_at(trainer):
            self.params.append(_flat(pl_module))

    def on_train_start(self, trainer, pl_module):
        self._start = trainer.global_step

    def resumed_at(self, trainer):
        return getattr(self, "_start", 0)


def _flat(module):
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()]).clone()


def _settings(**kwargs):
    return OneBitAdam(**{"warmup": STEPS_DENSE, "refresh": EVERY, "bound": BOUND, **kwargs})


def _fit(sync, world, hosts=1, model=None, epochs=2, callbacks=(), ckpt_path=None, accumulate=1, **strategy):
    pl.seed_everything(0, verbose=False)
    record = Record()
    model = model or Net()
    trainer = quiet_trainer(devices=world // hosts, num_nodes=hosts, max_epochs=epochs, callbacks=[record, *callbacks],
                            accumulate_grad_batches=accumulate,
                            strategy=RingDDPStrategy(sync=sync, timeout=60, start_method="fork", **strategy),
                            use_distributed_sampler=False)
    trainer.fit(model, ckpt_path=ckpt_path)
    return trainer, record, model


def _refused(model, sync, world, hosts=1, **fit):
    try:
        _fit(sync, world, hosts, model=model, **fit)
    except ValueError as err:
        return str(err)
    return None


# -- the one-process replay -----------------------------------------------------------------------------------------
def replay(batches, hosts=1, optimizer="adamw", warmup=STEPS_DENSE, refresh=EVERY, bound=BOUND, model=None,
           accumulate=1, dense_from=None):
    """The parameters after every step by the contract alone (the module's docstring), from every rank's batches
    (``accumulate`` micro-batches to an optimizer step, each loss divided by ``accumulate`` as Lightning does). A
    parameter no rank's loss reaches is left alone (torch's Adam skips a parameter without a gradient).
    ``dense_from``: from that step on, plain ring_ddp's steps (the summed gradient, the user's Adam on the state
    OneBitAdam left: a resume without ``sync=``)."""
    world, steps = len(batches), len(batches[0]) // accumulate
    per = world // hosts
    model = model or Net(optimizer)
    opt = model.optimizer_only() if isinstance(model, Recipe) else model.configure_optimizers()
    schedulers = model.schedulers(opt)
    group_of = {id(p): group for group in opt.param_groups for p in group["params"]}
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    spans, offset = [], 0  # each parameter's place in the bucket (the module's order)
    for _, p in named:
        spans.append((offset, offset + p.numel()))
        offset += p.numel()
    # one bucket, flat: a group of every rank; two_tier: per part, a group of the hosts' ranks that carry it
    parts = [[(name, a, b) for (name, _), (a, b) in zip(named, spans, strict=True)]] if hosts == 1 \
        else host_parts([(name, tuple(p.shape)) for name, p in named], per)
    ranks = world if hosts == 1 else hosts  # in each group
    sign = [SignGroup([(name, b - a) for name, a, b in part]) for part in parts]
    int4 = [[Int4Reference(rank) for rank in range(ranks)] for _ in parts]  # a rank's noise: its rank in the group
    history, frozen, variance_updates = [], None, {}  # v's updates: warm-up steps and refreshes
    for step in range(steps):
        data = [batches[r][step * accumulate:(step + 1) * accumulate] for r in range(world)]
        total = sum(len(y) for micro in data for _, y in micro)
        shares = [sum(len(y) for _, y in micro) / total for micro in data]
        grads = []
        for micro, share in zip(data, shares, strict=True):
            model.zero_grad(set_to_none=True)
            for x, y in micro:
                (model.loss(x, y) * share / accumulate).backward()
            grads.append([None if p.grad is None else p.grad.detach().clone() for p in params])
        used = [any(grads[r][i] is not None for r in range(world)) for i in range(len(params))]
        grads = [[torch.zeros_like(p) if g is None else g for g, p in zip(rank, params, strict=True)] for rank in grads]
        now = WARMUP if dense_from is not None and step >= dense_from else _phase(step, warmup, refresh)
        if now == WARMUP:
            for i, p in enumerate(params):  # the two-tier path's order: each host's sum, then across hosts
                p.grad = _sum([_sum([grads[r][i] for r in range(h * per, (h + 1) * per)]) for h in range(hosts)])
        elif now == REFRESH:  # every rank's weighted gradient through int4
            flats = [torch.cat([g.reshape(-1) for g in grads[r]]) for r in range(world)]
            total = _reduce(flats, parts, hosts, lambda i, xs, named_: int4_reduce(int4[i], xs, named_))
            for p, (start, end) in zip(params, spans, strict=True):
                p.grad = total[start:end].view_as(p).clone()
        for i, p in enumerate(params):
            if not used[i]:
                p.grad = None
        if now != COMPRESSED:
            opt.step()
            frozen = None
            for i, p in enumerate(params):
                if p.grad is not None:  # Adam stepped it: one more update of its v
                    variance_updates[i] = variance_updates.get(i, 0) + 1
        else:
            if frozen is None:
                frozen = []
                for i, p in enumerate(params):
                    beta2, eps = group_of[id(p)]["betas"][1], group_of[id(p)]["eps"]
                    if not opt.state[p]:  # never stepped: v = 0 masks it
                        opt.state[p].update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(p),
                                            exp_avg_sq=torch.zeros_like(p))
                    v, k = opt.state[p]["exp_avg_sq"], variance_updates.get(i, 0)
                    frozen.append(((v.sqrt() / (math.sqrt(1 - beta2 ** k) if k else 1.0)).add_(eps), v > 0))
            flats = []
            for r in range(world):
                xs = []
                for i, p in enumerate(params):
                    d, mask = frozen[i]
                    beta1 = group_of[id(p)]["betas"][0]
                    x = opt.state[p]["exp_avg"] * (shares[r] * beta1) + (1 - beta1) * grads[r][i]
                    xs.append((x / d * mask * used[i]).reshape(-1))
                flats.append(torch.cat(xs))
            u = _reduce(flats, parts, hosts, lambda i, xs, named_: sign[i].reduce(xs))
            with torch.no_grad():
                for i, (p, (start, end)) in enumerate(zip(params, spans, strict=True)):
                    if not used[i]:
                        continue
                    group = group_of[id(p)]
                    beta1, lr, wd = group["betas"][0], group["lr"], group["weight_decay"]
                    d, mask = frozen[i]
                    state = opt.state[p]
                    ui = u[start:end].view_as(p) * mask
                    state["exp_avg"].copy_(ui * d)
                    state["step"] += 1
                    p.mul_(1 - lr * wd)
                    p.add_((ui / (1 - beta1 ** float(state["step"]))).clamp(-bound, bound), alpha=-lr)
        for scheduler in schedulers:
            scheduler.step()
        history.append(_flat(model))
    return history


def _sum(tensors):
    total = tensors[0].clone()
    for t in tensors[1:]:
        total += t
    return total


def _reduce(flats, parts, hosts, reduce_part):
    """The sum over every rank: flat, every rank's bucket through ``reduce_part(0, flats, named)``; two_tier, each
    host's dense sum (its ranks in order) cut into ``parts``, part ``i`` of every host through ``reduce_part(i, ...)``
    (the group of the hosts' ``i``-th ranks) and put back in its place."""
    if hosts == 1:
        return reduce_part(0, flats, [(name, b - a) for name, a, b in parts[0]])
    per = len(flats) // hosts
    host_sums = [_sum(flats[h * per:(h + 1) * per]) for h in range(hosts)]
    result = torch.full_like(flats[0], math.nan)
    for i, part in enumerate(parts):
        reduced = reduce_part(i, [torch.cat([s[a:b] for _, a, b in part]) for s in host_sums],
                              [(name, b - a) for name, a, b in part])
        offset = 0
        for _, a, b in part:
            result[a:b] = reduced[offset:offset + b - a]
            offset += b - a
    assert not result.isnan().any()  # the parts cover the bucket
    return result


WARMUP, REFRESH, COMPRESSED = "warm-up", "refresh", "compressed"


def _phase(step, warmup, refresh):
    """Step ``step`` (0-based) by the docs: the first ``warmup`` are the warm-up's; then every ``refresh``-th step
    after the warm-up's end (``warmup + refresh``, ``warmup + 2 refresh``, ...) is a refresh; the rest compressed."""
    if step < warmup:
        return WARMUP
    return REFRESH if refresh and step > warmup and (step - warmup) % refresh == 0 else COMPRESSED


def _close(a, b):
    return (a - b).abs().max().item() <= TOLERANCE * max(1.0, b.abs().max().item())


# -- the launched groups --------------------------------------------------------------------------------------------
def _run_flat(rank, world, ckpt_dir):
    out = {}
    with launched_externally(rank, world), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for optimizer in ("adamw", "adam"):
            trainer, record, model = _fit(_settings(), world, model=Net(optimizer))
            out[("replay", optimizer)] = (record.params, model.seen)
        out["metrics"] = dict(trainer.strategy.features.sync.report().metrics)
        _, record, _ = _fit(None, world)
        out["ring_ddp"] = record.params
        # accumulation, two param groups, a per-step scheduler, a frozen and an unused layer
        _, record, model = _fit(_settings(), world, model=Recipe(), accumulate=2, find_unused_parameters=True)
        out["recipe"] = (record.params, model.seen)
        # heterogeneous batches: each rank's momentum weighted by its samples
        _, record, model = _fit(_settings(), world, hetero=HeteroBatching(batch_sizes=[12, 4]))
        out["hetero"] = (record.params, model.seen)
        # resume mid-run (6 steps: the warm-up, compressed steps and a refresh; residuals in flight), and the same
        # checkpoint under plain ring_ddp (Adam's own state)
        trainer, _, _ = _fit(_settings(), world, epochs=1)
        path = f"{ckpt_dir}/mid.ckpt"
        trainer.save_checkpoint(path)
        _, record, _ = _fit(_settings(), world, ckpt_path=path)
        out["resumed"] = record.params
        _, record, model = _fit(None, world, ckpt_path=path)
        out["resumed_plain"] = (record.params, model.seen)
        # a non-finite loss on rank 1 at a compressed step: skipped on every rank
        nan = NaNRecovery()
        trainer, record, _ = _fit(_settings(), world, model=NanLoss(), callbacks=[nan])
        out["nan"] = (record.params, nan.skipped)
        # the refusals, at set-up, on every rank alike
        out["refused"] = {"sgd": _refused(SGDNet(), _settings(), world),
                          "manual": _refused(Manual(), _settings(), world),
                          "warmup": _refused(Net(), _settings(warmup=12), world)}
    return out


def _run_hosts(rank, world):
    with launched_externally(rank, world, hosts=2), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, record, model = _fit(_settings(), world, hosts=2, epochs=3, topology="two_tier")
        _, dense, _ = _fit(None, world, hosts=2, epochs=3, topology="two_tier")
    return {"replay": (record.params, model.seen), "ring_ddp": dense.params}


@pytest.fixture(scope="module")
def flat2(tmp_path_factory):
    return run_ranks(_run_flat, 2, str(tmp_path_factory.mktemp("onebit")), deadline_s=240)


@pytest.fixture(scope="module")
def hosts():
    return run_ranks(_run_hosts, 4, deadline_s=180)


def _equal_runs(a, b):
    """Two runs' parameters equal after every step, the runs as long as each other (and not empty)."""
    assert len(a) == len(b) > 0, (len(a), len(b))
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _check(runs, key, hosts_=1, optimizer="adamw", steps=12, **recipe):
    world = len(runs)
    got = [runs[r][key][0] for r in range(world)]
    expected = replay([runs[r][key][1] for r in range(world)], hosts_, optimizer, **recipe)
    assert len(got[0]) == len(expected) == steps, (len(got[0]), len(expected))
    for step, (a, b) in enumerate(zip(got[0], expected, strict=True)):
        assert _close(a, b), f"step {step}: {(a - b).abs().max():.3g} from the replay"
    for rank in range(1, world):  # every rank bit-identical after every step
        assert _equal_runs(got[rank], got[0]), f"rank {rank}"
    return got[0]


@pytest.mark.parametrize("optimizer", ("adamw", "adam"))
def test_two_flat_ranks_replay_onebit_adam(flat2, optimizer):
    _check(flat2, ("replay", optimizer), optimizer=optimizer)


def test_two_hosts_of_two_replay_onebit_adam(hosts):
    got = _check(hosts, "replay", hosts_=2, steps=9)
    assert _equal_runs(got[:STEPS_DENSE], hosts[0]["ring_ddp"][:STEPS_DENSE])


def test_the_warm_up_is_ring_ddp_with_adam_bit_for_bit(flat2):
    got, dense = flat2[0][("replay", "adamw")][0], flat2[0]["ring_ddp"]
    assert _equal_runs(got[:STEPS_DENSE], dense[:STEPS_DENSE])
    assert not torch.equal(got[STEPS_DENSE], dense[STEPS_DENSE])  # the first compressed step is not the dense one


def test_the_recipe_replays_accumulation_param_groups_a_scheduler_frozen_and_unused_layers(flat2):
    got = _check(flat2, "recipe", model=Recipe(), accumulate=2)
    start = Recipe()
    assert len(got) == 12 and len(flat2[0]["recipe"][1]) == 24  # an optimizer step per two micro-batches
    frozen_and_unused = torch.cat([_flat(start.frozen), _flat(start.unused)])
    assert torch.equal(got[-1][-frozen_and_unused.numel():], frozen_and_unused)  # still where they started


def test_heterogeneous_batches_weigh_each_rank_by_its_samples(flat2):
    _check(flat2, "hetero")
    assert [len(y) for _, y in flat2[0]["hetero"][1][:1]] == [12] and len(flat2[1]["hetero"][1][0][1]) == 4


def test_resume_mid_run_is_exact_and_plain_ring_ddp_resumes_adams_state(flat2):
    for rank in range(2):
        uninterrupted = flat2[rank][("replay", "adamw")][0]
        resumed = flat2[rank]["resumed"]
        assert len(uninterrupted) == 12 and len(resumed) == 6, (len(uninterrupted), len(resumed))
        assert _equal_runs(resumed, uninterrupted[6:]), f"rank {rank}"
    # plain ring_ddp from the same checkpoint: AdamW's own steps on the m, v and step OneBitAdam left
    plain = [flat2[rank]["resumed_plain"][0] for rank in range(2)]
    batches = [flat2[rank][("replay", "adamw")][1][:6] + flat2[rank]["resumed_plain"][1] for rank in range(2)]
    expected = replay(batches, dense_from=6)[6:]
    assert len(plain[0]) == len(expected) == 6, (len(plain[0]), len(expected))
    for step, (a, b) in enumerate(zip(plain[0], expected, strict=True), start=6):
        assert _close(a, b), f"step {step}: {(a - b).abs().max():.3g} from the replay"
    assert _equal_runs(plain[1], plain[0])
    assert not torch.equal(plain[0][1], flat2[0]["resumed"][1])  # step 7: dense, not OneBitAdam's compressed step


def test_a_non_finite_gradient_skips_the_step_on_every_rank(flat2):
    params, skipped = flat2[0]["nan"]
    assert [flat2[rank]["nan"][1] for rank in range(2)] == [1, 1]
    assert torch.equal(params[7], params[6])  # step 7 changed nothing
    assert len(params) == 12 and _equal_runs(params, flat2[1]["nan"][0])
    assert all(torch.isfinite(p).all() for p in params)


def test_the_metrics_count_compressed_steps_and_refreshes(flat2):
    m = flat2[0]["metrics"]
    # 12 steps: the warm-up 0-2, refreshes at 6 and 9, compressed the other 7
    assert (m["sync/compressed_steps"], m["sync/refreshes"]) == (7.0, 2.0)
    assert m["sync/bytes_total"] > 0


def test_refusals_name_the_fix(flat2):
    for rank in range(2):
        refused = flat2[rank]["refused"]
        assert "return torch.optim.Adam or AdamW" in refused["sgd"]
        assert "manual optimization" in refused["manual"]
        assert "warm-up must end before the fit does" in refused["warmup"]
