"""Smoke test of ``python -m lightning_dist.benchmarks.codecs`` and its bucket layouts."""

import json

import pytest
import torch

from lightning_dist.benchmarks import codecs
from lightning_dist.benchmarks.codecs import QUICK_CODECS, bucket_layout, main


def test_buckets_are_the_issues_bucket_or_whole_rows_of_the_size_asked():
    assert bucket_layout("mlp").numel == 4_259_840 and len(bucket_layout("mlp").names) == 5
    assert bucket_layout("1M").numel == 2**18 and bucket_layout("25M").numel == 25 * 2**18
    with pytest.raises(ValueError, match="less than one 1024-wide row"):
        bucket_layout("1K")


def test_quick_run_writes_json_table_and_plot(tmp_path):
    payload = main(["--quick", "--rounds", "2", "--buckets", "1M", "--out", str(tmp_path)])
    records = json.loads((tmp_path / "codecs.json").read_text())["records"]
    assert [r["codec"] for r in records] == list(QUICK_CODECS) and records == payload["records"]
    for r in records:
        assert r["passes"] > 0 and r["ms"] > 0 and r["first_ms"] > 0 and r["pass_ms"] > 0
    topk = next(r for r in records if r["codec"] == "topk1%")
    assert topk["mass_kept"] == pytest.approx(1.0)  # the sampled selection is the exact top-k
    assert "passes [IQR]" in (tmp_path / "codecs.txt").read_text()
    assert (tmp_path / "codecs.png").read_bytes().startswith(b"\x89PNG")


def test_the_unit_pass_is_timed_in_place_on_the_bucket_each_codec_is_timed_on(monkeypatch):
    """The unit pass gets the same buffer as every codec, freshly restored from the gradient between the same two
    clock readings; it never reads the gradient's own copy nor writes a buffer the restoring copy has evicted."""
    events: list[tuple] = []
    drawn: list[torch.Tensor] = []  # the gradient measure_bucket draws, kept alive to be compared after it returns

    def clock() -> float:
        events.append(("tick",))
        return float(len(events))  # every call "takes" one tick

    def spy_gradient(*args):
        drawn.append(real_gradient(*args))
        return drawn[-1]

    def spy_pass(bucket: torch.Tensor) -> None:
        events.append(("pass", bucket, bucket.clone()))  # the tensor itself: alive, so compared by identity
        real_pass(bucket)  # in place: the next contender sees the gradient only if the bucket is restored again

    class SpyCompressor:
        def reduce(self, flat, layout, transport):
            events.append(("codec", flat, flat.clone()))
            flat.mul_(-1.0)  # a codec writes its input (error feedback, decoding): the gradient must not change
            return flat

        def commit(self):
            pass

    real_pass, real_gradient = codecs.unit_pass, codecs.gradient
    monkeypatch.setattr(codecs, "unit_pass", spy_pass)
    monkeypatch.setattr(codecs, "gradient", spy_gradient)
    monkeypatch.setattr(codecs, "_timer", lambda device: clock)
    monkeypatch.setitem(codecs.CODECS, "spy", codecs.Codec("spy", SpyCompressor))
    rounds, seed = 3, 7
    records = codecs.measure_bucket("4K", ["spy"], rounds, 2, torch.device("cpu"), seed)
    grad = real_gradient(codecs.bucket_layout("4K"), seed, torch.device("cpu"))
    assert [r["codec"] for r in records] == ["spy"]

    # every contender's call sits alone between two clock readings: first call, then 2 contenders per round
    calls = [e for e in events if e[0] != "tick"]
    assert [e[0] for e in events] == [kind for e in calls for kind in ("tick", e[0], "tick")]
    assert calls[0][0] == "codec"
    assert sorted(e[0] for e in calls[1:]) == ["codec"] * rounds + ["pass"] * rounds
    # the pass gets the very tensor the codecs get (the same object every call), and it holds the restored gradient
    # each time, although every contender before it wrote into it
    assert all(e[1] is calls[0][1] for e in calls)
    for _, _, seen in calls:
        assert torch.equal(seen, grad)
    # and it is not the gradient: the gradient measure_bucket drew is unchanged after every in-place write (the pass's
    # abs, the codec's negation), and the two share no memory (both tensors alive here, so no address is reused)
    assert len(drawn) == 1 and torch.equal(drawn[0], grad) and (grad < 0).any()
    assert not calls[0][1].untyped_storage().data_ptr() == drawn[0].untyped_storage().data_ptr()


def test_the_unit_pass_is_one_elementwise_pass_in_place():
    bucket = torch.tensor([-1.5, 0.0, 2.0])
    storage = bucket.data_ptr()  # the live tensor's own memory: the same address after means no new storage
    codecs.unit_pass(bucket)
    assert bucket.data_ptr() == storage and bucket.tolist() == [1.5, 0.0, 2.0]
