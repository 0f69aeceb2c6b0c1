"""The learning-rate schedules of the project's own jobs (the digits CNN, the byte LM): ``model.schedule`` on the
command line, the same three a user most often writes in ``configure_optimizers``.

- ``constant``: a linear warm-up over ``warmup_steps`` optimizer steps (from ``lr / warmup_steps``), then the peak;
- ``cosine``: the warm-up, then a cosine from the peak down to :data:`FINAL_FRACTION` of it at the fit's last step
  (nanoGPT's and most language-model recipes);
- ``wsd``: warm-up, stable, decay: the warm-up, the peak until the last :data:`WSD_DECAY_FRACTION` of the steps, then a
  linear decay to :data:`FINAL_FRACTION` of the peak at the fit's last step.

Each is a multiplier of the optimizer's peak rate per optimizer step (:func:`lr_factor`), stepped by Lightning every
optimizer step (``interval="step"``) through ``torch.optim.lr_scheduler.LambdaLR`` (:func:`lightning_scheduler`); the
fit's length is Lightning's ``trainer.estimated_stepping_batches`` (``max_steps``, or ``max_epochs`` of batches over
``accumulate_grad_batches``).
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, Optional

import torch

SCHEDULES = ("constant", "cosine", "wsd")
FINAL_FRACTION = 0.1  # cosine and WSD end at a tenth of the peak rate
WSD_DECAY_FRACTION = 0.2  # WSD decays over the fit's last fifth


def check_schedule(owner: str, schedule: str, warmup_steps: int) -> None:
    """Raise ``ValueError`` naming the value and the fix (a model's constructor: before any rank starts)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"{owner}: `schedule` must be one of {', '.join(SCHEDULES)}, got {schedule!r}.")
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
        raise ValueError(f"{owner}: `warmup_steps` must be an int >= 0 (0: no warm-up), got {warmup_steps!r}.")


def lr_factor(schedule: str, step: int, total_steps: int, warmup_steps: int) -> float:
    """The multiplier of the peak rate for optimizer step ``step`` (0-based) of a fit of ``total_steps``."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    if schedule == "cosine":
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - 1 - warmup_steps))
        return FINAL_FRACTION + (1.0 - FINAL_FRACTION) * 0.5 * (1.0 + math.cos(math.pi * progress))
    decay_start = max(warmup_steps, total_steps - round(WSD_DECAY_FRACTION * total_steps))
    if step < decay_start:
        return 1.0
    progress = min(1.0, (step - decay_start + 1) / max(1, total_steps - decay_start))
    return 1.0 - (1.0 - FINAL_FRACTION) * progress


def lightning_scheduler(optimizer: Any, schedule: str, warmup_steps: int,
                        total_steps: Callable[[], int]) -> Optional[dict]:
    """Lightning's ``lr_scheduler`` entry for ``optimizer`` (stepped every optimizer step), or None where the rate
    never changes (``constant`` without a warm-up: the optimizer alone, as before schedules existed). ``total_steps``
    (``trainer.estimated_stepping_batches``) is read only where the schedule decays."""
    if schedule == "constant" and warmup_steps == 0:
        return None
    factor = functools.partial(_factor, schedule, 0 if schedule == "constant" else total_steps(), warmup_steps)
    return {"scheduler": torch.optim.lr_scheduler.LambdaLR(optimizer, factor), "interval": "step"}


def _factor(schedule: str, total_steps: int, warmup_steps: int, step: int) -> float:
    """:func:`lr_factor` with the step last (a ``functools.partial`` of it: LambdaLR saves its state, a lambda none)."""
    return lr_factor(schedule, step, total_steps, warmup_steps)
