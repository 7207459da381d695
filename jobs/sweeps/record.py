"""What a grid or random sweep records at submit for the report to read (``sweep.json``, written by
``jobs.sweeps.arrays``), and the scale a swept key is drawn on. Standard library only: reading a report never loads
the config package, YAML or submitit."""

from __future__ import annotations

import itertools
import math
from typing import Any

SWEEP_FILE = "sweep.json"


def infer_scale(values: list[Any]) -> str:
    """How a grid key was swept: ``choice`` (not all numbers), ``log`` (positive values spread over a decade or more,
    evenly in log space: 1e-4,3e-4,1e-3) or ``linear`` (range(64,257,64), seeds). Random sweeps record their
    distribution's scale instead."""
    if not values or any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in values):
        return "choice"
    nums = sorted({float(v) for v in values})
    if len(nums) < 2 or nums[0] <= 0 or not all(math.isfinite(v) for v in nums) or nums[-1] / nums[0] < 10:
        return "linear"
    if len(nums) == 2:
        return "log" if nums[-1] / nums[0] >= 100 else "linear"

    def spread(gaps: list[float]) -> float:  # coefficient of variation: 0 for evenly spaced values
        mean = sum(gaps) / len(gaps)
        return math.sqrt(sum((g - mean) ** 2 for g in gaps) / len(gaps)) / mean

    logs = [math.log(v) for v in nums]
    linear_gaps = [b - a for a, b in itertools.pairwise(nums)]
    log_gaps = [b - a for a, b in itertools.pairwise(logs)]
    return "log" if spread(log_gaps) < spread(linear_gaps) else "linear"
