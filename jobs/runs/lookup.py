"""One way to name a run, for every command that takes one (``status``, ``logs``, ``cancel``, ``report``, ``sync``,
``resume``, ``export``, ``doctor --run``): its directory, a Slurm job id of one of its attempts (an array task's as
``ID_INDEX``), or its name (``run.name``, or the directory's name under the runs root). ``resolve`` turns any of
them into the run's directory, or fails in one line: an unknown reference says where it looked, an ambiguous one
lists the candidates. Commands that also show a sweep (``status``, ``logs``, ``report``) accept a sweep folder or its
name the same way. A folder this user may not read (another user's run on a shared filesystem) is one line naming
its owner (``readable``), not a traceback from the first file opened in it."""

from __future__ import annotations

import getpass
import os
import pwd
import re
import stat
from pathlib import Path

from ddp_core.errors import DdpJobError
from ddp_core.run.rundir import CONFIG_FILE, RunDir, run_name_of

DEFAULT_ROOT = Path("runs")
RUN_HELP = "a run directory, a Slurm job id of one of its attempts (ID_INDEX for an array task), or a run name"
_JOB_ID = re.compile(r"\d+(_\d+)?")
_SHOWN = 5  # candidates named in an ambiguity's line


def resolve(ref: str, root: Path = DEFAULT_ROOT, sweeps: bool = False) -> Path:
    """The run directory (or, with ``sweeps``, the sweep folder) ``ref`` names; ``DdpJobError`` otherwise."""
    kind = "a run directory or a sweep folder" if sweeps else "a run directory"
    path = Path(ref)
    readable(path, ref)
    if path.is_dir():
        if RunDir(path).exists() or (sweeps and find_runs(path)):
            return path.resolve()
        raise DdpJobError(f"'{ref}' is not {kind} (no {CONFIG_FILE} in it)", f"pass {kind}, a job id or a run name")
    runs = find_runs(root)
    if _JOB_ID.fullmatch(ref):
        found = [run for run in runs if ref in _job_ids(RunDir(run))]
        return _one(ref, found, root, "has job")
    if "/" not in ref:
        found = [run for run in runs if _named(run, ref)]
        if sweeps:
            found += [d for d in _folders(root) if d.name == ref and find_runs(d) and d not in found]
        return _one(ref, found, root, "is named")
    raise DdpJobError(f"'{ref}' is not {kind}, a job id or a run name", f"pass {kind}, a job id or a run name")


def readable(path: Path, ref: str) -> None:
    """``DdpJobError`` if this user may not reach ``path`` (a folder above it closed to her) or list and enter it, when
    it is a folder; a missing path passes (the callers say what they looked for)."""
    hint = "pass a run of your own, or ask its owner to share it (a group of yours and chmod -R g+rX)"
    try:
        info = path.stat()
    except PermissionError:
        closed = f"'{ref}' cannot be reached by {getpass.getuser()}: a folder above it is closed to you"
        raise DdpJobError(closed, hint) from None
    except OSError:
        return
    if not stat.S_ISDIR(info.st_mode) or os.access(path, os.R_OK | os.X_OK):
        return
    try:
        owner = pwd.getpwuid(info.st_uid).pw_name
    except KeyError:
        owner = f"uid {info.st_uid}"
    raise DdpJobError(
        f"'{ref}' cannot be read by {getpass.getuser()}: it belongs to {owner} (mode {info.st_mode & 0o7777:04o})", hint
    )


def _one(ref: str, found: list[Path], root: Path, how: str) -> Path:
    if len(found) == 1:
        return found[0].resolve()
    if not found:
        where = f"ls {root}" if root.is_dir() else f"there is no {root} here"
        raise DdpJobError(f"no run under '{root}' {how} '{ref}'", f"pass the run directory, or --root ({where})")
    names = ", ".join(str(p) for p in found[:_SHOWN]) + (
        f" and {len(found) - _SHOWN} more" if len(found) > _SHOWN else ""
    )
    raise DdpJobError(f"'{ref}' names {len(found)} runs under '{root}': {names}", "pass one of them")


def _folders(root: Path) -> list[Path]:
    return sorted(d for d in root.iterdir() if d.is_dir()) if root.is_dir() else []


def _named(run: Path, name: str) -> bool:
    """``name`` is the directory's name, or the ``run.name`` it was made from (``<name>-<time>-<id>``)."""
    return name in (run.name, run_name_of(run.name))


def _job_ids(run: RunDir) -> set[str]:
    try:
        ids = {str(j["job_id"]) for j in run.jobs()}
    except DdpJobError:
        ids = set()  # a damaged run.json: its attempts may still name the job
    return ids | {str(e.get("job_id")) for e in run.events()}


def find_runs(path: Path) -> list[Path]:
    """``path`` itself if it is a run directory, else the run directories one or two levels below it, sorted."""
    path = Path(path)
    if (path / CONFIG_FILE).is_file():
        return [path]
    runs = {p.parent for p in path.glob(f"*/{CONFIG_FILE}")}
    # Two levels deep only under folders that are not runs themselves: a run's own subfolders (wandb/...)
    # may hold files called config.yaml that are not run configs.
    runs |= {p.parent for p in path.glob(f"*/*/{CONFIG_FILE}") if p.parent.parent not in runs}
    return sorted(runs)
