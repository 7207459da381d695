"""A node going bad as a site sees it: Slurm drains it (an admin, or a site's health daemon such as NHC, with a
reason), and then a rank there dies. The drain is the evidence the after-failure policy excludes a node on
(``ddp_core.cluster.failures.to_exclude``); a rank's death alone is not.

``drain_and_kill(halted, node)``: once a ``CrashingTask`` rank (``error=HALT``, ``halt_file=halted``) waits at its
chosen batch on ``node``, the node is drained and that rank SIGKILLed, from outside, in that order: the failure's step
is the test's, never a raced moment. ``submit_drain_and_kill``: the same around ``ddpjob submit --wait``, the node
put back at the end (the cluster guard also resumes drained nodes before every cluster test).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Sequence

from tests.support.helpers import wait_for

REASON = "ddpjob test: ECC errors on DIMM 3"


def drain(node: str) -> None:
    done = subprocess.run(["scontrol", "update", f"NodeName={node}", "State=DRAIN", f"Reason={REASON}"],
                          capture_output=True, text=True, timeout=30)  # fmt: skip
    assert done.returncode == 0, done.stderr


def undrain(node: str) -> None:
    subprocess.run(["scontrol", "update", f"NodeName={node}", "State=RESUME"], capture_output=True, timeout=30)


def drain_and_kill(halted: Path, node: str, timeout_s: float = 180) -> int:
    """Drain ``node``, then SIGKILL the rank halted there; returns its pid."""
    wait_for(halted.exists, timeout_s, f"a rank on {node} to reach its chosen batch", poll=0.5)
    assert halted.read_text().startswith(f"{node} "), halted.read_text()
    pid = int(Path(f"{halted}.pid").read_text())
    drain(node)
    os.kill(pid, signal.SIGKILL)
    return pid


def submit_drain_and_kill(args: Sequence[str], cwd: Path, node: str, halted: Path) -> tuple[int, str, str]:
    """``ddpjob submit --wait ARGS`` (a ``CrashingTask`` with ``error=HALT``, ``halt_file=halted``) with ``node``
    drained and its halted rank killed; returns the command's exit code, stdout and stderr."""
    cmd = [sys.executable, "-m", "jobs", "submit", "--wait", *args]
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        drain_and_kill(halted, node)
        out, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
        undrain(node)
    return proc.returncode, out, err
