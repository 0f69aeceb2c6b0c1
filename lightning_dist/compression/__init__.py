"""Gradient compressors: the seam between weighting and transport in the DDP comm hook."""

from lightning_dist.compression.base import Compressor, NoCompressor

__all__ = ["Compressor", "NoCompressor"]
