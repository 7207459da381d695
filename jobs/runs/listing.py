"""Which runs and jobs a login-side command is about: the run directories a path names (``runs_to_show``), each
run's Slurm jobs (``run_jobs``), the ids to ask ``sacct`` for (``query_ids``), and how a path is shown. Shared by
``ddpjob status`` (``jobs.runs.status``), ``ddpjob logs``/``cancel`` (``jobs.runs.logs``) and the doctor.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Sequence

from ddp_core.errors import DdpJobError
from jobs.runs.lookup import DEFAULT_ROOT, find_runs, resolve

if TYPE_CHECKING:
    from ddp_core.run.rundir import RunDir


@dataclass(frozen=True)
class Job:
    job_id: str  # as submitted: "5301", or "5301_3" for an array task
    log_dir: Path
    submitted: str = ""
    on_slurm: bool = True  # submitit-local jobs have pids for ids; Slurm never heard of them


def run_jobs(run: RunDir) -> list[Job]:
    """The run's jobs in submission order: run.json's, then the ones only attempts.jsonl or a
    ``<job>_batch.out`` names (plain ``sbatch`` submissions record no job in run.json)."""
    jobs = [
        Job(
            str(j["job_id"]),
            Path(str(j.get("log_dir") or run.slurm)),
            str(j.get("submitted", "")),
            j.get("via") != "local",
        )
        for j in run.jobs()
    ]
    if any("_" in j.job_id for j in jobs):
        return jobs  # an array task logs its raw SLURM_JOB_ID in attempts.jsonl: the same job, not another one
    seen = [str(e.get("job_id") or "") for e in run.events()]
    seen += sorted(p.name.split("_")[0] for p in run.slurm.glob("*_batch.out")) if run.slurm.is_dir() else []
    known = {j.job_id for j in jobs}
    extra = [i for i in dict.fromkeys(seen) if i and i not in known]
    # torchrun's run ids land in attempts.jsonl too: only numbers are Slurm's (one bad id fails a whole sacct -j)
    extra.sort(key=lambda i: int(i) if i.isdigit() else math.inf)
    return jobs + [Job(i, run.slurm, on_slurm=i.isdigit()) for i in extra]


def query_ids(jobs: Sequence[Job]) -> list[str]:
    """Ids for ``-j``: an array task's base id, because sacct lists not-yet-started tasks only under the
    array (``5301_[4-9%2]``), never under ``5301_4``; the base also brings the started ones."""
    ids = {base for j in jobs if j.on_slurm and (base := j.job_id.split("_")[0]).isdigit()}
    return sorted(ids, key=lambda i: (len(i), i))


def shown_path(path: Path) -> str:
    rel = os.path.relpath(path)
    return path.as_posix() if rel.startswith("..") else rel


def runs_to_show(path: Optional[str], limit: int = 20) -> tuple[list[Path], bool]:
    """(run directories, whether to rank them as a sweep)."""
    if path is None:
        runs = find_runs(DEFAULT_ROOT) if DEFAULT_ROOT.is_dir() else []
        if not runs:
            raise DdpJobError(f"no runs found under ./{DEFAULT_ROOT}", "pass a run directory or a sweep folder")
        from ddp_core.run.rundir import META_FILE

        # run.json is rewritten at each submission: newest activity first
        runs.sort(key=lambda p: (p / META_FILE).stat().st_mtime if (p / META_FILE).is_file() else 0, reverse=True)
        return runs[:limit], False
    target = resolve(path, sweeps=True)
    runs = find_runs(target)
    return runs, runs != [target]
