"""The experiment trackers across interruptions of a real job: a rank killed after the last checkpoint (its restart in
the allocation trains the logged steps again), then a warning signal and a requeue; TensorBoard, MLflow and the CSV
file each hold every logged step exactly once, read back with their own readers (MLflow's through a real tracking
server, which ``ddpjob sync`` pushes the run's offline store to). Unit tests: tests/unit/ddp_core/trackers/."""

from __future__ import annotations

from pathlib import Path

import pytest

from ddp_core.run.rundir import RunDir
from ddp_core.trackers.mlflow_run import local_store
from tests.support.cli_runner import field, run_cli
from tests.support.helpers import ROOT, events, rank_logs, wait_gone
from tests.support.trackers import csv_steps, mlflow_runs, mlflow_server, mlflow_steps, tensorboard_steps

pytestmark = [pytest.mark.cluster_shared("b")]  # one 2-CPU job: see tests/support/cluster_guard.py
DIGITS = str(ROOT / "configs" / "digits.yaml")
CONFIG = [
    "task.target=tests.support.tasks:KilledThenSignalledTask", "train.max_steps=60", "train.log_every=5",
    "train.eval_every=20", "checkpoint.every_steps=20", "optim.warmup_steps=5", "wandb.mode=disabled",
    "log.trackers=[tensorboard,mlflow,csv]",
    # rank 1 dies in step 27 (after step 25 was logged; the checkpoint is step 20's), then the restarted ranks stop
    # on a warning signal at their 10th batch and the job is requeued
    "task.data.crash_rank=1", "task.data.crash_at=28", "task.data.error=SIGKILL", "task.data.crash_launch=0",
    "task.data.signal_at=10", "train.stop_check_ms=0",  # the ranks agree on the signal after its step
]  # fmt: skip
TRAIN, EVAL = list(range(5, 61, 5)), [20, 40, 60]


def test_every_tracker_holds_each_step_once_across_a_kill_and_a_requeue(tmp_path):
    proc = run_cli("submit", DIGITS, *CONFIG, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    job_id, run_dir = field(proc.stdout, "job"), Path(field(proc.stdout, "run dir"))
    (tmp_path / "server").mkdir()
    with mlflow_server(tmp_path / "server") as server:  # starts while the job runs
        assert wait_gone(job_id, 240) == "COMPLETED"
        check(run_dir, server, tmp_path)
    log = rank_logs(run_dir, job_id)[0]
    assert "WARNING ddp_core.trackers" not in log, log  # no tracker failed or was left out


def check(run_dir: Path, server: str, cwd: Path) -> None:
    starts = [(e["restart_count"], e["launch"], e["step"]) for e in events(run_dir, "start")]
    assert [s[:2] for s in starts] == [(0, 0), (0, 1), (1, 0)] and starts[1][2] == 20, starts
    assert events(run_dir, "restarted")[0]["step"] > 25  # step 25 was logged before the kill, and trained again
    assert [e["kind"] for e in events(run_dir, "interrupted")] == ["preemption"]
    tb = run_dir / "tensorboard"
    assert tensorboard_steps(tb, "train/loss") == TRAIN and tensorboard_steps(tb, "eval/loss") == EVAL
    assert len(list(tb.glob("events.out.tfevents.*"))) == 3  # one file per launch
    assert csv_steps(run_dir / "metrics.csv", "train/loss") == TRAIN
    assert csv_steps(run_dir / "metrics.csv", "eval/loss") == EVAL
    store = local_store(RunDir(run_dir))
    [offline] = mlflow_runs(store)
    assert offline.info.status == "FINISHED" and mlflow_steps(store, offline.info.run_id, "train/loss") == TRAIN
    synced = run_cli("sync", str(run_dir), "--mlflow-uri", server, cwd=cwd)
    assert synced.returncode == 0, synced.stdout + synced.stderr
    [run] = mlflow_runs(server)
    assert run.info.run_name == RunDir(run_dir).read_meta()["run_id"] and run.info.status == "FINISHED"
    assert mlflow_steps(server, run.info.run_id, "train/loss") == TRAIN
    assert mlflow_steps(server, run.info.run_id, "eval/loss") == EVAL
