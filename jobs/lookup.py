"""Find a run from what a user has at hand: its directory, or a Slurm job id (array tasks as ID_INDEX)."""

from __future__ import annotations

from pathlib import Path

from ddp_core.errors import DdpJobError
from ddp_core.run.rundir import RunDir


def _job_ids(run: RunDir) -> set[str]:
    try:
        ids = {str(j["job_id"]) for j in run.jobs()}
    except DdpJobError:
        ids = set()  # a damaged run.json: its attempts may still name the job
    return ids | {str(e.get("job_id")) for e in run.events()}


def find_run(target: str, root: Path = Path("runs")) -> RunDir:
    """``target`` is a run directory, or a job id searched for in the run directories under ``root``."""
    path = Path(target)
    if path.is_dir():
        run = RunDir(path.resolve())
        if not run.exists():
            raise DdpJobError(f"'{target}' is not a run directory (no config.yaml)", "pass a run directory or job id")
        return run
    if not target.replace("_", "").isdigit():
        raise DdpJobError(f"'{target}' is neither a directory nor a Slurm job id", "pass RUN_DIR or JOB_ID")
    for config in sorted(root.glob("*/config.yaml")) + sorted(root.glob("*/*/config.yaml")):
        if target in _job_ids(RunDir(config.parent)):
            return RunDir(config.parent.resolve())
    raise DdpJobError(f"no run under '{root}' has job {target}", "pass the run directory, or --root where runs live")
