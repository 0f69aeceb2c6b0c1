"""Gradient compressors: the seam between weighting and transport in the DDP comm hook.

``build_compressor(name, **kwargs)`` makes one by name (``none``, ``fp16``, ``bf16``, ``int8``, ``int4``, ``topk``,
``threshold``, ``powersgd``, ``sign``), wrapped in :class:`ErrorFeedback` by default for the lossy ones. See
:mod:`lightning_dist.compression.base` for the interface and :mod:`.registry` for the table.
"""

from lightning_dist.compression.base import BucketLayout, Compressor, NoCompressor
from lightning_dist.compression.cast import CastCompressor
from lightning_dist.compression.error_feedback import ErrorFeedback
from lightning_dist.compression.int8 import Int8Compressor
from lightning_dist.compression.powersgd import PowerSGDCompressor
from lightning_dist.compression.registry import COMPRESSORS, as_compressor, build_compressor, compressor_options
from lightning_dist.compression.sign import SignCompressor
from lightning_dist.compression.threshold import ThresholdCompressor
from lightning_dist.compression.topk import TopKCompressor
from lightning_dist.compression.transport import Transport

__all__ = [
    "COMPRESSORS",
    "BucketLayout",
    "CastCompressor",
    "Compressor",
    "ErrorFeedback",
    "Int8Compressor",
    "NoCompressor",
    "PowerSGDCompressor",
    "SignCompressor",
    "ThresholdCompressor",
    "TopKCompressor",
    "Transport",
    "as_compressor",
    "build_compressor",
    "compressor_options",
]
