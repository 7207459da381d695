"""The preemption decision table (ddp_core.cluster.preemption.decide) row by row, from ``scontrol show job`` records in
the form Slurm 22.05 prints them at each kind of interruption (captured on the local cluster)."""

from __future__ import annotations

import signal
import subprocess

import pytest

from ddp_core.cluster.env import DistEnv
from ddp_core.cluster.preemption import Interruption, decide, requeue, time_left
from ddp_core.cluster.slurm import SlurmGateway

TERM, USR2 = signal.SIGTERM, signal.SIGUSR2
# The fields that differ, as captured during each interruption; the rest of a record is the same.
RUNNING = "JobState=RUNNING Reason=None Requeue=1 Restarts=0 EndTime=Unknown Partition=low QOS=normal"
RECORDS = {
    "partition preemption": RUNNING + " PreemptTime=2026-11-22T19:14:02",
    "scancel": "JobState=COMPLETING Reason=None Requeue=1 Restarts=0 EndTime=2026-11-22T19:16:13 Partition=local",
    "scontrol requeue": "JobState=COMPLETING Reason=None Requeue=1 Restarts=1 EndTime=Unknown Partition=local",
    "time limit": "JobState=RUNNING Reason=None Requeue=1 Restarts=0 EndTime=2026-11-22T19:17:21 Partition=local",
    "warned early": RUNNING,
}


def job(name: str):
    record = f"JobId=5 JobName=x {RECORDS[name]}"
    return SlurmGateway(lambda cmd: subprocess.CompletedProcess(cmd, 0, record, "")).show_job("5")


@pytest.mark.parametrize(
    ("signum", "record", "mode", "left", "kind", "requeue"),
    [
        (TERM, "partition preemption", "REQUEUE", None, Interruption.preemption, True),
        (USR2, "partition preemption", "REQUEUE", 1e6, Interruption.preemption, True),  # preempt_send_user_signal
        (TERM, "partition preemption", "CANCEL", None, Interruption.preemption, False),
        (TERM, "scancel", None, 0.0, Interruption.cancelled, False),
        (TERM, "scontrol requeue", None, None, Interruption.terminated, False),
        (TERM, "time limit", None, 0.4, Interruption.timeout, False),
        (USR2, "warned early", None, 3600.0, Interruption.preemption, True),
        (USR2, "warned early", None, 100.0, Interruption.timeout, True),
        (TERM, None, None, None, Interruption.terminated, False),  # no scontrol on the node
        (USR2, None, None, None, Interruption.timeout, True),
    ],
)  # fmt: skip
def test_each_row_of_the_table(signum, record, mode, left, kind, requeue):
    decision = decide(signum, USR2, job(record) if record else None, mode, 0, left, lead_s=120)
    assert (decision.kind, decision.requeue) == (kind, requeue)
    assert decision.ends_preempted == (mode == "CANCEL")


@pytest.mark.parametrize(
    ("answers", "state", "refused", "calls"),
    [
        ([(1, "Unable to contact slurm controller (connect failure)"), (0, "")], "RUNNING", None,
         ["requeue", "show", "requeue"]),
        ([(1, "Socket timed out on send/recv operation")], "PENDING", None, ["requeue", "show"]),  # reply lost
        ([(1, "Requested operation is presently disabled for job 5")], "RUNNING",
         "Requested operation is presently disabled for job 5", ["requeue"]),  # for good: no retry
        ([(124, "scontrol did not answer within 15 s")], "RUNNING", "scontrol did not answer within 15 s",
         ["requeue"]),  # the runner's timeout: a retry would spend the grace time
        ([(1, "Socket timed out on send/recv operation")] * 3, "RUNNING", "Socket timed out on send/recv operation",
         ["requeue", "show", "requeue", "show", "requeue"]),
        ([(127, "scontrol: command not found")], "RUNNING", "scontrol: command not found",
         ["requeue"]),  # a container image without Slurm's commands: the batch script requeues (exits.requeue_within)
    ],
)  # fmt: skip
def test_requeue_retries_what_can_pass_and_says_why_it_did_not(answers, state, refused, calls):
    """Rank 0's ``scontrol requeue``: a controller that did not answer is asked again (CI saw one refusal between a
    checkpoint and the exit); a reply lost after Slurm requeued reads back PENDING; a refusal for good is final."""
    made: list[str] = []
    left = list(answers)

    def runner(cmd):
        made.append(cmd[1])
        if cmd[1] == "show":
            return subprocess.CompletedProcess(cmd, 0, f"JobId=5 JobState={state} Requeue=1 Restarts=0", "")
        code, err = left.pop(0)
        return subprocess.CompletedProcess(cmd, code, "", err)

    env = DistEnv(job_id="5", slurm_job_id="5", source="slurm")
    refusal = requeue(env, SlurmGateway(runner), tries=3, pause_s=0)
    assert (refusal.why if refusal else None) == refused
    assert (refusal is not None and refusal.missing) == (answers[0][0] == 127)
    assert made == calls


def test_without_scontrol_the_time_left_comes_from_the_jobs_environment():
    """Inside an image without scontrol, SLURM_JOB_END_TIME tells a warning well before the limit (a preemption, as
    with scontrol) from one near it (a timeout)."""
    assert time_left(None, 1000.0, "4600") == 3600.0
    assert time_left(None, 1000.0, None) is None and time_left(None, 1000.0, "0") is None
    left = time_left(None, 1000.0, "4600")
    assert decide(USR2, USR2, None, None, 0, left, lead_s=120).kind is Interruption.preemption
