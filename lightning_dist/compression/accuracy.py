"""What each compressor costs in accuracy, measured: the table ``lightning-dist-advise`` quotes beside its speed-ups.

Written by ``python -m lightning_dist.benchmarks.compression --write-accuracy-table`` from its digits workload (2 ranks,
the 22 k-parameter CNN, Adam, 8 epochs, the mean of 3 seeds): validation accuracy against dense, in points. A guide to
the order of the cost, not your model's. Rerun the benchmark to change it; docs/advise.md shows it row for row.
"""

from typing import Any

# (compressor, the settings it was measured at, points against dense, what was measured)
ACCURACY_COST: list[tuple[str, dict[str, Any], float, str]] = [
    ("none", {}, 0.0, "dense 98.24%"),
    ("fp16", {}, 0.09, "98.33%"),
    ("bf16", {}, -0.09, "98.15%"),
    ("int8", {}, 0.09, "EF: 98.33%"),
    ("int4", {}, 0.09, "EF, against dense's 98.15% of the same session: 98.24%"),
    ("topk", {"ratio": 0.01, "error_feedback": True}, -5.0, "1%, EF: 93.24%"),
    ("topk", {"ratio": 0.01, "error_feedback": False}, -1.85, "1%, no EF: 96.39%"),
    ("threshold", {"threshold": 0.1}, -1.48, "0.1, EF: 96.76%"),
    ("powersgd", {"rank": 2, "start_step": 2}, -0.55, "r2, start_step=2, EF: 97.69%"),
    ("powersgd", {"rank": 1, "start_step": 2}, -0.93, "r1, start_step=2, EF: 97.31%"),
    ("sign", {"chunk": 256}, -5.28, "chunk 256, EF on ranks and owners, session's dense 98.15%: 92.87%"),
]
