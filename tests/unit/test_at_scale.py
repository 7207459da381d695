"""bench/at_scale.py, the simulator of a long job's goodput: its arithmetic on tiny jobs whose failures are given,
worked out by hand (a step takes 1 s, a durable save 1 s every 10 steps, start-up 5 s, 100 s in all), and its runs
are the same for the same seed."""

from __future__ import annotations

import math
from typing import Iterator

import pytest

from bench.at_scale import TERMS, Costs, Failure, Policy, Scale, Simulation, simulate

TINY = Costs(step_s=1.0, every_steps=10, save_s=1.0, detect_s=1.0, startup_s=5.0, relaunch_s=2.0, queue_s=10.0)
REQUEUE, HERE = Policy("requeue"), Policy("in-allocation", in_allocation=True)


def failures(*at: tuple[float, bool]) -> Iterator[Failure]:
    """Failures after these exposed times (each since the one before), then none."""
    yield from (Failure(after, lost) for after, lost in at)
    while True:
        yield Failure(math.inf, False)


def run(policy: Policy, *at: tuple[float, bool], costs: Costs = TINY, nodes: int = 1):
    out = Simulation(costs, policy, nodes, 100.0, failures(*at)).run()
    assert sum(out.seconds.values()) == pytest.approx(100.0)  # every second in one term
    assert sum(out.share(t) for t in (*TERMS, "spares")) == pytest.approx(1.0)
    return out


def seconds(out) -> dict[str, float]:
    return {k: round(v, 9) for k, v in out.seconds.items()}


def test_no_failure():
    # 5 s start-up; 8 periods of 10 steps and a save (88 s); 7 steps of the ninth.
    out = run(REQUEUE)
    assert seconds(out) == {"training": 87.0, "checkpoint": 8.0, "retrained": 0.0, "startup": 5.0, "restarts": 0.0,
                            "queue": 0.0}  # fmt: skip
    assert out.goodput == 0.87 and (out.failures, out.requeues, out.restarts) == (0, 0, 0)


def test_a_failure_requeued():
    # At 30 s of exposure: start-up 5, two periods (22, step 20 saved), 3 s into step 21: those 3 s are lost. Then
    # detection 1, the queue 10 (not exposed), start-up 5: 46 s; 4 periods (44) and 10 s of steps to the end.
    out = run(REQUEUE, (30.0, False))
    assert seconds(out) == {"training": 20.0 + 40.0 + 10.0, "checkpoint": 2.0 + 4.0, "retrained": 3.0,
                            "startup": 10.0, "restarts": 1.0, "queue": 10.0}  # fmt: skip
    assert (out.failures, out.requeues, out.restarts) == (1, 1, 0)


def test_a_failure_restarted_in_the_allocation():
    # The same failure: detection and relaunch (1 + 2) and start-up 5, no queue: 38 s; 5 periods (55), 7 s of steps.
    out = run(HERE, (30.0, False))
    assert seconds(out) == {"training": 20.0 + 50.0 + 7.0, "checkpoint": 2.0 + 5.0, "retrained": 3.0,
                            "startup": 10.0, "restarts": 3.0, "queue": 0.0}  # fmt: skip
    assert (out.requeues, out.restarts) == (0, 1)


def test_a_lost_node_needs_a_spare_else_the_queue():
    # Without a spare, in-allocation restart cannot replace the dead node: the job is requeued, as today.
    assert seconds(run(HERE, (30.0, True))) == seconds(run(REQUEUE, (30.0, True)))
    # With one, a 4-node job restarts in place: the same seconds as a restart, and the spare's idle node-time costs.
    out = run(Policy("spare", in_allocation=True, spares=1), (30.0, True), nodes=4)
    assert seconds(out) == seconds(run(HERE, (30.0, False), nodes=4)) and (out.requeues, out.restarts) == (0, 1)
    assert out.goodput == pytest.approx(4 * 77.0 / (5 * 100.0)) and out.share("spares") == pytest.approx(0.2)
    # The spare is used up: the next lost node goes through the queue, and the requeue brings a spare again.
    out = run(Policy("spare", in_allocation=True, spares=1), (30.0, True), (20.0, True), (20.0, True))
    assert (out.failures, out.requeues, out.restarts) == (3, 1, 2)


def test_the_restart_budget_is_per_attempt():
    out = run(Policy("once", in_allocation=True, max_restarts=1), (20.0, False), (20.0, False), (20.0, False))
    assert (out.failures, out.requeues, out.restarts) == (3, 1, 2)  # restart, requeue (spent), restart (a new attempt)


def test_the_node_local_tier_is_restored_in_the_allocation_only():
    # A local copy every 5 steps (0.5 s), a durable one every 10. At 35.5 s of exposure: start-up 5, two periods of
    # 11.5 s (step 20, durable), steps 21-25 and the local save (5.5 s), 2 s into step 26.
    tiered = Costs(**(vars(TINY) | {"local_every_steps": 5, "local_save_s": 0.5}))
    assert run(HERE, (35.5, False), costs=tiered).seconds["retrained"] == pytest.approx(2.0)  # from step 25's copy
    assert run(REQUEUE, (35.5, False), costs=tiered).seconds["retrained"] == pytest.approx(5.0 + 2.0)  # step 20's
    # A lost node's copy survives on its peer: a spare restarts from it too.
    spare = Policy("spare", in_allocation=True, spares=1)
    assert run(spare, (35.5, True), costs=tiered).seconds["retrained"] == pytest.approx(2.0)


def test_a_failure_during_start_up():
    # 2 s into the first start-up: nothing trained is lost; requeued, the start-up runs again (2 + 5 s).
    out = run(REQUEUE, (2.0, False))
    assert out.seconds["startup"] == 7.0 and out.seconds["retrained"] == 0.0 and out.seconds["queue"] == 10.0


def test_without_checkpoints_a_failure_loses_everything():
    out = run(REQUEUE, (30.0, False), costs=Costs(**(vars(TINY) | {"every_steps": 0})))
    assert out.seconds["retrained"] == 25.0 and out.seconds["checkpoint"] == 0.0


def test_seeded_runs_are_the_same():
    scale = Scale(nodes=50, days=2.0, interruptions=400, over_gpus=400)  # ~15 failures in the 2 days
    first = simulate(TINY, HERE, scale, runs=3, seed=1)
    assert first.failures > 5 and 0 < first.goodput < 1
    assert seconds(simulate(TINY, HERE, scale, runs=3, seed=1)) == seconds(first)
    assert seconds(simulate(TINY, HERE, scale, runs=3, seed=2)) != seconds(first)
