"""Accounting for the collectives in :mod:`lightning_dist.comm`: bytes on the wire and time spent.

Every collective takes an optional :class:`CommStats` and records one :class:`CallRecord` into it. The
bytes are counted by the algorithm itself (the sum of the payloads it handed to ``isend``), not estimated
from a formula, so a test can check the count against the algorithm's analysis. For ``native`` (gloo's or
NCCL's own ``all_reduce``) the library does not say what it sent; we record the ring's count, which is what
a bandwidth-optimal implementation sends, and mark the record ``estimated``.

Bytes are also counted per *tier* (:data:`TIERS`): ``"intra_host"`` for collectives whose group lies inside one
host, ``"inter_host"`` for those whose group spans hosts. A collective records into the step's stats through
:meth:`CommStats.tier`, a view that tags its records; the strategy knows which of its groups span hosts
(:mod:`lightning_dist.comm.topology`).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Optional

TIERS = ("intra_host", "inter_host")  # a collective inside one host, or between hosts


@dataclass(frozen=True)
class CallRecord:
    """One collective call on one rank."""

    algorithm: str  # "ring", "tree" or "native": what actually ran ("auto" resolves to one of them)
    numel: int  # elements in the reduced tensor
    bytes_sent: int  # payload bytes this rank handed to the transport
    bytes_received: int  # payload bytes this rank received
    seconds: float  # wall time of the whole call on this rank
    estimated: bool = False  # True when the byte counts are the ring's formula, not a count


@dataclass
class CommStats:
    """Running totals over many calls, plus the records since the last :meth:`reset`.

    The strategy keeps one per training step: it reads the totals after backward and resets. Calls may be
    recorded from several threads (the communication worker, the backend's completion callbacks).
    """

    calls: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    seconds: float = 0.0
    # what the dense fp32 ring would have sent for the same gradients (the hook records it per bucket), and
    # time spent compressing and decompressing: for the compression ratio and the coding cost
    dense_bytes: int = 0
    codec_seconds: float = 0.0
    records: list[CallRecord] = field(default_factory=list)
    # bytes sent per tier ("intra_host", "inter_host"), by the records made through a tier view
    tier_bytes: dict[str, int] = field(default_factory=dict)
    keep_records: bool = True  # turn off for long benchmarks where only the totals matter
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def record(self, rec: CallRecord, tier: Optional[str] = None) -> None:
        with self._lock:
            if tier is not None:
                self.tier_bytes[tier] = self.tier_bytes.get(tier, 0) + rec.bytes_sent
            self.calls += 1
            self.bytes_sent += rec.bytes_sent
            self.bytes_received += rec.bytes_received
            self.seconds += rec.seconds
            if self.keep_records:
                self.records.append(rec)

    def record_dense(self, nbytes: int) -> None:
        # no lock: only the thread DDP runs the hook on writes this field (reset happens between steps)
        self.dense_bytes += nbytes

    def record_codec(self, seconds: float) -> None:
        with self._lock:
            self.codec_seconds += seconds

    def tier(self, name: str) -> TierStats:
        """A view that records into these stats with every record's bytes also counted under tier ``name``."""
        if name not in TIERS:
            raise ValueError(f"tier={name!r}: use one of {TIERS}")
        return TierStats(self, name)

    def __getstate__(self) -> dict:
        # the spawn launcher pickles the strategy, and with it these stats; a lock does not pickle
        return {k: v for k, v in self.__dict__.items() if k != "_lock"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def reset(self) -> None:
        self.calls = 0
        self.bytes_sent = 0
        self.bytes_received = 0
        self.seconds = 0.0
        self.dense_bytes = 0
        self.codec_seconds = 0.0
        self.records.clear()
        self.tier_bytes.clear()

    def as_dict(self) -> dict[str, float]:
        return {
            "calls": self.calls,
            "bytes_sent": self.bytes_sent,
            "bytes_received": self.bytes_received,
            "seconds": self.seconds,
            "dense_bytes": self.dense_bytes,
            "codec_seconds": self.codec_seconds,
            **{f"bytes_{tier}": float(self.tier_bytes.get(tier, 0)) for tier in TIERS},
        }


class TierStats:
    """:class:`CommStats` seen from one tier: what a collective records through it is counted in the stats and
    under the tier (pass it wherever a collective takes ``stats``)."""

    def __init__(self, stats: CommStats, tier: str) -> None:
        self.stats, self.name = stats, tier

    def record(self, rec: CallRecord, tier: Optional[str] = None) -> None:
        self.stats.record(rec, self.name if tier is None else tier)

    def record_codec(self, seconds: float) -> None:
        self.stats.record_codec(seconds)
