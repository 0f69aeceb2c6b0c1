"""Synchronising the workers every H steps instead of every step: DiLoCo (:class:`DiLoCo`), for links too slow for any
per-step exchange. ``RingDDPStrategy(sync=DiLoCo(every=50))``; docs/sync.md says when it pays."""

from lightning_dist.sync.settings import BALANCES, SYNCS, DiLoCo, as_sync

__all__ = ["BALANCES", "SYNCS", "DiLoCo", "as_sync"]
