"""Checkpoints that are never half-written and never silently corrupt.

Format
------
A checkpoint ``run.ckpt`` is an ordinary :func:`torch.save` file, loadable by anything that loads Lightning
checkpoints. Next to it lies a sidecar ``run.ckpt.meta.json``::

    {"global_step": 120, "epoch": 3, "kind": "regular", ..., "format": 1, "sha256": "<hex>", "bytes": 123456}

``sha256`` and ``bytes`` describe the checkpoint file; the other keys are for choosing which checkpoint to resume
from without loading one (``kind`` is ``"regular"``, ``"emergency"`` or ``"after_stop"``, :data:`KIND_ORDER`; ``rank``
names the writer where it matters).

Guarantees
----------
* Every file is written to a temp file in the same directory (so on the same filesystem), flushed, fsynced, moved
  onto its name with :func:`os.replace` and the directory fsynced. A crash leaves either the old file or the new one,
  never a mix; a failed write removes its temp file and leaves the destination untouched.
* The checkpoint is written before its sidecar, and a stale sidecar is removed before the checkpoint is replaced: a
  sidecar only ever describes the complete file next to it.
* :func:`verify` compares size and sha256 with the sidecar, so a file that was truncated or damaged after it was
  written (a partial copy, a full disk during a non-atomic copy, bit rot) raises :class:`CheckpointError` rather than
  being taken for a good one. A checkpoint without a sidecar (written by stock Lightning) is accepted only if
  ``torch.load(..., weights_only=True, mmap=True)`` succeeds.

Only local paths are covered: a path containing ``://`` (fsspec, e.g. ``s3://``) is left to Lightning's own
:class:`~lightning.fabric.plugins.io.torch_io.TorchCheckpointIO` by :class:`AtomicCheckpointIO`.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import secrets
import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

__all__ = [
    "META_SUFFIX", "AtomicCheckpointIO", "CheckpointError", "CheckpointInfo", "atomic_write_bytes", "checkpoint_dir",
    "find_checkpoints", "load_checkpoint", "newest_valid", "save_checkpoint", "verify",
]

META_SUFFIX = ".meta.json"
FORMAT = 1
_INTEGRITY_KEYS = frozenset({"format", "sha256", "bytes", "verified"})  # written by this module, not by callers
_CHUNK = 1 << 20


class CheckpointError(ValueError):
    """A checkpoint is missing, truncated, corrupt or unreadable; the message names the file and the fix."""


# ---- atomic writes ---------------------------------------------------------------------------------------------

def _fsync_dir(directory: Path) -> None:
    """Make a rename in ``directory`` durable; a no-op where directories cannot be fsynced (Windows, some FUSE)."""
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


@contextmanager
def _staged(path: Path, data: bytes) -> Iterator[Path]:
    """Write ``data`` to a new, fsynced temp file next to ``path``; it is removed if this or the body fails."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        with open(tmp, "xb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        yield tmp
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Replace the file at ``path`` with ``data`` so that a crash leaves the old content or the new, never a mix."""
    path = Path(path)
    with _staged(path, data) as tmp:
        os.replace(tmp, path)
    _fsync_dir(path.parent)


# ---- save, verify, load ----------------------------------------------------------------------------------------

def _sidecar(path: str | os.PathLike) -> Path:
    return Path(f"{os.fspath(path)}{META_SUFFIX}")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def save_checkpoint(checkpoint: dict, path: str | os.PathLike, meta: dict | None = None) -> str:
    """Atomically write ``checkpoint`` to ``path`` and its sidecar ``<path>.meta.json``; return the file's sha256.

    ``meta`` adds keys to the sidecar (``kind``, ``rank``, ...); it may override ``global_step`` and ``epoch``, which
    default to the checkpoint's own, but not the integrity keys ``format``, ``sha256``, ``bytes`` or ``verified``.
    The parent directory must exist.
    """
    meta = dict(meta or {})
    if reserved := sorted(_INTEGRITY_KEYS & meta.keys()):
        raise ValueError(f"save_checkpoint: meta may not set {reserved}; they describe the file and are computed")
    buffer = io.BytesIO()
    torch.save(checkpoint, buffer)
    data = buffer.getvalue()
    sha256 = hashlib.sha256(data).hexdigest()
    sidecar_data = json.dumps({
        "global_step": checkpoint.get("global_step"), "epoch": checkpoint.get("epoch"), **meta,
        "format": FORMAT, "sha256": sha256, "bytes": len(data),
    }, indent=1).encode()  # serialised before anything is written: a meta that JSON refuses changes nothing on disk

    path, sidecar = Path(path), _sidecar(path)
    with _staged(path, data) as tmp:
        # An old sidecar must not outlive the file it describes: were we to die between the replace and the new
        # sidecar, it would condemn a good checkpoint as corrupt. Without one, verify() falls back to a load check.
        try:
            sidecar.unlink()
            _fsync_dir(path.parent)
        except FileNotFoundError:
            pass
        os.replace(tmp, path)
    _fsync_dir(path.parent)
    atomic_write_bytes(sidecar, sidecar_data)
    return sha256


def _read_sidecar(path: Path, sidecar: Path) -> dict:
    fix = f"delete {sidecar} to accept {path} on a load check alone, or resume from another checkpoint"
    try:
        meta = json.loads(sidecar.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"checkpoint {path}: its sidecar {sidecar} is unreadable ({e}); {fix}") from e
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise CheckpointError(f"checkpoint {path}: sidecar {sidecar} has format {found!r}, expected {FORMAT}; {fix}")
    if not isinstance(meta.get("sha256"), str) or not isinstance(meta.get("bytes"), int):
        raise CheckpointError(f"checkpoint {path}: sidecar {sidecar} lacks 'sha256' or 'bytes'; {fix}")
    return meta


def _load_check(path: Path) -> dict:
    """Accept a checkpoint without a sidecar if it loads; return what can be told about it."""
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:
        raise CheckpointError(
            f"checkpoint {path} has no sidecar {_sidecar(path).name} and does not load with weights_only=True "
            f"({type(e).__name__}: {e}); it is truncated, corrupt or not a checkpoint: resume from another one"
        ) from e
    if not isinstance(checkpoint, dict):
        raise CheckpointError(f"checkpoint {path} holds a {type(checkpoint).__name__}, not a checkpoint dict")
    return {"sha256": None, "verified": False,
            "global_step": checkpoint.get("global_step"), "epoch": checkpoint.get("epoch")}


def verify(path: str | os.PathLike) -> dict:
    """Check the checkpoint at ``path`` against its sidecar and return the sidecar's meta plus ``verified=True``.

    Without a sidecar the file must load (``weights_only=True``); the meta is then ``{"sha256": None,
    "verified": False, "global_step": ..., "epoch": ...}`` taken from the checkpoint. Raises
    :class:`CheckpointError` for a missing, truncated or corrupt file or an unreadable sidecar.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist or is not a file")
    sidecar = _sidecar(path)
    if not sidecar.exists():
        return _load_check(path)
    meta = _read_sidecar(path, sidecar)
    size, expected = path.stat().st_size, meta["bytes"]
    if size < expected:
        raise CheckpointError(f"checkpoint {path} is truncated: {size} of {expected} bytes (per {sidecar.name}); "
                              "resume from another checkpoint")
    if size > expected:
        raise CheckpointError(f"checkpoint {path} has {size} bytes, {sidecar.name} says {expected}: it was changed "
                              "after it was saved; resume from another checkpoint")
    if _sha256(path) != meta["sha256"]:
        raise CheckpointError(f"checkpoint {path} is corrupt: its sha256 checksum does not match {sidecar.name}; "
                              "resume from another checkpoint")
    return {**meta, "verified": True}


def load_checkpoint(path: str | os.PathLike, map_location: Any = "cpu") -> dict:
    """:func:`verify` the checkpoint, then load it with ``weights_only=True``."""
    verify(path)
    return torch.load(path, map_location=map_location, weights_only=True)


# ---- finding the checkpoint to resume from ---------------------------------------------------------------------

def checkpoint_dir(trainer: Any, dirpath: str | os.PathLike | None = None) -> str:
    """Where a run's checkpoints go: ``dirpath`` when given, else the Trainer's ModelCheckpoint's directory (resolved
    in its ``setup``), else ``<default_root_dir>/checkpoints``. Preemption, memory-stop and emergency checkpoints
    (in its ``emergency/``) go there too, so that ``resume=auto`` finds them beside the regular ones."""
    found = dirpath or getattr(trainer.checkpoint_callback, "dirpath", None)
    return os.fspath(found) if found else os.path.join(trainer.default_root_dir, "checkpoints")


@dataclass(frozen=True)
class CheckpointInfo:
    """A verified checkpoint. ``global_step`` and ``epoch`` are -1 where the checkpoint does not record them."""

    path: str
    global_step: int
    epoch: int
    kind: str
    rank: int | None
    mtime: float
    meta: dict = field(repr=False, compare=False)

    def sort_key(self) -> tuple[int, int, float]:
        """Larger is newer: the step, then a regular checkpoint over one written after an agreed stop over an
        emergency one (:data:`KIND_ORDER`), then the modification time."""
        return self.global_step, KIND_ORDER.get(self.kind, KIND_ORDER["regular"]), self.mtime


# At one step, which checkpoint to resume from. "after_stop": written (by ModelCheckpoint, say) after FaultTolerance's
# agreed stop, whose checkpoint holds the loop mid-epoch; Lightning records the stopped epoch as finished, so resuming
# from a later file of the same step would skip the rest of that epoch.
KIND_ORDER = {"emergency": 0, "after_stop": 1, "regular": 2}


def _candidates(dirs: Iterable[str | os.PathLike], pattern: str, recursive: bool) -> Iterator[Path]:
    seen: set[str] = set()
    for directory in dirs:
        directory = Path(directory)
        if not directory.is_dir():
            continue
        for path in directory.rglob(pattern) if recursive else directory.glob(pattern):
            if path.name.startswith(".") or path.name.endswith(META_SUFFIX) or not path.is_file():
                continue  # temp files of an unfinished write, sidecars
            key = os.path.realpath(path)
            if key not in seen:
                seen.add(key)
                yield path


def _int_or(value: Any, default: int) -> int:
    return value if isinstance(value, int) else default


def find_checkpoints(dirs: Iterable[str | os.PathLike], pattern: str = "*.ckpt",
                     recursive: bool = True) -> list[CheckpointInfo]:
    """Every valid checkpoint matching ``pattern`` in ``dirs``, newest first (see :meth:`CheckpointInfo.sort_key`).

    Missing directories are fine. Invalid checkpoints are skipped with a :class:`UserWarning` that says why.
    """
    found = []
    for path in _candidates(dirs, pattern, recursive):
        if info := _described(path, verify):
            found.append(info)
    return sorted(found, key=CheckpointInfo.sort_key, reverse=True)


def newest_valid(dirs: Iterable[str | os.PathLike], pattern: str = "*.ckpt") -> CheckpointInfo | None:
    """The newest valid checkpoint in ``dirs`` (searched recursively), or None if there is none.

    The candidates are ranked by what their sidecars say (a checkpoint without one must load instead), then
    checksummed newest first until one verifies: a run's older checkpoints are not read at all. Skipped ones warn
    as in :func:`find_checkpoints`.
    """
    claimed = []
    for path in _candidates(dirs, pattern, True):
        if info := _described(path, _claims):
            claimed.append(info)
    for info in sorted(claimed, key=CheckpointInfo.sort_key, reverse=True):
        if info.meta["sha256"] is None:  # no sidecar: _claims has load-checked it already
            return info
        if verified := _described(Path(info.path), verify):
            return verified
    return None


def _claims(path: Path) -> dict:
    """What the sidecar says of ``path`` (its checksum unchecked), or the load check's meta without a sidecar."""
    sidecar = _sidecar(path)
    return _read_sidecar(path, sidecar) if sidecar.exists() else _load_check(path)


def _described(path: Path, check: Callable[[Path], dict]) -> CheckpointInfo | None:
    """``path`` as a :class:`CheckpointInfo` with ``check``'s meta, or None (with a warning, attributed to the caller
    of :func:`find_checkpoints` or :func:`newest_valid`) if the check fails."""
    try:
        meta = check(path)
        mtime = path.stat().st_mtime
    except (CheckpointError, OSError) as e:
        warnings.warn(f"skipping checkpoint {path}: {e}", UserWarning, stacklevel=3)
        return None
    return CheckpointInfo(
        path=str(path), global_step=_int_or(meta.get("global_step"), -1), epoch=_int_or(meta.get("epoch"), -1),
        kind=meta.get("kind", "regular"), rank=meta.get("rank"), mtime=mtime, meta=meta,
    )


# ---- Lightning plugin ------------------------------------------------------------------------------------------

def _is_remote(path: str | os.PathLike) -> bool:
    return "://" in os.fspath(path)


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's :class:`TorchCheckpointIO` with atomic, checksummed saves and verified loads for local paths.

    Use it as ``Trainer(plugins=[AtomicCheckpointIO()])``. Remote (``://``) paths behave as in the parent class.
    ``guard``, when set, wraps each local write (FaultTolerance sets it to its watchdog's ``paused``, so a long
    write is not taken for a stall).
    """

    guard: Optional[Callable[[str], AbstractContextManager[Any]]] = None
    kind: str = "regular"  # the sidecar's kind for what it writes ("after_stop" once FaultTolerance stopped the fit)

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | os.PathLike,
                        storage_options: Any | None = None) -> None:
        if _is_remote(path):
            return super().save_checkpoint(checkpoint, path, storage_options)
        if storage_options is not None:
            raise TypeError(
                f"`Trainer.save_checkpoint(..., storage_options=...)` is not supported by `{type(self).__name__}`;"
                " implement your own `CheckpointIO` to define how `storage_options` should be used."
            )
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        with self.guard(f"writing {path}") if self.guard is not None else nullcontext():
            save_checkpoint(checkpoint, path, meta={"kind": self.kind})

    def load_checkpoint(self, path: str | os.PathLike, map_location: Callable | Any = lambda storage, loc: storage,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """Verify the checkpoint (raising :class:`CheckpointError`), then load it like the parent class does."""
        if _is_remote(path):
            return super().load_checkpoint(path, map_location=map_location, weights_only=weights_only)
        if not os.path.exists(path):
            raise FileNotFoundError(f"Checkpoint file not found: {path}")  # as the parent class raises
        verify(path)
        return torch.load(path, map_location=map_location, weights_only=weights_only)

    def remove_checkpoint(self, path: str | os.PathLike) -> None:
        """Remove the checkpoint, then its sidecar (a crash in between leaves an orphan sidecar, which is ignored)."""
        if _is_remote(path) or os.path.isdir(path):
            return super().remove_checkpoint(path)
        Path(path).unlink(missing_ok=True)
        _sidecar(path).unlink(missing_ok=True)
