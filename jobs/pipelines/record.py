"""A pipeline's record, ``ROOT/pipelines/NAME/pipeline.json``: each step's run directory, job and dependencies, or
why it was not submitted. ``ddpjob pipeline`` writes it after each step it submits (a failure midway leaves a true
record), ``ddpjob status PIPELINE`` reads it, and a rerun reuses the steps it finds completed or still queued.
``states`` asks Slurm's accounting once for every step (``jobs.runs.status.collect``)."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

from ddp_core.errors import DdpJobError
from ddp_core.run.rundir import atomic_write_text
from jobs.runs import status
from jobs.runs.watcher import Poll

FILE = "pipeline.json"


@dataclass
class Entry:
    """One step as submitted: its run directory and job, what it waits for (``NAME:MODE``), or why it was not."""

    run_dir: str = ""
    job_id: str = ""
    after: list[str] = field(default_factory=list)
    submitted: str = ""
    skipped: str = ""  # not submitted, and why: an earlier step ended so that this one can never start


@dataclass
class Record:
    name: str
    file: str  # the pipeline file, absolute
    steps: dict[str, Entry] = field(default_factory=dict)

    def write(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        data = {"name": self.name, "file": self.file, "steps": {k: asdict(v) for k, v in self.steps.items()}}
        atomic_write_text(folder / FILE, json.dumps(data, indent=2) + "\n")


def read(folder: Path) -> Optional[Record]:
    """The record in ``folder``, None when there is none yet."""
    path = folder / FILE
    try:
        data: Any = json.loads(path.read_text())
        steps = {str(k): Entry(**v) for k, v in data["steps"].items()}
        return Record(str(data["name"]), str(data["file"]), steps)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise DdpJobError(f"{path} is unreadable ({err})", f"remove {path} to submit every step again") from None


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S")


def states(record: Record, poll: Optional[Poll[Any]] = None) -> dict[str, str]:
    """Each step's state as ``ddpjob status`` gives it (``SKIPPED`` for a step never submitted, ``MISSING`` for a run
    directory that is gone): one sacct call for all of them."""
    out = {name: "SKIPPED" for name, e in record.steps.items() if e.skipped}
    paths = {name: Path(e.run_dir) for name, e in record.steps.items() if not e.skipped}
    out |= {name: "MISSING" for name, path in paths.items() if not path.is_dir()}
    present = {name: path for name, path in paths.items() if path.is_dir()}
    rows = status.collect(list(present.values()), "eval/accuracy", poll=poll)
    by_path = {row.run.path.resolve(): row for row in rows}
    moment = time.time()
    for name, path in present.items():
        row = by_path.get(path.resolve())
        out[name] = row.state(moment) if row is not None else "MISSING"
    return out
