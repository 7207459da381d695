"""``slurm.nodes``: a node count or an elastic range MIN-MAX, parsed and range-checked (``node_range``)."""

from __future__ import annotations

import re
from typing import Any

from ddp_core.errors import DdpJobError

MAX_NODES = 1 << 16  # past it a node count is a typo
NODES_HINT = "set slurm.nodes to a count (e.g. 2) or a range MIN-MAX with 1 <= MIN <= MAX (e.g. 1-2)"
NODE_RANGE = re.compile(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?")


def node_range(value: Any) -> tuple[int, int]:
    """``slurm.nodes`` as (MIN, MAX): ``2`` -> (2, 2), ``"1-2"`` -> (1, 2). Raises ``DdpJobError`` for anything else
    (not numeric, MIN > MAX, MIN < 1, past ``MAX_NODES``): the config's validation calls it first."""
    if isinstance(value, int) and not isinstance(value, bool):
        low = high = value
    else:
        match = NODE_RANGE.fullmatch(value) if isinstance(value, str) else None
        if match is None:
            raise DdpJobError(
                f"config key 'slurm.nodes' = {value!r} is invalid: not a node count or MIN-MAX", NODES_HINT
            )
        low = int(match[1])
        high = int(match[2]) if match[2] is not None else low
    shown = value if isinstance(value, int) else repr(value)
    problem = None
    if low > high:
        problem = f"MIN {low} > MAX {high}"
    elif low <= 0:
        problem = "must be > 0" if low == high else f"MIN must be >= 1 (got {low})"
    elif high > MAX_NODES:
        problem = f"must be at most {MAX_NODES}"
    if problem:
        raise DdpJobError(f"config key 'slurm.nodes' = {shown} is invalid: {problem}", NODES_HINT)
    return low, high
