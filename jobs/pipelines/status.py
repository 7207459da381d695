"""``ddpjob status PIPELINE``: one row per step of a pipeline (its state, job, what it waits for, its run
directory), and for a step that will never run, why: the earlier step it waits for ended so that its condition can
never be met (Slurm cancelled it, ``--kill-on-invalid-dep``), or a rerun skipped it. PIPELINE is a pipeline file, its
name (its record under ``runs/pipelines/``) or its record's folder; anything else is a run or a sweep, which
``jobs.runs.status`` shows (``cmd_status`` hands it over)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Optional

from ddp_core.errors import DdpJobError
from jobs.pipelines import record, spec
from jobs.pipelines.after import After, satisfied
from jobs.runs import lookup
from jobs.runs import status as runs_status
from jobs.runs.listing import DEFAULT_ROOT, shown_path
from jobs.runs.watcher import Poll, watch


def find(path: Optional[str]) -> Optional[Path]:
    """The record folder ``path`` names (a pipeline file, a record folder, a pipeline's name), None if none."""
    if path is None:
        return None
    given = Path(path)
    lookup.readable(given, path)
    if (given / record.FILE).is_file():
        return given
    if given.suffix in (".yaml", ".yml") and given.is_file():
        try:
            return spec.load(given).folder
        except DdpJobError:
            return None  # a config file, not a pipeline's: the run status says what it can
    folder = DEFAULT_ROOT / "pipelines" / path
    if not spec.NAME.fullmatch(path) or not (folder / record.FILE).is_file():
        return None
    try:
        run = lookup.resolve(path, DEFAULT_ROOT, sweeps=True)
    except DdpJobError:
        return folder  # no run or sweep has the name: the pipeline's
    raise DdpJobError(
        f"'{path}' names a pipeline ({folder}) and a run or sweep ({shown_path(run)})",
        f"pass the pipeline's file or {folder} for the pipeline, {shown_path(run)} for the run",
    )


def why_not(name: str, rec: record.Record, states: dict[str, str]) -> str:
    """Why step ``name`` will never run, or ""."""
    entry = rec.steps[name]
    if entry.skipped:
        return f"skipped: {entry.skipped}"
    state = states.get(name, "")
    if not (state.startswith("CANCELLED") or state == "PENDING"):
        return ""
    for text in entry.after:
        after = After.parse(text)
        up = states.get(after.ref)
        if up is not None and satisfied(up, after.mode) is False:
            what = "cancelled" if state.startswith("CANCELLED") else "never runs"
            return f"{what}: {after.ref} ended {up}, and this step runs after {after}"
    return ""


def table(folder: Path, poll: Optional[Poll[Any]] = None) -> tuple[str, bool]:
    """(the pipeline's table, whether any step may still run); ``poll``: ``--watch``'s (``jobs.runs.watcher``)."""
    rec = record.read(folder)
    if rec is None:
        raise DdpJobError(f"no pipeline record in {folder}", "submit it first: ddpjob pipeline FILE")
    states = record.states(rec, poll)
    rows = [("STEP", "STATE", "JOB", "AFTER", "RUN DIR")]
    notes = []
    for name, entry in rec.steps.items():
        run = shown_path(Path(entry.run_dir)) if entry.run_dir else "-"
        rows.append((name, states.get(name, "?"), entry.job_id or "-", ",".join(entry.after) or "-", run))
        if reason := why_not(name, rec, states):
            notes.append(f"{name}: {reason}")
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = ["  ".join([*(c.ljust(w) for c, w in zip(r[:4], widths, strict=True)), r[4]]).rstrip() for r in rows]
    head = f"pipeline {rec.name} ({rec.file})"
    active = any(s in runs_status.ACTIVE_STATES for s in states.values())
    return "\n".join([head, *lines, *notes]), active


def cmd_status(args: argparse.Namespace) -> int:
    """``ddpjob status``: a pipeline's table, else the runs' (``jobs.runs.status``)."""
    folder = find(args.path)
    if folder is None:
        return runs_status.cmd_status(args)
    return watch(lambda poll: table(folder, poll), args.watch)


COMMANDS = {"status": cmd_status}
