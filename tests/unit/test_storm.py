"""The fault storm's harness without a cluster (tests/support/storm.py, tests/support/gated_tasks.py): a seed is one
schedule, each fault fits the run's setting, the gate count goes on across attempts, and what a fault must record is
held against what was recorded. (The storm itself: tests/cluster/test_fault_storm.py.)"""

from __future__ import annotations

import threading

import torch

from tests.support import storm, storm_budgets
from tests.support.gated_tasks import StormDigitsTask


def test_a_seed_is_one_schedule_whose_faults_fit_its_setting_and_land_while_it_trains():
    for seed in range(200):
        schedule = storm.plan(seed, 6)
        assert schedule == storm.plan(seed, 6)  # replayed exactly
        gates = [f.gate for f in schedule.faults]
        assert gates == sorted(set(gates)) and gates[-1] <= storm.STEPS - 2 * storm.EVERY, schedule.describe()
        assert all(schedule.setting in storm.KINDS[f.kind] for f in schedule.faults), schedule.describe()
        assert all(sum(f.kind == k for f in schedule.faults) <= 1 for k in storm.ONCE), schedule.describe()
        assert not any(f.then_controller and f.kind not in storm.REQUEUES for f in schedule.faults)
    drawn = {f.kind for seed in range(200) for f in storm.plan(seed, 6).faults}
    assert drawn == set(storm.KINDS)  # every kind comes up
    assert "DDPJOB_STORM_SEED=7" in storm.plan(7, 3).describe()


def test_the_gates_count_batches_across_attempts_and_wait_for_the_go(tmp_path):
    batch = (torch.zeros(2, 64), torch.zeros(2, dtype=torch.long))
    first = StormDigitsTask(gate_dir=str(tmp_path), gates=[3, 5], wait_s=30)
    for _ in range(3):
        first.split(batch)  # gate 0 not armed yet: the run goes past its count
    assert not (tmp_path / "at-0").exists()
    (tmp_path / "arm-0").touch()
    again = StormDigitsTask(gate_dir=str(tmp_path), gates=[3, 5], wait_s=30)  # the next attempt's task
    reached = threading.Thread(target=again.split, args=(batch,))
    reached.start()
    while not (tmp_path / "at-0").exists():
        assert reached.is_alive()
    assert reached.is_alive() and (tmp_path / "batches").read_text() == "4"  # the first armed batch, waiting
    (tmp_path / "go-0").touch()
    reached.join(30)
    assert not reached.is_alive()
    again.split(batch)  # count 5: gate 1's, not armed
    assert not (tmp_path / "at-1").exists()


def recorded(kind: str, *events: dict, rank: int = 1, host: str = "") -> storm.Recorded:
    return storm.Recorded(storm.Fault(0, kind, 5, rank), 0.0, 0, list(events), host)


def test_a_fault_must_record_its_kind_and_nothing_else():
    killed = {"event": "failure", "kind": "infrastructure", "rank": 1, "host": "n2"}
    assert storm.check_recorded(recorded("kill", killed)) == []
    assert storm.check_recorded(recorded("kill", {**killed, "kind": "unknown", "rank": None}))  # the bug
    assert storm.check_recorded(recorded("kill", killed, rank=0))  # attributed to the wrong rank
    assert storm.check_recorded(recorded("kill"))  # nothing recorded
    assert storm.check_recorded(recorded("kill_node", killed, host="n2")) == []
    assert storm.check_recorded(recorded("kill_node", killed, host="n3"))
    assert storm.check_recorded(recorded("controller", killed))  # a failure where none belongs
    assert storm.check_recorded(recorded("requeue", {"event": "interrupted", "kind": "terminated"})) == []
    assert storm.check_recorded(recorded("usr2", {"event": "interrupted", "kind": "timeout"}))
    assert storm.check_recorded(recorded("stall_long", {"event": "hang"})) == []
    assert storm.check_recorded(recorded("stall_long"))


def schedule_of(*kinds: str) -> storm.Schedule:
    return storm.Schedule(0, "low", tuple(storm.Fault(i, k, 5 + 4 * i, 1) for i, k in enumerate(kinds)))


def test_a_budget_is_spent_by_the_fault_that_takes_it_past_its_limit_and_only_by_it():
    tight = storm_budgets.Budgets(restarts=1, failures=1, preemptions=0, hangs=1)
    # A kill restarted in the allocation, one requeued (restarts spent), one restarted in the requeued attempt.
    assert storm_budgets.spending(schedule_of("kill", "kill", "kill"), tight) is None
    spent = storm_budgets.spending(schedule_of("kill", "kill", "kill", "kill"), tight)
    assert spent == storm_budgets.Spent(3, "failure", 2)
    assert spent.reason(tight) == "after 2 failures (slurm.max_failures=1)"
    assert storm_budgets.spending(schedule_of("stall_long", "kill", "usr2"), tight) == storm_budgets.Spent(
        2, "preemption", 1
    )
    assert storm_budgets.spending(schedule_of("stall_long", "stall_long"), tight) == storm_budgets.Spent(1, "hang", 2)
    for seed in range(100):  # each seed's schedule ends at its spending fault, with the budgets in its overrides
        schedule, budgets, spent = storm_budgets.draw(seed, 5)
        assert spent is None or spent.index == schedule.faults[-1].index, schedule.describe()
        given = storm_budgets.overrides(schedule, budgets)
        assert f"slurm.max_failures={budgets.failures}" in given and "slurm.max_failures=30" not in given
