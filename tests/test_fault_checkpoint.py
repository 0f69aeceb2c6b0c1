"""Atomic, checksummed checkpoints: round trip, failed saves, damaged files, choosing the checkpoint to resume from,
and the Lightning CheckpointIO plugin. No process group; one short single-process Trainer run."""

from __future__ import annotations

import hashlib
import json
import os
import warnings

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_dist.fault import checkpoint as ckpt_mod
from lightning_dist.fault.checkpoint import (
    META_SUFFIX,
    AtomicCheckpointIO,
    CheckpointError,
    atomic_write_bytes,
    checkpoint_dir,
    find_checkpoints,
    load_checkpoint,
    newest_valid,
    save_checkpoint,
    verify,
)
from lightning_dist.testing import ToyClassifier, quiet_trainer

# ---- helpers ---------------------------------------------------------------------------------------------------


def _lightning_like(step: int, epoch: int = 0, value: float = 1.0) -> dict:
    """What a Lightning checkpoint holds: tensors, numbers, strings, dicts and lists only."""
    return {
        "epoch": epoch,
        "global_step": step,
        "pytorch-lightning_version": "2.6.6",
        "state_dict": {"layer.weight": torch.full((2, 3), value), "layer.bias": torch.arange(2.0)},
        "loops": {"fit_loop": {"epoch_progress": {"total": {"completed": epoch}}}},
        "optimizer_states": [{"state": {}, "param_groups": [{"lr": 0.1, "params": [0, 1]}]}],
        "lr_schedulers": [],
        "callbacks": {},
    }


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        if isinstance(a[key], torch.Tensor):
            assert torch.equal(a[key], b[key]), key
        elif isinstance(a[key], dict):
            _assert_same(a[key], b[key])
        else:
            assert a[key] == b[key], key


def _sidecar(path) -> dict:
    return json.loads(open(f"{path}{META_SUFFIX}").read())


def _temp_files(directory) -> list[str]:
    return [name for name in os.listdir(directory) if name.startswith(".")]


def _truncate(path) -> None:
    data = open(path, "rb").read()
    open(path, "wb").write(data[: len(data) // 2])


def _flip_middle_byte(path) -> None:
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(path, "wb").write(bytes(data))


def _set_mtime(path, mtime: float) -> None:
    os.utime(path, (mtime, mtime))


# ---- round trip ------------------------------------------------------------------------------------------------


def test_round_trip_and_sidecar(tmp_path):
    path = tmp_path / "run.ckpt"
    checkpoint = _lightning_like(step=12, epoch=3)
    sha256 = save_checkpoint(checkpoint, path, meta={"kind": "regular", "rank": 0})

    _assert_same(load_checkpoint(path), checkpoint)
    data = path.read_bytes()
    assert sha256 == hashlib.sha256(data).hexdigest()
    assert _sidecar(path) == {"format": 1, "sha256": sha256, "bytes": len(data), "global_step": 12, "epoch": 3,
                              "kind": "regular", "rank": 0}
    assert verify(path) == {**_sidecar(path), "verified": True}
    assert _temp_files(tmp_path) == []


def test_meta_may_not_set_integrity_keys(tmp_path):
    with pytest.raises(ValueError, match="sha256"):
        save_checkpoint(_lightning_like(1), tmp_path / "a.ckpt", meta={"sha256": "0" * 64})
    assert os.listdir(tmp_path) == []


# ---- failed saves ----------------------------------------------------------------------------------------------


def _fail(*args, **kwargs):
    raise OSError(28, "No space left on device")


@pytest.mark.parametrize("failing", ["replace", "fsync"])
def test_failed_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch, failing):
    path = tmp_path / "run.ckpt"
    save_checkpoint(_lightning_like(1, value=1.0), path)
    monkeypatch.setattr(os, failing, _fail)
    with pytest.raises(OSError, match="No space"):
        save_checkpoint(_lightning_like(2, value=2.0), path)
    monkeypatch.undo()

    _assert_same(load_checkpoint(path), _lightning_like(1, value=1.0))
    assert _temp_files(tmp_path) == []
    # A failed fsync happens before anything is touched; a failed replace comes after the old sidecar is removed,
    # which leaves the old (complete) file to the load check.
    assert verify(path)["verified"] is (failing == "fsync")


def test_failed_atomic_write_leaves_destination_untouched(tmp_path, monkeypatch):
    path = tmp_path / "file.bin"
    path.write_bytes(b"old")
    monkeypatch.setattr(os, "replace", _fail)
    with pytest.raises(OSError):
        atomic_write_bytes(path, b"new content")
    assert path.read_bytes() == b"old"
    assert _temp_files(tmp_path) == []


def test_crash_before_the_new_sidecar_does_not_condemn_the_new_file(tmp_path, monkeypatch):
    """Overwriting: the old sidecar goes before the new file arrives, so it can never describe the new file."""
    path = tmp_path / "last.ckpt"
    save_checkpoint(_lightning_like(1, value=1.0), path)
    monkeypatch.setattr(ckpt_mod, "atomic_write_bytes", _fail)  # only the sidecar is written with it
    with pytest.raises(OSError):
        save_checkpoint(_lightning_like(2, value=2.0), path)
    monkeypatch.undo()

    assert not os.path.exists(f"{path}{META_SUFFIX}")
    assert verify(path) == {"sha256": None, "verified": False, "global_step": 2, "epoch": 0}
    _assert_same(load_checkpoint(path), _lightning_like(2, value=2.0))


# ---- damaged files ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("damage", "word"), [(_truncate, "truncated"), (_flip_middle_byte, "checksum")])
def test_damaged_checkpoint_is_refused(tmp_path, damage, word):
    path = tmp_path / "run.ckpt"
    save_checkpoint(_lightning_like(5), path)
    size = path.stat().st_size
    damage(path)
    assert (path.stat().st_size == size) is (word == "checksum")

    for load in (verify, load_checkpoint, AtomicCheckpointIO().load_checkpoint):
        with pytest.raises(CheckpointError, match=word) as excinfo:
            load(path)
        assert str(path) in str(excinfo.value)


def test_find_checkpoints_skips_damaged_ones_with_a_warning(tmp_path):
    for step in (1, 3, 4, 5):
        save_checkpoint(_lightning_like(step), tmp_path / f"step={step}.ckpt")
    _truncate(tmp_path / "step=5.ckpt")
    _flip_middle_byte(tmp_path / "step=4.ckpt")

    with pytest.warns(UserWarning) as record:
        found = find_checkpoints([tmp_path])
    assert [info.global_step for info in found] == [3, 1]
    assert all(info.kind == "regular" and info.meta["verified"] for info in found)
    messages = sorted(str(w.message) for w in record)
    assert len(messages) == 2
    assert messages[0].startswith(f"skipping checkpoint {tmp_path / 'step=4.ckpt'}: ") and "checksum" in messages[0]
    assert messages[1].startswith(f"skipping checkpoint {tmp_path / 'step=5.ckpt'}: ") and "truncated" in messages[1]


def test_unreadable_sidecar_is_refused(tmp_path):
    path = tmp_path / "run.ckpt"
    save_checkpoint(_lightning_like(1), path)
    open(f"{path}{META_SUFFIX}", "w").write('{"format": 1, "sha2')
    with pytest.raises(CheckpointError, match="unreadable") as excinfo:
        verify(path)
    assert f"delete {path}{META_SUFFIX}" in str(excinfo.value)


def test_missing_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        verify(tmp_path / "nope.ckpt")
    with pytest.raises(FileNotFoundError):  # as Lightning's own TorchCheckpointIO raises
        AtomicCheckpointIO().load_checkpoint(tmp_path / "nope.ckpt")


# ---- checkpoints without a sidecar -----------------------------------------------------------------------------


def test_checkpoint_without_sidecar_is_accepted_if_it_loads(tmp_path):
    path = tmp_path / "stock.ckpt"
    torch.save(_lightning_like(7, epoch=2), path)  # as stock Lightning writes it

    assert verify(path) == {"sha256": None, "verified": False, "global_step": 7, "epoch": 2}
    _assert_same(load_checkpoint(path), _lightning_like(7, epoch=2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        [info] = find_checkpoints([tmp_path])
    assert (info.global_step, info.epoch, info.kind, info.rank) == (7, 2, "regular", None)


@pytest.mark.parametrize("content", [b"not a checkpoint at all", "truncated"])
def test_unloadable_file_without_sidecar_is_skipped(tmp_path, content):
    save_checkpoint(_lightning_like(1), tmp_path / "good.ckpt")
    bad = tmp_path / "bad.ckpt"
    if content == "truncated":
        torch.save(_lightning_like(9), bad)
        _truncate(bad)
    else:
        bad.write_bytes(content)

    with pytest.raises(CheckpointError, match="no sidecar"):
        verify(bad)
    with pytest.warns(UserWarning, match=f"skipping checkpoint {bad}: "):
        found = find_checkpoints([tmp_path])
    assert [info.path for info in found] == [str(tmp_path / "good.ckpt")]


# ---- choosing the checkpoint to resume from --------------------------------------------------------------------


def test_ordering(tmp_path):
    now = 1_700_000_000.0
    layout = [  # name, step, kind, mtime
        ("old-but-far.ckpt", 20, "regular", now - 100),
        ("emergency.ckpt", 20, "emergency", now),
        ("recent-but-early.ckpt", 10, "regular", now + 100),
        ("sub/same-step-newer.ckpt", 10, "regular", now + 200),
    ]
    for name, step, kind, mtime in layout:
        path = tmp_path / name
        path.parent.mkdir(exist_ok=True)
        save_checkpoint(_lightning_like(step), path, meta={"kind": kind, "rank": 1 if kind == "emergency" else None})
        _set_mtime(path, mtime)

    found = find_checkpoints([tmp_path, tmp_path / "sub"])  # overlapping directories list a file once
    assert [os.path.relpath(info.path, tmp_path) for info in found] == [
        "old-but-far.ckpt", "emergency.ckpt", "sub/same-step-newer.ckpt", "recent-but-early.ckpt"]
    assert (found[1].kind, found[1].rank) == ("emergency", 1)
    assert newest_valid([tmp_path]).path == str(tmp_path / "old-but-far.ckpt")
    assert [info.global_step for info in find_checkpoints([tmp_path], recursive=False)] == [20, 20, 10]


def test_temp_files_and_sidecars_are_ignored(tmp_path):
    save_checkpoint(_lightning_like(1), tmp_path / "a.ckpt")
    (tmp_path / ".a.ckpt.tmp-123-abcd").write_bytes(b"half")
    (tmp_path / ".b.ckpt").write_bytes(b"half")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert [info.path for info in find_checkpoints([tmp_path], pattern="*")] == [str(tmp_path / "a.ckpt")]


def test_newest_valid_without_checkpoints(tmp_path):
    assert newest_valid([]) is None
    assert newest_valid([tmp_path]) is None
    assert newest_valid([tmp_path / "missing", str(tmp_path / "also-missing")]) is None


# ---- Lightning plugin ------------------------------------------------------------------------------------------


def test_checkpoint_io_save_load_remove(tmp_path):
    plugin = AtomicCheckpointIO()
    path = tmp_path / "nested" / "dir" / "run.ckpt"
    checkpoint = _lightning_like(4, epoch=1)
    plugin.save_checkpoint(checkpoint, path)

    assert _sidecar(path)["kind"] == "regular" and _sidecar(path)["global_step"] == 4
    _assert_same(plugin.load_checkpoint(path, weights_only=True), checkpoint)
    with pytest.raises(TypeError, match="storage_options"):
        plugin.save_checkpoint(checkpoint, tmp_path / "other.ckpt", storage_options={"x": 1})

    plugin.remove_checkpoint(path)
    assert os.listdir(path.parent) == []
    plugin.remove_checkpoint(path)  # removing twice is fine


def test_checkpoint_io_leaves_remote_paths_to_lightning():
    plugin = AtomicCheckpointIO()
    url = "memory://lightning-dist-test/run.ckpt"
    plugin.save_checkpoint({"w": torch.ones(2)}, url)
    assert torch.equal(plugin.load_checkpoint(url)["w"], torch.ones(2))
    plugin.remove_checkpoint(url)
    with pytest.raises(FileNotFoundError):
        plugin.load_checkpoint(url)


def _tiny() -> ToyClassifier:
    return ToyClassifier(features=4, hidden=(), samples=4, batch_size=2)  # two steps an epoch


def _trainer(tmp_path, max_steps: int) -> L.Trainer:
    return quiet_trainer(plugins=[AtomicCheckpointIO()], max_steps=max_steps, devices=1, enable_checkpointing=True,
                         callbacks=[ModelCheckpoint(dirpath=tmp_path)])


@pytest.mark.slow  # two Lightning runs
def test_trainer_writes_verified_checkpoints_and_resumes(tmp_path):
    first = _trainer(tmp_path, max_steps=2)
    first.fit(_tiny())
    path = first.checkpoint_callback.best_model_path
    assert os.path.isfile(f"{path}{META_SUFFIX}")
    assert verify(path)["verified"] and _sidecar(path)["global_step"] == 2

    second = _trainer(tmp_path, max_steps=3)
    second.fit(_tiny(), ckpt_path=path, weights_only=True)
    assert second.global_step == 3
    assert newest_valid([tmp_path]).global_step == 3


def test_newest_valid_checksums_only_until_one_verifies(tmp_path, monkeypatch):
    for step in (1, 2, 3, 4):
        save_checkpoint(_lightning_like(step), tmp_path / f"step={step}.ckpt")
    hashed = []
    real = ckpt_mod._sha256
    monkeypatch.setattr(ckpt_mod, "_sha256", lambda path: hashed.append(path.name) or real(path))
    assert newest_valid([tmp_path]).global_step == 4 and hashed == ["step=4.ckpt"]
    hashed.clear()
    _flip_middle_byte(tmp_path / "step=4.ckpt")
    with pytest.warns(UserWarning, match=r"step=4.ckpt: .*checksum"):
        info = newest_valid([tmp_path])
    assert info.global_step == 3 and info.meta["verified"] and hashed == ["step=4.ckpt", "step=3.ckpt"]


def test_resume_choice_is_reused_by_the_ranks_of_one_run_only(tmp_path, monkeypatch):
    from lightning_dist.fault import resume

    for var in (resume.ENV, resume.ENV_DIR, "TORCHELASTIC_RUN_ID"):
        monkeypatch.setenv(var, "")  # recorded, so that what choose() sets is undone after the test
        monkeypatch.delenv(var)
    first, second = tmp_path / "job0" / "checkpoints", tmp_path / "job1" / "checkpoints"
    for directory, step in ((first, 3), (second, 7)):
        directory.mkdir(parents=True)
        save_checkpoint(_lightning_like(step), directory / f"step={step}.ckpt")
    assert resume.choose(str(first)) == str(first / "step=3.ckpt")
    save_checkpoint(_lightning_like(5), first / "step=5.ckpt")  # a rank started later resumes as its launcher chose
    assert resume.choose(str(first)) == str(first / "step=3.ckpt")
    assert resume.choose(str(second)) == str(second / "step=7.ckpt")  # a sweep's next job, in the same process


def test_one_place_says_where_a_runs_checkpoints_go(tmp_path):
    from types import SimpleNamespace

    bare = SimpleNamespace(checkpoint_callback=None, default_root_dir=str(tmp_path))
    assert checkpoint_dir(bare) == str(tmp_path / "checkpoints")
    assert checkpoint_dir(bare, tmp_path / "mine") == str(tmp_path / "mine")  # FaultTolerance(dirpath=...)
    with_callback = SimpleNamespace(checkpoint_callback=ModelCheckpoint(dirpath=tmp_path / "ckpts"),
                                    default_root_dir=str(tmp_path))
    assert checkpoint_dir(with_callback) == str(tmp_path / "ckpts")
    assert checkpoint_dir(with_callback, str(tmp_path / "mine")) == str(tmp_path / "mine")
