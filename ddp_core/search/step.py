"""A search trial's srun step, and what follows its failure: what the batch script's watcher does for a single run
(``cluster.supervise``), inside a worker that outlives its trials' steps.

A worker runs each trial as an srun step of its own allocation (``search.worker``). When a step fails with no
decision of its ranks (no requeue, no completion), its failure is diagnosed from the ranks' ``rank_failed`` events
since the step started and srun's report (``cluster.failures``), and the after-failure policy (``cluster.policy``, the
watcher's own, with running again in this allocation allowed) records it in the trial's run directory and decides:

- a user error: ``failed``; the step's code stands, and the worker tells the study the trial failed;
- infrastructure or unknown: the step runs again in the same allocation and resumes from the trial's checkpoint,
  first as a restart within ``slurm.max_restarts`` (a ``restarted`` event, as the batch script's watcher restarts a
  single run's step), then within ``slurm.max_failures`` (health: ``max_health_failures``) of this worker's job (a
  worker of another job that takes the trial over starts a budget of its own, as ``ddpjob resume`` does), unless the
  failure excludes a node of this allocation (``failures.to_exclude``: on evidence, such as Slurm draining it): then
  the worker's job is requeued off it (``ExcNodeList``, and the array's pending workers too), and its next attempt
  resumes the trial, still bound to it. A node the partition cannot do without is not excluded: the step runs again.

A requeue that the step's rank 0 decided but could not make (inside a container image without scontrol:
``requeue_deferred``) is made here, outside the image, as the batch script's watcher makes it for a single run.

Torch-free.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import threading
import time
from dataclasses import replace
from typing import Iterator, Mapping, Optional, Sequence

from ddp_core.cluster import exits, oom_log
from ddp_core.cluster.env import LAUNCH_VAR, DistEnv
from ddp_core.cluster.failures import DECIDED, diagnose, srun_step_error, srun_task_ends
from ddp_core.cluster.policy import Allocation, Outcome, decide_after, nodes_of
from ddp_core.cluster.slurm import NODE_GATEWAY, JobInfo, SlurmGateway
from ddp_core.run.rundir import RunDir
from ddp_core.search.slots import Slot

log = logging.getLogger("ddp_core")


def call(command: Sequence[str], launch: int = 0, extra: Mapping[str, str] = {}) -> tuple[int, list[str]]:
    """Run the srun step (the trial's ``launch``-th in this attempt: ``DistEnv.launch``; ``extra``: more of its
    environment); its stderr passes through to the worker's, and is kept for srun's report of its tasks."""
    environ = {**os.environ, **extra, LAUNCH_VAR: str(launch)}
    proc = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, errors="replace", env=environ)
    assert proc.stderr is not None
    lines = []
    for line in proc.stderr:
        sys.stderr.write(line)
        lines.append(line)
    return proc.wait(), lines


def run(
    command: Sequence[str],
    run_dir: RunDir,
    ending: threading.Event,
    gateway: SlurmGateway = NODE_GATEWAY,
    slot: Optional[Slot] = None,
) -> int:
    """Run the trial's step, again after each failure the module docstring retries here; returns the last code.
    ``slot``: a packed sweep's slot (``search.pack``), whose node the step runs on and whose worker makes the requeue
    that the step's rank 0 deferred to it (``REQUEUE_DEFERRED`` is returned)."""
    env, launch, halved = DistEnv.from_env(), 0, 0  # halved: the launches a micro-batch's halving took (no budget)
    while True:
        before, launched = len(run_dir.events()), time.time()
        code, stderr = call(command, launch, slot.environment() if slot is not None else {})
        new = run_dir.events()[before:]
        # Rank 0 decided a requeue inside a container image without scontrol: this worker, outside it, makes it (a
        # packed trial's is its pool's to make, once for all its slots).
        made = None if slot is not None or ending.is_set() else exits.requeue_deferred(run_dir, env, new, code, gateway)
        if made is not None:
            return made
        if code == 0 or ending.is_set() or any(e["event"] in DECIDED for e in new):
            return code
        steps = [r["step"] for r in run_dir.metrics()]
        ranks = [e for e in new if e["event"] == "rank_failed"]
        last = max(steps) if steps else None
        oom = oom_log.reader(run_dir.slurm, launched, env.slurm_job_id)  # the kernel's OOM killer, in this node's log
        failure = diagnose(ranks, srun_task_ends(stderr), code, last, srun_step_error(stderr), oom)
        here = (slot.node,) if slot is not None else tuple(sorted(nodes_of(os.environ.get("SLURM_JOB_NODELIST", ""))))
        # The trial's steps take the whole allocation: a restart runs on all of it or not at all.
        allocation = Allocation(here, len(here), len(here), restarts=launch - halved)
        step_env = replace(env, launch=launch)  # the failed step's: its events, and the restart's count
        with told_to(run_dir, env):
            decision = decide_after(
                failure, run_dir, step_env, gateway, run_dir.load_config().slurm, job=job_of(env, gateway), here=here,
                can_run_again=True, array_job_id=os.environ.get("SLURM_ARRAY_JOB_ID", ""),
                label=f"trial {run_dir.name}: ", allocation=allocation,
            )  # fmt: skip
        launch += 1
        halved += decision.outcome is Outcome.RUN_AGAIN and decision.failure.micro_batch is not None
        if decision.outcome is Outcome.REQUEUED:
            return 0  # the worker's job is requeued off an excluded node: Slurm ends this step's worker
        if decision.outcome is not Outcome.RUN_AGAIN:
            return code


@contextlib.contextmanager
def told_to(run_dir: RunDir, env: DistEnv) -> Iterator[None]:
    """What the policy logs about a trial (a spent budget, a restart) goes to the trial's own log too, beside its rank
    0's (``RUN/slurm/JOB_0_log.err``, what ``ddpjob logs RUN`` shows), not only to the worker's or the pack's."""
    handler = None
    try:
        if env.slurm_job_id:
            handler = logging.FileHandler(run_dir.slurm / f"{env.slurm_job_id}_0_log.err", mode="a")
    except OSError:  # the trial's folder is unwritable: the worker's log still has it
        pass
    if handler is not None:
        handler.setFormatter(logging.Formatter("%(asctime)s [worker] %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
        log.addHandler(handler)
    try:
        yield
    finally:
        if handler is not None:
            log.removeHandler(handler)
            handler.close()


def job_of(env: DistEnv, gateway: SlurmGateway) -> Optional[JobInfo]:
    """The worker's job, whose partition the policy's room check reads (None outside Slurm)."""
    return gateway.show_job(env.slurm_job_id) if env.slurm_job_id else None


def last_failure(run_dir: RunDir) -> Optional[str]:
    """The reason the trial's newest ``failure``, ``failed`` or ``budget_exhausted`` event gives, for the study's
    record."""
    for e in reversed(run_dir.events()):
        if e["event"] in ("budget_exhausted", "failed"):
            return str(e.get("reason"))
        if e["event"] == "failure":
            return f"{e.get('kind')} failure: {e.get('error')}"
    return None
