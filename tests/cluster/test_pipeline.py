"""A pipeline on the real cluster (``ddpjob pipeline``, docs/pipelines.md): three steps, train -> use -> last.

train is preempted once (it sends itself the warning signal at a chosen batch of its first attempt: it checkpoints
and requeues its own job); use waits for train's final end, not its first attempt, and reads train's run directory
and best checkpoint, resolved as it starts; use then fails (a closed gate), so Slurm cancels last (its afterok can
never be met) and ``ddpjob status`` says why. ``submit --after`` decides the ended runs from their accounting. The
rerun, the gate opened, keeps train and submits only use and last.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.cli_runner import run_cli
from tests.support.helpers import ROOT, events, sacct_state, wait_gone

# one-CPU jobs: see tests/support/cluster_guard.py; cluster_user: as ddpjob-alice too (tests/support/as_user.py)
pytestmark = [pytest.mark.cluster_shared("a"), pytest.mark.cluster_user]
TRAIN = [
    "task.target=tests.support.tasks:SignalledDigitsTask", "train.max_steps=60", "optim.warmup_steps=0",
    "train.eval_every=20", "train.log_every=10", "checkpoint.every_steps=20", "checkpoint.monitor=max:eval/accuracy",
    "slurm.tasks_per_node=1", "wandb.mode=disabled",
    "train.stop_check_ms=0",  # the flag is read after every step: the signal at batch 30 stops the first attempt
]  # fmt: skip
SCRIPT = str(ROOT / "tests" / "support" / "pipeline_step.py")
DIGITS = str(ROOT / "configs" / "digits.yaml")


def pipeline_file(folder: Path, gate: Path) -> Path:
    steps = {
        "train": {"config": DIGITS, "overrides": TRAIN},
        "use": {
            "script": SCRIPT,
            "args": [
                "--earlier",
                "${steps.train.run_dir}",
                "--checkpoint",
                "${steps.train.best_checkpoint}",
                "--gate",
                str(gate),
            ],
            "after": "train",
        },
        "last": {"script": SCRIPT, "args": ["--earlier", "${steps.use.run_dir}"], "after": ["use:ok"]},
    }
    path = folder / "chain.yaml"
    path.write_text(json.dumps({"name": "chain", "steps": steps}))  # JSON is YAML
    return path


def steps_of(folder: Path) -> dict[str, dict]:
    return json.loads((folder / "runs" / "pipelines" / "chain" / "pipeline.json").read_text())["steps"]


def test_pipeline_waits_for_a_requeued_step_cancels_after_a_failure_and_reruns_what_is_left(tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    path = pipeline_file(tmp_path, gate)
    # Train's rank 0 signals itself at its 30th batch of the job's first attempt only: one requeue.
    first = run_cli("pipeline", str(path), cwd=tmp_path, env={"DDPJOB_TEST_SIGNAL_AT": "0:30@0"})
    assert first.returncode == 0, first.stdout + first.stderr
    steps = steps_of(tmp_path)
    train, use, last = steps["train"], steps["use"], steps["last"]
    assert f"use: job {use['job_id']}, after afterok:{train['job_id']}," in first.stdout
    assert f"last: job {last['job_id']}, after afterok:{use['job_id']}," in first.stdout

    assert wait_gone(use["job_id"], timeout=150) == "FAILED"
    assert wait_gone(last["job_id"], timeout=60).startswith("CANCELLED")
    assert sacct_state(train["job_id"]) == "COMPLETED"
    train_dir = Path(train["run_dir"])
    starts = [e["restart_count"] for e in events(train_dir, "start")]
    assert starts == [0, 1], starts  # preempted once, requeued as the same job
    seen = json.loads((Path(use["run_dir"]) / "seen.json").read_text())
    # use started after train's final end: train's last attempt had completed when use read its record.
    assert seen["earlier_events"][-1] == "completed" and seen["earlier_events"].count("start") == 2, seen
    completed_at = events(train_dir, "completed")[-1]["t"]
    assert seen["t"] > completed_at
    best = json.loads((train_dir / "checkpoints" / "best.json").read_text())["step"]
    assert seen["earlier"] == str(train_dir)
    assert seen["checkpoint"] == str(train_dir / "checkpoints" / f"step_{best:08d}.pt") and seen["checkpoint_exists"]

    status = run_cli("status", "chain", cwd=tmp_path)
    assert status.returncode == 0, status.stderr
    table = status.stdout
    assert "last: cancelled: use ended FAILED(1), and this step runs after use:ok" in table, table
    states = {line.split()[0]: line.split()[1] for line in table.splitlines()[2:5]}
    assert states == {"train": "COMPLETED", "use": "FAILED(1)", "last": "CANCELLED"}, table

    # `submit --after` decides an ended run from its accounting: nothing to wait for, or never.
    dry = run_cli("submit", DIGITS, "--dry-run", "--after", str(train_dir), "--after", f"{use['run_dir']}:notok",
                  cwd=tmp_path)  # fmt: skip
    assert dry.returncode == 0 and "--dependency" not in dry.stdout, dry.stdout + dry.stderr
    never = run_cli("submit", DIGITS, "--dry-run", "--after", use["job_id"], cwd=tmp_path)
    assert never.returncode == 2 and "ended FAILED(1), so this job could never start" in never.stderr, never.stderr

    gate.touch()  # the fix, from outside: the rerun submits use and last only
    rerun = run_cli("pipeline", str(path), cwd=tmp_path)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    again = steps_of(tmp_path)
    assert f"train: kept (COMPLETED), job {train['job_id']}" in rerun.stdout
    assert again["train"] == train and again["use"]["job_id"] != use["job_id"]
    assert f"use: job {again['use']['job_id']}, run dir" in rerun.stdout  # train completed: nothing to wait for
    assert wait_gone(again["last"]["job_id"], timeout=120) == "COMPLETED"
    assert sacct_state(again["use"]["job_id"]) == "COMPLETED"
    final = run_cli("status", str(path), cwd=tmp_path).stdout
    assert final.count("COMPLETED") == 3 and "cancelled" not in final, final
