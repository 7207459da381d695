"""Restarts inside the allocation (ddp_core.cluster.policy's ``Allocation``, the batch script's watcher
``cluster.supervise --in-allocation``): which failures restart where, what they spend, and what the watcher hands the
batch script's loop of job steps.

Slurm's answers come from a fabricated gateway (tests/support/policy.py); the jobs that
restart for real, on the local cluster, are in tests/cluster/test_restart_in_allocation.py.
"""

from __future__ import annotations

import subprocess

import pytest

from ddp_core.cluster import supervise
from ddp_core.cluster.env import DistEnv
from ddp_core.cluster.exits import ExitCode
from ddp_core.cluster.failures import Failure, Kind, attempt_events
from ddp_core.cluster.policy import Allocation, Outcome
from ddp_core.cluster.slurm import SlurmGateway
from ddp_core.run import private
from tests.support.policy import ENV, Slurm, decide, events, run_dir

TWO_OF_THREE = Allocation(live=("n1", "n2", "n3"), step_nodes=2, fewest=2, restarts=0)


def test_a_failure_restarts_in_the_allocation_without_spending_the_requeue_budget(tmp_path):
    run, slurm = run_dir(tmp_path, "slurm.max_failures=0"), Slurm()
    decision = decide(run, slurm, allocation=TWO_OF_THREE)
    assert (decision.outcome, decision.nodes) == (Outcome.RUN_AGAIN, ("n1", "n2"))
    assert events(run) == [("failure", "n2"), ("restarted", "infrastructure")] and slurm.asked() == []
    restarted = run.events()[-1]
    assert (restarted["launch"], restarted["count"], restarted["step"], restarted["nodes"]) == (1, 1, 40, ["n1", "n2"])
    # Its budget spent, the next failure (on another node: nothing excluded) goes through the queue, and the one the
    # restart took did not count against slurm.max_failures=0: the requeue is this failure's, the first of the budget.
    spent = Allocation(TWO_OF_THREE.live, 2, 2, restarts=3)
    other = Failure(Kind.infrastructure, 0, "n1", 45, "killed by a signal (Killed)")
    decision = decide(run, slurm, other, allocation=spent)
    assert (decision.outcome, decision.code) == (Outcome.STOPPED, ExitCode.BUDGET_SPENT)
    assert "after 1 failure (slurm.max_failures=0)" in run.events()[-1]["reason"]


def test_max_restarts_zero_always_requeues(tmp_path):
    run, slurm = run_dir(tmp_path, "slurm.max_restarts=0"), Slurm()
    assert decide(run, slurm, allocation=TWO_OF_THREE).outcome is Outcome.REQUEUED
    assert slurm.asked() == [("scontrol", "requeue", "57")]


def test_a_dead_node_is_replaced_by_a_spare_and_a_drained_node_by_another(tmp_path):
    run, slurm = run_dir(tmp_path, "slurm.spare_nodes=1"), Slurm()
    lost_n2 = Allocation(live=("n1", "n3"), step_nodes=2, fewest=2, restarts=0)
    assert decide(run, slurm, allocation=lost_n2).nodes == ("n1", "n3")
    # n2, drained by Slurm, is excluded at its rank's failure: the step runs on the live nodes the run does not exclude.
    run2, slurm2 = run_dir(tmp_path / "2", "slurm.spare_nodes=1"), Slurm(states={"n2": "MIXED+DRAIN"})
    decision = decide(run2, slurm2, allocation=TWO_OF_THREE)
    assert (decision.outcome, decision.nodes) == (Outcome.RUN_AGAIN, ("n1", "n3"))
    assert events(run2)[-3:] == [("failure", "n2"), ("excluded", "n2"), ("restarted", "infrastructure")]
    assert slurm2.asked() == []


def test_without_a_spare_a_lost_node_requeues_unless_the_job_is_elastic(tmp_path):
    fixed = Allocation(live=("n1",), step_nodes=2, fewest=2, restarts=0)
    run, slurm = run_dir(tmp_path), Slurm()
    assert decide(run, slurm, allocation=fixed).outcome is Outcome.REQUEUED
    # slurm.nodes=1-2: the job goes on with the one node left (the trainer keeps the global batch).
    elastic = Allocation(live=("n1",), step_nodes=2, fewest=1, restarts=0)
    run2, slurm2 = run_dir(tmp_path / "2", "slurm.nodes=1-2"), Slurm()
    assert decide(run2, slurm2, allocation=elastic).nodes == ("n1",) and slurm2.asked() == []


def test_a_user_error_is_never_restarted(tmp_path):
    run, slurm = run_dir(tmp_path), Slurm()
    bad = Failure(Kind.user, 1, "n2", 40, "ValueError: bad batch")
    assert decide(run, slurm, bad, allocation=TWO_OF_THREE).outcome is Outcome.FAILED
    assert [e for e, _ in events(run)] == ["failure", "failed"]


class Allocated(Slurm):
    """The fabricated cluster, with n2 down."""

    def answer(self, cmd: tuple[str, ...]) -> subprocess.CompletedProcess[str]:
        if cmd[:3] == ("scontrol", "show", "node"):
            self.calls.append(tuple(cmd))
            state = "DOWN+NOT_RESPONDING" if cmd[-1] == "n2" else "ALLOCATED"
            return subprocess.CompletedProcess(cmd, 0, f"NodeName={cmd[-1]} State={state}\n", "")
        return super().answer(cmd)


@pytest.fixture
def batch(monkeypatch):
    """The batch script's environment: a 3-node allocation, 1 task per node."""
    for name, value in {"SLURM_JOB_NODELIST": "n[1-3]", "SLURM_NTASKS_PER_NODE": "1"}.items():
        monkeypatch.setenv(name, value)


def test_the_watcher_hands_the_loop_the_next_steps_nodes(tmp_path, batch, capsys):
    """srun's report says only that the step ended; n2 is down: the failure is n2's, and the next step runs on n1 and
    the spare n3 (the options the batch script's loop puts before srun's own)."""
    run, slurm = run_dir(tmp_path, "slurm.nodes=2", "slurm.spare_nodes=1", "slurm.tasks_per_node=1"), Allocated()
    log = tmp_path / "batch.err"
    log.write_text("ddpjob: attempt 0 of job 57 started on n1\nsrun: error: Node failure on n2\n")
    env = DistEnv(job_id="57", slurm_job_id="57")
    code = supervise.decide(run, log, 1, env, SlurmGateway(slurm.answer), in_allocation=True)
    assert code == ExitCode.RESTART
    assert capsys.readouterr().out.split() == ["--nodes=2", "--ntasks=2", "--nodelist=n1,n3", "--overlap", "--mem=0"]
    [failure] = [e for e in run.events() if e["event"] == "failure"]
    assert (failure["kind"], failure["host"]) == ("infrastructure", "n2") and "n2 stopped responding" in failure[
        "error"
    ]
    # Without --in-allocation (the EXIT trap's call: no loop to run another step) the job is requeued.
    run2 = run_dir(tmp_path / "2", "slurm.nodes=2", "slurm.spare_nodes=1")
    assert supervise.decide(run2, log, 1, env, SlurmGateway(slurm.answer)) == ExitCode.OK
    assert ("scontrol", "requeue", "57") in slurm.calls


def test_the_next_step_numbers_its_own_events(tmp_path):
    """A restarted step's ``rank_failed`` events are its own: the watcher of step 1 does not read step 0's."""
    old = {"event": "rank_failed", "job_id": "57", "restart_count": 0, "launch": 0, "kind": "user"}
    new = {"event": "rank_failed", "job_id": "57", "restart_count": 0, "launch": 1, "kind": "infrastructure"}
    assert attempt_events([old, new], DistEnv(job_id="57", launch=1)) == [new]


def test_a_job_that_ends_for_good_removes_its_node_local_copies_on_its_live_nodes(tmp_path, batch):
    """A spent budget ends the job: the watcher removes LOCAL_PATH/ddpjob-USER-JOB on each node still up (one srun task
    per node, beside the ended step); with no node-local tier it asks nothing."""
    run = run_dir(tmp_path, "slurm.max_restarts=0", "slurm.max_failures=0", "checkpoint.local_every_steps=2",
                  "checkpoint.local_path=/dev/shm/")  # fmt: skip
    slurm = Allocated()
    log = tmp_path / "batch.err"
    log.write_text("ddpjob: attempt 0 of job 57 started on n1\nsrun: error: n1: task 1: Killed\n")
    env = DistEnv(job_id="57", slurm_job_id="57")
    assert supervise.decide(run, log, 137, env, SlurmGateway(slurm.answer), in_allocation=True) == 137
    removal = [c for c in slurm.calls if c[0] == "srun"]
    assert removal == [("srun", "--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--nodelist=n1,n3", "--overlap",
                        "--quiet", "rm", "-rf", "--", f"/dev/shm/ddpjob-{private.user_tag()}-57")]  # fmt: skip
    run2, slurm2 = run_dir(tmp_path / "2", "slurm.max_restarts=0", "slurm.max_failures=0"), Allocated()
    supervise.decide(run2, log, 137, env, SlurmGateway(slurm2.answer), in_allocation=True)
    assert not [c for c in slurm2.calls if c[0] == "srun"]


def test_a_step_srun_could_not_start_is_slurms_not_ready_and_runs_again_after_a_pause(tmp_path, monkeypatch):
    """Right after a slurmctld restart its nodes re-register, and srun cannot create the restart's step (the storm's
    seed 11: "Memory required by task is not available", twice in a second). No rank ran: an infrastructure failure,
    never "the same failure at the same step again" (a user error); the restart waits before each next step."""
    from ddp_core.cluster import policy
    from ddp_core.cluster.failures import NOT_STARTED, diagnose, srun_step_error, srun_task_ends

    lines = ["srun: error: Unable to create step for job 57: Memory required by task is not available"]
    failure = diagnose([], srun_task_ends(lines), 1, 40, srun_step_error(lines))
    assert (failure.kind, failure.rank, failure.host) == (Kind.infrastructure, None, None)
    assert failure.error == f"{NOT_STARTED}: Unable to create step for job 57: Memory required by task is not available"
    assert srun_step_error(["srun: error: n2: task 1: Killed"]) == ""
    slept: list[float] = []
    monkeypatch.setattr(policy.time, "sleep", slept.append)
    run, slurm = run_dir(tmp_path), Slurm()
    for restarts in (0, 1):
        allocation = Allocation(live=("n1", "n2"), step_nodes=2, fewest=2, restarts=restarts)
        assert decide(run, slurm, failure, allocation=allocation).nodes == ("n1", "n2")
    assert slept == [policy.STEP_RETRY_S, 2 * policy.STEP_RETRY_S]
    assert [e.get("kind") for e in run.events() if e["event"] == "failure"] == ["infrastructure"] * 2


def test_a_micro_batch_that_ran_out_under_fsdp_runs_again_in_the_allocation_outside_every_budget(tmp_path, monkeypatch):
    """A rank's ``RanOut`` (``data.batch_size=auto`` where the steps communicate) carries the micro-batch: the
    attempt runs again on the same nodes, whatever slurm.max_restarts says and without spending it; the attempt after
    it probes under half (``memory.below``). Without the micro-batch (a fixed one, or one) it is the run's end."""
    run, slurm = run_dir(tmp_path, "slurm.max_restarts=0", "slurm.max_failures=0"), Slurm()
    ran_out = Failure(Kind.memory, 1, "n2", 6, "RanOut: a micro-batch of 4 ran out at step 6", micro_batch=4)
    spent = Allocation(TWO_OF_THREE.live, 2, 2, restarts=0)
    decision = decide(run, slurm, ran_out, allocation=spent)
    assert (decision.outcome, decision.nodes) == (Outcome.RUN_AGAIN, ("n1", "n2")) and slurm.asked() == []
    assert events(run) == [("failure", "n2"), ("restarted", "memory")]
    assert run.events()[0]["micro_batch"] == 4
    monkeypatch.setenv("SLURM_JOB_NODELIST", "n[1-3]")  # the batch script's environment
    assert supervise.this_allocation(ENV, slurm.gateway, run.load_config().slurm, run.events()).restarts == 0
    # A search's trial step (no allocation of its own, can run again there): the same.
    assert decide(run, slurm, ran_out, can_run_again=True).outcome is Outcome.RUN_AGAIN
    # Neither: the end, as for any memory failure.
    assert decide(run, slurm, ran_out).outcome is Outcome.FAILED
    at_one = Failure(Kind.memory, 1, "n2", 6, "OutOfMemory: a micro-batch of 1 does not fit at step 6")
    assert decide(run, slurm, at_one, allocation=spent).outcome is Outcome.FAILED
