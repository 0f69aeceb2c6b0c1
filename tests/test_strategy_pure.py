"""RingDDPStrategy's construction, registry names and exchange slots: no process group needed."""

import inspect
from datetime import timedelta

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry

import lightning_dist
from lightning_dist import RingDDPStrategy
from lightning_dist.comm import CallRecord
from lightning_dist.compression import Compressor, NoCompressor
from lightning_dist.strategy import StepExchange


@pytest.mark.parametrize(
    "name,start_method,find_unused",
    [
        ("ring_ddp", "popen", None),
        ("ring_ddp_spawn", "spawn", None),
        ("ring_ddp_fork", "fork", None),
        ("ring_ddp_notebook", "fork", None),
        ("ring_ddp_find_unused_parameters_true", "popen", True),
        ("ring_ddp_notebook_find_unused_parameters_true", "fork", True),
    ],
)
def test_registered_names(name, start_method, find_unused):
    assert name in StrategyRegistry
    strategy = StrategyRegistry.get(name)
    assert isinstance(strategy, RingDDPStrategy)
    assert strategy.start_method == start_method
    assert strategy._ddp_kwargs.get("find_unused_parameters") == find_unused


def test_trainer_accepts_the_name():
    trainer = pl.Trainer(strategy="ring_ddp_fork", accelerator="cpu", devices=2, logger=False)
    assert isinstance(trainer.strategy, RingDDPStrategy)
    assert trainer.strategy.algorithm == "auto"
    assert trainer.world_size == 2


@pytest.mark.parametrize("key", ["ddp_comm_hook", "ddp_comm_state", "ddp_comm_wrapper", "model_averaging_period"])
def test_conflicting_ddp_keywords_are_rejected(key):
    with pytest.raises(ValueError, match=f"{key}.*collide"):
        RingDDPStrategy(**{key: object()})
    RingDDPStrategy(**{key: None})  # DDPStrategy's default is accepted, as DDPStrategy accepts it


def test_signature_mirrors_ddp_strategy_with_our_arguments_keyword_only():
    ours = inspect.signature(RingDDPStrategy.__init__).parameters
    theirs = inspect.signature(DDPStrategy.__init__).parameters
    positional = [n for n, p in theirs.items() if p.kind is p.POSITIONAL_OR_KEYWORD]
    assert [n for n, p in ours.items() if p.kind is p.POSITIONAL_OR_KEYWORD] == positional
    for name in ("algorithm", "compressor", "overlap"):
        assert ours[name].kind is inspect.Parameter.KEYWORD_ONLY
    cpu = [torch.device("cpu")] * 2
    s = RingDDPStrategy(None, cpu, None, None, None, None, None, None, None, "gloo", None, "fork")
    assert s.parallel_devices == cpu and s.process_group_backend == "gloo" and s.start_method == "fork"
    assert s.collective_timeout == timedelta(minutes=30)  # timeout=None: torch's default, as DDPStrategy
    assert RingDDPStrategy(timeout=None).collective_timeout == DDPStrategy()._timeout


def test_the_strategy_pickles_for_the_spawn_launcher():
    import pickle

    strategy = pickle.loads(pickle.dumps(RingDDPStrategy(start_method="spawn", algorithm="ring")))
    assert strategy.algorithm == "ring" and strategy.overlap
    strategy._hook_state.stats.record(CallRecord("ring", 1, 4, 4, 0.1))  # its lock was recreated


def test_other_ddp_keywords_pass_through_and_timeout_converts():
    s = RingDDPStrategy(algorithm="ring", timeout=42, find_unused_parameters=True, static_graph=True,
                        bucket_cap_mb=1, gradient_as_bucket_view=True)
    assert s._ddp_kwargs == {"find_unused_parameters": True, "static_graph": True, "bucket_cap_mb": 1,
                             "gradient_as_bucket_view": True}
    assert s.collective_timeout == timedelta(seconds=42)
    assert RingDDPStrategy(timeout=timedelta(minutes=2)).collective_timeout == timedelta(seconds=120)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"algorithm": "rings"}, "'rings'.*one of"),
        ({"timeout": 0}, "timeout=0.*positive"),
        ({"timeout": "soon"}, "timeout='soon'"),
        ({"start_method": "thread"}, "start_method='thread'"),
        ({"compressor": "zip"}, "compressor='zip'"),
        ({"overlap": "yes"}, "overlap='yes'"),
    ],
)
def test_bad_arguments_name_the_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RingDDPStrategy(**kwargs)


def test_compressor_argument():
    assert isinstance(RingDDPStrategy().features.compressor, NoCompressor)
    assert isinstance(RingDDPStrategy(compressor="none").features.compressor, NoCompressor)

    class Custom(Compressor):
        name = "custom"

    custom = Custom()
    assert RingDDPStrategy(compressor=custom).features.compressor is custom


def test_step_exchange_layout_and_reading():
    # two ranks' vectors, summed by hand as the exchange would
    vecs = []
    for rank in range(2):
        exchange = StepExchange(rank, 2)
        exchange.register("samples")
        exchange.register("bad_step")
        exchange.register("compute_s", per_rank=True)
        exchange.register("samples", per_rank=False)  # idempotent
        exchange.set("samples", 10 + rank)
        exchange.add("bad_step", 1 if rank == 1 else 0)
        exchange.set("compute_s", 0.5 * (rank + 1))
        vecs.append(exchange.pack())
    assert vecs[0].dtype == torch.float64 and vecs[0].numel() == 2 + 2 * 1
    exchange.load(vecs[0] + vecs[1])
    assert exchange.agreed("samples") == 21
    assert exchange.agreed("bad_step") == 1
    assert exchange.per_rank("compute_s") == [0.5, 1.0]
    with pytest.raises(KeyError, match="not registered"):
        exchange.set("stop", 1)
    with pytest.raises(RuntimeError, match="exchange"):
        StepExchange(0, 1).agreed("samples")


def test_package_exports():
    assert lightning_dist.RingDDPStrategy is RingDDPStrategy
    assert hasattr(lightning_dist, "DistMetrics")


def test_features_of_finds_the_seam_and_bucket_observers_register_once():
    from lightning_dist.strategy import BucketObserver, features_of

    strategy = RingDDPStrategy()
    features = features_of(strategy)
    assert features is strategy.features
    assert features_of(DDPStrategy()) is None and features_of(object()) is None
    observer, observers = BucketObserver(), strategy.features._hook_state.observers
    features.add_bucket_observer(observer)
    features.add_bucket_observer(observer)
    assert observers == [observer]
    features.remove_bucket_observer(observer)
    features.remove_bucket_observer(observer)  # not registered any more: nothing happens
    assert observers == []


# ---- per-rank gradient accumulation (lightning_dist.strategy.micro) --------------------------------------------

def test_lightning_results_hold_the_batch_micro_batches_set():
    # MicroBatches sets the results' batch per micro-batch (what self.log infers a batch size from); that the
    # trainer still has its results, and Lightning still calls the closure in the order MicroBatches needs, is
    # tests/test_upstream.py's
    from lightning.pytorch.trainer.connectors.logger_connector.result import _ResultCollection

    results = _ResultCollection(training=True)
    assert results.batch is None and results.batch_size is None


def test_a_batch_is_cut_along_the_share_and_other_values_pass_whole():
    from lightning_dist.strategy.micro import cut

    x, y = torch.arange(40.0).reshape(10, 4), torch.arange(10)
    pieces = cut({"x": x, "y": y, "name": "digits", "scale": torch.tensor(2.0), "table": torch.zeros(3)}, [4, 3, 3])
    assert [p["y"].tolist() for p in pieces] == [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]
    assert torch.equal(torch.cat([p["x"] for p in pieces]), x)
    assert all(p["name"] == "digits" and p["scale"] == 2.0 and p["table"].shape == (3,) for p in pieces)
    assert cut((x, y), [5, 5])[1][0].data_ptr() == x[5:].data_ptr()  # views, no copy
    with pytest.raises(ValueError, match="no tensor whose first dimension is 10.*hetero.accumulate='off'"):
        cut([torch.zeros(3, 10)], [5, 5])


def test_collectives_inside_a_micro_batch_skip_or_refuse_instead_of_hanging():
    strategy = RingDDPStrategy()
    value = torch.tensor(3.0)
    strategy._micro.inner = True  # a micro-batch other than the step's last runs training_step
    assert strategy.reduce(value) is value  # self.log(sync_dist=True): the last micro-batch's value is the step's
    for call in (lambda: strategy.all_gather(value), lambda: strategy.broadcast(value), strategy.barrier):
        with pytest.raises(RuntimeError, match="different numbers of micro-batches.*hetero.accumulate='off'"):
            call()
