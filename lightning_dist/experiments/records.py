"""Records that come back from forked ranks, as files: rank zero's logged metrics and every rank's step timeline.

Ranks that Lightning's fork launcher (``strategy="ring_ddp_notebook"``) starts from a notebook share nothing
with it once forked: only the weights and ``trainer.callback_metrics`` come back to the notebook's process.
What a notebook plots (every logged value at every step, each rank's timeline) therefore goes to files
that the notebook reads once ``fit`` returns:

- :class:`JsonlLogger`: a Lightning logger; rank zero appends one JSON line per ``log_metrics`` call, so
  the per-step ``dist/*`` metrics the strategy gathers to rank zero (every rank's compute time, bytes,
  batch size) arrive with the model's own ``train/loss`` and ``val/acc``;
- :class:`StepTimeline`: a callback; every rank writes its own ``timeline-rank{r}.jsonl``, one line per
  training batch: when it started, when backward handed its last gradient bucket over (compute done),
  when the last bucket came back reduced (waiting for peers done), when the optimizer step ended.

Both need only a directory every rank can write to, so they work under every launcher (fork, spawn,
popen, torchrun; across machines with a shared filesystem). Records are plain dicts, no pandas.
"""

from __future__ import annotations

import csv
import json
import math
import os
import time
from typing import Any, Iterable, Optional, Sequence

import lightning.pytorch as pl
from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import Logger
from lightning.pytorch.utilities.data import extract_batch_size
from typing_extensions import override

from lightning_dist.strategy.features import features_of

Record = dict[str, Any]


def _plain(value: Any) -> Any:
    """A logged value as a JSON-able Python number (tensors, NumPy scalars); other values as they are."""
    if hasattr(value, "item"):
        return value.item()
    return value


def read_jsonl(path: str | os.PathLike) -> list[Record]:
    """Every JSON line of ``path`` as a dict; an absent file gives ``[]``, a cut-off last line is skipped."""
    if not os.path.exists(path):
        return []
    out = []
    with open(path) as fh:
        for line in fh:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:  # a rank killed mid-write leaves half a line at the end
                continue
    return out


def read_csv_metrics(path: str | os.PathLike) -> list[Record]:
    """Lightning's ``CSVLogger`` file (``csv/metrics.csv`` of ``lightning-dist-train``) as records: one dict
    per row, empty cells left out, numbers as floats (``step`` and ``epoch`` as ints)."""
    if not os.path.exists(path):
        return []
    out = []
    with open(path, newline="") as fh:
        for row in csv.DictReader(fh):
            record: Record = {}
            for key, text in row.items():
                if text in ("", None):
                    continue
                value = float(text)
                record[key] = int(value) if key in ("step", "epoch") else value
            out.append(record)
    return out


def series(records: Iterable[Record], key: str, x: str = "step") -> tuple[list[float], list[float]]:
    """``(xs, values)`` of the records that hold ``key`` (and ``x``), in order: one metric's curve."""
    xs, ys = [], []
    for record in records:
        if key in record and x in record and record[key] is not None:
            xs.append(record[x])
            ys.append(record[key])
    return xs, ys


def last(records: Sequence[Record], key: str, default: Optional[float] = None) -> Optional[float]:
    """The last value logged for ``key`` (``default`` if it never was)."""
    for record in reversed(records):
        if key in record:
            return record[key]
    return default


class JsonlLogger(Logger):
    """A Lightning logger whose records outlive forked ranks: rank zero appends them to ``<save_dir>/<name>.jsonl``.

    Each ``log_metrics(metrics, step)`` call becomes one line ``{"step": step, **metrics}``; read them back
    in the launching process with :meth:`records` once ``fit`` has returned. The file starts empty when the
    logger is made in the launching process (or in rank zero under ``torchrun``); other ranks never write.

    Args:
        save_dir: directory of the file (created if missing).
        name: the file's name without ``.jsonl``.
    """

    def __init__(self, save_dir: str | os.PathLike, name: str = "metrics") -> None:
        super().__init__()
        self._save_dir, self._name = os.fspath(save_dir), name
        self.path = os.path.join(self._save_dir, f"{name}.jsonl")
        if rank_zero_only.rank == 0:  # the ranks a launcher re-creates (popen, torchrun) must not truncate it
            os.makedirs(self._save_dir, exist_ok=True)
            open(self.path, "w").close()

    @property
    @override
    def name(self) -> str:
        return self._name

    @property
    @override
    def version(self) -> str:
        return ""

    @property
    @override
    def save_dir(self) -> str:
        return self._save_dir

    @property
    @override
    def log_dir(self) -> str:
        return self._save_dir

    @override
    @rank_zero_only
    def log_metrics(self, metrics: dict[str, Any], step: Optional[int] = None) -> None:
        record = {"step": step, **{key: _plain(value) for key, value in metrics.items()}}
        with open(self.path, "a") as fh:  # one open per call: nothing buffered is lost if the rank dies
            fh.write(json.dumps(record) + "\n")

    @override
    @rank_zero_only
    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass  # the notebooks pass their settings explicitly; a model's hparams are in its checkpoint

    def records(self) -> list[Record]:
        """Everything logged so far, one dict per ``log_metrics`` call, in order."""
        return read_jsonl(self.path)


class StepTimeline(Callback):
    """Every rank's training batches as time intervals, each rank into ``<save_dir>/timeline-rank{r}.jsonl``.

    One record per training batch and rank, times in seconds since the epoch (``time.time()``: comparable
    across the processes of one machine):

    - ``start``: the batch reached ``training_step`` (data loading is before it);
    - ``compute_end``: backward handed its last gradient bucket over (forward and backward done). Under
      :class:`~lightning_dist.RingDDPStrategy` this is the hook's own stamp; under other strategies the end of
      backward, so ``wait`` is then 0;
    - ``comm_end``: the last bucket came back reduced: ``comm_end - compute_end`` is what this rank waited for
      its peers and the wire (a fast rank waits for a slow one here);
    - ``end``: the optimizer step and the batch's callbacks are done.

    Plus ``rank``, ``step`` (the global step the batch belongs to), ``epoch``, ``batch_idx``, ``samples``
    (this rank's batch size) and ``loss`` (this rank's batch loss). Read them with :func:`read_timeline`.
    The files start empty at each fit.
    """

    def __init__(self, save_dir: str | os.PathLike) -> None:
        self.save_dir = os.fspath(save_dir)
        self._file: Any = None
        self._offset = 0.0  # time.time() - time.perf_counter(): the hook's stamps are perf_counter's
        self._row: Record = {}

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._close()  # a fit that failed before its teardown left it open
        os.makedirs(self.save_dir, exist_ok=True)
        self._file = open(os.path.join(self.save_dir, f"timeline-rank{trainer.global_rank}.jsonl"), "w",
                          buffering=1)  # line-buffered: every record reaches the file as it is written
        self._offset = time.time() - time.perf_counter()

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        try:
            samples = extract_batch_size(batch)
        except Exception:  # noqa: BLE001 - a batch type Lightning cannot size: leave the count out
            samples = None
        self._row = {"rank": trainer.global_rank, "step": trainer.global_step, "epoch": trainer.current_epoch,
                     "batch_idx": batch_idx, "samples": samples, "start": time.time()}

    @override
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        now = time.perf_counter()
        features = features_of(trainer.strategy)
        window = features.backward_window() if features is not None else None
        if window is None:  # not RingDDPStrategy, or no bucket this backward (accumulation): no wait to split out
            self._row["compute_end"] = self._row["comm_end"] = self._offset + now
            return
        handed, done = window
        self._row["compute_end"] = self._offset + handed
        self._row["comm_end"] = self._offset + done

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._file is None or "start" not in self._row:
            return
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        row = {**self._row, "end": time.time(), "loss": None if loss is None else float(loss)}
        row.setdefault("compute_end", row["end"])
        row.setdefault("comm_end", row["compute_end"])
        self._file.write(json.dumps(row) + "\n")
        self._row = {}

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._close()  # Lightning runs no teardown after a failure

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._close()

    def _close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_timeline(save_dir: str | os.PathLike) -> list[Record]:
    """Every rank's :class:`StepTimeline` records, rank by rank, with times in seconds since the earliest
    ``start`` of any rank and the intervals added: ``compute`` (start to compute_end), ``wait`` (compute_end
    to comm_end), ``duration`` (start to end)."""
    rows: list[Record] = []
    rank = 0
    while os.path.exists(os.path.join(save_dir, f"timeline-rank{rank}.jsonl")):
        rows += read_jsonl(os.path.join(save_dir, f"timeline-rank{rank}.jsonl"))
        rank += 1
    if not rows:
        return []
    origin = min(r["start"] for r in rows)
    for r in rows:
        for key in ("start", "compute_end", "comm_end", "end"):
            r[key] -= origin
        r["compute"] = r["compute_end"] - r["start"]
        r["wait"] = r["comm_end"] - r["compute_end"]
        r["duration"] = r["end"] - r["start"]
    return rows


def epoch_times(timeline: Sequence[Record], rank: int = 0) -> list[float]:
    """Seconds per epoch on ``rank``: from its first batch's start to its last batch's end (validation, which
    runs after the last batch, is not included)."""
    spans: dict[int, list[float]] = {}
    for r in timeline:
        if r["rank"] == rank:
            span = spans.setdefault(r["epoch"], [math.inf, -math.inf])
            span[0], span[1] = min(span[0], r["start"]), max(span[1], r["end"])
    return [spans[e][1] - spans[e][0] for e in sorted(spans)]


def per_rank(timeline: Sequence[Record], key: str) -> dict[int, tuple[list[int], list[float]]]:
    """``{rank: (steps, values)}`` of one timeline field (``"samples"``, ``"compute"``, ``"wait"``, ...)."""
    out: dict[int, tuple[list[int], list[float]]] = {}
    for r in timeline:
        if r.get(key) is not None:
            steps, values = out.setdefault(r["rank"], ([], []))
            steps.append(r["step"])
            values.append(r[key])
    return dict(sorted(out.items()))
