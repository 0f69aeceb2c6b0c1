"""lightning_dist: ring all-reduce, compression and heterogeneous batching for PyTorch Lightning DDP.

Importing the package registers ``"ring_ddp"`` (and its ``_spawn``, ``_fork``, ``_notebook`` and
``_find_unused_parameters_true`` variants) in Lightning's strategy registry, so
``Trainer(strategy="ring_ddp")`` works.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_dist._deprecation import renamed
from lightning_dist.callbacks import DistMetrics, ElasticTraining, FaultTolerance, MemoryMonitor, NaNRecovery
from lightning_dist.loss_scaler import LossScaler
from lightning_dist.strategy import RingDDPStrategy

__version__ = "0.1.0"

RingDDPStrategy.register_strategies(StrategyRegistry)

__all__ = ["DistMetrics", "ElasticTraining", "FaultTolerance", "LossScaler", "MemoryMonitor", "NaNRecovery",
           "RingDDPStrategy", "__version__"]

__getattr__ = renamed(__name__, {"DistMetricsCallback": DistMetrics})  # the old name, for one release
