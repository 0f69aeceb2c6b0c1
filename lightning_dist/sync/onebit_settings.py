"""OneBitAdam's settings, checked before any process starts (the user writes them as
``RingDDPStrategy(sync=OneBitAdam(...))``: :class:`~lightning_dist.sync.onebit_adam.OneBitAdam`), and the schedule of
its steps: a dense warm-up, then compressed steps with a refresh every ``refresh``-th one. How a step goes:
docs/onebit-adam.md."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Union

from lightning_dist.compression import Compressor, as_compressor


@dataclass
class OneBitAdamSettings:
    """Adam with its momentum compressed after a dense warm-up (docs/onebit-adam.md, "How a step goes"). The user
    keeps ``torch.optim.Adam`` or ``AdamW`` in ``configure_optimizers``.

    Args:
        warmup: dense Adam steps first: an int of optimizer steps, or a fraction in ``[0, 1)`` of the fit's estimated
            steps (``trainer.estimated_stepping_batches``). 1-bit Adam's runs used 15-25%; 20% by default, which
            kept every seed of the sync benchmark closest to dense (docs/onebit-adam.md, "Measured").
        compressor: how the momentum travels: a compressor's name (``"sign"``, the default; ``"int4"``, ``"int8"``,
            ``"topk"``, ...: :func:`~lightning_dist.compression.build_compressor` with its defaults, error feedback
            included), a dict of its arguments, or a :class:`~lightning_dist.compression.Compressor`. ``"none"``
            sends it dense (Adam with a frozen second moment: the ablation).
        refresh: every ``refresh``-th step after the warm-up's end is a *refresh*: the gradient itself travels
            (through ``refresh_compressor``) and the user's Adam steps on it, updating ``v``. 0: never.
        refresh_compressor: how a refresh's gradient travels: a compressor's name (``"int4"``, the default, built
            without error feedback: a refresh is rare, and its rounding is unbiased), a dict of
            ``build_compressor``'s arguments, or a Compressor; ``"none"`` sends it dense.
        bound: the largest update per coordinate, in units of the learning rate (Adam's own is about 1); None: none.
    """

    warmup: Union[int, float] = 0.2
    compressor: Union[Compressor, str, dict, None] = "sign"
    refresh: int = 25
    refresh_compressor: Union[Compressor, str, dict, None] = "int4"
    bound: Optional[float] = 4.5

    def __post_init__(self) -> None:
        warmup = self.warmup
        if isinstance(warmup, bool) or not isinstance(warmup, (int, float)) or not (
                (isinstance(warmup, int) and warmup >= 0) or (isinstance(warmup, float) and 0 <= warmup < 1)):
            raise ValueError(f"OneBitAdam(warmup={warmup!r}): the dense Adam steps first, an int >= 0 of optimizer "
                             "steps or a fraction in [0, 1) of the fit's steps (0.2: 20%)")
        if isinstance(self.refresh, bool) or not isinstance(self.refresh, int) or self.refresh < 0:
            raise ValueError(f"OneBitAdam(refresh={self.refresh!r}): the steps between refreshes of Adam's second "
                             "moment after the warm-up, an int >= 0 (0: never; 25 is the default)")
        if self.bound is not None and (isinstance(self.bound, bool) or not isinstance(self.bound, (int, float))
                                       or not 0 < self.bound < math.inf):
            raise ValueError(f"OneBitAdam(bound={self.bound!r}): the largest update per coordinate in units of the "
                             "learning rate, a number > 0 (4.5 is the default), or None for none")
        for key, example in (("compressor", "int4"), ("refresh_compressor", "none")):
            value = getattr(self, key)
            value = getattr(value, "value", value)
            if isinstance(value, str) and key == "refresh_compressor":
                value = {"name": value, "error_feedback": False} if value != "none" else value
            try:
                setattr(self, key, as_compressor(value))
            except ValueError as err:
                raise ValueError(f"OneBitAdam({key}=...): {str(err).split(' (e.g.')[0]} (e.g. on the command line "
                                 f"sync.{key}={example})") from err

    def describe(self) -> str:
        bound = "None" if self.bound is None else f"{self.bound:g}"
        return (f"OneBitAdam(warmup={self.warmup!r}, compressor={self.compressor.describe()}, refresh={self.refresh}, "
                f"refresh_compressor={self.refresh_compressor.describe()}, bound={bound})")


WARMUP, REFRESH, COMPRESSED = "warmup", "refresh", "compressed"  # what a step is


def phase(index: int, warmup: int, refresh: int) -> str:
    """What optimizer step ``index`` (0-based: ``global_step`` before it) is: a warm-up step (``index < warmup``), a
    refresh (every ``refresh``-th step after the warm-up's end) or a compressed step."""
    if index < warmup:
        return WARMUP
    since = index - warmup
    return REFRESH if refresh > 0 and since > 0 and since % refresh == 0 else COMPRESSED
