"""The default model and data for the training command, tests and notebooks: a small CNN on sklearn's digits.

The digits set (1,797 8x8 grey images, shipped with scikit-learn, no download) trains to 97% validation
accuracy in a few CPU seconds, so multi-rank runs, compression and fault tests can train to convergence in CI.
``WideMLP`` on ``SyntheticDataModule`` is the bandwidth-bound workload (16.4 MiB of gradients per step) that
the step benchmark uses to show what communication costs. ``ByteLM`` on ``StdlibText`` (a 1.3 M-parameter byte-level
transformer on the Python standard library's sources, held out by file) is the workload of syncing every H steps.
"""

from lightning_dist.examples.cnn import DigitsCNN
from lightning_dist.examples.digits import DigitsDataModule
from lightning_dist.examples.lm import ByteLM, StdlibText
from lightning_dist.examples.mlp import SyntheticDataModule, WideMLP

__all__ = ["ByteLM", "DigitsCNN", "DigitsDataModule", "StdlibText", "SyntheticDataModule", "WideMLP"]
