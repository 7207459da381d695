"""A search trial's srun step, and what follows its failure: what the batch script's watcher does for a single run
(``cluster.supervise``), inside a worker that outlives its trials' steps.

A worker runs each trial as an srun step of its own allocation (``search.worker``). When a step fails with no
decision of its ranks (no requeue, no completion), its failure is diagnosed from the ranks' ``rank_failed`` events
since the step started and srun's report (``cluster.failures``), and recorded in the trial's run directory:

- a user error: the step's code stands, and the worker tells the study the trial failed;
- infrastructure or unknown, within the trial's ``slurm.max_failures`` (health: ``max_health_failures``): the step runs
  again in the same allocation and resumes from the trial's checkpoint, unless the failure excludes a node of this
  allocation (``failures.to_exclude``): then the worker's job is requeued off it (``ExcNodeList``, and the array's
  pending workers too), and its next attempt resumes the trial, still bound to it.

A requeue that the step's rank 0 decided but could not make (inside a container image without scontrol:
``requeue_deferred``) is made here, outside the image, as the batch script's watcher makes it for a single run.

Torch-free.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
from typing import Any, Optional, Sequence

from ddp_core.cluster import exits
from ddp_core.cluster.env import DistEnv, expand_nodelist
from ddp_core.cluster.failures import (
    DECIDED,
    Failure,
    Kind,
    as_repeated,
    budget,
    diagnose,
    excluded_hosts,
    keep_array_off,
    keep_off,
    record_exclusions,
    spent,
    srun_task_ends,
)
from ddp_core.cluster.slurm import NODE_GATEWAY, SlurmGateway
from ddp_core.run.rundir import RunDir

log = logging.getLogger("ddp_core")


def call(command: Sequence[str]) -> tuple[int, list[str]]:
    """Run the srun step; its stderr passes through to the worker's, and is kept for srun's report of its tasks."""
    proc = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, errors="replace")
    assert proc.stderr is not None
    lines = []
    for line in proc.stderr:
        sys.stderr.write(line)
        lines.append(line)
    return proc.wait(), lines


def run(command: Sequence[str], run_dir: RunDir, ending: threading.Event, gateway: SlurmGateway = NODE_GATEWAY) -> int:
    """Run the trial's step, again after each failure the module docstring retries here; returns the last code."""
    env = DistEnv.from_env()
    while True:
        before = len(run_dir.events())
        code, stderr = call(command)
        new = run_dir.events()[before:]
        # Rank 0 decided a requeue inside a container image without scontrol: this worker, outside it, makes it.
        if not ending.is_set() and (made := exits.requeue_deferred(run_dir, env, new, code, gateway)) is not None:
            return made
        if code == 0 or ending.is_set() or any(e["event"] in DECIDED for e in new):
            return code
        steps = [r["step"] for r in run_dir.metrics()]
        failure = diagnose(
            [e for e in new if e["event"] == "rank_failed"], srun_task_ends(stderr), code, max(steps) if steps else None
        )
        earlier = [e for e in run_dir.events() if e["event"] == "failure"]
        failure = as_repeated(failure, earlier)
        run_dir.log_event("failure", job_id=env.job_id, restart_count=env.restart_count, **failure.fields())
        then = "stop" if failure.kind is Kind.user else retry(run_dir, env, gateway, failure, earlier)
        if then == "stop":
            return code
        if then == "requeued":
            return 0  # the worker's job is requeued off an excluded node: Slurm ends this step's worker


def retry(run_dir: RunDir, env: DistEnv, gateway: SlurmGateway, failure: Failure, earlier: list[dict[str, Any]]) -> str:
    """After an infrastructure, health or unknown failure: run the step ``again`` here, or in the worker's next
    attempt (``requeued``: its job, off a node the trial now excludes), or ``stop`` (a spent budget)."""
    name, limit = budget(failure, run_dir.load_config().slurm)
    used = spent(failure, earlier)
    after = f"{failure.kind.value} failure of {failure.where} at step {failure.step} ({failure.error})"
    log.warning("trial %s: %s", run_dir.name, after)
    record_exclusions(run_dir, env, failure)
    excluded = excluded_hosts(run_dir.events())
    nodelist = os.environ.get("SLURM_JOB_NODELIST", "")
    here = set(expand_nodelist(nodelist)) if nodelist else set()
    if used > limit or here & set(excluded):
        code = exits.requeue_within(run_dir, env, name, used, limit, failure.step, after)
        if code != exits.ExitCode.REQUEUED:
            return "stop"
        if env.slurm_job_id:
            keep_off(gateway, env.slurm_job_id, sorted(excluded))
        if array := os.environ.get("SLURM_ARRAY_JOB_ID"):  # the search's workers still pending
            keep_array_off(gateway, array, sorted(excluded))
        return "requeued"
    log.info("trial %s: running its step again (%d of %d %ss spent)", run_dir.name, used, limit, name)
    return "again"


def last_failure(run_dir: RunDir) -> Optional[str]:
    """The reason the trial's newest ``failure`` or ``budget_exhausted`` event gives, for the study's record."""
    for e in reversed(run_dir.events()):
        if e["event"] == "budget_exhausted":
            return str(e.get("reason"))
        if e["event"] == "failure":
            return f"{e.get('kind')} failure: {e.get('error')}"
    return None
