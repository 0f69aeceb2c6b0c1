"""The suite runs the codecs' plain torch path: compiling their kernels (lightning_dist.compression.kernels) costs
seconds per process, and every launched rank would pay it. One test compares the compiled kernels with it."""

import os

os.environ.setdefault("LIGHTNING_DIST_COMPILE", "0")
