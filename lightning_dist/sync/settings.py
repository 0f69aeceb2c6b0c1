"""What ``RingDDPStrategy(sync=...)`` accepts: :class:`DiLoCo`'s settings, checked before any process starts."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Union

from lightning_dist.compression import Compressor, as_compressor

# What ``sync=`` may name: the default (every step: today's gradient all-reduce, unchanged) and DiLoCo. The one list,
# read by the strategy's check, the Hydra group (conf/sync/) and the errors.
SYNCS = ("every_step", "diloco")


@dataclass
class DiLoCo:
    """Synchronise the workers every ``every`` optimizer steps instead of every step (DiLoCo, Douillard et al. 2023).

    A *worker* is a host under ``topology="two_tier"`` (its ranks all-reduce their gradients every step over the links
    inside the host) and a rank under ``"flat"``. Between syncs each worker trains alone: the user's optimizer (the
    *inner* optimizer) steps on the worker's own gradient. After every ``every``-th optimizer step (``global_step`` a
    multiple of ``every``) the workers' mean pseudo-gradient ``theta_global - theta_worker`` is the gradient of an outer
    ``torch.optim.SGD([theta_global], lr=outer_lr, momentum=outer_momentum, nesterov=True)`` step, and every rank
    continues from the new ``theta_global`` (:mod:`lightning_dist.sync.diloco`).

    Args:
        every: inner steps between syncs (``H``), at least 1.
        outer_lr: the outer SGD's learning rate (0.7 in the paper; 1.0 with ``outer_momentum=0`` averages the
            workers' parameters).
        outer_momentum: the outer SGD's Nesterov momentum, in ``[0, 1)``.
        compressor: how the pseudo-gradient travels between workers: None (dense, by the strategy's algorithm), a
            compressor name (``"int8"``, ``"topk"``, ...: :func:`~lightning_dist.compression.build_compressor` with
            its defaults, error feedback included where it has it), a dict of ``build_compressor``'s arguments, or a
            :class:`~lightning_dist.compression.Compressor`. Its error feedback is kept per worker across syncs.
    """

    every: int = 50
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    compressor: Union[Compressor, str, dict, None] = None

    def __post_init__(self) -> None:
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1:
            raise ValueError(f"DiLoCo(every={self.every!r}): the inner steps between syncs must be an int >= 1 "
                             "(1 syncs after every step; DiLoCo's paper uses 500, 10-100 suit small models)")
        if not _finite_number(self.outer_lr) or self.outer_lr <= 0:
            raise ValueError(f"DiLoCo(outer_lr={self.outer_lr!r}) must be a positive number (0.7 in the paper; 1.0 "
                             "with outer_momentum=0 averages the workers' parameters)")
        if not _finite_number(self.outer_momentum) or not 0 <= self.outer_momentum < 1:
            raise ValueError(f"DiLoCo(outer_momentum={self.outer_momentum!r}) must be in [0, 1) (0.9 in the paper)")
        self.outer_lr, self.outer_momentum = float(self.outer_lr), float(self.outer_momentum)
        # a name or a dict is built now, so a bad compressor fails here, before any process starts
        try:
            self.compressor = as_compressor(getattr(self.compressor, "value", self.compressor))
        except ValueError as err:  # its message speaks of the per-step compression= group; say where this one goes
            raise ValueError(f"DiLoCo(compressor=...), the pseudo-gradient's: {str(err).split(' (e.g.')[0]} "
                             "(e.g. DiLoCo(compressor='int8'), on the command line sync.compressor=int8 or "
                             "sync.compressor={name:topk,ratio:0.01})") from err

    def describe(self) -> str:
        """The settings in one line, for logs and for matching a checkpoint's state."""
        return (f"DiLoCo(every={self.every}, outer_lr={self.outer_lr:g}, outer_momentum={self.outer_momentum:g}, "
                f"compressor={self.compressor.describe()})")


def as_sync(sync: Any) -> Optional[DiLoCo]:
    """What ``RingDDPStrategy(sync=...)`` accepts: None or ``"every_step"`` (every step, the default), ``"diloco"``
    (DiLoCo's defaults), a :class:`DiLoCo`, or a dict of its arguments, optionally with ``name`` (``"diloco"`` or
    ``"every_step"``: Hydra's ``sync`` group passes one)."""
    sync = getattr(sync, "value", sync)  # an enum from a structured config
    if sync is None or isinstance(sync, DiLoCo):
        return sync
    if isinstance(sync, str):
        if sync not in SYNCS:
            raise ValueError(f"sync={sync!r}; use one of {', '.join(SYNCS)}, a DiLoCo(every=..., ...) or a dict of "
                             "its arguments")
        return None if sync == "every_step" else DiLoCo()
    if isinstance(sync, dict):
        settings = dict(sync)
        name = settings.pop("name", "diloco")
        if name not in SYNCS:
            raise ValueError(f"sync={{'name': {name!r}, ...}}; name must be one of {', '.join(SYNCS)}")
        if name == "every_step":
            if settings:
                raise ValueError(f"sync=every_step has no settings, got {sorted(settings)}: they are DiLoCo's; pick "
                                 "sync=diloco (on the command line: sync=diloco sync.every=50 ...)")
            return None
        unknown = sorted(set(settings) - {"every", "outer_lr", "outer_momentum", "compressor"})
        if unknown:
            raise ValueError(f"sync={sync!r}: DiLoCo has no setting(s) {unknown}; its settings are every, outer_lr, "
                             "outer_momentum and compressor")
        return DiLoCo(**settings)
    raise ValueError(f"sync={sync!r}; use None or 'every_step' (every step), 'diloco', a "
                     "lightning_dist.sync.DiLoCo(every=..., ...) or a dict of its arguments")


def _finite_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
