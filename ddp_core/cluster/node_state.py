"""What a node's state in ``scontrol show node`` means to ddpjob: ``gone``, the one test of a lost node, for the batch
script's watcher (``cluster.supervise``), the next attempt's accounting (``cluster.node_loss``) and rank 0's watch of
the batch node (``cluster.batch_node``). Torch-free."""

from __future__ import annotations

from typing import Optional

GONE = ("DOWN", "NOT_RESPONDING", "FAIL")  # NOT_RESPONDING: the "*" of sinfo, before SlurmdTimeout marks it DOWN


def gone(node: Optional[dict[str, str]]) -> bool:
    """Whether Slurm says a node is gone (``node``: its ``scontrol show node`` fields); a node it cannot answer for
    (None) is taken as alive, and whatever runs there finds out."""
    state = (node or {}).get("State", "")
    return any(word in state for word in GONE)
