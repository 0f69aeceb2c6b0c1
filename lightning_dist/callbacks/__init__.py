"""Lightning callbacks that work with RingDDPStrategy (MemoryMonitor also with any other strategy).

They hold policy; the mechanisms they drive live below them (``strategy/``, ``fault/``, ``memory/``). DistMetrics, the
strategy's own reporting (the strategy adds it), lives in :mod:`lightning_dist.strategy.dist_metrics`. One naming rule:
a callback is named for what it does, with no ``Callback`` suffix (as Lightning's ``EarlyStopping``);
``DistMetricsCallback`` still imports for one release, with a ``DeprecationWarning``.
"""

from lightning_dist._deprecation import renamed
from lightning_dist.callbacks.elastic import ElasticTraining
from lightning_dist.callbacks.fault_tolerance import FaultTolerance
from lightning_dist.callbacks.memory_monitor import InsufficientMemoryError, MemoryMonitor
from lightning_dist.callbacks.nan_recovery import NaNRecovery, NaNRecoveryError
from lightning_dist.strategy.dist_metrics import DistMetrics

__all__ = ["DistMetrics", "ElasticTraining", "FaultTolerance", "InsufficientMemoryError", "MemoryMonitor",
           "NaNRecovery", "NaNRecoveryError"]

__getattr__ = renamed(__name__, {"DistMetricsCallback": DistMetrics})
