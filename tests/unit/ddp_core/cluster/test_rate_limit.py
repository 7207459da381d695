"""The back-off schedule (ddp_core/cluster/backoff.py) and the gateway's reading of a rate-limited answer
(ddp_core/cluster/slurm_text.py, slurm.py): the controller's own message text, as libslurm 24.11/26.05 spell it."""

from __future__ import annotations

import subprocess
from typing import Sequence

import pytest

from ddp_core.cluster import slurm, slurm_text
from ddp_core.cluster.backoff import Backoff

# What a client prints when slurmctld (SlurmctldParameters=rl_enable) refuses it: the two libslurm messages,
# after the client's own prefix (libslurm's errno table, strings of libslurmfull.so of 24.11.5 and 26.05.5).
BACKOFF = "slurm_load_jobs error: Rate limit exceeded, please retry momentarily"
HARD_DROP = "squeue: error: Rate limit exceeded, please retry later"


def answer(code: int, err: str = "", out: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.CompletedProcess(["squeue"], code, out, err)


def test_the_schedule_grows_to_its_ceiling_and_starts_again_on_reset():
    b = Backoff()
    assert [b.next() for _ in range(7)] == [2, 4, 8, 16, 30, 30, 30]
    b.reset()
    assert b.next() == 2
    b.slowest()
    assert [b.next(), b.next()] == [30, 30]
    assert [Backoff(first_s=10, max_s=30).next() for _ in range(1)] == [10]


def test_the_controllers_rate_limit_messages_are_try_again_later():
    assert slurm_text.rate_limited(answer(1, BACKOFF))
    assert slurm_text.rate_limited(answer(1, HARD_DROP + "\n"))
    assert not slurm_text.rate_limited(answer(0, "", "Rate limit exceeded, please retry later"))  # a job named so
    assert not slurm_text.rate_limited(answer(1, "slurm_load_jobs error: Invalid job id specified"))
    assert not slurm_text.rate_limited(answer(slurm_text.TIMED_OUT, "squeue did not answer within 60 s"))


class Limited:
    """A controller over its bucket for the first ``refusals`` calls, then answering."""

    def __init__(self, refusals: int, out: str) -> None:
        self.refusals, self.out, self.calls = refusals, out, 0

    def __call__(self, cmd: Sequence[str]) -> subprocess.CompletedProcess[str]:
        self.calls += 1
        if self.calls <= self.refusals:
            return subprocess.CompletedProcess(list(cmd), 1, "", BACKOFF + "\n")
        return subprocess.CompletedProcess(list(cmd), 0, self.out, "")


def test_the_gateway_asks_again_after_the_back_off_never_reading_a_refusal_as_no_jobs():
    slept: list[float] = []
    row = "5301|5301|PENDING|0|0|Priority|2026-12-02T10:00:00\n"
    gateway = slurm.SlurmGateway(Limited(2, row), sleep=slept.append)
    (job,) = gateway.queue_states(["5301"])
    assert (job.state, job.reason, job.start_time) == ("PENDING", "Priority", "2026-12-02T10:00:00")
    assert slept == [1.0, 2.0]  # the back-off's delays, from 1 s inside one call
    # Still refused after rate_limit_wait_s: one line that says "later", not an empty queue (the job "gone").
    stuck = slurm.SlurmGateway(Limited(99, row), rate_limit_wait_s=10, sleep=slept.append)
    refused = r"rate-limits your calls .*Rate limit exceeded, please retry momentarily"
    with pytest.raises(slurm.SlurmBusy, match=refused):
        stuck.squeue_ids(["5301"])
    # The trainer's calls never raise: a refused show_job is "cannot say" (None), as a controller that is down.
    assert slurm.SlurmGateway(Limited(99, ""), rate_limit_wait_s=0).show_job("5301") is None


def test_a_whole_configuration_whose_closing_ping_was_rate_limited_is_an_answer():
    """26.05, as a user whose jobs spent her RPC budget: ``scontrol show config`` prints the configuration, then its
    ping of the controllers is rate-limited (not retried): "... is DOWN" and exit 1. The answer counts."""
    config = "Configuration data as of 2026-12-02T14:16:49\nKillWait                = 10 sec\n\n"
    pinged = slurm.SlurmGateway(lambda cmd: answer(1, out=config + "Slurmctld(primary) at vm is DOWN\n"))
    assert (pinged.show_config(required=True) or {}).get("KillWait") == "10 sec"
    assert slurm_text.config_answer(answer(1, out="", err="slurm_load_ctl_conf error: Unable to contact")) is None
