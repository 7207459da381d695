"""The after-failure policy (ddp_core.cluster.policy) that the batch script's watcher, the node-loss check and a search
worker's trial step share: its decision table, and the search step that once kept a copy of its own (no room check,
earlier failures of every job counted).

Slurm's answers come from a fabricated gateway (SlurmGateway's runner): what is decided, recorded and asked of Slurm
for each row. The jobs that fail for real, on the local cluster, are in tests/cluster/test_slurm_jobs.py,
tests/cluster/test_node_exclusion.py and tests/cluster/test_sweep_exclusion.py.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ddp_core.cluster.exits import ExitCode
from ddp_core.cluster.failures import Failure, Kind
from ddp_core.cluster.policy import Outcome
from ddp_core.run.rundir import RunDir
from ddp_core.search import step
from tests.support.fuzz import fuzz
from tests.support.helpers import ROOT
from tests.support.policy import Slurm, decide, events, failure_event, run_dir


def test_a_user_error_fails_wherever_it_happens(tmp_path):
    run, slurm = run_dir(tmp_path), Slurm()
    bad = Failure(Kind.user, 1, "n2", 40, "ValueError: bad batch")
    for can_run_again in (False, True):
        decision = decide(run, slurm, bad, can_run_again=can_run_again, here={"n1", "n2"})
        assert (decision.outcome, decision.code) == (Outcome.FAILED, ExitCode.FAILED)
    assert events(run) == [("failure", "n2"), ("failed", None)] * 2
    assert run.events()[-1]["reason"] == "rank 1 on n2 failed at step 40: ValueError: bad batch"
    assert slurm.asked() == []


def test_a_task_over_its_memory_limit_fails_the_job_naming_its_peak_and_excludes_nothing(tmp_path):
    """Out of memory is a row of the table: srun's ``task 0: Out Of Memory`` (the cgroup's OOM handler) diagnoses
    it before the peers' broken connections; the same request runs out again on any node, so neither a restart nor
    a requeue, no node excluded, no budget spent; the reason names the step's peak and the limit."""
    from ddp_core.cluster.failures import diagnose, spent, srun_task_ends

    ends = srun_task_ends(["srun: error: n1: task 0: Out Of Memory", "srun: error: n1: task 1: Terminated"])
    peers = [{"event": "rank_failed", "rank": 1, "kind": "infrastructure", "error": "DistNetworkError: reset", "t": 1}]
    oom = diagnose(peers, ends, 1, None)
    assert (oom.kind, oom.rank, oom.host) == (Kind.memory, 0, "n1")
    assert spent(oom, [failure_event("57", "n1", "memory")]) == 1  # an earlier memory failure spends nothing
    run, slurm = run_dir(tmp_path, "slurm.mem_gb=0.3"), Slurm()
    for can_run_again in (False, True):
        decision = decide(run, slurm, oom, can_run_again=can_run_again, here={"n1", "n2"})
        assert (decision.outcome, decision.code) == (Outcome.FAILED, ExitCode.FAILED)
    assert events(run) == [("failure", "n1"), ("failed", None)] * 2 and slurm.asked() == []
    assert run.events()[-1]["reason"] == (
        "out of host memory on n1 (rank 0) before its first step: "
        "a task's peak 150 MiB of the job's 308M (slurm.mem_gb=0.3)"
    )


def test_the_watcher_requeues_where_a_step_runs_again(tmp_path):
    """The same first failure: the watcher's attempt is over (requeued); a caller that can run again does, here."""
    run, slurm = run_dir(tmp_path), Slurm()
    assert decide(run, slurm).outcome is Outcome.REQUEUED
    assert slurm.asked() == [("scontrol", "requeue", "57")]  # nothing excluded: no ExcNodeList
    run2, slurm2 = run_dir(tmp_path / "2"), Slurm()
    assert decide(run2, slurm2, can_run_again=True, here={"n1", "n2"}).outcome is Outcome.RUN_AGAIN
    assert events(run2) == [("failure", "n2")] and slurm2.asked() == []


def test_a_failure_on_a_node_slurm_drained_requeues_the_job_off_it_and_keeps_the_array_off(tmp_path):
    run, slurm = run_dir(tmp_path), Slurm(states={"n2": "MIXED+DRAIN"})
    decision = decide(run, slurm, can_run_again=True, here={"n1", "n2"}, array_job_id="50")
    assert decision.outcome is Outcome.REQUEUED
    assert events(run)[-3:] == [("failure", "n2"), ("excluded", "n2"), ("requeued", "failure")]
    assert run.events()[-2]["reason"].startswith("Slurm says State=MIXED+DRAIN (Reason=bad DIMM")
    assert slurm.asked() == [("scontrol", "requeue", "57"), ("scontrol", "update", "JobId=57", "ExcNodeList=n2"),
                             ("scontrol", "update", "JobId=50", "ExcNodeList=n2")]  # fmt: skip
    # The node-loss check's case: the failed node is not this attempt's, which runs (the exclusion is kept).
    run2, slurm2 = run_dir(tmp_path / "2"), Slurm(states={"n2": "DOWN*"})
    assert decide(run2, slurm2, can_run_again=True, here={"n1", "n3"}).outcome is Outcome.RUN_AGAIN
    assert events(run2)[-2:] == [("failure", "n2"), ("excluded", "n2")] and slurm2.asked() == []


def test_kills_of_a_rank_on_a_healthy_node_exclude_nothing_however_many(tmp_path):
    """The storm's case: rank 1 on n2 killed again and again; Slurm says n2 is fine, so each failure runs again here
    (or requeues the job, once the attempt is over), within the budget, on the same nodes."""
    run, slurm = run_dir(tmp_path, "slurm.max_failures=30"), Slurm("n[1-2]")
    for _ in range(4):
        assert decide(run, slurm, can_run_again=True, here={"n1", "n2"}).outcome is Outcome.RUN_AGAIN
    assert decide(run, slurm).outcome is Outcome.REQUEUED
    assert events(run) == [("failure", "n2")] * 5 + [("requeued", "failure")]
    assert slurm.asked() == [("scontrol", "requeue", "57")]


@pytest.mark.parametrize("can_run_again", [False, True])
def test_a_bad_node_the_job_cannot_do_without_is_not_excluded_and_the_job_goes_on(tmp_path, can_run_again):
    """Excluding drained n2 would leave the 2-node job's partition n[1-2] one node: it is not excluded (Slurm places
    nothing new on a drained node, so a requeued job waits for one), and the job goes on within its budget."""
    run, slurm = run_dir(tmp_path, "slurm.nodes=2"), Slurm("n[1-2]", states={"n2": "MIXED+DRAIN"})
    decision = decide(run, slurm, can_run_again=can_run_again, here={"n1", "n2"})
    assert decision.outcome is (Outcome.RUN_AGAIN if can_run_again else Outcome.REQUEUED)
    assert events(run)[:2] == [("failure", "n2"), ("not_excluded", "n2")]
    assert "failed" not in [e["event"] for e in run.events()]
    assert slurm.asked() == ([] if can_run_again else [("scontrol", "requeue", "57")])  # no ExcNodeList


def test_the_budget_counts_this_jobs_failures_only(tmp_path):
    run, slurm = run_dir(tmp_path, "slurm.max_failures=1"), Slurm()
    run.log_event("failure", **failure_event("50", "n3"))  # another job's (an earlier submission, another worker)
    assert decide(run, slurm, can_run_again=True, here={"n1", "n2"}).outcome is Outcome.RUN_AGAIN
    decision = decide(run, slurm, can_run_again=True, here={"n1", "n2"})  # this job's second: over the budget
    assert (decision.outcome, decision.code) == (Outcome.STOPPED, ExitCode.BUDGET_SPENT)
    assert "after 2 failures (slurm.max_failures=1)" in run.events()[-1]["reason"]
    assert slurm.asked() == []


# A trial's step: srun's report of a rank killed on n2 the first time, success the second.
STEP = "[ -e {mark} ] && exit 0; touch {mark}; echo 'srun: error: n2: task 1: Killed' >&2; exit 137"


@pytest.fixture
def worker(monkeypatch):
    for name, value in {"SLURM_JOB_ID": "57", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_ARRAY_JOB_ID": "50"}.items():
        monkeypatch.setenv(name, value)
    for name in ("SLURM_RESTART_COUNT", "SLURM_PROCID", "TORCHELASTIC_RUN_ID", "RANK"):  # one process, the worker's
        monkeypatch.delenv(name, raising=False)


def run_step(run: RunDir, slurm: Slurm, tmp_path: Path) -> int:
    command = ["bash", "-c", STEP.format(mark=tmp_path / "failed-once")]
    return step.run(command, run, threading.Event(), slurm.gateway)


def test_a_trial_step_runs_again_within_its_workers_own_budget(tmp_path, worker):
    """The trial failed under another worker's job before: those failures spend that job's budget, not this one's.
    No restart budget (slurm.max_restarts=0): the step runs again within slurm.max_failures."""
    run, slurm = run_dir(tmp_path, "slurm.max_failures=1", "slurm.max_restarts=0"), Slurm()
    run.log_event("failure", **failure_event("49", "n3"))
    assert run_step(run, slurm, tmp_path) == 0  # ran again, and succeeded
    assert events(run)[-1] == ("failure", "n2") and slurm.asked() == []


def test_a_trial_step_runs_again_when_its_bad_node_cannot_be_excluded(tmp_path, worker):
    """Before the policy was shared, the step requeued its worker off n2 into a partition that could not hold it;
    then it failed the trial instead. Now the drained n2, which the 2-node partition cannot do without, is kept and
    the step runs again (and succeeds)."""
    run, slurm = run_dir(tmp_path, "slurm.nodes=2"), Slurm("n[1-2]", states={"n2": "IDLE+DRAIN"})
    assert run_step(run, slurm, tmp_path) == 0
    assert events(run)[-3:] == [("failure", "n2"), ("not_excluded", "n2"), ("restarted", "infrastructure")]
    assert slurm.asked() == []


def test_the_step_is_torch_free():
    code = "import sys, ddp_core.search.step, ddp_core.cluster.policy; assert 'torch' not in sys.modules"
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0


@fuzz(40)
@given(
    budgets=st.tuples(st.integers(0, 3), st.integers(0, 2)),
    storm=st.lists(
        st.tuples(st.sampled_from([Kind.infrastructure, Kind.health]), st.sampled_from(["n1", "n2"])),
        min_size=1,
        max_size=8,
    ),
)
def test_a_mixed_storm_of_failures_stops_exactly_when_a_budget_is_spent_and_says_which(
    tmp_path_factory, budgets, storm
):
    """Any sequence of killed ranks and failed health checks, on either node: each budget counts its own kind only,
    the run goes on while every budget has room, and the failure that takes one over it stops the run with that
    budget's key in the reason (issue 56: "a run that spends a budget ends with that reason, and only then")."""
    limits = {Kind.infrastructure: ("failures", budgets[0]), Kind.health: ("health_failures", budgets[1])}
    run = run_dir(tmp_path_factory.mktemp("storm"), *(f"slurm.max_{k}={v}" for k, v in limits.values()))
    slurm, counts = Slurm(), {Kind.infrastructure: 0, Kind.health: 0}
    for i, (kind, host) in enumerate(storm):
        counts[kind] += 1
        decision = decide(run, slurm, Failure(kind, 1, host, 10 * (i + 1), "x"), can_run_again=True, here={"n1", "n2"})
        key, limit = limits[kind]
        if counts[kind] <= limit:
            assert decision.outcome is not Outcome.STOPPED, (i, storm, run.events()[-1])
            continue
        assert (decision.outcome, decision.code) == (Outcome.STOPPED, ExitCode.BUDGET_SPENT), (i, storm)
        (spent,) = [e for e in run.events() if e["event"] == "budget_exhausted"]
        assert spent["reason"].endswith(f"(slurm.max_{key}={limit})"), spent
        return
    assert "budget_exhausted" not in [e["event"] for e in run.events()]
