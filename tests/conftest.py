"""Shared fixtures. Slurm-marked tests need the local cluster (scripts/slurm-local up); with
DDPJOB_REQUIRE_SLURM=1 (set by scripts/test and CI) a missing cluster fails them instead of skipping."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session", autouse=True)
def _job_environment():
    # Jobs inherit the submitter's environment: let them import tests.tasks, and keep threads low.
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("WANDB_SILENT", "true")


def _cluster_up() -> bool:
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and any(state in out.stdout for state in ("idle", "mix", "alloc"))


@pytest.fixture(scope="session")
def slurm_cluster():
    if not _cluster_up():
        if os.environ.get("DDPJOB_REQUIRE_SLURM") == "1":
            pytest.fail("the local Slurm cluster is not up (scripts/slurm-local up)")
        pytest.skip("no Slurm cluster (scripts/slurm-local up); set DDPJOB_REQUIRE_SLURM=1 to fail instead")
    return True


def run_cli(*args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Run ``python -m jobs ARGS`` the way a user would, from ``cwd``."""
    return subprocess.run(
        [sys.executable, "-m", "jobs", *args],
        cwd=cwd, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def field(output: str, name: str) -> str:
    """The value of a ``name: value`` line the CLI printed."""
    for line in output.splitlines():
        if line.startswith(f"{name}:"):
            return line.split(":", 1)[1].strip()
    raise AssertionError(f"no '{name}:' line in output:\n{output}")
