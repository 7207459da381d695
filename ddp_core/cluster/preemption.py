"""Preemption and time limits: signal handlers that only set a flag, a per-step agreement between ranks,
and the decision (requeue or stop) after the checkpoint is written.

Slurm delivers the warning signal (``slurm.signal``, default USR2, ``slurm.signal_lead_s`` before the time
limit) and SIGTERM (preemption, ``scontrol requeue``, scancel) to every task, but not at the same instant and
not always to every rank. Each rank's handler records the signal; at step boundaries the ranks all-reduce it (MAX),
so they all stop after the same step, checkpoint together, and rank 0 requeues the job.

The all-reduce is asynchronous and on the CPU (gloo, also on GPU nodes: see ``ddp_core.distributed.groups``): the one
started at a step boundary is read at the next exchange, by when it has long completed. No rank waits for its peers
there, and the CUDA stream never waits for the flag. Asynchronous is not free, though: with two ranks on two cores
an exchange after every step made a 2.3 ms step ~0.7 ms slower (the collective's threads and messages compete with
the step's own). So the ranks exchange every k steps, k chosen so that exchanges are about ``train.stop_check_ms``
apart: each exchange also carries every rank's proposal for the next k (from its own pace since the last exchange),
and the smallest one is taken. Every rank reads the same results at the same steps, so they all stop after the same
step, at most about twice ``stop_check_ms`` (plus a step) after the signal. ``stop_check_ms=0``: after every step.

The same exchange carries rank 0's deadline stop (``ddp_core.cluster.deadline``): where no warning signal came in
time, rank 0 records it itself before the time limit, and the ranks stop as if it had come.

Torch-free at import (``agree`` imports torch): ``ddp_core.runtime`` installs a
``StopFlag`` when a user's script imports it, before the script has imported torch.
"""

from __future__ import annotations

import logging
import signal
import time
from dataclasses import dataclass
from enum import Enum
from types import FrameType
from typing import TYPE_CHECKING, Optional

from ddp_core.cluster import signals
from ddp_core.cluster.deadline import Deadline, job_end
from ddp_core.cluster.env import DistEnv
from ddp_core.cluster.slurm import MISSING, NODE_GATEWAY, TIMED_OUT, JobInfo, SlurmGateway
from ddp_core.config import SlurmConfig

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

log = logging.getLogger(__name__)

# Timed signals arrived up to ~1 min earlier than asked on the test cluster; allow for it when classifying.
_TIMEOUT_SLACK_S = 90
# The most steps between two flag exchanges, however fast the steps are.
MAX_CHECK_EVERY = 1000


class Interruption(str, Enum):
    timeout = "timeout"  # the warning signal near the time limit: requeue (timeout budget)
    preemption = "preemption"  # chosen for preemption, or a warning signal well before the limit: requeue
    terminated = "terminated"  # SIGTERM while Slurm requeues the job itself (`scontrol requeue`): save, leave
    cancelled = "cancelled"  # SIGTERM of a job that ends (scancel, time limit reached): save, never requeue
    stopped = "stopped"  # a signal outside Slurm (torchrun, a plain process): save and exit non-zero


class StopFlag:
    """Installs handlers for the warning signal and SIGTERM; the handlers only record which arrived.

    ``interval_s``: the time to aim for between two exchanges of the flag in ``agree`` (0: every call).
    ``handlers=False``: installs none; its owner calls ``record`` (script mode's deferred warning, which records only
    the warning signal). ``group``: the process group of the exchanges (None: the default group, which must serve CPU
    tensors). ``deadline``: rank 0's deadline stop, checked at each exchange (``ddp_core.cluster.deadline``);
    ``by_deadline``: this rank recorded the warning for it; ``lost_batch_node``: rank 0 recorded it because the batch
    node is gone (``ddp_core.cluster.batch_node``)."""

    def __init__(self, warning_signal: str, interval_s: float = 0.0, handlers: bool = True) -> None:
        self.warning = signals.warning_signal(warning_signal)
        self.received = 0  # signal number; SIGTERM wins over the warning signal
        self.received_at = 0.0
        self.interval_s = interval_s
        self.group: Optional[dist.ProcessGroup] = None
        self.deadline: Optional[Deadline] = None
        self.by_deadline = False
        self.lost_batch_node: Optional[str] = None  # rank 0 recorded the warning itself: the batch node is gone
        self._pending: Optional[tuple[dist.Work, torch.Tensor, int]] = None  # the exchange in flight, its call
        self._calls = 0  # agree() calls so far: every rank counts the same
        self._due = 1  # the call that exchanges next
        self._last = (0, 0.0)  # (call, perf_counter) of the last exchange: this rank's pace since
        self._cleared = 0  # the call at which the agreed signal was last acted on (clear)
        if not handlers:
            return
        for sig in (self.warning, signal.SIGTERM):
            # Replaces submitit's handlers: its USR2 handler checkpoints rank 0 alone, inside the handler.
            signals.install(sig, self.record)
        # Held since the task's first instruction (ddp_core.cluster.signals): one that came meanwhile is recorded now.
        signals.release(self.warning, signal.SIGTERM)

    def record(self, signum: int, frame: Optional[FrameType] = None) -> None:
        """The signal handler: remember ``signum`` (SIGTERM is never overwritten by the warning)."""
        if self.received != signal.SIGTERM:
            self.received = signum
            self.received_at = time.time()

    def clear(self) -> None:
        """The agreed signal was acted on, on every rank at the same call: forget it, and the exchange in flight,
        which still carries it. A signal that arrives from now on is agreed on afresh."""
        self.received = 0
        self._cleared = self._calls

    def agree(self) -> int:
        """Called by every rank after every step: the signal any rank had received by the previous exchange (0 if
        none, and between exchanges), the same on every rank. At an exchange it reads the one in flight and starts
        the next with this rank's flag and its proposal for the steps until the one after."""
        self._calls += 1
        if self._calls < self._due:
            return 0
        import torch  # already loaded by the caller: a dictionary lookup, not an import
        import torch.distributed as dist

        if not dist.is_initialized():
            self._check_deadline(1, time.perf_counter())  # the next call is the next chance to stop
            return self.received
        agreed, every = self._read()
        now = time.perf_counter()
        call, at = self._last
        pace = (now - at) / max(1, self._calls - call)  # seconds per step on this rank
        propose = 1 if not call or pace <= 0 else int(self.interval_s / pace)
        self._last = (self._calls, now)
        # Not flagged now, the earliest stop is after the exchange after next: ``every`` steps to the next, at most
        # this rank's own proposal after it.
        self._check_deadline(every + min(max(1, propose), MAX_CHECK_EVERY), now, pace if call else None)
        # A CPU tensor: gloo, never the CUDA stream. The warning signal's number is smaller than SIGTERM's on Linux
        # (USR1 10, USR2 12, TERM 15), so MAX makes SIGTERM win if any rank saw it; MAX of minus the proposals is
        # minus the smallest.
        value = torch.tensor([self.received, -min(max(1, propose), MAX_CHECK_EVERY)], dtype=torch.int64)
        work = dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        self._pending = (work, value, self._calls)
        self._due = self._calls + every
        return agreed

    def _check_deadline(self, steps: int, now: float, pace: Optional[float] = None) -> None:
        """Rank 0 at an exchange: record the warning itself when the deadline says so (``steps``: until the earliest
        stop if it does not now; ``pace``: seconds per step, None before the flag has measured one)."""
        if self.deadline is None or self.received:
            return
        if pace is None:  # the attempt's first steps: their time since training started, priming included
            pace = (now - self.deadline.armed_at) / max(1, self._calls)
        if self.deadline.check(steps, pace):
            self.record(self.warning)
            self.by_deadline = True

    def _read(self) -> tuple[int, int]:
        """The exchange in flight, waited for: (agreed signal, steps until the next exchange); (0, 1) if none."""
        if self._pending is None:
            return 0, 1
        work, value, started = self._pending
        self._pending = None
        work.wait()
        signum, minus_every = value.tolist()
        # An exchange started before the last clear() carries a signal already acted on.
        return (int(signum) if started > self._cleared else 0), int(-minus_every)

    def settle(self) -> int:
        """Wait for the exchange in flight (every rank, before the group is used for anything it must not overlap
        or is destroyed) and return its agreed signal."""
        return self._read()[0]


@dataclass(frozen=True)
class Decision:
    kind: Interruption
    requeue: bool  # rank 0 requeues the job itself (within the kind's budget)
    why: str  # for the log
    ends_preempted: bool = False  # PreemptMode=CANCEL: the run ends here; `ddpjob resume` continues it


def decide(
    signum: int,
    warning: int,
    job: Optional[JobInfo],
    mode: Optional[str],
    own_restarts: int,
    time_left_s: Optional[float],
    lead_s: int,
    deadline: bool = False,
) -> Decision:
    """What an attempt that stopped on ``signum`` (after its checkpoint) leads to, from what Slurm says about the
    job (``job``: ``scontrol show job``; None where scontrol cannot be reached) and how its partition or QOS
    preempts (``mode``: REQUEUE, CANCEL, ...; None if unknown). ``deadline``: rank 0 recorded the warning itself,
    for the time limit (``ddp_core.cluster.deadline``). The decision table:

    | signal  | what Slurm says                                  | kind       | then                               |
    |---------|--------------------------------------------------|------------|------------------------------------|
    | any     | PreemptTime set, mode REQUEUE (or unknown and    | preemption | rank 0 requeues now, inside the    |
    |         | Requeue=1): partition/QOS preemption; with       |            | GraceTime (exiting first would end |
    |         | preempt_send_user_signal the warning signal      |            | the job FAILED, never requeued)    |
    |         | comes first, else SIGTERM                        |            |                                    |
    | any     | PreemptTime set, mode CANCEL                     | preemption | end; status shows PREEMPTED;       |
    |         |                                                  |            | `ddpjob resume` continues          |
    | SIGTERM | Restarts above this attempt's: scontrol requeue  | terminated | leave: Slurm requeues it           |
    | SIGTERM | RUNNING with EndTime now: the time limit         | timeout    | leave (the warning signal, earlier,|
    |         |                                                  |            | was the chance to requeue)         |
    | SIGTERM | otherwise (COMPLETING, CANCELLED): scancel       | cancelled  | leave, never requeue               |
    | warning | rank 0's deadline stop (no signal in time)       | timeout    | rank 0 requeues (timeout budget)   |
    | warning | time left <= signal_lead_s (+ slack)             | timeout    | rank 0 requeues (timeout budget)   |
    | warning | earlier (scancel --signal, a site's notice)      | preemption | rank 0 requeues                    |
    | SIGTERM | scontrol unreachable (a container without it)    | terminated | leave (Slurm's choice stands)      |

    A suspended job (PreemptMode=SUSPEND) gets SIGSTOP/SIGCONT, never reaches this: it just pauses.
    """
    if job is not None and job.preempt_time:
        if mode == "CANCEL" or (mode is None and not job.requeue):
            return Decision(
                Interruption.preemption,
                False,
                f"preempted (PreemptMode={mode or '?'}): the job ends here",
                ends_preempted=True,
            )
        return Decision(Interruption.preemption, True, f"preempted (PreemptMode={mode or 'REQUEUE'})")
    if signum != warning:
        if job is None:
            return Decision(Interruption.terminated, False, "SIGTERM (scontrol unreachable: Slurm's choice stands)")
        if back_in_queue(job, own_restarts):
            return Decision(Interruption.terminated, False, "SIGTERM: Slurm requeues the job")
        # At the limit the job still reads RUNNING; scancel moves it to COMPLETING (and its EndTime to now too).
        if job.state == "TIMEOUT" or (job.state == "RUNNING" and time_left_s is not None and time_left_s <= 5):
            return Decision(Interruption.timeout, False, "SIGTERM at the time limit: the job ends")
        return Decision(Interruption.cancelled, False, f"SIGTERM: the job ends ({job.state or 'cancelled'})")
    if deadline:
        return Decision(Interruption.timeout, True, "the time limit is near (deadline stop)")
    if time_left_s is None or time_left_s <= lead_s + _TIMEOUT_SLACK_S:
        return Decision(Interruption.timeout, True, "the time limit is near")
    return Decision(Interruption.preemption, True, "warning signal well before the time limit")


def back_in_queue(job: JobInfo, own_restarts: int) -> bool:
    """Slurm has requeued the job: this attempt is over (a later one counts more restarts, or it waits queued)."""
    return job.restarts > own_restarts or job.state in ("REQUEUED", "REQUEUE_HOLD", "PENDING")


def time_left(job: Optional[JobInfo], since: float, env_end: Optional[str] = None) -> Optional[float]:
    """Seconds from ``since`` to the job's scheduled end; None when unknown (unlimited). Where scontrol cannot say
    (``job`` None: a container image without it), ``env_end``: the end Slurm put in the job's environment at its
    start (``SLURM_JOB_END_TIME``, epoch seconds), so a warning signal well before it is still told from a timeout."""
    end = job_end(job, None) if job is not None else job_end(None, env_end)
    return None if end is None else end - since


@dataclass(frozen=True)
class Refusal:
    """Why a requeue was not made: scontrol's own words, and whether there is no scontrol here at all (a container
    image without Slurm's commands), which the batch script outside it can make up for."""

    why: str
    missing: bool = False


def tasks_per_node(job_id: str, slurm: Optional[SlurmConfig], gateway: SlurmGateway) -> int:
    """An elastic job's tasks per node, as Slurm holds the running job (``NumTasks`` over ``NumNodes``), read before a
    requeue (right after one, scontrol has answered nothing for the job here); 0 for any other job or no answer."""
    if slurm is None or not slurm.elastic:
        return 0
    job = gateway.show_job(job_id)
    raw = job.raw if job is not None else {}
    try:
        return int(raw["NumTasks"]) // max(1, int(raw["NumNodes"].split("-")[0]))
    except (KeyError, ValueError):
        return 0


def elastic_again(job_id: str, slurm: Optional[SlurmConfig], gateway: SlurmGateway, per_node: int) -> None:
    """A requeued elastic job would wait for as many nodes (and tasks) as it last got: Slurm keeps the allocated
    count as the job's. Give it back ``slurm.nodes``'s range (with the spares), ``per_node`` tasks on each, so it
    starts on as few as MIN again, say without a dead node. Asked right after the requeue, while Slurm's SIGTERM lets
    this process finish; if that fails, the job waits for its last count, as before."""
    if slurm is None or not slurm.elastic:
        return
    low, high = slurm.min_nodes + slurm.spare_nodes, slurm.max_nodes + slurm.spare_nodes
    # Slurm's SIGTERM to the requeued step reaches every process of the step, scontrol too: blocked around the call
    # (a blocked signal stays blocked in the child), then this thread's mask as it was.
    before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        proc = gateway.update_job(job_id, NumNodes=f"{low}-{high}", NumTasks=low * per_node) if per_node else None
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)
    if proc is None or proc.returncode != 0:
        why = (proc.stderr.strip() or f"exit {proc.returncode}") if proc else "scontrol show job gave no task count"
        log.warning("job %s will wait for the node count it had: giving it back %d-%d nodes failed: %s", job_id,
                    low, high, why)  # fmt: skip


# Refusals no retry changes (``_job_requeue_op``): requeue disabled for the job or cluster, not the job's owner, not a
# batch job. A missing scontrol, or one that did not answer within NODE_TIMEOUT_S, is final too: a retry would spend
# the grace time. Anything else (a connection refused or a reply lost under load) is tried again, briefly.
_PERMANENT = ("presently disabled", "access", "permission", "only batch", "invalid job id")


def requeue(
    env: DistEnv,
    gateway: SlurmGateway = NODE_GATEWAY,
    tries: int = 3,
    pause_s: float = 1.0,
    slurm: Optional[SlurmConfig] = None,
) -> Optional[Refusal]:
    """Put this job back in the queue (same job id). Rank 0, or the batch script's watcher. None once Slurm accepted,
    else why not (scontrol's own words; ``missing``: no scontrol here). A failed call is retried ``tries`` times in
    all, ``pause_s`` apart, unless Slurm refused for good;
    before each retry the job's state is read back: a requeue whose reply was lost has already made it PENDING.
    ``slurm``: the run's request; an elastic one (``slurm.nodes`` MIN-MAX) gets its range back (``elastic_again``)."""
    if not env.slurm_job_id:
        log.warning("not running in a Slurm job: nothing to requeue; continue later with `ddpjob resume`")
        return Refusal("not running in a Slurm job")
    why, missing, per_node = "", False, tasks_per_node(env.slurm_job_id, slurm, gateway)
    for attempt in range(1, tries + 1):
        if attempt > 1:
            time.sleep(pause_s)
            job = gateway.show_job(env.slurm_job_id)
            if job is not None and back_in_queue(job, env.restart_count):
                log.info("job %s was requeued although scontrol said: %s", env.slurm_job_id, why)
                elastic_again(env.slurm_job_id, slurm, gateway, per_node)
                return None
        proc = gateway.requeue(env.slurm_job_id)
        if proc.returncode == 0:
            log.info("requeued job %s", env.slurm_job_id)
            elastic_again(env.slurm_job_id, slurm, gateway, per_node)
            return None
        why = proc.stderr.strip() or f"scontrol requeue exited {proc.returncode}"
        missing = proc.returncode == MISSING
        final = (
            attempt == tries
            or proc.returncode in (MISSING, TIMED_OUT)
            or any(word in why.lower() for word in _PERMANENT)
        )
        log.log(
            logging.ERROR if final and not missing else logging.WARNING,  # missing: the caller may defer it
            "scontrol requeue %s failed (try %d of %d): %s",
            env.slurm_job_id,
            attempt,
            tries,
            why,
        )
        if final:
            break
    return Refusal(why, missing)
