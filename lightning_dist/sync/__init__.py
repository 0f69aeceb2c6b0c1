"""Ways of syncing the workers, as sync settings and the drivers they bind (:mod:`lightning_dist.sync.driver`): every
step (the default), every H steps (:class:`DiLoCo`, for links too slow for any per-step exchange), or every step with
Adam's momentum compressed (:class:`OneBitAdam`). ``RingDDPStrategy(sync=DiLoCo(every=50))``; docs/sync.md and
docs/onebit-adam.md say when each pays, docs/contributing/feature-seam.md how to write a driver of your own."""

from __future__ import annotations

from dataclasses import fields
from typing import Any, Optional

from lightning_dist.sync.auto import Auto
from lightning_dist.sync.context import SyncContext
from lightning_dist.sync.diloco_driver import DiLoCo
from lightning_dist.sync.diloco_settings import BALANCES
from lightning_dist.sync.driver import EveryStep, FitSettings, SyncDriver, SyncReport, SyncSettings
from lightning_dist.sync.onebit_adam import OneBitAdam

# What ``sync=`` may name: the default (every step: today's gradient all-reduce, unchanged) and the drivers by name. The
# one list, read by the strategy's check, the Hydra group (conf/sync/) and the errors.
DRIVERS: dict[str, type[SyncSettings]] = {"every_step": EveryStep, "diloco": DiLoCo, "onebit_adam": OneBitAdam,
                                          "auto": Auto}
SYNCS = tuple(DRIVERS)

__all__ = ["BALANCES", "DRIVERS", "SYNCS", "Auto", "DiLoCo", "EveryStep", "FitSettings", "OneBitAdam", "SyncContext",
           "SyncDriver", "SyncReport", "SyncSettings", "as_sync"]


def as_sync(sync: Any) -> Optional[SyncSettings]:
    """What ``RingDDPStrategy(sync=...)`` accepts, as the settings the strategy binds (None: every step, the default):
    None or ``"every_step"``; any :class:`SyncSettings` (a :class:`DiLoCo`, or settings of your own), as they are; a
    name of :data:`DRIVERS` (its defaults); a dict of a driver's arguments, optionally with ``name`` (``"diloco"`` when
    absent; Hydra's ``sync`` group passes one); or a dict with ``_target_``, a driver of any package built as Hydra's
    ``instantiate`` builds it (the class or a function returning the driver, by its dotted path, and its arguments
    beside it: a ``conf/sync/<yours>.yaml`` in the command's ``--config-dir``)."""
    sync = getattr(sync, "value", sync)  # an enum from a structured config
    if sync is None or isinstance(sync, EveryStep):
        return None
    if isinstance(sync, SyncSettings):
        return sync
    if isinstance(sync, str):
        if sync not in DRIVERS:
            raise ValueError(f"sync={sync!r}; use one of {', '.join(SYNCS)}, a DiLoCo(every=..., ...), a dict of its "
                             "arguments, or a lightning_dist.sync.SyncSettings of your own")
        return as_sync(DRIVERS[sync]())
    if isinstance(sync, dict) and "_target_" in sync:
        return _instantiate(dict(sync))
    if isinstance(sync, dict):
        settings = dict(sync)
        name = settings.pop("name", "diloco")
        if name not in DRIVERS:
            raise ValueError(f"sync={{'name': {name!r}, ...}}; name must be one of {', '.join(SYNCS)}")
        if name == "every_step":
            if settings:
                raise ValueError(f"sync=every_step has no settings, got {sorted(settings)}: they are DiLoCo's; pick "
                                 "sync=diloco (on the command line: sync=diloco sync.every=50 ...)")
            return None
        known = [f.name for f in fields(DRIVERS[name])]
        unknown = sorted(set(settings) - set(known))
        if unknown:
            raise ValueError(f"sync={sync!r}: {DRIVERS[name].__name__} has no setting(s) {unknown}; its settings are "
                             f"{', '.join(known)}")
        return DRIVERS[name](**settings)
    raise ValueError(f"sync={sync!r}; use None or 'every_step' (every step), 'diloco', a "
                     "lightning_dist.sync.DiLoCo(every=..., ...), a dict of its arguments, or a "
                     "lightning_dist.sync.SyncSettings of your own")


def _instantiate(settings: dict[str, Any]) -> SyncSettings:
    """A driver named by ``_target_`` (its other keys its arguments; ``name`` is the group option's, dropped)."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    settings.pop("name", None)
    target = settings["_target_"]
    try:
        driver = instantiate(settings, _convert_="all")
    except InstantiationException as err:
        raise ValueError(f"sync={{'_target_': {target!r}, ...}}: {err}; the target must import (on PYTHONPATH, or "
                         "in the working directory) and take the other keys as arguments") from err
    if not isinstance(driver, SyncSettings):
        raise ValueError(f"sync={{'_target_': {target!r}, ...}} built a {type(driver).__name__}, not a "
                         "lightning_dist.sync.SyncSettings: name a SyncSettings subclass or a function returning one")
    return driver
