"""A run's goodput (jobs.runs.goodput) on known cases: a real run requeued twice, a restart in the allocation, a run
resumed by a second job, a requeue Slurm made without an event. The expected figures are worked out by hand from the
records, term by term, and every case's terms sum to its total."""

from __future__ import annotations

import pytest

from ddp_core.run.rundir import RunDir
from jobs.runs import goodput, status
from tests.support.fake_slurm import FakeSlurm
from tests.support.goodput import (
    REQUEUED,
    REQUEUED_END,
    restarted_in_allocation,
    saved,
    start,
    train,
    write_run,
)

T0 = 1795842000.0  # the real run's times below are T0 + the figure written


def terms(g: goodput.Goodput) -> dict[str, float]:
    return {k: round(v, 6) for k, v in g.seconds.items()}


def test_a_real_run_requeued_twice():
    g = goodput.of_run(RunDir(REQUEUED), end=REQUEUED_END)
    assert g is not None
    assert (g.launches, g.requeues, g.restarts, g.retrained_steps) == (3, 2, 0, 19)
    # Each launch: its process start ("launched") -> its start event is start-up.
    startup = (222.162 - 219.872) + (259.34 - 257.07) + (321.838 - 317.228)
    # Each "requeued" -> the next launch's process start.
    queue = (257.07 - 250.158) + (317.228 - 310.147)
    # Launch 0 counts through its checkpoint of step 500 (the one launch 1 resumed from), launch 1 through step 1400's,
    # launch 2 through its last row before the end (step 1710); the checkpoint rows' save_s in them block.
    saves = [0.0088 + 0.0074 + 0.007 + 0.0065 + 0.0112, 0.0879, 0.0093 + 0.016 + 0.0104]
    spans = [249.672 - 222.162, 308.976 - 259.34, 339.469 - 321.838]
    # Failures at steps 503 and 1416 (the rank_failed events), resumed from 500 and 1400: 3 and 16 steps trained
    # again, at the median step time of the launch that trained them again (55.039 and 56.94 ms).
    retrained = 3 * 0.055039 + 16 * 0.05694
    # The rest of each failed launch, to its requeue.
    restarts = (250.158 - 249.672) + (310.147 - 308.976) - retrained
    expected = {
        "training": sum(spans) - sum(saves), "checkpoint": sum(saves), "retrained": retrained, "startup": startup,
        "restarts": restarts, "queue": queue, "other": (REQUEUED_END - T0) - 339.469,
    }  # fmt: skip
    assert terms(g) == pytest.approx(expected, abs=1e-3)
    assert g.total == pytest.approx(120.0)
    assert g.fraction == pytest.approx(expected["training"] / 120.0)


def test_a_restart_in_the_allocation():
    events, rows = restarted_in_allocation()
    g = goodput.measure(events, rows)
    assert g is not None
    assert (g.launches, g.requeues, g.restarts, g.retrained_steps) == (2, 0, 1, 14)
    # Launch 0: process start 1000, first step 1005; counts through its checkpoint of step 10 (1010.5, 0.5 s of it
    # blocked); reached step 24 (its rank_failed), launch 1 resumed from 10: 14 steps at launch 1's 0.4 s. Its end is
    # the restarted event (1020): the rest of 1010.5..1020 is the restart. Launch 1 begins there (not at its own
    # process start, 1021), trains from 1030 to its last row (1041, 1 s of it its final save), completes at 1042.
    assert terms(g) == pytest.approx({
        "training": 5.0 + 10.0, "checkpoint": 0.5 + 1.0, "retrained": 5.6, "startup": 5.0 + 10.0,
        "restarts": 9.5 - 5.6, "queue": 0.0, "other": 1.0,
    })  # fmt: skip
    assert g.total == pytest.approx(42.0)
    assert g.line() == (
        "goodput 35.7% of 42.0s (2 launches): checkpoint blocking 3.6%, steps trained again 13.3% (14 steps), "
        "start-up 35.7%, restarts 9.3% (1 in the allocation), other 2.4%"
    )


def test_a_run_resumed_by_another_job_leaves_the_gap_out():
    events = [
        start(2.0, 0, launched=0.0, job="A"),
        {"event": "failure", "t": 9.0, "job_id": "A", "kind": "infrastructure", "step": 8},
        {"event": "failed", "t": 9.5, "job_id": "A", "step": 8},
        {"event": "included", "t": 50.0, "host": "n1"},  # `ddpjob resume --include-node`: a person, not the run
        start(104.0, 5, launched=100.0, job="B"),
        {"event": "completed", "t": 109.0, "job_id": "B", "step": 10},
    ]
    rows = [train(5, 6.0, 800.0), saved(5, 6.5, 0.5), train(10, 108.0, 800.0)]
    g = goodput.measure(events, rows)
    assert g is not None and (g.launches, g.requeues, g.restarts, g.retrained_steps) == (2, 0, 0, 3)
    # Job A ends at its last decision (9.5); steps 6-8 are trained again by job B (0.8 s each), the rest of job A's
    # end is "other", as is job B's after its last row. 9.5 -> 100 is nobody's.
    assert terms(g) == pytest.approx({
        "training": 4.0 + 4.0, "checkpoint": 0.5, "retrained": 2.4, "startup": 2.0 + 4.0, "restarts": 0.0,
        "queue": 0.0, "other": 0.6 + 1.0,
    })  # fmt: skip
    assert g.total == pytest.approx(9.5 + 9.0)


def test_a_requeue_slurm_made_ends_at_the_launchs_last_record():
    # Preempted: the ranks saved step 10 and left (interrupted); Slurm requeued the job itself (no requeued event).
    events = [
        start(1.0, 0, launched=0.0),
        {"event": "interrupted", "t": 7.0, "job_id": "7", "kind": "preemption", "step": 10},
        start(22.0, 10, launched=20.0, restart_count=1),
    ]
    rows = [train(10, 5.0, 400.0), saved(10, 5.2, 0.2), train(20, 26.0, 400.0)]
    g = goodput.measure(events, rows)
    assert g is not None and (g.requeues, g.retrained_steps) == (1, 0)
    assert terms(g) == pytest.approx({
        "training": 4.0 + 4.0, "checkpoint": 0.2, "retrained": 0.0, "startup": 1.0 + 2.0, "restarts": 1.8,
        "queue": 13.0, "other": 0.0,
    })  # fmt: skip
    assert g.total == pytest.approx(26.0)


def test_nothing_to_measure_before_the_first_start():
    assert goodput.measure([], []) is None
    assert goodput.measure([{"event": "start", "job_id": "7", "step": 0}], []) is None  # no time: left out
    # A start without the process's start time: no start-up measured, and a run of no time yet.
    g = goodput.measure([start(5.0, 0, launched=None)], [])
    assert g is not None and g.total == 0.0 and g.fraction == 0.0
    assert g.line() == "goodput 0.0% of 0.0s (1 launch)"


def test_status_of_one_run_says_its_goodput(tmp_path):
    run = write_run(tmp_path / "run", *restarted_in_allocation())
    text, _ = status.status_text(str(run), "eval/accuracy", runner=FakeSlurm())
    assert text.splitlines()[-1] == goodput.measure(*restarted_in_allocation()).line()  # type: ignore[union-attr]
