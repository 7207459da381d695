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
