"""A gradient bucket cut into the parts the ranks of a host carry across hosts, one part each.

A two-tier reduction (:mod:`lightning_dist.strategy.tiers`) and DiLoCo's pseudo-gradient under two_tier
(:mod:`lightning_dist.sync.diloco`) both hand part ``i`` of a bucket (slice ``i`` of every parameter,
:meth:`~lightning_dist.compression.BucketLayout.split`) to the ``i``-th rank of every host and gather the parts back
inside the host: :class:`PartPlan` is how a bucket's ranges map to the parts and back.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_dist.compression.base import BucketLayout


@dataclass(frozen=True)
class PartPlan:
    """A bucket layout cut into a host's parts (:meth:`BucketLayout.split`), seen from the rank that holds part
    ``index``.

    ``gather``: the bucket's ranges that, concatenated, make the parts end to end, each padded to ``width``
    (``(-1, n)``: ``n`` zeros); ``scatter``: the ranges of those parts that, concatenated, give the bucket back;
    ``spans``: where this rank's part lies in the bucket.
    """

    layout: BucketLayout  # this rank's part
    length: int  # its elements (the rest of its ``width`` is padding)
    width: int  # the longest part: every part is padded to it for the reduce-scatter
    pad: int  # the most padding any part needs
    gather: tuple[tuple[int, int], ...]
    scatter: tuple[tuple[int, int], ...]
    spans: tuple[tuple[int, int], ...]

    @classmethod
    def of(cls, layout: BucketLayout, parts: int, index: int) -> PartPlan:
        split = layout.split(parts)
        lengths = [part.numel for part, _ in split]
        width = max(lengths)
        gather: list[tuple[int, int]] = []
        where: dict[tuple[int, int], tuple[int, int]] = {}  # a piece's range in the bucket -> its range in the parts
        for i, (_, spans) in enumerate(split):
            offset = i * width
            for a, b in spans:
                gather.append((a, b))
                where[(a, b)] = (offset, offset + b - a)
                offset += b - a
            if lengths[i] < width:
                gather.append((-1, width - lengths[i]))
        scatter = tuple(where[span] for span in sorted(where))  # bucket order
        return cls(split[index][0], lengths[index], width, width - min(lengths), tuple(gather), scatter,
                   tuple(split[index][1]))
