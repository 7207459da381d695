"""Small venvs of one dependency at another version than the project's venv has, for the tests of the commands that
call that dependency's own CLI (``ddpjob sync``'s ``wandb sync``): the oldest release the project supports, read from
pyproject.toml's floor, so the test follows the range it guards.

A venv is built once per machine from Debian's ``/usr/bin/python3`` under ``/var/cache/ddpjob-deps`` (pip from the
registry, ~15 s for wandb), under a lock: the suite's workers may ask for it together. Only that one package and
what it needs go in: the CLI under test needs nothing of the project's.
"""

from __future__ import annotations

import fcntl
import os
import re
import subprocess
from pathlib import Path

from tests.support.helpers import ROOT

CACHE = Path(os.environ.get("DDPJOB_DEPS_CACHE", "/var/cache/ddpjob-deps"))


def floor(package: str) -> str:
    """The lowest version pyproject.toml admits for ``package`` (its ``>=`` bound)."""
    text = (ROOT / "pyproject.toml").read_text()
    found = re.search(rf'"{re.escape(package)}>=([0-9][^",<]*)', text)
    assert found, f"pyproject.toml names no floor for {package}"
    return found.group(1)


def python_with(package: str, version: str) -> str:
    """The ``python`` of a cached venv that holds ``package==version`` (built on first use)."""
    folder = CACHE / f"{package}-{version}"
    python = folder / "bin" / "python"
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / f".{package}-{version}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (folder / ".complete").exists():
            subprocess.run(["rm", "-rf", str(folder)], check=True)
            subprocess.run(["/usr/bin/python3", "-m", "venv", str(folder)], check=True)
            subprocess.run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                            f"{package}=={version}"], check=True, capture_output=True)  # fmt: skip
            (folder / ".complete").touch()
    return str(python)
