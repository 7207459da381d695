"""A stand-in for sacct, squeue and scancel (the gateway's runner) with canned output."""

from __future__ import annotations

import subprocess
from collections.abc import Sequence


class FakeSlurm:
    """Stands in for sacct/squeue/scancel: canned stdout per command, every call recorded."""

    def __init__(self, sacct: str | list[str] = "", squeue: str = "", returncode: int = 0) -> None:
        self.sacct = [sacct] if isinstance(sacct, str) else sacct  # successive refreshes: successive answers
        self.out = {"squeue": squeue, "scancel": ""}
        self.returncode = returncode
        self.calls: list[list[str]] = []

    def __call__(self, cmd: Sequence[str]) -> subprocess.CompletedProcess[str]:
        self.calls.append(list(cmd))
        out = (self.sacct.pop(0) if len(self.sacct) > 1 else self.sacct[0]) if cmd[0] == "sacct" else self.out[cmd[0]]
        return subprocess.CompletedProcess(list(cmd), self.returncode, out, "")

    def count(self, name: str) -> int:
        return sum(1 for c in self.calls if c[0] == name)
