"""lightning_dist: ring all-reduce, compression and heterogeneous batching for PyTorch Lightning DDP."""

__version__ = "0.1.0"
