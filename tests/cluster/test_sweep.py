"""Sweeps on the real local cluster: job arrays, dedup on resubmit, MaxArraySize chunks, resumable trials."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddp_core.run.rundir import RunDir
from tests.support.cli_runner import field, run_cli
from tests.support.helpers import ROOT, digests, events, rank_logs, running_profile, wait_for, wait_gone

DIGITS = str(ROOT / "configs" / "digits.yaml")
QUICK = [
    "train.max_steps=40",
    "train.eval_every=0",
    "train.log_every=10",
    "checkpoint.every_steps=20",
    "wandb.mode=disabled",
]


def trial_dirs(sweep_dir: Path) -> list[Path]:
    return sorted(p.parent for p in sweep_dir.glob("*/config.yaml"))


def completed(run_dir: Path) -> bool:
    found = events(run_dir)
    return bool(found) and found[-1]["event"] == "completed"


@pytest.fixture
def small_max_array_size():
    profile = running_profile()  # `up` alone means the default profile: the suite's pass keeps its own

    def up(size: str | None) -> None:
        env = dict(os.environ)
        env.pop("SLURM_LOCAL_MAX_ARRAY_SIZE", None)
        if size:
            env["SLURM_LOCAL_MAX_ARRAY_SIZE"] = size
        cmd = [str(ROOT / "scripts" / "slurm-local"), "up", "--profile", profile]
        subprocess.run(cmd, check=True, env=env, capture_output=True)

    up("300")
    yield 300
    up(None)


def test_thousand_trials_make_ceil_n_over_max_sbatch_calls(slurm_cluster, small_max_array_size, tmp_path):
    # A counting wrapper in front of the real sbatch (the cluster stays real): every call is logged.
    shim, calls = tmp_path / "bin", tmp_path / "sbatch-calls"
    shim.mkdir()
    (shim / "sbatch").write_text(f'#!/bin/sh\necho "$@" >> {calls}\nexec /usr/bin/sbatch "$@"\n')
    (shim / "sbatch").chmod(0o755)
    env = dict(os.environ, PATH=f"{shim}:{os.environ['PATH']}")
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "jobs", "sweep", DIGITS, "train.seed=range(0,1000)", "--name", "big",
         "slurm.additional={hold: true}"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    elapsed = time.monotonic() - started
    assert proc.returncode == 0, proc.stdout + proc.stderr
    arrays = field(proc.stdout, "arrays").split()[: math.ceil(1000 / small_max_array_size)]
    try:
        assert len(calls.read_text().splitlines()) == math.ceil(1000 / small_max_array_size) == 4
        assert len(arrays) == 4
        assert len(trial_dirs(tmp_path / "runs" / "big")) == 1000
        print(f"submitted 1000 trials in {elapsed:.1f} s")
    finally:
        subprocess.run(["scancel", *arrays], check=False)


def test_interrupted_array_task_resumes_its_trial_bitwise(slurm_cluster, tmp_path):
    # Two trials that train the same weights (task.data.pause_s only sleeps): the paced one is interrupted, the other
    # is its uninterrupted twin, in the same array. One rank each: the array task's own requeue is the point here.
    slow = ["task.target=tests.support.tasks:SlowDigitsTask", "train.max_steps=200", "train.log_every=5",
            "train.eval_every=0", "checkpoint.every_steps=50", "task.model.dropout=0.2", "optim.lr=0.002",
            "slurm.tasks_per_node=1"]  # fmt: skip
    proc = run_cli("sweep", DIGITS, *slow, "task.data.pause_s=0.03,0.0", "--name", "sig", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    array = field(proc.stdout, "arrays").split()[0]
    paced = {RunDir(t).load_config().task.data["pause_s"] > 0: t for t in trial_dirs(Path(field(proc.stdout, "dir")))}
    trial, twin = paced[True], paced[False]
    job, twin_job = (json.loads((t / "run.json").read_text())["jobs"][0]["job_id"] for t in (trial, twin))
    assert job.startswith(f"{array}_") and twin_job.startswith(f"{array}_")  # two tasks of one array
    wait_for(lambda: (trial / "metrics.jsonl").exists() and len(events(trial, "start")) == 1, 120, "trial start")
    time.sleep(1.5)
    subprocess.run(["scancel", "--signal=USR2", job], check=True)
    wait_for(lambda: completed(trial) and completed(twin), 240, "both trials to complete", poll=1)
    assert [e["event"] for e in events(trial)].count("requeued") == 1
    starts = events(trial, "start")
    assert starts[1]["step"] == events(trial, "interrupted")[0]["step"] > 0
    assert [e["event"] for e in events(twin)] == ["start", "completed"]
    twin_digests = digests(rank_logs(twin.parent, twin_job))
    assert list(twin_digests) == [0] and digests(rank_logs(trial.parent, job)) == twin_digests  # one rank each
    for task in (job, twin_job):
        wait_gone(task, 120)  # leave nothing running
