"""DiLoCo (issue 31) on launched fork ranks, against a one-process replay of its contract.

The replay (:func:`replay`) is the contract written out on one process: N workers, each a copy of the model with its
own inner optimizer, each stepping on its own gradient (a worker of several ranks: the mean of its ranks' mean-loss
gradients); after every H-th step the workers' mean pseudo-gradient ``theta_global - theta_worker`` is the gradient
of ``torch.optim.SGD([theta_global], lr, momentum, nesterov=True)``, and every worker restarts from the new
``theta_global``. The launched runs must match it within float rounding, ranks of one worker bit-identical after
every step, every rank bit-identical after every sync.

Under a decaying inner learning rate (:class:`DecayingNet`: the rate at step ``k`` is ``decay(k)`` of its own) the
replay decays each worker's inner rate alike and writes out the default ``DiLoCo(inner_rate="rise")``: at each outer
step ``r`` = the mean inner rate of the steps the pseudo-gradient carries over the highest such mean so far, and the
outer SGD's rate is ``max(outer_lr, min(1, outer_lr / r))`` (at a constant rate ``r`` = 1: the outer rate as set).

A compressed pseudo-gradient (``DiLoCo(compressor=...)``) is checked exchange by exchange: :class:`Exchanges` records
what each rank handed the reduction and what came back, which must be, bit for bit, what the codec written out
(``tests/test_compression_ranks.py``'s ``ReferenceCodec``, with its error feedback and int8's noise) makes of it; the
outer steps on those sums must give the runs' ``theta_global``.

Three launched groups (2 and 3 flat ranks, 4 ranks posing as 2 hosts of 2) hold every fit; the assertions share them.
"""

from __future__ import annotations

import copy
import functools
import math
import warnings

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from test_compression_ranks import ReferenceCodec
from torch.optim.lr_scheduler import LambdaLR

from lightning_dist import RingDDPStrategy
from lightning_dist.callbacks import MemoryMonitor, NaNRecovery
from lightning_dist.compression import COMPRESSORS
from lightning_dist.hetero import HeteroBatching
from lightning_dist.sync import Auto, DiLoCo, auto_rule
from lightning_dist.sync.diloco_exchange import Exchanges as DiLoCoExchanges
from lightning_dist.testing import RecordingLogger, ToyClassifier, launched_externally, quiet_trainer, run_ranks

N_SAMPLES, BATCH = 96, 8
EVERY = 4
WARMUP = 3  # DiLoCo(warmup=...)'s fits: steps 1-3 average, then the first cycle is partial (one step, to step 4)
EPOCHS = 2
AUTO_EPOCHS, AUTO_BYTES = 19, 1000  # sync='auto''s fit: 114 steps on 2 ranks (syncs at 50 and 100, the final at 114);
# a bytes budget under dense's (Net's 709 float32 gradients a step) and over DiLoCo H=50's
TOLERANCE = 2e-5  # relative to the parameters' largest value: float rounding of other summation orders
# Net's parameters in the module's order: net.0.weight (512), net.0.bias (32), net.2.weight (160), net.2.bias (5);
# the cut into about equal runs of whole parameters (streaming's fragments, tests/test_sync_streaming.py)
CUTS = {1: [[0, 1, 2, 3]], 2: [[0], [1, 2, 3]]}
SETTINGS = {"topk": {"ratio": 0.05}, "threshold": {"threshold": 1e-3, "max_ratio": 0.2}, "powersgd": {"rank": 2}}
WRITTEN_OUT = ("int8", "int4", "topk", "threshold")  # compressors tests/test_compression_ranks.py writes out
DECAY_STEPS = 18  # the decaying fits' optimizer steps (flat: 3 epochs of 6; 2 hosts: 6 of 3): outer steps after steps
# 4 (r = 1), 8 (r = 0.725 / 0.925: the outer rate 0.7 / r = 0.89), 12 and 16 (r = 0.525 / 0.925 and below: capped at 1)


class Net(ToyClassifier):
    """16 -> 32 -> 5 on 96 samples, SGD with momentum or AdamW; the batches it trained on kept in ``seen``."""

    def __init__(self, optimizer="sgd", **kwargs):
        super().__init__(features=16, hidden=(32,), classes=5, samples=N_SAMPLES, batch_size=BATCH, momentum=0.9,
                         optimizer=optimizer, lr=0.1 if optimizer == "sgd" else 0.01, distributed_sampler=True,
                         seed=0, keep_batches=True, **kwargs)


def decay(step):
    """DecayingNet's inner rate at optimizer step ``step`` (from 0), a fraction of its own: linear, 5% of it a step
    (not geometric: a mean rate read a step late, after the scheduler stepped, would change every ratio)."""
    return 1.0 - 0.05 * step


class DecayingNet(Net):
    """Net whose inner learning rate decays every optimizer step: a ``LambdaLR`` that Lightning steps after each
    (``interval="step"``), so step ``k`` (from 0) runs at ``decay(k)`` of the optimizer's rate."""

    def configure_optimizers(self):
        optimizer = super().configure_optimizers()
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": LambdaLR(optimizer, decay), "interval": "step"}}


class NanLoss(Net):
    """Rank 1's loss is NaN at global step 5 (its inner step must be skipped, by its worker alone)."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if (self.global_rank, self.trainer.global_step) == (1, 5) else loss


class Poison(Callback):
    """After global step 5, rank 1's first weight turns +Inf (a fault no gradient check sees): its worker's
    progress, and so its pseudo-gradient at the sync after step 8, are not finite."""

    def on_train_batch_end(self, trainer, pl_module, *args):
        if trainer.global_rank == 1 and trainer.global_step == 5:
            with torch.no_grad():
                pl_module.net[0].weight[0, 0] = float("inf")


class ValNet(Net):
    """Net validating on its first 32 rows in one batch (every rank the same rows), its loss averaged over ranks."""

    def val_dataloader(self):
        x, y = self.data()
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x[:32], y[:32]), batch_size=32)

    def validation_step(self, batch, batch_idx):
        self.log("val/loss", torch.nn.functional.cross_entropy(self.net(batch[0]), batch[1]), sync_dist=True)


class Validated(Callback):
    """Each validation's step, reported loss, theta_global and this rank's parameters as validated."""

    def __init__(self):
        self.seen = []

    def on_validation_end(self, trainer, pl_module):
        sync = trainer.strategy.features.sync.loop
        self.seen.append((trainer.global_step, float(trainer.callback_metrics["val/loss"]),
                          torch.cat([g.reshape(-1) for g in sync.outer.theta]).clone(), _flat(pl_module)))


class Record(Callback):
    """This rank's parameters after every optimizer step, and once more after the fit (what landed at its end); under
    DiLoCo the outer SGD's learning rate after every step too."""

    def __init__(self):
        self.params, self.end, self.outer_lrs = [], None, []

    def on_train_batch_end(self, trainer, pl_module, *args):
        self.params.append(_flat(pl_module))
        sgd = getattr(getattr(getattr(trainer.strategy.features.sync, "loop", None), "outer", None), "sgd", None)
        if sgd is not None:
            self.outer_lrs.append(sgd.param_groups[0]["lr"])

    def teardown(self, trainer, pl_module, stage):
        self.end = _flat(pl_module)


def _flat(module):
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()]).clone()


class Exchanges:
    """Every bucket DiLoCo reduces on this rank while open (a launched rank's own copy of the class is patched): its
    parameters' names and shapes, the weighted pseudo-gradient this rank handed to the reduction and the sum that
    came back; the tests check each against the codec written out (``ReferenceCodec``)."""

    def __init__(self):
        self.calls = []

    def __enter__(self):
        real, calls = DiLoCoExchanges._reduce, self.calls

        def recording(sync, bucket, codec, transport):
            given = bucket.flat.clone()
            finite = real(sync, bucket, codec, transport)
            calls.append((bucket.layout.names, bucket.layout.shapes, given, bucket.flat.clone()))
            return finite

        DiLoCoExchanges._reduce, self._real = recording, real
        return self

    def __exit__(self, *exc):
        DiLoCoExchanges._reduce = self._real


def _part(flat, names, shapes, index, parts):
    """Part ``index`` of ``parts`` of a bucket, as two_tier cuts it (docs: slice ``index`` of every parameter, between
    rows where it has at least ``parts`` rows, else between elements; the first slices one row or element longer):
    its pieces' names and sizes, its values and, per piece, where the piece lies in the bucket."""
    pieces, sizes, where, start = [], [], [], 0
    for name, shape in zip(names, shapes, strict=True):
        numel = math.prod(shape)
        rows = shape[0] if len(shape) >= 1 and shape[0] >= parts else numel
        row = numel // rows
        base, extra = divmod(rows, parts)
        first = index * base + min(index, extra)
        count = base + (index < extra)
        if count:
            pieces.append(f"{name}#{index}/{parts}")
            sizes.append(count * row)
            where.append((start + first * row, start + (first + count) * row))
        start += numel
    return pieces, sizes, torch.cat([flat[a:b] for a, b in where]), where


def check_exchanges(runs, key, name, settings, hosts=1):
    """Every exchange recorded under ``key`` (:class:`Exchanges`' calls on every rank) came back as the codec written
    out sums what the workers handed it: flat, each rank a worker; ``hosts`` > 1, rank ``i`` of every host carries
    part ``i`` of the bucket across hosts (each part's own residuals and noise; a host's ranks hold the same
    pseudo-gradient) and the host gathers the parts. Returns every call's sum."""
    world = len(runs)
    per = world // hosts
    calls = [runs[rank][key] for rank in range(world)]
    assert len({len(c) for c in calls}) == 1 and len(calls[0]) > 0, [len(c) for c in calls]
    reference, sums = ReferenceCodec(name, **settings), []
    for c, (names, shapes, _, _) in enumerate(calls[0]):
        given = [calls[rank][c][2] for rank in range(world)]
        assert all(calls[rank][c][0] == names for rank in range(world))
        fragment = tuple(names)  # each fragment its own compressor
        if hosts == 1:
            want = reference.reduce(given, list(names), [math.prod(s) for s in shapes], [(fragment, r)
                                                                                         for r in range(world)])
        else:
            want = torch.empty_like(given[0])
            for i in range(per):
                for h in range(hosts):  # the host's ranks hold the same pseudo-gradient
                    assert torch.equal(given[h * per + i], given[h * per]), f"call {c}: host {h} disagrees"
                parts = [_part(given[h * per + i], names, shapes, i, per) for h in range(hosts)]
                pieces, sizes, _, where = parts[0]
                total = reference.reduce([p[2] for p in parts], pieces, sizes, [(fragment, i, h)
                                                                                 for h in range(hosts)])
                at = 0
                for a, b in where:
                    want[a:b] = total[at:at + b - a]
                    at += b - a
        for rank in range(world):
            got = calls[rank][c][3]
            assert torch.equal(got, want), f"{name} call {c} rank {rank}: {(got - want).abs().max():.3g} off"
        sums.append(want)
    return sums


@functools.lru_cache(maxsize=1)
def _alone():
    """Each worker's parameters after every step of the first epoch at 2 flat ranks, never synced (the replay)."""
    return replay(2, every=100 * EVERY, epochs=1, final_sync=False)[0]


def _outer_steps(start, sums, averages=()):
    """theta_global after each sync, by the contract: one SGD (Nesterov) step per sync on its reduced sum, or, for the
    syncs in ``averages`` (the final sync), theta_global minus it."""
    theta = start.clone()
    outer = torch.optim.SGD([theta], lr=DiLoCo.outer_lr, momentum=DiLoCo.outer_momentum, nesterov=True)
    after = []
    for i, reduced in enumerate(sums):
        with torch.no_grad():
            if i in averages:
                theta.sub_(reduced)
            else:
                theta.grad = reduced.clone()
                outer.step()
        after.append(theta.detach().clone())
    return after


def _strategy(sync, **kwargs):
    return RingDDPStrategy(sync=sync, timeout=60, start_method="fork", **kwargs)


def _fit(strategy, world, hosts=1, model=None, callbacks=(), epochs=EPOCHS, ckpt_path=None, **kwargs):
    pl.seed_everything(0, verbose=False)
    record = Record()
    trainer = quiet_trainer(devices=world // hosts, num_nodes=hosts, strategy=strategy, max_epochs=epochs,
                            callbacks=[record, *callbacks], use_distributed_sampler=False, **kwargs)
    trainer.fit(model or Net(), ckpt_path=ckpt_path)
    return trainer, record


# -- the one-process replay -----------------------------------------------------------------------------------------
def replay(world, hosts=1, optimizer="sgd", every=EVERY, outer_lr=DiLoCo.outer_lr,
           outer_momentum=DiLoCo.outer_momentum, epochs=EPOCHS, batches=None, fragments=1, delay=0, mix=0.5, steps=None,
           final_sync=True, warmup=0, means=None, decay=None, inner_rate=DiLoCo.inner_rate, outer_lrs=None, dense=0):
    """Each worker's parameters after every step, and at the end of the fit, and the workers' ranks, by the contract
    alone (the module's docstring; streaming's, tests/test_sync_streaming.py: ``fragments`` cut by :data:`CUTS`,
    ``delay`` and ``mix``). ``hosts > 1``: workers of ``world // hosts`` ranks, whose gradient is the mean of their
    ranks' mean-loss gradients weighted by samples; ``batches`` (per rank, every step's ``(x, y)``) replaces the
    unshuffled DistributedSampler's rows, and workers are then weighted by the samples since each fragment's last
    sync.
    ``steps`` (``balance="steps"``, flat): per rank the inner steps of each training step, each its own mean-loss
    step on one of the rank's ``batches`` (which then hold every inner step's ``(x, y)``).
    ``final_sync``: after the last step, in place of the sync due there, what is in flight lands, every fragment's
    ``theta_global`` becomes itself minus the mean pseudo-gradient since its last sync (the workers' mean, no outer
    momentum), and every worker takes ``theta_global`` (DiLoCo(final_sync=True)).
    ``warmup``: after each of the first ``warmup`` steps every fragment's ``theta_global`` becomes itself minus the mean
    pseudo-gradient (the workers' mean), with no outer momentum, and every worker takes it.
    ``means``: a list that gets, after every step, the workers' mean at each parameter's last sync (``theta_global``
    before that sync minus the mean pseudo-gradient: what ``validate="mean"`` validates), flat.
    ``decay``: a function, the inner rate of training step ``k`` (from 0) is ``decay(k)`` of the optimizer's own, on
    every worker (DecayingNet's schedule). ``inner_rate``: ``"rise"`` (DiLoCo's default) or ``"none"``: at each
    outer step (not at an average: the warm-up's, the final sync's) ``rate`` = the mean inner rate of the training
    steps since the fragment's last sync (read when its sync starts), ``peak`` = the highest such rate so far, this
    one included, and the outer rate is ``max(outer_lr, min(1, outer_lr * peak / rate))`` (``"none"``: ``outer_lr``).
    ``outer_lrs``: a list that gets the outer rate after every step.
    ``dense`` (flat): the first ``dense`` steps are dense DDP steps (every worker steps on the workers' mean gradient,
    so all stay one model with one optimizer state), then DiLoCo is bound from that model: ``sync="auto"`` switching to
    DiLoCo after its measuring steps."""
    assert inner_rate in ("rise", "none"), inner_rate
    assert not dense or hosts == 1, "dense steps first: flat workers"
    per = world // hosts if hosts > 1 else 1
    workers = [list(range(w * per, (w + 1) * per)) for w in range(world // per)]
    x, y = Net().data()
    start = Net(optimizer)
    models = [copy.deepcopy(start) for _ in workers]
    inner = [m.configure_optimizers() for m in models]
    theta = [p.detach().clone() for p in start.parameters()]
    synced_mean = [t.clone() for t in theta]
    outer = torch.optim.SGD(theta, lr=outer_lr, momentum=outer_momentum, nesterov=True)
    cut, spacing = CUTS[fragments], every // fragments
    steps_per_epoch = N_SAMPLES // (world * BATCH) if batches is None else len(batches[-1]) // epochs
    if steps is not None:  # each rank's inner steps, grouped by training step
        batches = [[batches[r][i:i + steps[r]] for i in range(0, len(batches[r]), steps[r])] for r in range(world)]
        steps_per_epoch = len(batches[0]) // epochs
    history = [[] for _ in workers]
    samples = [[0] * len(workers) for _ in cut]  # per fragment, per worker, since the fragment's last sync
    rates = [[] for _ in cut]  # per fragment, the inner rate of each training step since the fragment's last sync
    base_lrs = [[group["lr"] for group in optimizer.param_groups] for optimizer in inner]
    peak = 0.0  # the highest mean inner rate of an outer step's pseudo-gradient so far
    pending = []  # (lands, fragment, mean pseudo-gradient per parameter, each worker's parameters at the start, rate)

    def mean_of(fragment):
        """The fragment's mean pseudo-gradient since its last sync, and the mean inner rate of its steps."""
        counts, steps_rates = samples[fragment], rates[fragment]
        weights = [1 / len(workers)] * len(workers) if batches is None else [c / sum(counts) for c in counts]
        samples[fragment], rates[fragment] = [0] * len(workers), []
        with torch.no_grad():
            return {i: sum(m * (theta[i] - list(models[w].parameters())[i]) for w, m in enumerate(weights))
                    for i in cut[fragment]}, sum(steps_rates) / len(steps_rates)

    def land(fragment, mean, snapshots, rate=None, averages=False):
        nonlocal peak
        with torch.no_grad():
            for i in cut[fragment]:
                synced_mean[i] = theta[i] - mean[i]
                if averages:
                    theta[i].sub_(mean[i])
                else:
                    theta[i].grad = mean[i]
            if not averages:
                peak = max(peak, rate)
                ratio = rate / peak
                # "rise": the outer rate over outer_lr is the peak rate over this one, at most 1 in all, at least
                # outer_lr (a rising rate: this one is the peak)
                outer.param_groups[0]["lr"] = max(outer_lr, min(1.0, outer_lr / ratio)) if inner_rate == "rise" \
                    else outer_lr
                outer.step()
                outer.zero_grad(set_to_none=True)
            for w, model in enumerate(models):
                params = list(model.parameters())
                for i in cut[fragment]:
                    if snapshots is None:
                        params[i].copy_(theta[i])
                    else:
                        params[i].add_(theta[i] - snapshots[w][i], alpha=mix)

    step = 0
    for _ in range(epochs):
        for k in range(steps_per_epoch):
            factor = 1.0 if decay is None else decay(step)
            for optimizer, lrs in zip(inner, base_lrs, strict=True):
                for group, lr in zip(optimizer.param_groups, lrs, strict=True):
                    group["lr"] = lr * factor
            for fragment_rates in rates:  # every worker steps at the same rate
                fragment_rates.append(inner[0].param_groups[0]["lr"])
            for w, ranks in enumerate(workers):
                model = models[w]
                if steps is not None:  # flat: worker w is rank w
                    for bx, by in batches[w][step]:
                        inner[w].zero_grad()
                        torch.nn.functional.cross_entropy(model.net(bx), by).backward()
                        inner[w].step()
                        for counts in samples:
                            counts[w] += len(by)
                    continue
                inner[w].zero_grad()
                if batches is None:
                    data = [(x[rows], y[rows]) for rows in
                            ([(k * BATCH + j) * world + r for j in range(BATCH)] for r in ranks)]
                else:
                    data = [batches[r][step] for r in ranks]
                total = sum(len(by) for _, by in data)
                for counts in samples:
                    counts[w] += total
                loss = sum(len(by) / total * torch.nn.functional.cross_entropy(model.net(bx), by) for bx, by in data)
                loss.backward()
                if step >= dense:
                    inner[w].step()
            if step < dense:  # a dense step: the workers' mean gradient, the same step on every worker
                with torch.no_grad():
                    grads = [torch.stack([list(m.parameters())[i].grad for m in models]).mean(0)
                             for i in range(len(theta))]
                for w, model in enumerate(models):
                    for p, g in zip(model.parameters(), grads, strict=True):
                        p.grad = g.clone()
                    inner[w].step()
            step += 1
            if step == dense:  # DiLoCo bound from the model every worker holds, counting from here
                with torch.no_grad():
                    for t, p in zip(theta, models[0].parameters(), strict=True):
                        t.copy_(p)
                samples = [[0] * len(workers) for _ in cut]
                rates = [[] for _ in cut]
            for item in [p for p in pending if p[0] == step]:
                pending.remove(item)
                land(*item[1:])
            if final_sync and step == epochs * steps_per_epoch:  # its last step: what is in flight lands, every
                for item in pending:  # fragment averages the workers, and they all take theta
                    land(*item[1:])
                pending = []
                for fragment in range(len(cut)):
                    land(fragment, mean_of(fragment)[0], None, averages=True)
                with torch.no_grad():
                    for model in models:
                        for p, g in zip(model.parameters(), theta, strict=True):
                            p.copy_(g)
            elif step <= warmup:
                for fragment in range(len(cut)):
                    land(fragment, mean_of(fragment)[0], None, averages=True)
            elif step % spacing == 0 and step > dense:
                fragment = (step % every) // spacing
                mean, rate = mean_of(fragment)
                snapshots = [[p.detach().clone() for p in model.parameters()] for model in models]
                if delay:
                    pending.append((step + delay, fragment, mean, snapshots, rate))
                else:
                    land(fragment, mean, None, rate)
            for w in range(len(workers)):
                history[w].append(_flat(models[w]))
            if outer_lrs is not None:
                outer_lrs.append(outer.param_groups[0]["lr"])
            if means is not None:
                means.append(torch.cat([m.reshape(-1) for m in synced_mean]))
    for item in pending:  # final_sync=False: what is in flight lands as the fit ends
        land(*item[1:])
    return history, [_flat(m) for m in models], workers


def _decay_epochs(world):
    """The epochs of DECAY_STEPS optimizer steps at ``world`` ranks (each rank takes BATCH rows a step)."""
    return DECAY_STEPS * world * BATCH // N_SAMPLES


def _close(a, b):
    return (a - b).abs().max().item() <= TOLERANCE * max(1.0, b.abs().max().item())


# -- the launched groups --------------------------------------------------------------------------------------------
def _run_flat(rank, world, ckpt_dir):
    out = {}
    with launched_externally(rank, world), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for optimizer in ("sgd", "adamw"):
            _, record = _fit(_strategy(DiLoCo(every=EVERY)), world, model=Net(optimizer))
            out[("replay", optimizer)] = record.params
        if world == 3:
            return out
        _, record = _fit(_strategy(DiLoCo(every=EVERY, warmup=WARMUP)), world, model=Net("adamw"))
        out[("replay", "adamw", WARMUP)] = record.params
        # sync='auto' held to DiLoCo H=50 (dense excluded by its bytes): its measuring steps dense, then DiLoCo. A
        # short fit: the bound on syncs left (the quality tables' business, not this test's) lowered to one
        saved = auto_rule.MIN_SYNCS
        auto_rule.MIN_SYNCS = {family: dict.fromkeys(bounds, 1) for family, bounds in saved.items()}
        try:
            trainer, record = _fit(_strategy(Auto(methods=["diloco50"], max_bytes_per_step=AUTO_BYTES, long_s=60.0)),
                                   world, epochs=AUTO_EPOCHS)
        finally:
            auto_rule.MIN_SYNCS = saved
        out["auto"] = (record.params, [(h["step"], h["choice"]) for h in trainer.strategy.features.sync.history])
        # a decaying inner rate: the default (inner_rate="rise") answers it, "none" (the rule before it) does not
        for rule in ("rise", "none"):
            _, record = _fit(_strategy(DiLoCo(every=EVERY, inner_rate=rule)), world, model=DecayingNet(),
                             epochs=_decay_epochs(world))
            out[("decay", rule)] = (record.params, record.outer_lrs)
        # every compressor on the pseudo-gradient: ranks identical after each sync, residuals carried
        for name in COMPRESSORS:
            compressor = {"name": name, **SETTINGS.get(name, {})}
            with Exchanges() as exchanges:
                trainer, record = _fit(_strategy(DiLoCo(every=EVERY, compressor=compressor)), world)
            sync = trainer.strategy.features.sync.loop
            # error feedback's residuals alone (int8's generator state is a tensor too, and no residual)
            state = sync.fragments[0].compressor.state_dict().get("residuals", {})
            residuals = sum(float(v.abs().sum()) for v in _tensors(state))
            out[("compressor", name)] = (record.params, residuals, sync.outer_steps, dict(sync.metrics))
            out[("exchanges", name)] = exchanges.calls
        # sync=every_step and sync=None: today's default, bit for bit
        for sync in (None, "every_step"):
            _, record = _fit(_strategy(sync), world)
            out[("every_step", sync)] = record.params
        _, record = _fit(RingDDPStrategy(timeout=60, start_method="fork"), world)
        out["default"] = record.params
        # the skip: rank 1's worker turns non-finite after step 5; the sync after step 8 skips on every rank, with
        # NaNRecovery armed (which hears of it) and without
        nan = NaNRecovery()
        _, record = _fit(_strategy(DiLoCo(every=EVERY)), world, callbacks=[Poison(), nan])
        out["skip"] = (record.params, nan.skipped)
        _, record = _fit(_strategy(DiLoCo(every=EVERY)), world, callbacks=[Poison()])
        out["skip_unarmed"] = (record.params, None)
        nan = NaNRecovery()
        _, record = _fit(_strategy(DiLoCo(every=EVERY)), world, model=NanLoss(), callbacks=[nan])
        out["inner_skip"] = (record.params, nan.skipped)
        # resume mid-cycle (the first epoch's 6 steps end between the syncs after steps 4 and 8), int8 residuals
        diloco = {"every": EVERY, "compressor": "int8", "final_sync": False}  # a fit to go on as if never stopped
        _, record = _fit(_strategy(diloco), world)
        out["uninterrupted"] = record.params
        trainer, _ = _fit(_strategy(diloco), world, epochs=1)
        path = f"{ckpt_dir}/mid_cycle.ckpt"
        trainer.save_checkpoint(path)
        _, record = _fit(_strategy(diloco), world, ckpt_path=path)
        out["resumed"] = record.params
        out["checkpoint"] = torch.load(path, weights_only=True)["lightning_dist"]["sync"]["state"]["settings"] \
            if rank == 0 else None
        # the final sync of a fit that ends mid-cycle (6 steps, the last sync after step 4); theta_global after it
        trainer, record = _fit(_strategy(DiLoCo(every=EVERY)), world, model=Net("adamw"), epochs=1)
        theta = torch.cat([g.reshape(-1) for g in trainer.strategy.features.sync.loop.outer.theta])
        out["final"] = (record.params, record.end, theta)
        # validation of theta_global mid-cycle (after step 6, the last sync after step 4), and of each worker's own
        for validate in ("mean", "global", "worker"):
            validated = Validated()
            trainer, record = _fit(_strategy(DiLoCo(every=EVERY, validate=validate)), world, model=ValNet("adamw"),
                                   callbacks=[validated], limit_val_batches=None)
            out[("validate", validate)] = (record.params, validated.seen,
                                           float(trainer.callback_metrics["sync/validated_global"]),
                                           float(trainer.callback_metrics["sync/validated_mean"]))
        # Lightning's SIGTERM broadcast (every rank, every batch) only before the batches that end with a sync
        broadcasts = []
        real = torch.distributed.broadcast
        torch.distributed.broadcast = lambda tensor, *a, **k: broadcasts.append(tensor.numel()) or real(tensor, *a, **k)
        try:
            _fit(_strategy(DiLoCo(every=EVERY)), world)
            out["broadcasts"] = len(broadcasts)
            broadcasts.clear()
            _fit(_strategy(None), world)
            out["broadcasts_every_step"] = len(broadcasts)
        finally:
            torch.distributed.broadcast = real
        # metrics logged after every sync; MemoryMonitor's estimate counts DiLoCo's copies
        logger, monitor = RecordingLogger(), MemoryMonitor()
        _fit(_strategy(DiLoCo(every=EVERY)), world, epochs=1, logger=logger, log_every_n_steps=1,
             callbacks=[monitor])
        out["logged"] = logger.logged if rank == 0 else None
        out["memory"] = (monitor.estimate.parts.get("sync_state"), sum(p.numel() * 4 for p in Net().parameters()))
    return out


def _run_hosts(rank, world, ckpt_dir):
    out = {}
    with launched_externally(rank, world, hosts=2), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for optimizer in ("sgd", "adamw"):
            _, record = _fit(_strategy(DiLoCo(every=EVERY), topology="two_tier"), world, hosts=2,
                             model=Net(optimizer))
            out[("replay", optimizer)] = record.params
        _, record = _fit(_strategy(DiLoCo(every=EVERY, warmup=WARMUP), topology="two_tier"), world, hosts=2,
                         model=Net("adamw"))
        out[("replay", "adamw", WARMUP)] = record.params
        _, record = _fit(_strategy(DiLoCo(every=EVERY), topology="two_tier"), world, hosts=2, model=DecayingNet(),
                         epochs=_decay_epochs(world))
        out[("decay", "rise")] = (record.params, record.outer_lrs)
        for name in ("int8", "topk", "powersgd"):
            compressor = {"name": name, **SETTINGS.get(name, {})}
            with Exchanges() as exchanges:
                trainer, record = _fit(_strategy(DiLoCo(every=EVERY, compressor=compressor), topology="two_tier"),
                                       world, hosts=2)
            out[("compressor", name)] = (record.params, trainer.strategy.features.sync.loop.outer_steps)
            out[("exchanges", name)] = exchanges.calls
        strategy = _strategy(DiLoCo(every=EVERY), topology="two_tier", hetero=HeteroBatching(batch_sizes=[14, 6, 4, 8]))
        model = Net()
        _, record = _fit(strategy, world, hosts=2, epochs=EPOCHS, model=model)
        out["hetero"] = (record.params, model.seen)
    return out


def _tensors(tree):
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, dict):
        for value in tree.values():
            yield from _tensors(value)
    elif isinstance(tree, (list, tuple)):
        for value in tree:
            yield from _tensors(value)


@pytest.fixture(scope="module")
def flat2(tmp_path_factory):
    return run_ranks(_run_flat, 2, str(tmp_path_factory.mktemp("sync2")), deadline_s=240)


@pytest.fixture(scope="module")
def flat3(tmp_path_factory):
    return run_ranks(_run_flat, 3, str(tmp_path_factory.mktemp("sync3")), deadline_s=180)


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    return run_ranks(_run_hosts, 4, str(tmp_path_factory.mktemp("sync4")), deadline_s=240)


def _check_replay(runs, world, hosts_, optimizer, warmup=0):
    expected, _, workers = replay(world, hosts_, optimizer, warmup=warmup)
    got = [runs[rank][("replay", optimizer, warmup) if warmup else ("replay", optimizer)] for rank in range(world)]
    for w, ranks in enumerate(workers):
        for rank in ranks:
            assert len(got[rank]) == len(expected[w])
            for step, (a, b) in enumerate(zip(got[rank], expected[w], strict=True), start=1):
                assert _close(a, b), f"rank {rank} (worker {w}) step {step}: {(a - b).abs().max():.3g} from the replay"
    # ranks of one worker bit-identical after every step; every rank after every sync
    for step in range(len(expected[0])):
        for ranks in workers:
            assert all(torch.equal(got[rank][step], got[ranks[0]][step]) for rank in ranks)
        if (step + 1) % EVERY == 0 or step < warmup or step == len(expected[0]) - 1:  # every sync, the final sync
            assert all(torch.equal(got[rank][step], got[0][step]) for rank in range(world)), f"step {step + 1}"


pytestmark = pytest.mark.slow


@pytest.mark.parametrize("optimizer", ("sgd", "adamw"))
def test_two_flat_ranks_replay_diloco(flat2, optimizer):
    _check_replay(flat2, 2, 1, optimizer)


@pytest.mark.parametrize("optimizer", ("sgd", "adamw"))
def test_three_flat_ranks_replay_diloco(flat3, optimizer):
    _check_replay(flat3, 3, 1, optimizer)


@pytest.mark.parametrize("optimizer", ("sgd", "adamw"))
def test_two_hosts_of_two_replay_diloco(hosts, optimizer):
    _check_replay(hosts, 4, 2, optimizer)


def test_auto_switched_to_diloco_replays_its_dense_steps_then_diloco_from_them(flat2):
    """``sync="auto"`` that picks DiLoCo after its measuring steps: the one-process replay of that many dense steps
    (one model, the workers' mean gradient), then DiLoCo H=50 bound from the model they left, its first outer step at
    step 50 (a multiple of H), the final sync at the end."""
    measuring = Auto().warmup_steps + Auto().steps
    params, history = flat2[0]["auto"]
    assert history == [(measuring, "diloco50")]
    expected, _, _ = replay(2, every=50, epochs=AUTO_EPOCHS, dense=measuring)
    for rank in range(2):
        got = flat2[rank]["auto"][0]
        assert len(got) == len(expected[rank]) == AUTO_EPOCHS * N_SAMPLES // (2 * BATCH)
        for step, (a, b) in enumerate(zip(got, expected[rank], strict=True), start=1):
            assert _close(a, b), f"rank {rank} step {step}: {(a - b).abs().max():.3g} from the replay"
    for step in (*range(measuring), 49, 99, len(params) - 1):  # one model: the dense steps, the syncs, the final
        assert torch.equal(flat2[0]["auto"][0][step], flat2[1]["auto"][0][step]), step
    assert not torch.equal(flat2[0]["auto"][0][measuring + 1], flat2[1]["auto"][0][measuring + 1])  # local steps
    # the replay is not DiLoCo's from the start: the dense steps are what tell them apart
    plain, _, _ = replay(2, every=50, epochs=AUTO_EPOCHS)
    assert not _close(plain[0][measuring - 1], expected[0][measuring - 1])


def test_a_warm_up_that_averages_every_step_replays_flat_and_two_tier(flat2, hosts):
    _check_replay(flat2, 2, 1, "adamw", warmup=WARMUP)
    _check_replay(hosts, 4, 2, "adamw", warmup=WARMUP)
    # the warm-up's steps are other steps than the plain run's: the runs part after the first step
    assert not torch.equal(flat2[0][("replay", "adamw", WARMUP)][0], flat2[0][("replay", "adamw")][0])


def _check_decay(runs, world, hosts_, rule="rise"):
    """The launched fit under DecayingNet's rate against the replay under the same decay and ``rule``, every rank
    after every step; the outer SGD's rate after every step against the replay's arithmetic. Returns the replay's
    workers' parameters after every step and its outer rates."""
    lrs = []
    expected, _, workers = replay(world, hosts_, decay=decay, inner_rate=rule, epochs=_decay_epochs(world),
                                  outer_lrs=lrs)
    for w, ranks in enumerate(workers):
        for rank in ranks:
            params, outer_lrs = runs[rank][("decay", rule)]
            assert len(params) == len(expected[w]) == len(outer_lrs) == len(lrs) == DECAY_STEPS
            for step, (a, b) in enumerate(zip(params, expected[w], strict=True), start=1):
                assert _close(a, b), f"{rule}: rank {rank} step {step}: {(a - b).abs().max():.3g} from the replay"
            assert outer_lrs == pytest.approx(lrs, rel=1e-12, abs=0), f"{rule}: rank {rank}'s outer rates"
        for step in range(DECAY_STEPS):
            assert all(torch.equal(runs[rank][("decay", rule)][0][step], runs[ranks[0]][("decay", rule)][0][step])
                       for rank in ranks)
    return expected, lrs


def test_a_decaying_inner_rate_raises_the_outer_rate_as_the_replay_writes_it_out_flat_and_two_tier(flat2, hosts):
    outer_lr = DiLoCo.outer_lr
    assert DiLoCo().inner_rate == "rise"  # the default
    for runs, world, hosts_ in ((flat2, 2, 1), (hosts, 4, 2)):
        rise, lrs = _check_decay(runs, world, hosts_)
        # the outer steps after steps 4 (the peak: the rate as set), 8 (0.7 x 0.925 / 0.725 = 0.89: the mean rates
        # of steps 1-4 and 5-8) and 12 and 16 (at most 1); the final sync after step 18 averages and leaves the rate
        after = [lrs[step - 1] for step in (4, 8, 12, 16, 18)]
        assert after == pytest.approx([outer_lr, outer_lr * 0.925 / 0.725, 1.0, 1.0, 1.0], rel=1e-9), after
        # the rule matters here: the same decay under "none" (the outer rate as set) ends elsewhere
        none, _ = replay(world, hosts_, decay=decay, inner_rate="none", epochs=_decay_epochs(world))[:2]
        assert not _close(rise[0][-1], none[0][-1]) and _close(rise[0][3], none[0][3])  # apart from step 8 on
        assert not _close(runs[0][("decay", "rise")][0][-1], none[0][-1])
    # and when the rate is read: a step's rate read after Lightning's scheduler stepped (the next step's) would give
    # other outer rates (0.7 x 0.875 / 0.675 after step 8), which the launched runs' were compared with above
    late = []
    replay(2, decay=lambda k: decay(k + 1), epochs=_decay_epochs(2), outer_lrs=late)
    assert late[7] == pytest.approx(outer_lr * 0.875 / 0.675) and late[7] != pytest.approx(lrs[7], rel=1e-3)
    # the launched "none" (flat) is the replay's "none": the outer rate as set throughout
    _, lrs = _check_decay(flat2, 2, 1, rule="none")
    assert lrs == [outer_lr] * DECAY_STEPS


def test_hetero_batches_weigh_ranks_and_workers_by_samples(hosts):
    seen = [hosts[rank]["hetero"][1] for rank in range(4)]
    assert [len(bx) for bx, _ in seen[0][:2]] == [14, 14] and [len(bx) for bx, _ in seen[2][:2]] == [4, 4]
    expected, _, workers = replay(4, 2, batches=seen)
    for w, ranks in enumerate(workers):
        for rank in ranks:
            got = hosts[rank]["hetero"][0]
            assert len(got) == len(expected[w])
            for step, (a, b) in enumerate(zip(got, expected[w], strict=True), start=1):
                assert _close(a, b), f"rank {rank} step {step}: {(a - b).abs().max():.3g} from the replay"


@pytest.mark.parametrize("name", COMPRESSORS)
def test_every_compressor_carries_the_pseudo_gradient(flat2, name):
    params, residuals, outer_steps, metrics = flat2[0][("compressor", name)]
    assert outer_steps == len(params) // EVERY == 3
    for step in range(EVERY - 1, len(params), EVERY):
        assert torch.equal(params[step], flat2[1][("compressor", name)][0][step])
    assert all(torch.isfinite(p).all() for p in params)
    start, dense = _flat(Net()), flat2[0][("compressor", "none")][0][-1]
    # the same descent as the dense sync (top-k at 5% moves 3 syncs x 5% of the entries: the lowest, ~0.78)
    # (sign, 1 bit per element: ~0.67)
    assert torch.nn.functional.cosine_similarity(params[-1] - start, dense - start, dim=0) > (0.6 if name == "sign"
                                                                                               else 0.7)
    if name in ("int8", "int4", "topk", "threshold", "powersgd"):
        assert residuals > 0, f"{name}: no error-feedback residual carried between syncs"
    if name in WRITTEN_OUT:  # the exchanges themselves, exactly; what they started from; where they landed
        sums = check_exchanges(flat2, ("exchanges", name), name, SETTINGS.get(name, {}))
        assert len(sums) == 3
        # the first sync's input: each worker's weighted pseudo-gradient after 4 steps alone (the replay, no sync)
        for rank in range(2):
            assert _close(flat2[rank][("exchanges", name)][0][2], (start - _alone()[rank][EVERY - 1]) / 2), rank
        # theta_global after each: the outer step on the codec's sum (the final sync: theta_global minus it)
        for step, theta in zip((EVERY, 2 * EVERY, 3 * EVERY), _outer_steps(start, sums, averages={2}), strict=True):
            assert _close(params[step - 1], theta), f"{name}: theta_global after step {step}"
    assert metrics["sync/outer_steps"] == 3 and metrics["sync/bytes_per_sync"] > 0
    dense_bytes = flat2[0][("compressor", "none")][3]["sync/bytes_per_sync"]
    smaller = {"int8": 2.5, "topk": 3, "powersgd": 3}  # int8: 1 byte + a float scale per 512 of 709 elements
    if name in smaller:
        assert metrics["sync/bytes_per_sync"] < dense_bytes / smaller[name]


@pytest.mark.parametrize("name", ("int8", "topk", "powersgd"))
def test_two_tier_compressed_pseudo_gradient_identical_on_every_rank_after_a_sync(hosts, name):
    params, outer_steps = hosts[0][("compressor", name)]
    assert len(params) == 6 and outer_steps == 2  # the sync after step 4 and the final sync after step 6
    for rank in range(1, 4):
        for step in (EVERY - 1, len(params) - 1):
            assert torch.equal(hosts[rank][("compressor", name)][0][step], params[step])
    if name in WRITTEN_OUT:  # each host part compressed across hosts, exactly as written out; theta_global from it
        sums = check_exchanges(hosts, ("exchanges", name), name, SETTINGS.get(name, {}), hosts=2)
        assert len(sums) == 2
        for step, theta in zip((EVERY, 6), _outer_steps(_flat(Net()), sums, averages={1}), strict=True):
            assert _close(params[step - 1], theta), f"{name}: theta_global after step {step}"


@pytest.mark.parametrize("sync", (None, "every_step"))
def test_every_step_is_todays_default_bit_for_bit(flat2, sync):
    for rank in range(2):
        default = flat2[rank]["default"]
        assert len(default) == len(flat2[rank][("every_step", sync)])
        assert all(torch.equal(a, b) for a, b in zip(default, flat2[rank][("every_step", sync)], strict=True))


@pytest.mark.parametrize("run", ("skip", "skip_unarmed"))
def test_a_non_finite_pseudo_gradient_skips_the_outer_step_on_every_rank(flat2, run):
    params = [flat2[rank][run][0] for rank in range(2)]
    # the sync after step 8 is skipped: every rank restarts from theta_global of the sync after step 4
    assert torch.equal(params[0][7], params[1][7]) and torch.equal(params[0][7], params[0][3])
    assert all(torch.isfinite(p).all() for rank in range(2) for p in params[rank][7:])
    assert not torch.isfinite(params[1][6]).all() and torch.isfinite(params[0][6]).all()


def test_nan_recovery_hears_of_the_skipped_outer_step(flat2):
    # the poisoned weight saturates a tanh: rank 1's losses and gradients stay finite, only the sync sees it
    assert [flat2[rank]["skip"][1] for rank in range(2)] == [1, 1]


def test_a_non_finite_loss_skips_the_inner_step_of_its_worker_alone(flat2):
    params = [flat2[rank]["inner_skip"][0] for rank in range(2)]
    assert [flat2[rank]["inner_skip"][1] for rank in range(2)] == [0, 1]
    assert torch.equal(params[1][5], params[1][4]) and not torch.equal(params[0][5], params[0][4])
    assert torch.equal(params[0][7], params[1][7]) and not torch.equal(params[0][7], params[0][3])  # synced
    assert all(torch.isfinite(p).all() for rank in range(2) for p in params[rank])


def test_resume_mid_cycle_ends_bit_identical(flat2):
    for rank in range(2):
        resumed, whole = flat2[rank]["resumed"], flat2[rank]["uninterrupted"]
        assert len(resumed) == len(whole) // 2 == 6
        assert all(torch.equal(a, b) for a, b in zip(resumed, whole[len(whole) // 2:], strict=True)), f"rank {rank}"
    assert flat2[0]["checkpoint"].startswith("DiLoCo(every=4")


def test_sync_metrics_logged_after_every_sync(flat2):
    logged = [(step, metrics) for step, metrics in flat2[0]["logged"] if "sync/outer_steps" in metrics]
    assert [step for step, _ in logged] == [4, 6]  # the sync after step 4, the final sync after step 6
    metrics = logged[0][1]
    assert metrics["sync/outer_steps"] == 1 and metrics["sync/bytes_per_sync"] > 0
    assert math.isfinite(metrics["sync/pseudo_grad_norm"]) and metrics["sync/pseudo_grad_norm"] > 0
    assert metrics["sync/seconds"] > 0


def test_memory_monitor_counts_theta_global_and_momentum(flat2):
    counted, params = flat2[0]["memory"]
    # theta_global, the outer momentum, the exchange's buckets, the validated workers' mean (no buffers)
    assert counted == 4 * params


def test_lightnings_sigterm_broadcast_runs_before_syncs_only(flat2):
    for rank in range(2):
        assert flat2[rank]["broadcasts_every_step"] >= 12  # one per batch (and DDP's own at set-up)
        assert flat2[rank]["broadcasts"] == flat2[rank]["broadcasts_every_step"] - 12 + 3  # 3 syncs in 12 steps


def test_a_fit_ending_mid_cycle_ends_with_one_model_the_replays_theta_global(flat2):
    expected, final, _ = replay(2, optimizer="adamw", epochs=1)  # 6 steps: the final sync after step 6
    ends = [flat2[rank]["final"][1] for rank in range(2)]
    for rank in range(2):
        params, end, theta = flat2[rank]["final"]
        assert len(params) == len(expected[rank]) == 6
        same = all(_close(a, b) for a, b in zip(params, expected[rank], strict=True))
        assert same, f"rank {rank} differs from the replay"
        assert not torch.equal(params[4], flat2[1 - rank]["final"][0][4])  # mid-cycle the workers differ
        assert torch.equal(end, params[-1]) and torch.equal(end, theta) and torch.equal(end, ends[0])
        assert (end - final[rank]).abs().max() <= 1e-5 * max(1.0, final[rank].abs().max().item())


def _loss(flat):
    model = Net()
    torch.nn.utils.vector_to_parameters(flat, model.parameters())
    x, y = model.data()
    with torch.no_grad():
        return float(torch.nn.functional.cross_entropy(model.net(x[:32]), y[:32]))


def test_validation_runs_on_theta_global_and_leaves_the_workers_bit_for_bit(flat2):
    for rank in range(2):
        params, seen, flag, mean_flag = flat2[rank][("validate", "global")]
        assert (flag, mean_flag) == (1.0, 0.0)  # sync/validated_global: the metrics name the model validated
        # the workers' parameters are those of the same fit without validation, bit for bit
        assert len(params) == len(flat2[rank][("replay", "adamw")]) == 12
        assert all(torch.equal(a, b) for a, b in zip(params, flat2[rank][("replay", "adamw")], strict=True))
        assert [step for step, *_ in seen] == [6, 12]
        step, loss, theta, validated = seen[0]  # after step 6: mid-cycle, the last sync after step 4
        assert not torch.equal(params[5], flat2[1 - rank][("validate", "global")][0][5])
        assert torch.equal(validated, theta) and not torch.equal(validated, params[5])
        assert abs(loss - _loss(theta)) <= 1e-6 * max(1.0, abs(loss))  # a separate evaluation of theta_global


def test_validation_runs_by_default_on_the_workers_mean_at_the_last_sync(flat2):
    """validate="mean" (the default) validates theta_global before the last sync's outer step minus the mean
    pseudo-gradient: the replay's, not theta_global (the outer step's Nesterov extrapolation), and not a worker's."""
    means = []
    replay(2, optimizer="adamw", means=means)
    for rank in range(2):
        params, seen, flag, mean_flag = flat2[rank][("validate", "mean")]
        assert (flag, mean_flag) == (0.0, 1.0)
        assert all(torch.equal(a, b) for a, b in zip(params, flat2[rank][("replay", "adamw")], strict=True))
        assert [step for step, *_ in seen] == [6, 12]
        step, loss, theta, validated = seen[0]  # after step 6: mid-cycle, the last sync after step 4
        assert _close(validated, means[step - 1]) and not _close(validated, theta)
        assert not torch.equal(validated, params[5])  # each worker's own parameters are restored after it
        assert abs(loss - _loss(validated)) <= 1e-6 * max(1.0, abs(loss))
        step, loss, theta, validated = seen[1]  # the fit's last validation: after the final sync, theta_global
        assert torch.equal(validated, theta)


def test_validate_worker_runs_on_each_workers_own_parameters(flat2):
    own = [flat2[rank][("validate", "worker")][0][5] for rank in range(2)]  # after step 6
    for rank in range(2):
        params, seen, flag, mean_flag = flat2[rank][("validate", "worker")]
        assert (flag, mean_flag) == (0.0, 0.0)
        step, loss, theta, validated = seen[0]
        assert torch.equal(validated, own[rank])
        assert abs(loss - (_loss(own[0]) + _loss(own[1])) / 2) <= 1e-6 * max(1.0, abs(loss))  # sync_dist's mean
        assert abs(loss - flat2[rank][("validate", "global")][1][0][1]) > 1e-6
