"""Find a run from what a user has at hand: its directory, or a Slurm job id (array tasks as ID_INDEX)."""

from __future__ import annotations

import json
from pathlib import Path

from ddp_core.errors import DdpJobError
from ddp_core.rundir import RunDir


def _job_ids(run_dir: Path) -> set[str]:
    ids: set[str] = set()
    try:
        ids.update(str(j["job_id"]) for j in json.loads((run_dir / "run.json").read_text()).get("jobs", []))
    except (OSError, ValueError):
        pass
    attempts = run_dir / "attempts.jsonl"
    if attempts.exists():
        for line in attempts.read_text().splitlines():
            try:
                ids.add(str(json.loads(line).get("job_id")))
            except ValueError:
                continue
    return ids


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
        if target in _job_ids(config.parent):
            return RunDir(config.parent.resolve())
    raise DdpJobError(f"no run under '{root}' has job {target}", "pass the run directory, or --root where runs live")
