"""A whole node lost: the failure nobody lived to record, accounted at the start of the next attempt.

When a node dies (power, kernel, its slurmd gone with every process on it), no rank there records anything, and the
batch script's watcher (``cluster.supervise``) cannot decide either: srun waits on the dead node until slurmctld marks
it DOWN (``SlurmdTimeout``), then Slurm itself ends the attempt (``NODE_FAIL``) and, with ``--requeue``, queues the
same job again. The batch script of that next attempt runs ``python -m ddp_core.cluster.supervise --begin RUN_DIR``
before srun (``SlurmRequest.watch_lines``, ``jobs.submission.request``), which comes here when the previous attempt
ended with no decision recorded (no ``requeued``, ``failure``, ...):

- accounting says how it ended (``sacct -D``; without accounting nothing does, and the attempt goes on); for
  ``NODE_FAIL``, which of its nodes went down (the controller's node events, else the nodes down now), recorded as one
  infrastructure ``failure`` event naming that host;
- from there the after-failure policy decides (``cluster.policy``, the watcher's and a search trial's step's too),
  with this attempt as the one that runs again: that failure counts against ``slurm.max_failures`` like any other,
  and once spent the attempt ends here (exit code ``BUDGET_SPENT``) and the run reads FAILED with the reason;
- the lost host is excluded (``failures.to_exclude``: Slurm's NODE_FAIL is the evidence); if this attempt was placed
  on it again, the job is requeued off it now, before srun starts a rank there (``NOT_STARTED``); with that requeue, a
  sweep's array keeps its pending tasks off it. When too few nodes would be left without it, it is not excluded and
  this attempt runs.

Torch-free; it never raises (a question Slurm cannot answer leaves the attempt to run).
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Optional

from ddp_core.cluster import exits
from ddp_core.cluster.env import DistEnv, expand_nodelist
from ddp_core.cluster.failures import DECIDED, Failure, Kind, attempt_events
from ddp_core.cluster.node_state import gone
from ddp_core.cluster.policy import Outcome, decide_after, nodes_of
from ddp_core.cluster.slurm import SlurmGateway
from ddp_core.config import SlurmConfig
from ddp_core.run.rundir import RunDir

log = logging.getLogger("ddp_core")

# Accounting records a node's DOWN event when slurmctld ends the job for it: a little slack past the attempt's End.
EVENT_SLACK_S = 60
GO_ON = 0  # the batch script runs srun


def node_failure(gateway: SlurmGateway, job_id: str, step: Optional[int]) -> Optional[Failure]:
    """The failure of the job's previous attempt if Slurm ended it for a node failure, naming the node that went
    down (None for any other end, or when accounting cannot say)."""
    answer = gateway.sacct([job_id], "State,NodeList,Start,End", attempts=True)
    if answer.error is not None:  # the controller keeps only the current attempt: how the last one ended is lost
        log.warning(
            "accounting does not answer (%s): whether the previous attempt lost a node is unknown", answer.error
        )
        return None
    rows = [r for r in answer.rows if len(r) == 4]
    ended = [r for r in rows if r[0].split()[:1] not in (["RUNNING"], ["PENDING"])]
    if not ended or ended[-1][0].split()[0] != "NODE_FAIL":
        return None
    _, nodelist, start, end = ended[-1]
    nodes = expand_nodelist(nodelist)
    until = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(time.mktime(time.strptime(end, "%Y-%m-%dT%H:%M:%S"))
                                                                     + EVENT_SLACK_S))  # fmt: skip
    down = gateway.nodes_down_between(nodes, start, until) or [n for n in nodes if gone(gateway.show_node(n))]
    host = down[0] if down else None
    what = f"{', '.join(down)} stopped responding" if down else f"a node of {nodelist} failed"
    lost = "Slurm ended the attempt for it (NODE_FAIL)" if down else ""
    return Failure(Kind.infrastructure, None, host, step, f"node failure: {what} (Slurm ended the attempt: NODE_FAIL)",
                   lost=lost)  # fmt: skip


def begin(
    run_dir: RunDir, env: DistEnv, nodelist: str, slurm: SlurmConfig, gateway: SlurmGateway, array_job_id: str = ""
) -> int:
    """Before a requeued attempt's srun (see the module docstring): ``GO_ON``, or the batch script's exit code when
    this attempt must not start (a spent budget, a requeue off an excluded node it was placed on).
    ``array_job_id``: a sweep's array, whose pending tasks stay off a node this run now excludes."""
    if not env.restart_count or not env.slurm_job_id:
        return GO_ON
    previous = attempt_events(run_dir.events(), replace(env, restart_count=env.restart_count - 1))
    if any(e["event"] in DECIDED or e["event"] in ("failure", "failed") for e in previous):
        return GO_ON
    steps = [r["step"] for r in run_dir.metrics()]
    failure = node_failure(gateway, env.slurm_job_id, max(steps) if steps else None)
    if failure is None:
        return GO_ON
    # Slurm has requeued the job already: this attempt is the one that runs again, unless it sits on an excluded node.
    decision = decide_after(
        failure, run_dir, env, gateway, slurm, job=gateway.show_job(env.slurm_job_id), here=nodes_of(nodelist),
        array_job_id=array_job_id, can_run_again=True, attempt=env.restart_count - 1, label="the previous attempt: ",
    )  # fmt: skip
    return {Outcome.RUN_AGAIN: GO_ON, Outcome.REQUEUED: exits.ExitCode.NOT_STARTED}.get(decision.outcome, decision.code)
