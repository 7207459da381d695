"""What a node's state in ``scontrol show node`` means to ddpjob: ``gone``, the one test of a lost node, for the batch
script's watcher (``cluster.supervise``), the next attempt's accounting (``cluster.node_loss``) and rank 0's watch of
the batch node (``cluster.batch_node``); ``down``, the stricter test of the run lock (``cluster.run_lock``), which
breaks a holder's lock only once Slurm has taken its node out: a node that is only NOT_RESPONDING (a slow network, a
loaded slurmd) may still run a live trainer that holds it. Torch-free."""

from __future__ import annotations

from typing import Optional

GONE = ("DOWN", "NOT_RESPONDING", "FAIL")  # NOT_RESPONDING: the "*" of sinfo, before SlurmdTimeout marks it DOWN
DOWN = ("DOWN", "FAIL")  # Slurm took the node out (after SlurmdTimeout) and ended or requeued its jobs


def gone(node: Optional[dict[str, str]]) -> bool:
    """Whether Slurm says a node is gone (``node``: its ``scontrol show node`` fields); a node it cannot answer for
    (None) is taken as alive, and whatever runs there finds out."""
    state = (node or {}).get("State", "")
    return any(word in state for word in GONE)


def down(node: Optional[dict[str, str]]) -> bool:
    """Whether Slurm has taken the node out (DOWN or FAIL, whatever else its state says); NOT_RESPONDING alone, or a
    node it cannot answer for (None), is not."""
    words = (node or {}).get("State", "").replace("+", " ").split()
    return any(word.rstrip("*") in DOWN for word in words)
