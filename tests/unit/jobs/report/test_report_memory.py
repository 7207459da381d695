"""The run report's Memory section (``jobs.report.page``): what a run did about memory, from its events."""

from __future__ import annotations

import re
from pathlib import Path

from jobs.report import write_report
from tests.support.goodput import restarted_in_allocation, write_run


def test_single_run_report_says_the_micro_batch_its_probe_chose_and_each_halving(tmp_path: Path):
    """data.batch_size=auto: the newest attempt's probe (its start event) and what followed it."""
    events, rows = restarted_in_allocation()
    probed = {"micro_batch": 8, "grad_accum": 2, "probe_s": 0.4, "probed": [[16, False], [8, True]]}
    starts = [i for i, e in enumerate(events) if e["event"] == "start"]
    events[starts[-1]] |= probed
    shrunk = {"event": "micro_batch_shrunk", "t": events[-1]["t"], "step": 30, "was": 8, "micro_batch": 4,
              "grad_accum": 4, "ranks": [1], "error": "rank 1: DefaultCPUAllocator: can't allocate memory"}  # fmt: skip
    run = write_run(tmp_path / "run", [*events, shrunk], rows)
    page = write_report(run)[1].read_text()
    note = re.findall(r'<p class="memory">([^<]*)</p>', page)
    assert note == [f"micro-batch in run: 8 x 2 a replica (data.batch_size=auto, probed in 0.40 s at step "
                    f"{events[starts[-1]]['step']}); halved to 4 at step 30, out of memory on rank 1: "
                    "DefaultCPUAllocator: can&#x27;t allocate memory"]  # fmt: skip
    assert (
        "<h2>Memory</h2>" not in write_report(write_run(tmp_path / "fixed", *restarted_in_allocation()))[1].read_text()
    )


def test_single_run_report_says_when_an_invariant_run_began_recomputing_activations(tmp_path: Path):
    """train.invariant: the step an out-of-memory turned activation checkpointing on (trainer.redo)."""
    events, rows = restarted_in_allocation()
    again = {"event": "activations_recomputed", "t": events[-1]["t"], "step": 30, "ranks": [0],
             "error": "rank 0: DefaultCPUAllocator: can't allocate memory"}  # fmt: skip
    page = write_report(write_run(tmp_path / "run", [*events, again], rows))[1].read_text()
    assert re.findall(r'<p class="memory">([^<]*)</p>', page) == [
        "activations recomputed from step 30 in run, out of memory on rank 0: DefaultCPUAllocator: can&#x27;t allocate "
        "memory"
    ]
