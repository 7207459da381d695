"""The after-failure policy: what follows a failure that no rank decided (``cluster.failures`` says what it was).

One policy, three callers, which differ only by parameters:

- the batch script's watcher (``cluster.supervise``), once srun has returned: the attempt is over, so the job is
  requeued (``can_run_again=False``);
- the start check of a requeued attempt (``cluster.node_loss``), for the previous attempt's lost node: this attempt
  is the one that runs again (``can_run_again=True``, ``here``: its nodes; ``attempt``: the previous one's count);
- a search worker's trial step (``search.step``): the step runs again in the worker's allocation
  (``can_run_again=True``, ``here``: the allocation's nodes).

``decide_after``, in order:

1. an unknown failure this job saw before at the same step is a user error (``failures.as_repeated``); one
   ``failure`` event is recorded;
2. a user error: ``failed`` recorded, ``FAILED``;
3. the node the failure excludes, on evidence about it (``failures.to_exclude``: a failed health check, a device
   error, Slurm's DOWN, FAIL or drained state; never a count of killed processes); a node whose exclusion would leave
   the job's partition too few (``room_for``) is not excluded (``not_excluded`` recorded): the job goes on within its
   budget, never FAILED for that alone;
4. a restart inside the allocation (``Allocation``, within ``slurm.max_restarts``) on its live nodes the run does not
   exclude (a memory failure's own, outside that budget, where the micro-batch that ran out can halve:
   ``run_smaller``); else ``RUN_AGAIN`` when the caller can run again here, within the failure's budget
   (``failures.budget``), and none of ``here`` is excluded;
5. else the job is requeued off its excluded nodes within the budget (``exits.requeue_within``); a spent budget or a
   refused requeue is ``STOPPED`` with ``requeue_within``'s code. Once ``REQUEUED``, the job's ``ExcNodeList`` holds
   every excluded node, and a new one is kept off the array's pending tasks too (a sweep's later trials, a search's
   later workers).

Torch-free; it records and logs what it decides, and the callers map the ``Decision`` to their exit code.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import time
from dataclasses import dataclass
from typing import Collection, Optional

from ddp_core.cluster import exits
from ddp_core.cluster.env import DistEnv, expand_nodelist
from ddp_core.cluster.failures import (
    LIMIT_KILLED,
    NOT_STARTED,
    Failure,
    Kind,
    as_repeated,
    budget,
    excluded_hosts,
    memory_side,
    spent,
    to_exclude,
    when,
)
from ddp_core.cluster.slurm import JobInfo, SlurmGateway
from ddp_core.cluster.slurm_text import rss_bytes
from ddp_core.config import SlurmConfig
from ddp_core.run.rundir import RunDir

log = logging.getLogger("ddp_core")
STEP_RETRY_S = 5  # times the restart's count: the pause before a job step srun could not start (failures.NOT_STARTED)


class Outcome(str, enum.Enum):
    RUN_AGAIN = "run_again"  # the caller runs the failed work again in the allocation it holds
    REQUEUED = "requeued"  # Slurm ends this attempt and queues the same job again
    FAILED = "failed"  # a user error or a task out of memory: the job ends FAILED (``failed`` recorded)
    STOPPED = "stopped"  # a spent budget or a refused requeue (``budget_exhausted``/``requeue_failed`` recorded)


@dataclass(frozen=True)
class Decision:
    """What follows a failure: the outcome, the failure as recorded (a repeated unknown one reads user), for
    ``STOPPED`` ``requeue_within``'s code (``BUDGET_SPENT``, ``REQUEUE_FAILED``), and for a restart inside the
    allocation (``Allocation``) the nodes its next job step runs on."""

    outcome: Outcome
    failure: Failure
    code: int = exits.ExitCode.OK
    nodes: tuple[str, ...] = ()


@dataclass(frozen=True)
class Allocation:
    """The allocation a failed job step ran in, which can run the next one (the batch script's watcher): a restart
    there costs no trip through the queue."""

    live: tuple[str, ...]  # its nodes that still respond, in the allocation's order (the batch node first)
    step_nodes: int  # the nodes a step runs on: the allocation's less slurm.spare_nodes
    fewest: int  # the fewest a step may run on: slurm.nodes' MIN for an elastic job, else step_nodes
    restarts: int  # the restarts this attempt made already (its ``restarted`` events)

    def pick(self, excluded: Collection[str]) -> tuple[str, ...]:
        """The next step's nodes: the first ``step_nodes`` live ones the run does not exclude; empty when fewer than
        ``fewest`` are left."""
        usable = [n for n in self.live if n not in excluded][: self.step_nodes]
        return tuple(usable) if len(usable) >= self.fewest else ()


def decide_after(
    failure: Failure,
    run_dir: RunDir,
    env: DistEnv,
    gateway: SlurmGateway,
    slurm: SlurmConfig,
    *,
    job: Optional[JobInfo] = None,
    here: Collection[str] = (),
    array_job_id: str = "",
    can_run_again: bool = False,
    attempt: Optional[int] = None,
    label: str = "",
    allocation: Optional[Allocation] = None,
) -> Decision:
    """Record ``failure`` and decide what follows it (the module docstring). ``job``: the job's record, whose
    partition the room check reads (None: not checked); ``here``: the nodes of the allocation that would run again;
    ``array_job_id``: the job's array, if any; ``attempt``: the restart count of the attempt the failure ended
    (default: this one's); ``label``: what the log lines start with (a trial's name); ``allocation``: the allocation
    that can run the next job step, within ``slurm.max_restarts`` (the batch script's watcher)."""
    events = run_dir.events()
    earlier = [e for e in events if e["event"] == "failure" and e.get("job_id") == env.job_id]
    restarted = [e for e in events if e["event"] == "restarted" and e.get("job_id") == env.job_id]
    failure = as_repeated(failure, earlier)
    if failure.kind is Kind.memory and failure.error == LIMIT_KILLED and env.slurm_job_id:
        failure = dataclasses.replace(failure, error=memory_error(gateway.memory_use(env.slurm_job_id), slurm))
    ended = env.restart_count if attempt is None else attempt
    run_dir.log_event("failure", job_id=env.job_id, restart_count=ended, **failure.fields())
    if failure.kind is Kind.user:
        reason = f"{failure.where} failed at step {failure.step}: {failure.error}"
        return failed(run_dir, env, failure, reason, "a user error, not retried: fix it, then continue with", label)
    if failure.kind is Kind.memory:
        if failure.micro_batch and (smaller := run_smaller(run_dir, env, failure, allocation, can_run_again, label)):
            return smaller
        side = memory_side(failure.error)
        where = f" on {failure.host} (rank {failure.rank})" if failure.rank is not None else ""
        detail = failure.error.removeprefix("out of memory: ")
        reason = f"out of {side} memory{where} {when(failure.step)}: {detail}"
        then = "not retried, the same request runs out again on any node: give it more, then continue with"
        return failed(run_dir, env, failure, reason, then, label, memory_fix(side, slurm.mem_gb))
    name, limit = budget(failure, slurm)  # a health check's own: its node is excluded each time
    used = spent(failure, earlier, restarted)
    after = f"{failure.kind.value} failure of {failure.where} at step {failure.step} ({failure.error})"
    log.warning("%s%s", label, after)
    new, before = to_exclude(events, failure, node_evidence(gateway, failure)), excluded_hosts(events)
    if new and not room_for(gateway, job, {**before, **new}, slurm.min_nodes + slurm.spare_nodes):
        keep_using(run_dir, env, new, label)
        new = {}
    excluded = {**before, **new}
    if allocation is not None and allocation.restarts < slurm.max_restarts and (nodes := allocation.pick(excluded)):
        return restart(run_dir, env, failure, new, allocation, nodes, slurm.max_restarts)
    if can_run_again and used <= limit and not set(here) & set(excluded):
        record_exclusions(run_dir, env, new)
        log.info("%srunning it again here (%d of %d %ss spent)", label, used, limit, name)
        return Decision(Outcome.RUN_AGAIN, failure)
    record_exclusions(run_dir, env, new)
    if used <= limit and (placed_on := sorted(set(here) & set(excluded))):
        log.warning("%sthis allocation holds %s, which the run excludes: requeued off it", label, ", ".join(placed_on))
    code = exits.requeue_within(run_dir, env, name, used, limit, failure.step, after, gateway=gateway, slurm=slurm)
    if code != exits.ExitCode.REQUEUED:
        return Decision(Outcome.STOPPED, failure, code)
    if excluded and env.slurm_job_id:
        keep_off(gateway, env.slurm_job_id, sorted(excluded))
    if new and array_job_id:
        keep_array_off(gateway, array_job_id, sorted(excluded))
    return Decision(Outcome.REQUEUED, failure, code)


def restart(
    run_dir: RunDir,
    env: DistEnv,
    failure: Failure,
    new: dict[str, str],
    allocation: Allocation,
    nodes: tuple[str, ...],
    limit: int,
) -> Decision:
    """A restart inside the allocation: the exclusions and a ``restarted`` event recorded, ``RUN_AGAIN`` on ``nodes``.
    It spends the attempt's restart budget, not ``slurm.max_failures`` (``failures.spent``). After a step srun could
    not start, it first waits ``STEP_RETRY_S`` seconds a restart (5, 10, 15: a restarted controller's nodes register
    within seconds)."""
    record_exclusions(run_dir, env, new)
    count = allocation.restarts + 1
    if failure.error.startswith(NOT_STARTED):  # Slurm was not ready (a controller just back): give it a moment
        log.warning("waiting %d s for Slurm before the next job step", STEP_RETRY_S * count)
        time.sleep(STEP_RETRY_S * count)
    run_dir.log_event(
        "restarted", job_id=env.job_id, restart_count=env.restart_count, launch=env.launch + 1, step=failure.step,
        kind=failure.kind.value, count=count, nodes=list(nodes),
    )  # fmt: skip
    spared = [n for n in nodes if n not in allocation.live[: allocation.step_nodes]]
    log.warning(
        "restarting the ranks in this allocation on %s%s (restart %d of slurm.max_restarts=%d)",
        ",".join(nodes), f", spare {','.join(spared)} taking over" if spared else "", count, limit,
    )  # fmt: skip
    return Decision(Outcome.RUN_AGAIN, failure, nodes=nodes)


def run_smaller(
    run_dir: RunDir,
    env: DistEnv,
    failure: Failure,
    allocation: Optional[Allocation],
    can_run_again: bool,
    label: str,
) -> Optional[Decision]:
    """A micro-batch that ran out where the strategy's steps communicate (fsdp under ``data.batch_size=auto``: no
    rank could stop in the step and agree): the attempt again where it ran, from the newest checkpoint, its probe
    under half of it (``trainer.memory.below``). It spends no budget, and cannot loop: each time halves the
    micro-batch, and at one the rank raises the memory failure that ends the run. None where nothing can run it
    again here."""
    nodes = allocation.pick(excluded_hosts(run_dir.events())) if allocation is not None else ()
    if allocation is not None and not nodes:
        return None
    if not nodes and not can_run_again:
        return None
    log.warning(
        "%sout of memory with a micro-batch of %d on rank %s (%s): running the attempt again here at half of it",
        label, failure.micro_batch, failure.rank, failure.error,
    )  # fmt: skip
    if nodes:
        run_dir.log_event(
            "restarted", job_id=env.job_id, restart_count=env.restart_count, launch=env.launch + 1, step=failure.step,
            kind=failure.kind.value, count=0, nodes=list(nodes),
        )  # fmt: skip
    return Decision(Outcome.RUN_AGAIN, failure, nodes=tuple(nodes))


def failed(
    run_dir: RunDir, env: DistEnv, failure: Failure, reason: str, then: str, label: str, resume_args: str = ""
) -> Decision:
    """The job ends FAILED: a ``failed`` event with ``reason``, and the log line that says how to go on."""
    run_dir.log_event("failed", job_id=env.job_id, step=failure.step, reason=reason)
    resume = f"ddpjob resume {run_dir.path}" + (f" {resume_args}" if resume_args else "")
    log.error("%s%s; %s: %s", label, reason, then, resume)
    return Decision(Outcome.FAILED, failure, exits.ExitCode.FAILED)


def memory_fix(side: str, mem_gb: Optional[float]) -> str:
    """The ``ddpjob resume`` arguments that give a run out of ``side`` memory more room: the host's is the job's
    memory request (``mem_gb``: slurm.mem_gb, None where unknown or unset); a device's is the micro-batch (fitted:
    auto) or the activations."""
    if side == "host":
        return f"slurm.mem_gb={2 * mem_gb:g}" if mem_gb else "slurm.mem_gb=N"
    return "data.batch_size=auto (or smaller), or strategy.activation_checkpointing=true"


def memory_error(use: Optional[tuple[str, str]], slurm: SlurmConfig) -> str:
    """``out of memory: a task's peak 150M of the job's 308M (slurm.mem_gb=0.3)``, as far as accounting says."""
    asked = f"slurm.mem_gb={slurm.mem_gb:g}" if slurm.mem_gb else "slurm.mem_gb unset: the cluster's default"
    if use is None:
        return f"out of memory ({asked})"
    peak, request = use
    return f"out of memory: a task's peak {rss_bytes(peak) / 2**20:.0f} MiB of the job's {request or '?'} ({asked})"


def room_for(gateway: SlurmGateway, job: Optional[JobInfo], excluded: dict[str, str], needed: int) -> bool:
    """Whether the job's partition keeps the ``needed`` nodes without ``excluded`` (True when Slurm cannot say).
    ``needed``: slurm.nodes' MIN and the spare nodes, not the job's NumNodes, which for a running elastic job is the
    count it got."""
    part = gateway.show_partition(job.partition) if job is not None else None
    if job is None or part is None:
        return True
    nodes = set(expand_nodelist(part.get("Nodes", ""))) if part.get("Nodes") else set()
    return not nodes or len(nodes - set(excluded)) >= needed


def node_evidence(gateway: SlurmGateway, failure: Failure) -> Optional[dict[str, str]]:
    """What Slurm says of the node an infrastructure failure names (``failures.to_exclude``'s evidence); None for
    any other failure, which asks Slurm nothing."""
    if failure.kind is not Kind.infrastructure or failure.host is None:
        return None
    return gateway.show_node(failure.host)


def keep_using(run_dir: RunDir, env: DistEnv, bad: dict[str, str], label: str) -> None:
    """Bad nodes the job cannot do without (its partition would have too few left): not excluded, a ``not_excluded``
    event each. The job goes on within its budget on the nodes Slurm gives it (Slurm itself places nothing on a node
    that is DOWN or drained, so a requeued job waits for one to come back), rather than failing for that alone."""
    for host, why in bad.items():
        run_dir.log_event("not_excluded", job_id=env.job_id, host=host, reason=why)
        log.warning("%s%s is bad (%s), but excluding it would leave too few nodes for this job: not excluded, going "
                    "on within the budget", label, host, why)  # fmt: skip


def record_exclusions(run_dir: RunDir, env: DistEnv, new: dict[str, str]) -> None:
    """The hosts ``failures.to_exclude`` named, each recorded as an ``excluded`` event and logged."""
    for host, why in new.items():
        run_dir.log_event("excluded", job_id=env.job_id, host=host, reason=why)
        log.warning("excluding %s from this run's later attempts: %s", host, why)


def keep_off(gateway: SlurmGateway, job_id: str, hosts: list[str], tries: int = 10, pause_s: float = 0.5) -> None:
    """The requeued job's ``ExcNodeList``: Slurm takes it once the job is back in the queue, which the requeue's
    reply may precede by a moment."""
    for attempt in range(tries):
        proc = gateway.update_job(job_id, ExcNodeList=",".join(hosts))
        if proc.returncode == 0:
            log.info("job %s excludes %s", job_id, ",".join(hosts))
            return
        if attempt + 1 < tries:
            time.sleep(pause_s)
    log.error("job %s could not exclude %s: %s", job_id, ",".join(hosts), proc.stderr.strip())


def keep_array_off(gateway: SlurmGateway, array_job_id: str, hosts: list[str]) -> None:
    """The array's pending tasks (a sweep's later trials, a search's later workers) stay off ``hosts``; its running
    ones refuse (scontrol exits 1), each their own to decide."""
    gateway.update_job(array_job_id, ExcNodeList=",".join(hosts))
    log.info("the pending tasks of array %s exclude %s", array_job_id, ",".join(hosts))


def nodes_of(nodelist: str) -> set[str]:
    """The hosts of a Slurm node list (``SLURM_JOB_NODELIST``); none for an empty one."""
    return set(expand_nodelist(nodelist)) if nodelist else set()
