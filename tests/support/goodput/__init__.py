"""Runs' records for the goodput tests (``jobs.runs.goodput``): a real run's, and small ones as ddpjob writes them.

``requeued/``: a real run, trimmed (the metrics rows keep step, time, split, loss, step_ms, save_s and write_s; the
errors are cut to 80 characters): ``bench/soak.py --minutes 2 --kill-every-s 60 --only requeue`` on the local
cluster, the digits job on 2 ranks with a checkpoint every 100 steps, rank 1 SIGKILLed at 30 s and 90 s; each kill was
requeued (``slurm.max_failures``) and the bench cancelled the job 120 s after the first launch began (``REQUEUED_END``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from tests.support.helpers import ROOT

REQUEUED = ROOT / "tests" / "support" / "goodput" / "requeued"
REQUEUED_END = 1795842219.872 + 120  # the first launch's process start (its start event's "launched"), + 2 minutes

Record = dict[str, Any]


def train(step: int, t: float, step_ms: float) -> Record:
    return {"step": step, "time": t, "split": "train", "loss": 1.0, "step_ms": step_ms}


def saved(step: int, t: float, save_s: float) -> Record:
    return {"step": step, "time": t, "split": "checkpoint", "save_s": save_s}


def start(
    t: float, step: int, launched: Optional[float], job: str = "7", restart_count: int = 0, launch: int = 0
) -> Record:
    """Rank 0's start event of a launch, as the trainer writes it."""
    return {"event": "start", "t": t, "job_id": job, "restart_count": restart_count, "launch": launch, "step": step,
            "world_size": 2, "nodes": 1, "launched": launched}  # fmt: skip


def restarted_in_allocation() -> tuple[list[Record], list[Record]]:
    """(events, metrics rows) of a run whose rank 1 was killed after step 24 and restarted in its allocation from the
    checkpoint of step 10, as the batch script's watcher records it (``failure``, then ``restarted``); the second
    launch completes at step 30. The rows past step 10 of the first launch are gone: the second launch's start
    rewound metrics.jsonl to its checkpoint."""
    events = [
        start(1005.0, 0, launched=1000.0),
        {"event": "rank_failed", "t": 1018.0, "job_id": "7", "restart_count": 0, "rank": 0, "step": 24},
        {"event": "failure", "t": 1019.0, "job_id": "7", "restart_count": 0, "kind": "infrastructure", "step": 20},
        {"event": "restarted", "t": 1020.0, "job_id": "7", "restart_count": 0, "launch": 1, "step": 20,
         "kind": "infrastructure", "count": 1, "nodes": ["n1"]},
        start(1030.0, 10, launched=1021.0, launch=1),
        {"event": "completed", "t": 1042.0, "job_id": "7", "step": 30},
    ]  # fmt: skip
    rows = [train(10, 1010.0, 500.0), saved(10, 1010.5, 0.5), train(20, 1036.0, 400.0), train(30, 1040.0, 400.0),
            saved(30, 1041.0, 1.0)]  # fmt: skip
    return events, rows


def write_run(path: Path, events: list[Record], rows: list[Record]) -> Path:
    """A run directory with these records (and a config.yaml, so that it is one)."""
    path.mkdir(parents=True)
    (path / "config.yaml").write_text("run:\n  name: t\n")
    (path / "attempts.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path
