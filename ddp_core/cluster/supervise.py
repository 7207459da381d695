"""The batch script's watcher of its attempt: ``python -m ddp_core.cluster.supervise RUN_DIR BATCH_LOG STATUS``.

The batch script runs it from its EXIT trap once srun has returned (``SlurmRequest.watch_lines``), so it
sees every way an attempt can fail, including the ones no rank lives to report: a rank killed by a signal, a node
gone. When rank 0 decided a requeue it could not make (no scontrol inside a container image: ``requeue_deferred``,
exit code ``REQUEUE_DEFERRED``), it makes it (``exits.requeue_deferred``). With srun's status 0, or when the ranks
decided the attempt's end themselves (a requeue after a signal, a
spent budget, a hang), or when Slurm is ending the job anyway (cancelled, timed out, preempted, requeued), it does
nothing. Otherwise it diagnoses the failure (``failures.diagnose``: the ranks' ``rank_failed`` events and srun's
report in BATCH_LOG after this attempt's marker), and the after-failure policy (``cluster.policy``, which the
node-loss check and a search's trial step share) records one ``failure`` event and decides:

- a user error: records ``failed`` and leaves srun's status, so the job ends FAILED within seconds;
- infrastructure or unknown: restarts the ranks in the allocation within ``slurm.max_restarts`` (``--in-allocation``),
  else requeues the same job within ``slurm.max_failures`` (``exits.requeue_within``), off the nodes the run excludes
  on evidence (``failures.to_exclude``; never one the partition cannot do without); the next attempt resumes from the
  newest checkpoint. An unknown failure seen again at the same step is a user error.

Its exit code is the batch script's: 0 once the job is requeued, else srun's status. Torch-free, and it never
raises: a watcher that fails leaves the job as srun left it.

A node that dies whole leaves nobody to decide: Slurm ends that attempt itself (``NODE_FAIL``) and requeues the job.
``--begin RUN_DIR``, run by the next attempt's batch script before srun, records that failure (``node_loss``).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

from ddp_core.cluster import exits, node_loss, oom_log
from ddp_core.cluster.env import DistEnv, expand_nodelist
from ddp_core.cluster.failures import (
    DECIDED,
    Failure,
    Kind,
    attempt_events,
    diagnose,
    srun_step_error,
    srun_task_ends,
)
from ddp_core.cluster.node_state import gone
from ddp_core.cluster.policy import Allocation, Outcome, decide_after
from ddp_core.cluster.slurm import NODE_GATEWAY, SlurmGateway
from ddp_core.config import CheckpointConfig, SlurmConfig
from ddp_core.errors import DdpJobError
from ddp_core.run import private
from ddp_core.run.rundir import RunDir

log = logging.getLogger("ddp_core")

MARKER = "ddpjob: attempt {restart} of job {job} started"  # the batch script echoes it to BATCH_LOG first
TAIL_BYTES = 256 * 1024


def srun_lines(batch_log: Path, env: DistEnv) -> list[str]:
    """BATCH_LOG's lines after this attempt's marker (srun writes its report there, the batch script's stderr)."""
    try:
        with open(batch_log, "rb") as f:
            f.seek(max(0, f.seek(0, 2) - TAIL_BYTES))
            text = f.read().decode(errors="replace")
    except OSError:
        return []
    marker = MARKER.format(restart=env.restart_count, job=env.job_id)
    return text.rpartition(marker)[2].splitlines() if marker in text else []


def decide(
    run_dir: RunDir,
    batch_log: Path,
    status: int,
    env: DistEnv,
    gateway: SlurmGateway,
    array_job_id: str = "",
    in_allocation: bool = False,
) -> int:
    """What the batch script exits with (see the module docstring), or ``RESTART`` (with ``in_allocation``: the
    batch script's loop of job steps, which can run another). ``array_job_id``: a sweep's array, whose tasks still
    pending (the sweep's later trials) stay off the nodes this run excludes."""
    if status == 0 or not env.slurm_job_id:
        return status
    job = gateway.show_job(env.slurm_job_id)
    if job is not None and job.state != "RUNNING":  # cancelled, timed out, preempted, requeued: Slurm's to end
        return status
    cfg = run_dir.load_config()
    events = run_dir.events()
    attempt = attempt_events(events, env)
    if (code := exits.requeue_deferred(run_dir, env, attempt, status, gateway, cfg.slurm)) is not None:  # an image
        return code
    if any(e["event"] in DECIDED for e in attempt):
        return status
    metric_steps = [r["step"] for r in run_dir.metrics()]
    lines = srun_lines(batch_log, env)
    failure = diagnose(
        [e for e in attempt if e["event"] == "rank_failed"],
        srun_task_ends(lines),
        status,
        max(metric_steps) if metric_steps else None,
        srun_step_error(lines),
        oom_log.reader(run_dir.slurm, job.started if job is not None else None, env.slurm_job_id),  # the kernel's
    )
    allocation = this_allocation(env, gateway, cfg.slurm, events) if in_allocation and job is not None else None
    if allocation is not None:
        first = ran_on(env, events, allocation_order(cfg.slurm), allocation.step_nodes)
        failure = lost_node(failure, first, allocation)
    decision = decide_after(
        failure, run_dir, env, gateway, cfg.slurm, job=job, array_job_id=array_job_id, allocation=allocation
    )
    if decision.outcome in (Outcome.FAILED, Outcome.STOPPED):
        remove_local_copies(cfg.checkpoint, env, gateway, allocation.live if allocation is not None else None)
    if decision.outcome is Outcome.RUN_AGAIN:
        # The next step's srun options, for the batch script's loop (its standard output; the logs go to stderr).
        # --overlap: a step that lost a node never completes there, and Slurm holds its CPUs on the others until
        # then ("Requested nodes are busy" for ever); its ranks are gone, so the new step shares nothing in use.
        # --mem=0: where memory is a resource (the site profile), the lost step's memory stays held on the others
        # too, and a step asking for its own is refused ("Memory required by task is not available"); with 0 it
        # may use the job's memory on each node without taking any (docs/failures.md).
        print(f"--nodes={len(decision.nodes)} --ntasks={len(decision.nodes) * tasks_per_node()} "
              f"--nodelist={','.join(decision.nodes)} --overlap --mem=0")  # fmt: skip
        return exits.ExitCode.RESTART
    return 0 if decision.outcome is Outcome.REQUEUED else status


def this_allocation(
    env: DistEnv, gateway: SlurmGateway, slurm: SlurmConfig, events: list[dict[str, Any]]
) -> Allocation:
    """The job's allocation as it stands: its nodes that still respond (Slurm's node state), how many a job step
    takes, and the restarts this attempt made."""
    nodes = allocation_order(slurm)
    live = tuple(n for n in nodes if not gone(gateway.show_node(n)))
    step_nodes = len(nodes) - slurm.spare_nodes
    restarts = sum(
        1 for e in events
        if e["event"] == "restarted" and e.get("job_id") == env.job_id and e.get("restart_count") == env.restart_count
        and e.get("kind") != "memory"  # a micro-batch halved (policy.run_smaller): outside slurm.max_restarts
    )  # fmt: skip
    return Allocation(live, step_nodes, min(step_nodes, slurm.min_nodes) if slurm.elastic else step_nodes, restarts)


def allocation_order(slurm: SlurmConfig) -> list[str]:
    """The allocation's nodes in the order job steps take them: with spare nodes the batch node (this one) comes last,
    a spare the steps use only when no other node is left (``SlurmRequest.first_step_options``)."""
    nodes = expand_nodelist(os.environ.get("SLURM_JOB_NODELIST", ""))
    here = socket.gethostname()
    return [n for n in nodes if n != here] + [n for n in nodes if n == here] if slurm.spare_nodes else nodes


def remove_local_copies(
    checkpoint: CheckpointConfig, env: DistEnv, gateway: SlurmGateway, live: Optional[Sequence[str]] = None
) -> None:
    """The job ends here for good (a user error, a spent budget): its node-local checkpoint copies
    (``checkpoint.local_every_steps``) go with it, on each of its nodes still up (``live``, when the caller asked Slurm
    already; a completed run's ranks remove their own). A later ``ddpjob resume`` is another job, which could not use
    them."""
    if not checkpoint.local_every_steps or not env.job_id:
        return
    if live is None:
        live = [n for n in expand_nodelist(os.environ.get("SLURM_JOB_NODELIST", "")) if not gone(gateway.show_node(n))]
    folder = f"{checkpoint.local_path.rstrip('/')}/{private.per_user_name(env.job_id)}"  # the tier's, per user
    if live and gateway.run_on_each(live, ["rm", "-rf", "--", folder]).returncode == 0:
        log.info("removed the node-local copies %s on %s", folder, ",".join(live))


def ran_on(env: DistEnv, events: list[dict[str, Any]], order: list[str], step_nodes: int) -> list[str]:
    """The nodes of the job step that failed: those its ``restarted`` event chose, else (the attempt's first step)
    the first ``step_nodes`` of the allocation's ``order``, where the first step's srun options put it."""
    for e in reversed(events):
        if e["event"] == "restarted" and e.get("job_id") == env.job_id and e.get("launch") == env.launch:
            if e.get("restart_count") == env.restart_count:
                return list(e.get("nodes") or [])
    return order[:step_nodes]


def lost_node(failure: Failure, step_nodes: list[str], allocation: Allocation) -> Failure:
    """A failure no rank explained, on a step one of whose nodes is gone: that node's death (``--no-kill`` kept the
    allocation), an infrastructure failure naming it."""
    gone = [n for n in step_nodes if n not in allocation.live]
    if not gone or failure.kind in (Kind.user, Kind.health, Kind.memory):
        return failure
    what = f"node failure: {', '.join(gone)} stopped responding (the allocation kept the others: --no-kill)"
    return Failure(Kind.infrastructure, None, gone[0], failure.step, what, lost="gone from the allocation")


def tasks_per_node() -> int:
    """The allocation's tasks per node (sbatch --ntasks-per-node, which ddpjob always sets)."""
    raw = os.environ.get("SLURM_NTASKS_PER_NODE", "1")
    return int(raw) if raw.isdigit() else 1


def main(argv: Optional[Sequence[str]] = None, gateway: SlurmGateway = NODE_GATEWAY) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(format="%(asctime)s [batch] %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("ddp_core").setLevel(logging.INFO)
    if len(args) == 2 and args[0] == "--begin":
        return main_begin(args[1], gateway)
    in_allocation = args[:1] == ["--in-allocation"]
    args = args[1:] if in_allocation else args
    if len(args) != 3 or not args[2].lstrip("-").isdigit():
        log.error(
            "usage: python -m ddp_core.cluster.supervise [--in-allocation] RUN_DIR BATCH_LOG STATUS | --begin RUN_DIR"
        )
        return 2
    status = int(args[2])
    if not args[0]:  # the template's batch script ended before it had a run directory
        return status
    # Once it requeues the job, Slurm sends the batch step SIGTERM (SIGKILL after KillWait): the requeued job's
    # ExcNodeList is set after the requeue, and the job stays completing, not schedulable, until this process ends.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        array_job_id = os.environ.get("SLURM_ARRAY_JOB_ID", "")
        return decide(
            RunDir(Path(args[0])), Path(args[1]), status, DistEnv.from_env(), gateway, array_job_id, in_allocation
        )
    except (DdpJobError, OSError, ValueError) as err:
        log.error("the attempt's watcher could not decide (%s): the job ends as srun left it", err)
        return status


def main_begin(run_dir: str, gateway: SlurmGateway) -> int:
    """``--begin RUN_DIR``: before a requeued attempt's srun, the previous attempt's node failure (``node_loss``)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # as above: it may requeue the job itself
    try:
        rd = RunDir(Path(run_dir))
        env = DistEnv.from_env()
        if any(e["event"] == "completed" and e.get("job_id") == env.job_id for e in rd.events()):
            # Slurm 24.11 requeues a job that was preempted once more when its next attempt ends, although it ended
            # on its own: the run is done, nothing is started (docs/local-cluster.md, Slurm releases).
            log.warning("Slurm started job %s again after its run completed: nothing to run", env.job_id)
            return exits.ExitCode.ALREADY_COMPLETE
        slurm = rd.load_config().slurm
        nodelist, array_job_id = os.environ.get("SLURM_JOB_NODELIST", ""), os.environ.get("SLURM_ARRAY_JOB_ID", "")
        return node_loss.begin(rd, env, nodelist, slurm, gateway, array_job_id)
    except (DdpJobError, OSError, ValueError) as err:
        log.error("the attempt's start check could not decide (%s): the attempt runs", err)
        return node_loss.GO_ON


if __name__ == "__main__":
    exits.leave(main(), teardown=True)  # no torch.distributed here: the interpreter's own exit
