"""Small experiments for notebooks: run a job on ranks forked from the notebook, read back what every rank
measured, plot it.

- :mod:`.records`: :class:`JsonlLogger` (rank zero's logged metrics, to a file) and :class:`StepTimeline`
  (every rank's batches as time intervals, a file per rank): what survives ranks forked from a notebook;
- :mod:`.runs`: :func:`fit_digits` (the digits job with a ``RingDDPStrategy`` of your settings) and
  :func:`fit_config` (``lightning-dist-train``'s Hydra configs with overrides), both returning a :class:`Run`;
- :mod:`.plots`: the notebooks' figures (curves, quality against bytes, per-rank timelines, batch sizes).
"""

from lightning_dist.experiments.records import (
    JsonlLogger,
    StepTimeline,
    epoch_times,
    last,
    per_rank,
    read_csv_metrics,
    read_jsonl,
    read_timeline,
    series,
)
from lightning_dist.experiments.runs import (
    SMALL_ENV,
    Run,
    compose_config,
    fit_config,
    fit_digits,
    load_run,
    quiet_logs,
    small_settings,
    summary_callback,
)

__all__ = ["JsonlLogger", "Run", "SMALL_ENV", "StepTimeline", "compose_config", "epoch_times",
           "fit_config", "fit_digits", "last", "load_run", "per_rank", "quiet_logs", "read_csv_metrics", "read_jsonl",
           "read_timeline", "series", "small_settings", "summary_callback"]
