"""What a node's state in ``scontrol show node`` means to ddpjob: ``gone``, the one test of a lost node, for the batch
script's watcher (``cluster.supervise``), the next attempt's accounting (``cluster.node_loss``) and rank 0's watch of
the batch node (``cluster.batch_node``); ``down``, the stricter test of the run lock (``cluster.run_lock``), which
breaks a holder's lock only once Slurm has taken its node out: a node that is only NOT_RESPONDING (a slow network, a
loaded slurmd) may still run a live trainer that holds it; ``bad``, Slurm's word that a node is unfit, the evidence
the after-failure policy excludes a node on (``failures.to_exclude``): taken out (DOWN, FAIL, which NOT_RESPONDING
becomes after SlurmdTimeout) or drained by an admin or a site's health check. Torch-free."""

from __future__ import annotations

from typing import Optional

GONE = ("DOWN", "NOT_RESPONDING", "FAIL")  # NOT_RESPONDING: the "*" of sinfo, before SlurmdTimeout marks it DOWN
DOWN = ("DOWN", "FAIL")  # Slurm took the node out (after SlurmdTimeout) and ended or requeued its jobs
BAD = (*DOWN, "DRAIN", "DRAINING", "DRAINED")  # ... or an admin or a health check drained it


def gone(node: Optional[dict[str, str]]) -> bool:
    """Whether Slurm says a node is gone (``node``: its ``scontrol show node`` fields); a node it cannot answer for
    (None) is taken as alive, and whatever runs there finds out."""
    state = (node or {}).get("State", "")
    return any(word in state for word in GONE)


def down(node: Optional[dict[str, str]]) -> bool:
    """Whether Slurm has taken the node out (DOWN or FAIL, whatever else its state says); NOT_RESPONDING alone, or a
    node it cannot answer for (None), is not."""
    return any(word in DOWN for word in words(node))


def bad(node: Optional[dict[str, str]]) -> str:
    """Slurm's word that the node is unfit: ``State=IDLE+DRAIN (Reason=...)`` when it is DOWN, FAIL or drained,
    else '' (NOT_RESPONDING alone, or a node Slurm cannot answer for, is no evidence)."""
    if not any(word in BAD for word in words(node)):
        return ""
    assert node is not None
    reason = node.get("Reason", "")
    return f"State={node.get('State', '')}" + (f" (Reason={reason})" if reason and reason != "(null)" else "")


def words(node: Optional[dict[str, str]]) -> list[str]:
    """The words of a node's state (``MIXED+DRAIN`` -> MIXED, DRAIN; ``DOWN*`` -> DOWN: the flag characters off)."""
    return [w.rstrip("*~#!%$@^-") for w in (node or {}).get("State", "").replace("+", " ").split()]
