"""The lines under ``ddpjob status``'s table (jobs.runs.notes), and the state a run's own record gives a job Slurm
recorded FAILED: fabricated events and sacct output. (On real runs: tests/cluster/test_status_real_jobs.py and the
fault storms, tests/cluster/test_fault_storm.py.)"""

from __future__ import annotations

from jobs.runs import notes, status
from tests.support.fake_slurm import FakeSlurm
from tests.unit.jobs.runs.test_status import NOW, make_run


def test_status_names_the_bad_nodes_a_run_excluded_and_those_it_could_not_do_without():
    events = [
        {"event": "excluded", "host": "n3", "reason": "Slurm says State=DOWN*, after: killed by a signal (Killed)"},
        {"event": "not_excluded", "host": "n2", "reason": "Slurm says State=MIXED+DRAIN (Reason=ECC)"},
    ]
    assert notes.for_run("r", events, None) == [
        "excluded in r: n3 (Slurm says State=DOWN*, after: killed by a signal (Killed))",
        "bad but kept in r (too few nodes without it): n2 (Slurm says State=MIXED+DRAIN (Reason=ECC))",
    ]
    assert notes.for_run("r", [*events, {"event": "excluded", "host": "n2", "reason": "x"}], None)[1:] == []


def test_a_run_that_spent_a_budget_reads_budget_exhausted_with_the_reason_and_how_to_go_on(tmp_path):
    reason = "requeue budget exhausted after 1 preemption (slurm.max_preemptions=0)"
    killed = {"event": "failure", "kind": "infrastructure", "rank": 1, "host": "n2", "step": 12, "error": "killed"}
    events = [
        {"event": "start", "job_id": "100", "restart_count": 0, "step": 0, "world_size": 2},
        killed,
        {"event": "budget_exhausted", "job_id": "100", "step": 12, "reason": reason},
        {"event": "rank_failed", "job_id": "100", "rank": 1},  # a rank's own record after the decision
    ]
    run = make_run(tmp_path / "run", jobs=["100"], events=events)
    (row,) = status.collect([run], "eval/accuracy", runner=FakeSlurm(sacct="100|100|FAILED|15:0|t0|t1\n"))
    assert row.state(NOW) == "BUDGET_EXHAUSTED" and not row.active(NOW)
    said = notes.for_run("r", events, None)
    then = "infrastructure: not requeued: its budget is spent"
    assert said[0] == f"failure in r at step 12: rank 1 on n2: killed ({then})"
    assert said[1] == f"stopped in r at step 12: {reason}; `ddpjob resume` continues it, with budgets of its own"
    requeued = [*events[:2], {"event": "requeued", "job_id": "100"}, {"event": "start", "job_id": "100", "step": 10}]
    (row,) = status.collect(
        [make_run(tmp_path / "again", jobs=["100"], events=requeued)], "eval/accuracy",
        runner=FakeSlurm(sacct="100|100|REQUEUED|0:0|t0|t1\n100|100|FAILED|1:0|t2|t3\n"),
    )  # fmt: skip
    assert row.state(NOW) == "FAILED(1)"  # Slurm's own word where the run's record names no end
    assert [n for n in notes.for_run("r", requeued, None) if n.startswith("stopped")] == []


def test_a_memory_failure_says_whose_memory_where_and_the_fix_for_that_side():
    """Host memory (a limit's kill, with accounting's peak) told apart from a device's (a GPU's allocator)."""
    host = {"event": "failure", "kind": "memory", "rank": 3, "host": "n2", "step": 40,
            "error": "out of memory: a task's peak 1990 MiB of the job's 2G (slurm.mem_gb=2)"}  # fmt: skip
    device = host | {"step": None, "error": "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"}
    assert notes.for_run("r", [host], None) == [
        "out of host memory in r at step 40 on n2 (rank 3): a task's peak 1990 MiB of the job's 2G (slurm.mem_gb=2) "
        "(not retried: give it slurm.mem_gb=N)"
    ]
    assert notes.for_run("r", [device], None) == [
        "out of device memory in r before its first step on n2 (rank 3): OutOfMemoryError: CUDA out of memory. Tried "
        "to allocate 2.00 GiB (not retried: give it data.batch_size=auto (or smaller), or "
        "strategy.activation_checkpointing=true)"
    ]


def test_a_fitted_micro_batch_is_noted_with_each_halving_of_the_newest_attempt():
    first = {"event": "start", "step": 0, "micro_batch": 8, "grad_accum": 2, "probe_s": 0.5}
    shrunk = {"event": "micro_batch_shrunk", "step": 6, "micro_batch": 4, "error": "rank 1: can't allocate memory"}
    again = {"event": "start", "step": 10, "micro_batch": 16, "grad_accum": 1, "probe_s": 0.25}
    assert notes.memory_note("r", [first, shrunk]) == (
        "micro-batch in r: 8 x 2 a replica (data.batch_size=auto, probed in 0.50 s at step 0); halved to 4 at step 6, "
        "out of memory on rank 1: can't allocate memory"
    )
    assert notes.memory_note("r", [first, shrunk, again]) == (
        "micro-batch in r: 16 x 1 a replica (data.batch_size=auto, probed in 0.25 s at step 10)"
    )  # another attempt, on other hardware: probed anew
    assert notes.memory_note("r", [{"event": "start", "step": 0}]) is None  # a fixed micro-batch
    recomputed = {"event": "activations_recomputed", "step": 7, "micro_batch": 4, "error": "rank 0: can't allocate"}
    assert notes.memory_note("r", [first, shrunk, recomputed]).endswith(
        "; activations recomputed at step 7 on, out of memory on rank 0: can't allocate"
    )  # at the smallest micro-batch: the last resort
    kept = {**again, "micro_batch": 8, "grad_accum": 2, "shards": 2, "kept": True}  # train.invariant's later attempt
    assert notes.memory_note("r", [first, kept]) == (
        "micro-batch in r: 8 x 2 a replica (data.batch_size=auto, probed in 0.25 s at step 10, train.invariant's 2 "
        "shards, kept from the run's first probe)"
    )
    # fsdp: the attempt that ran out ended, and its successor's rank 0 records the shrink before its start.
    restarted = {**shrunk, "micro_batch": 4, "restarted": True}
    assert notes.memory_note("r", [first, restarted, {**again, "micro_batch": 4, "grad_accum": 4}]) == (
        "micro-batch in r: 4 x 4 a replica (data.batch_size=auto, probed in 0.25 s at step 10); halved to 4 at step 6, "
        "out of memory on rank 1: can't allocate memory"
    )


def test_activations_recomputed_under_invariant_are_noted_for_the_newest_attempt():
    start = {"event": "start", "step": 0, "grad_accum": 2}
    again = {"event": "activations_recomputed", "step": 3, "ranks": [1], "error": "rank 1: can't allocate memory"}
    said = "activations recomputed from step 3 in r, out of memory on rank 1: can't allocate memory"
    assert notes.memory_note("r", [start, again]) == said
    assert notes.memory_note("r", [start, again, {"event": "start", "step": 4}]) is None  # a new attempt: off again
