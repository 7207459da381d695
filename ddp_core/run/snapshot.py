"""Code snapshots, compute-node side: every attempt of a run imports the code that was submitted.

A job queued or requeued days after ``ddpjob submit`` would otherwise import whatever the user's working tree holds
by then: a silent change of code in the middle of a run, and the end of exact resume. So the login node copies the
user's code into the run directory at submit (``jobs.submission.snapshot``): the task module's top-level package (or
module file), or a script's directory, or a script module's package. Its record, ``RUN/code.json`` (layout in
``ddp_core.run.rundir``), says where the copy came from, where it lies, and the git commit and diff it was taken at.

Here, on every rank of every attempt, before the task or script is imported: ``activate`` puts the snapshot first on
``sys.path`` (a snapshotted package shadows the working tree's), and ``script_in_snapshot`` maps a script's recorded
path to its copy. The library's own packages (``ddp_core``, ``jobs``) are never snapshotted: they are the installed
ddpjob, which the job's Python imports before any run directory is read.

The ``snapshot`` config section (``SnapshotConfig``) is owned here. This module imports no torch.
"""

from __future__ import annotations

import importlib
import json
import logging
import sys
from pathlib import Path
from typing import Any, Optional

from ddp_core.config.perf import PROFILE_REQUEST
from ddp_core.errors import DdpJobError
from ddp_core.run import permissions
from ddp_core.run.rundir import RunDir

log = logging.getLogger("ddp_core.run.snapshot")

LIBRARY_PACKAGES = frozenset({"ddp_core", "jobs"})


def read_record(run_dir: RunDir) -> Optional[dict[str, Any]]:
    """``RUN/code.json``, or None for a run submitted without a snapshot."""
    try:
        record = json.loads(run_dir.code_record.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:
        raise DdpJobError(
            f"{run_dir.code_record} is damaged ({err})", "resubmit, or delete it to run without the snapshot"
        ) from None
    if not isinstance(record, dict) or not isinstance(record.get("path"), str):
        raise DdpJobError(f"{run_dir.code_record} is damaged (no 'path')", "resubmit, or delete it")
    return record


def activate(run_dir: RunDir) -> Optional[dict[str, Any]]:
    """Put the run's snapshot first on ``sys.path`` (before the task or script is imported); its record, or None.
    First the run's permission policy (``ddp_core.run.permissions``): this process's umask, and every file that
    decides what runs (config.yaml, code.json, the snapshot, the profile trigger) refused if another user could
    have changed it."""
    permissions.tighten(permissions.is_private())
    record = read_record(run_dir)
    check_run_files(run_dir, record)
    if record is None:
        return None
    path = Path(record["path"])
    if not path.is_dir():
        raise DdpJobError(
            f"the run's code snapshot {path} is missing (recorded in {run_dir.code_record})",
            "run directories must be on a filesystem every node sees; resubmit to take a new snapshot",
        )
    for name in record.get("packages", []):
        loaded = sys.modules.get(name)
        origin = getattr(loaded, "__file__", None) or ""
        if loaded is not None and not origin.startswith(str(path)):
            # Already imported from elsewhere (a sitecustomize, a pickled callable): the copy would be half-used.
            log.warning("%s was imported from %s before the snapshot was activated: that copy is used", name, origin)
    sys.path.insert(0, str(path))
    importlib.invalidate_caches()
    return record


def check_run_files(run_dir: RunDir, record: Optional[dict[str, Any]]) -> None:
    """The files of ``run_dir`` that decide what an attempt runs, checked before it imports anything (one line naming
    the first another user owns or can write, ``permissions.check_trusted``)."""
    files = [run_dir.config_file, run_dir.code_record, run_dir.path / PROFILE_REQUEST]
    permissions.check_trusted([f for f in files if f.exists()], top=run_dir.path)
    if record is not None and Path(record["path"]).is_dir():  # a sweep's trials share the sweep's: up to its folder
        code = Path(record["path"])
        permissions.check_trusted(permissions.tree(code), top=code.parent)


def script_in_snapshot(record: Optional[dict[str, Any]], script_path: str) -> str:
    """The snapshot's copy of a script recorded at ``script_path`` (the same path when the run has no snapshot)."""
    if record is None or record.get("kind") != "directory":
        return script_path
    source, script = Path(record["source"]), Path(script_path)
    if script.parent != source:
        return script_path
    copy = Path(record["path"]) / script.name
    if not copy.is_file():
        raise DdpJobError(
            f"the run's code snapshot {record['path']} has no {script.name}", "resubmit to take a new snapshot"
        )
    return str(copy)


def describe(record: Optional[dict[str, Any]]) -> str:
    """One line for status: what was snapshotted, from where, at which commit."""
    if record is None:
        return "none (each attempt imports the code as it is when it starts)"
    size = record.get("bytes", 0) / 1024
    text = f"{record.get('files', '?')} files, {size:.0f} KiB of {record.get('source')} in {record['path']}"
    git = record.get("git")
    if git:
        text += f"; git {str(git.get('commit', ''))[:12]}"
        if git.get("diff"):
            text += f" + uncommitted changes ({git['diff']})"
    return text
