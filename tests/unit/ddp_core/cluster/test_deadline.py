"""The deadline stop (ddp_core.cluster.deadline): its arithmetic, where the job's end comes from, and the ranks'
agreement on it through the stop flag, with the clock values given by the test (no timed waits). The job that stops
for it on the local cluster: tests/cluster/test_deadline.py."""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import pytest

from ddp_core.cluster import deadline
from ddp_core.cluster.deadline import Deadline, due, end_time, job_end, warning_due
from ddp_core.cluster.env import DistEnv
from ddp_core.cluster.exits import ExitCode, requeue_within
from ddp_core.cluster.preemption import Interruption, StopFlag, decide
from ddp_core.cluster.slurm import SlurmGateway
from ddp_core.config import SlurmConfig
from ddp_core.run.rundir import RunDir
from tests.support.helpers import ROOT

TERM, USR2 = signal.SIGTERM, signal.SIGUSR2
SLURM_ENV = DistEnv(job_id="57", slurm_job_id="57", source="slurm")


@pytest.mark.parametrize(
    ("now", "steps", "step_s", "save_s", "margin_s", "stop"),
    [
        (900.0, 2, 5.0, 20.0, 30.0, False),  # 900 + 10 + 20 + 30 = 960 < 1000
        (940.0, 2, 5.0, 20.0, 30.0, True),  # 1000: exactly at the end is too late
        (939.0, 2, 5.0, 20.0, 30.0, False),
        (939.0, 3, 5.0, 20.0, 30.0, True),  # one step more to the next chance to stop
        (969.0, 1, 0.0, 0.0, 30.0, False),  # nothing measured yet: the margin alone
        (1010.0, 1, 1.0, 0.0, 0.0, True),  # past the end already (an attempt that started too late): stop now
    ],
)  # fmt: skip
def test_due_when_the_steps_a_save_and_the_margin_reach_the_end(now, steps, step_s, save_s, margin_s, stop):
    assert due(now, 1000.0, steps, step_s, save_s, margin_s) is stop


def test_a_deadline_stops_once_and_logs_its_figures(caplog):
    clock = iter([900.0, 930.0, 945.0, 950.0])
    saves = iter([10.0, 10.0, 20.0, 20.0])
    d = Deadline(1000.0, 30, lambda: next(saves), clock=lambda: next(clock))
    with caplog.at_level(logging.INFO, logger="ddp_core.cluster.deadline"):
        assert [d.check(2, 2.5) for _ in range(4)] == [False, False, True, False]
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith("deadline stop: now + 2 steps x 2.5 s + save 20 s + margin 30 s (slurm.deadline_margin_s)")
    assert "(in 55.0 s)" in line and "as if the warning signal had come" in line


def test_the_end_comes_from_the_environment_else_from_scontrol():
    asked: list[tuple[str, ...]] = []

    def answer(cmd):
        asked.append(tuple(cmd))
        return subprocess.CompletedProcess(cmd, 0, "JobId=57 JobState=RUNNING EndTime=2026-11-28T04:54:15", "")

    gateway = SlurmGateway(answer)
    assert end_time(SLURM_ENV, gateway, {"SLURM_JOB_END_TIME": "1795841655"}) == 1795841655.0 and not asked
    assert end_time(SLURM_ENV, gateway, {}) == datetime.fromisoformat("2026-11-28T04:54:15").timestamp()
    assert asked == [("scontrol", "show", "job", "-o", "57")]  # Slurm 22.05 has no SLURM_JOB_END_TIME
    assert end_time(DistEnv(), gateway, {"SLURM_JOB_END_TIME": "1795841655"}) is None  # outside Slurm: none
    unknown = SlurmGateway(lambda cmd: subprocess.CompletedProcess(cmd, 0, "JobId=57 EndTime=Unknown", ""))
    assert end_time(SLURM_ENV, unknown, {}) is None  # no time limit
    assert job_end(None, "0") is None and job_end(None, None) is None


def test_script_mode_warns_signal_lead_s_before_the_end_only_with_a_signal(monkeypatch):
    monkeypatch.setenv("SLURM_JOB_END_TIME", "5000")
    assert warning_due(SlurmConfig(signal_lead_s=90), SLURM_ENV) == 4910.0
    assert warning_due(SlurmConfig(signal="none"), SLURM_ENV) is None  # nothing to send: the script runs into the limit
    assert warning_due(SlurmConfig(signal=None), SLURM_ENV) is None


def test_arm_only_inside_a_job_with_an_end(monkeypatch):
    monkeypatch.delenv("SLURM_JOB_END_TIME", raising=False)
    assert deadline.arm(SlurmConfig(), DistEnv(), lambda: 0.0) is None  # no Slurm job: nothing asked
    monkeypatch.setenv("SLURM_JOB_END_TIME", "5000")
    armed = deadline.arm(SlurmConfig(deadline_margin_s=12), SLURM_ENV, lambda: 0.0)
    assert armed is not None and (armed.end, armed.margin_s) == (5000.0, 12)


@pytest.mark.parametrize(
    ("signum", "preempted", "kind", "requeue"),
    [
        (USR2, False, Interruption.timeout, True),  # whatever the time left: rank 0 stopped for the time limit
        (USR2, True, Interruption.preemption, True),  # a preemption under way wins (its own budget)
        (TERM, False, Interruption.cancelled, False),  # SIGTERM since: Slurm's choice stands
    ],
)
def test_a_deadline_stop_is_a_timeout_that_requeues(signum, preempted, kind, requeue):
    fields = "JobId=5 JobState=RUNNING Requeue=1 Restarts=0 EndTime=2026-11-22T19:17:21"
    fields += " PreemptTime=2026-11-22T19:14:02" if preempted else ""
    job = SlurmGateway(lambda cmd: subprocess.CompletedProcess(cmd, 0, fields, "")).show_job("5")
    decision = decide(signum, USR2, job, "REQUEUE" if preempted else None, 0, 3600.0, lead_s=120, deadline=True)
    assert (decision.kind, decision.requeue) == (kind, requeue)


def test_without_a_process_group_the_deadline_stops_at_the_next_call(monkeypatch):
    """One process (no group): each call is an exchange, the horizon one step, the stop at once."""
    pytest.importorskip("torch")
    flag = StopFlag("USR2", 0.1, handlers=False)
    clock = iter([900.0, 950.0, 990.0])
    horizons: list[int] = []

    class Seen(Deadline):
        def check(self, steps: int, step_s: float) -> bool:
            horizons.append(steps)
            return super().check(steps, step_s)

    flag.deadline = Seen(1000.0, 10, lambda: 5.0, clock=lambda: next(clock))
    assert [flag.agree() for _ in range(3)] == [0, 0, USR2]  # 990 + 5 + 10 >= 1000
    assert flag.by_deadline and horizons == [1, 1, 1]
    flag.record(TERM)  # a SIGTERM after it still wins, as for a signal
    assert flag.received == TERM


def test_rank_0s_deadline_stops_every_rank_after_the_same_step():
    """Two ranks over gloo, an exchange after every step: rank 0's clock reads 1000, 1100, ... at its checks. End 2000,
    margin 50, save 200: its 9th check (1800) is the first that reaches the end (unless a step took 25 s: the steps'
    own time is real); the exchange started there is read at the next call, on both ranks alike. The horizon is two
    steps: the next exchange's, and the one after it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SUBMITIT_"))}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         str(ROOT / "tests" / "support" / "deadline_ranks.py"), "2000", "50", "200"],
        capture_output=True, text=True, timeout=180, env=env | {"OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = dict(re.findall(r"^rank (\d) (stops .*)$", proc.stdout, re.M))
    assert lines == {
        "0": f"stops at call 10 on {int(USR2)} by_deadline True steps [2]",
        "1": f"stops at call 10 on {int(USR2)} by_deadline False steps []",
    }, proc.stdout + proc.stderr
    assert "deadline stop: now + 2 steps" in proc.stderr


def test_dead_time_requeues_within_max_timeouts_only(tmp_path):
    """A job whose attempts have time for a step or two each: every deadline stop is a timeout (``after_stop`` counts
    this job's), and past ``slurm.max_timeouts`` the job ends instead of requeueing again."""
    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    asked: list[tuple[str, ...]] = []
    gateway = SlurmGateway(lambda cmd: asked.append(tuple(cmd)) or subprocess.CompletedProcess(cmd, 0, "", ""))
    codes = []
    for spent in (1, 2, 3):
        run.log_event("interrupted", kind="timeout", job_id="57", step=spent)
        codes.append(requeue_within(run, SLURM_ENV, "timeout", spent, 2, spent, "its checkpoint", gateway=gateway))
    assert codes == [ExitCode.REQUEUED, ExitCode.REQUEUED, ExitCode.BUDGET_SPENT]
    assert asked == [("scontrol", "requeue", "57")] * 2
    assert run.events()[-1]["reason"] == "requeue budget exhausted after 3 timeouts (slurm.max_timeouts=2)"


def test_the_save_cost_falls_back_to_what_earlier_attempts_recorded(tmp_path):
    from ddp_core.checkpoint.manager import recorded_save_cost

    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    assert recorded_save_cost(run) == 0.0  # no metrics yet
    lines = ['{"step": 10, "time": 1.0, "split": "checkpoint", "save_s": 9.0}',
             '{"step": 10, "time": 1.0, "split": "train", "loss": 2.0}',
             '{"step": 20, "time": 2.0, "split": "checkpoint", "save_s": 0.1, "write_s": 2.5}',
             '{"step": 30, "time": 3.0, "split": "checkpoint", "save_s": 1.5}',
             '{"step": 40, "time": 4.0, "split": "checkpoint", "save_s": 0.2}']  # fmt: skip
    Path(run.metrics_file).write_text("\n".join(lines) + "\n")
    assert recorded_save_cost(run) == 2.5  # the longest of the three most recent
