"""What ``ddpjob doctor`` and its drill report: one ``Finding`` per check, with a stable key, and how a list of
them is printed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

Level = Literal["ok", "info", "warn", "problem", "unknown"]


@dataclass(frozen=True)
class Finding:
    key: str  # stable snake_case identifier: scripts and tests match on it, never on the message
    level: Level
    message: str
    fix: str = ""
    value: Any = None  # what was checked (a mode, seconds, a count), for --json


def render(findings: list[Finding]) -> str:
    lines = (f"{f.level.upper():<8} {f.key:<18} {f.message}" + (f"  fix: {f.fix}" if f.fix else "") for f in findings)
    return "\n".join(lines)


def node_count_finding(nodes: Any, min_nodes: int, max_nodes: int, partition: str, total: int) -> Finding:
    """``slurm.nodes`` (a count, or an elastic MIN-MAX) against the ``total`` nodes of ``partition``. A MIN the
    partition cannot give pends forever: a problem. A MAX above it is reached never: a warning (Slurm starts the job
    on what there is, as ``check_fits`` warns at submit)."""
    if total <= 0:
        return Finding("nodes", "unknown", f"slurm.nodes={nodes}: partition {partition} does not say its node count")
    where = f"partition {partition} has {total} nodes"
    if min_nodes > total:
        fix = f"set slurm.nodes<={total}" + (f" (a range: MIN<={total})" if min_nodes != max_nodes else "")
        return Finding("nodes", "problem", f"slurm.nodes={nodes}: {where}, the job needs {min_nodes}", fix, nodes)
    if max_nodes > total:
        why = f"slurm.nodes={nodes}: {where}, so attempts run on at most {total} (MAX {max_nodes} is never reached)"
        return Finding("nodes", "warn", why, f"set slurm.nodes={min_nodes}-{total}", nodes)
    if min_nodes != max_nodes:
        why = f"slurm.nodes={nodes}: each attempt starts on {min_nodes} to {max_nodes} nodes, as many as are free "
        why += f"({where})"
        return Finding("nodes", "info", why, value=nodes)
    return Finding("nodes", "ok", f"slurm.nodes={nodes}: {where}", value=nodes)
