"""The deadline stop: a run saves and requeues before its job's time limit by itself, with or without Slurm's warning
signal, whichever comes first.

Slurm's warning (``slurm.signal``, ``slurm.signal_lead_s`` before the limit) may never come: a site whose jobs may not
ask for one (``slurm.signal: none``), a container setup it does not reach, a save that takes longer than the lead. At
the limit itself Slurm sends SIGTERM and ends the job TIMEOUT: too late to requeue it.

**The trainer** (``Deadline``, armed by rank 0 at the start of training) knows the job's end (``end_time``:
``SLURM_JOB_END_TIME`` in the task's environment, Slurm 23.02 and later; else ``scontrol show job``'s EndTime), its
own pace and what a synchronous save costs (``checkpoint.manager``). At each exchange of the stop flag
(``preemption.StopFlag.agree``) rank 0 asks ``due``: if it did not flag a stop now, the earliest it could stop is
after the steps until the exchange after next; once those steps, a save and ``slurm.deadline_margin_s`` would reach
the end, it records the warning signal as if it had come. The exchange carries it to every rank (a MAX all-reduce:
rank 0's clock decides), they all stop after the same step, checkpoint synchronously, and rank 0 requeues the job as
a timeout (``slurm.max_timeouts``). An attempt that cannot finish its first step before the limit never gets here:
Slurm ends it TIMEOUT, and nothing requeues it; an attempt with time for one step only stops after it, each
requeue counted against ``slurm.max_timeouts``.

**Script mode** (``warning_due``): ddpjob cannot see a user's steps, so rank 0 (a torchrun job: node 0's agent) sends
the configured warning signal itself at ``end - slurm.signal_lead_s`` when none came by then, and the script's own
handler takes it as it would take Slurm's; the ranks agree on it at their next optimizer step
(``ddp_core.script.deferred``, ``ddp_core.runtime``). With ``slurm.signal: none`` nothing is sent: the script runs
into the limit.

Torch-free.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from datetime import datetime
from typing import Callable, Mapping, Optional

from ddp_core.cluster.env import DistEnv
from ddp_core.cluster.slurm import NODE_GATEWAY, JobInfo, SlurmGateway
from ddp_core.config.schema import SlurmConfig

log = logging.getLogger(__name__)

END_VAR = "SLURM_JOB_END_TIME"  # epoch seconds, set by Slurm 23.02 and later in every task's environment


def due(now: float, end: float, steps: int, step_s: float, save_s: float, margin_s: float) -> bool:
    """Whether a run that can stop ``steps`` steps of ``step_s`` from ``now`` at the earliest must stop now: the save
    (``save_s``) and the margin after those steps would reach ``end`` (seconds; ``now`` and ``end``: epoch)."""
    return now + steps * step_s + save_s + margin_s >= end


def job_end(job: Optional[JobInfo], env_end: Optional[str]) -> Optional[float]:
    """The job's scheduled end, epoch seconds: ``env_end`` (``SLURM_JOB_END_TIME``) where set, else ``job``'s EndTime
    (``scontrol show job``); None when unknown or unlimited."""
    if env_end is not None and env_end.isdigit() and int(env_end) > 0:
        return float(env_end)
    if job is None or job.end_time is None:
        return None
    try:
        return datetime.fromisoformat(job.end_time).timestamp()
    except ValueError:
        return None


def end_time(
    env: DistEnv, gateway: SlurmGateway = NODE_GATEWAY, environ: Mapping[str, str] = os.environ
) -> Optional[float]:
    """This Slurm job's end (epoch seconds): from the environment, else one ``scontrol show job``; None outside
    Slurm, without a time limit, or where neither says."""
    if not env.slurm_job_id:
        return None
    env_end = environ.get(END_VAR)
    return job_end(None if env_end else gateway.show_job(env.slurm_job_id), env_end)


class Deadline:
    """Rank 0's deadline for this attempt: ``check`` at each exchange of the stop flag. ``save_s``: what a synchronous
    save costs now (the checkpoint manager's measure); ``clock``: epoch seconds (a test's own)."""

    def __init__(
        self, end: float, margin_s: float, save_s: Callable[[], float], clock: Callable[[], float] = time.time
    ) -> None:
        self.end, self.margin_s, self.save_s, self.clock = end, margin_s, save_s, clock
        self.armed_at = time.perf_counter()  # the pace of the first steps, before the stop flag has measured one
        self.reached = False

    def check(self, steps: int, step_s: float) -> bool:
        """Whether to stop now: ``steps`` of ``step_s`` seconds until the earliest stop otherwise. Logs the figures
        once, when it is."""
        now, save_s = self.clock(), self.save_s()
        if self.reached or not due(now, self.end, steps, step_s, save_s, self.margin_s):
            return False
        self.reached = True
        log.info(
            "deadline stop: now + %d steps x %.3g s + save %.3g s + margin %g s (slurm.deadline_margin_s) reaches the "
            "job's end at %s (in %.1f s): every rank checkpoints and the job is requeued, as if the warning signal "
            "had come",
            steps,
            step_s,
            save_s,
            self.margin_s,
            time.strftime("%H:%M:%S", time.localtime(self.end)),
            self.end - now,
        )
        return True


def arm(
    slurm: SlurmConfig, env: DistEnv, save_s: Callable[[], float], gateway: SlurmGateway = NODE_GATEWAY
) -> Optional[Deadline]:
    """Rank 0 of the trainer, before its first step: this attempt's ``Deadline``; None outside Slurm or without a
    known end (the warning signal, if any, is then the only stop before the limit)."""
    end = end_time(env, gateway)
    if end is None:
        if env.slurm_job_id:
            log.info("no end time for job %s (no time limit, or scontrol did not say): no deadline stop", env.job_id)
        return None
    log.info(
        "the job ends at %s (in %.0f s): the ranks stop before it once the steps to the next stop check, a save and "
        "slurm.deadline_margin_s=%d no longer fit, whether or not a warning signal came",
        time.strftime("%H:%M:%S", time.localtime(end)),
        end - time.time(),
        slurm.deadline_margin_s,
    )
    return Deadline(end, slurm.deadline_margin_s, save_s)


def warning_due(slurm: SlurmConfig, env: DistEnv, gateway: SlurmGateway = NODE_GATEWAY) -> Optional[float]:
    """Script mode: when Slurm's warning signal is due (epoch seconds, ``end - slurm.signal_lead_s``); None without
    one (``slurm.signal: none``), outside Slurm, or without a known end."""
    if not slurm.sends_signal:
        return None
    end = end_time(env, gateway)
    return None if end is None else end - slurm.signal_lead_s


def at(when: float, act: Callable[[], None], name: str = "deadline") -> threading.Timer:
    """Call ``act`` once from a daemon thread at ``when`` (epoch seconds). Start it from a thread that holds the
    warning signal and SIGTERM (``cluster.signals``): the timer's thread inherits the mask, so the kernel never
    delivers either to it."""
    timer = threading.Timer(max(0.0, when - time.time()), act)
    timer.name, timer.daemon = name, True
    timer.start()
    return timer
