"""The deadline stop on the real local cluster: a job that gets no warning signal (``slurm.signal: none``) still saves
and requeues itself before its time limit (``ddp_core.cluster.deadline``).

Slurm ends a job at its time limit with SIGTERM, then SIGKILL after KillWait: too late to requeue it (a job still
running then ends TIMEOUT). How late: slurmctld checks time limits in its background loop, so the SIGTERM comes after
EndTime by up to that loop's period plus ``OverTimeLimit`` (here 22.05, OverTimeLimit=0: 10 s after EndTime, KillWait
10 s more). The stop aims at EndTime itself, never at that slack.
"""

from __future__ import annotations

import subprocess
from datetime import datetime
from pathlib import Path

import pytest

from tests.support.cli_runner import field, run_cli
from tests.support.helpers import ROOT, events, rank_logs, wait_gone

# 2-CPU jobs: cluster_guard.py; cluster_user: it passes as ddpjob-alice too (tests/support/as_user.py)
pytestmark = [pytest.mark.cluster_shared("a"), pytest.mark.slurm_interface, pytest.mark.cluster_user]
DIGITS = str(ROOT / "configs" / "digits.yaml")
# 120 steps of 1 s in the first attempt (a two-minute limit less the 30 s margin cannot hold them), the 30 to 100 left
# at full speed once requeued. Few steps, slow ones: the requeued attempt has the limit less the margin (90 s) for its
# start, its steps and its save, and on a loaded 2-core CI machine a start took 25 s and a full-speed 2-node step up to
# 0.2 s (with 400 steps of 0.3 s, the ~300 left made the requeued attempt run into the deadline again).
CONFIG = [
    "task.target=tests.support.tasks:SlowFirstAttemptDigitsTask", "task.data.pause_s=1.0", "train.max_steps=120",
    "train.log_every=5", "checkpoint.every_steps=20", "data.batch_size=16", "wandb.mode=disabled",
    "slurm.signal=none", "slurm.time_min=2",  # no warning signal; slurm.deadline_margin_s: its default, 30 s
]  # fmt: skip


def attempts(job_id: str) -> list[dict[str, str]]:
    """The job's attempts as sacct keeps them (``--duplicates``: a requeued one is a record of its own)."""
    out = subprocess.run(
        ["sacct", "-n", "-X", "-P", "--duplicates", "-o", "State,Start,End,Timelimit", "-j", job_id],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    keys = ("state", "start", "end", "limit")
    return [dict(zip(keys, line.split("|"), strict=True)) for line in out.stdout.splitlines() if line.strip()]


def test_without_a_signal_the_job_saves_and_requeues_itself_before_its_time_limit(slurm_cluster, tmp_path):
    proc = run_cli("submit", DIGITS, *CONFIG, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    job_id, run_dir = field(proc.stdout, "job"), Path(field(proc.stdout, "run dir"))
    assert "--signal" not in (run_dir / "slurm" / f"{job_id}_submission.sh").read_text()
    assert wait_gone(job_id, 300) == "COMPLETED"

    record = [(e["event"], e.get("kind")) for e in events(run_dir)]
    assert record == [("start", None), ("interrupted", "timeout"), ("requeued", "timeout"), ("start", None),
                      ("completed", None)], record  # fmt: skip
    starts = events(run_dir, "start")
    assert [(e["job_id"], e["restart_count"]) for e in starts] == [(job_id, 0), (job_id, 1)]
    (stopped,) = [e["step"] for e in events(run_dir, "interrupted")]
    assert 0 < stopped < 120 and starts[1]["step"] == stopped

    # Saved and requeued before the first attempt's EndTime (its start plus the two-minute limit), never killed.
    first, last = attempts(job_id)
    assert first["state"] == "REQUEUED" and last["state"] == "COMPLETED", (first, last)
    end = datetime.fromisoformat(first["start"]).timestamp() + 120
    left = end - events(run_dir, "requeued")[0]["t"]
    # About slurm.deadline_margin_s (30 s) before it: the save and the requeue take it from there, and sacct's
    # whole seconds put the end up to 1 s early.
    assert 0 < left < 40, f"requeued {left:.1f} s before the time limit"
    print(f"deadline stop at step {stopped}: requeued {left:.1f} s before the time limit")

    logs = rank_logs(run_dir, job_id)
    assert "deadline stop: now + " in logs[0] and "stopping at step" in logs[1]
    assert f"resumed from step_{stopped:08d}.pt" in logs[0], logs[0][-3000:]
    assert "finished at step 120" in logs[0]
