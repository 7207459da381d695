"""Whether a run is still queued or running, asked before anything starts it again (``resume``, ``prepare --job-id``):
a run directory holds one run, and two jobs training in it would interleave checkpoints and metrics.

Its jobs are every Slurm job id it knows of, however the run was started: those ``submit`` and ``resume`` recorded
in ``run.json``, and those whose attempts logged a start (a job of the plain sbatch template, one submitted by hand
or by a script). One ``squeue`` asks for all of them, and it fails closed: a squeue that cannot answer stops the
command in one line instead of reading as "nothing runs".
"""

from __future__ import annotations

import re

from ddp_core.cluster.slurm import GATEWAY, SlurmGateway
from ddp_core.errors import DdpJobError
from ddp_core.run.rundir import RunDir

SLURM_ID = re.compile(r"\d+(_\d+)?")


def slurm_jobs(run_dir: RunDir) -> list[str]:
    """Every Slurm job id of the run (recorded at submit, or logged by an attempt's start), oldest first."""
    ids = [str(j.get("job_id")) for j in run_dir.jobs() if j.get("via") != "local"]
    ids += [str(e.get("job_id")) for e in run_dir.events() if e["event"] == "start"]
    return [j for j in dict.fromkeys(ids) if SLURM_ID.fullmatch(j)]


def queued(job_ids: list[str], gateway: SlurmGateway = GATEWAY, strict: bool = False) -> set[str]:
    """Those of ``job_ids`` (array tasks as ARRAY_INDEX) still pending or running: one squeue for all of them.
    ``strict``: a squeue that cannot answer is one line (``SlurmGateway.squeue_ids``), not "none"."""
    arrays = sorted({j.split("_")[0] for j in job_ids})
    return {listed for listed, _ in gateway.squeue_ids(arrays, strict=strict)}


def refuse_if_active(run_dir: RunDir, gateway: SlurmGateway = GATEWAY, this_job: str = "") -> None:
    """One line if a job of the run other than ``this_job`` is still queued or running, or if Slurm cannot say."""
    ids = [j for j in slurm_jobs(run_dir) if j != this_job]
    running = queued(ids, gateway, strict=True)
    if active := [j for j in ids if j in running]:
        raise DdpJobError(
            f"run {run_dir.name} is still queued or running as job {active[0]}", "wait for it or scancel it first"
        )
