"""Preemption on the real local cluster: signals, requeues and kills never change the final weights.

Every test compares against one uninterrupted reference run of the same config (2 ranks, DDP, dropout,
cosine LR): the interrupted runs must end with the same sha256 of the weights on every rank.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.cli_runner import field, run_cli
from tests.support.helpers import (
    ROOT,
    cached_reference,
    digests,
    events,
    final_digests,
    metric_steps,
    rank_logs,
    rank_pid,
    run_trainer,
    sacct_state,
    two_rank_reference,
    wait_for,
    wait_gone,
    wandb_records,
    write_shadowing_files,
)
from tests.support.interrupts import interrupt, wait_training

pytestmark = [pytest.mark.cluster_shared("b")]  # 2-CPU jobs: see tests/support/cluster_guard.py
DIGITS = str(ROOT / "configs" / "digits.yaml")
CONFIG = [
    "task.target=tests.support.tasks:SlowDigitsTask", "train.max_steps=300", "train.log_every=5",
    "train.eval_every=100", "checkpoint.every_steps=40", "checkpoint.keep_last=10", "data.batch_size=16",
    "task.model.dropout=0.2",
    "wandb.mode=disabled",  # W&B's offline writer costs each attempt ~3 s of CPU: only the test that checks it has it
]  # fmt: skip
SLOW = "task.data.pause_s=0.03"  # ~10 s of training: room for signals at random steps


@pytest.fixture(scope="module")
def reference(pytestconfig, tmp_path_factory) -> str:
    """The uninterrupted run of the same config: 2 ranks under torchrun outside Slurm, bitwise a 2-rank job's; reused
    from pytest's cache by the passes after the first (the release passes rerun this module's template test)."""
    return two_rank_reference(pytestconfig, tmp_path_factory, "preemption", DIGITS, CONFIG)


def submit(cwd: Path, *extra: str) -> tuple[str, Path]:
    proc = run_cli("submit", DIGITS, *CONFIG, SLOW, *extra, cwd=cwd)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return field(proc.stdout, "job"), Path(field(proc.stdout, "run dir"))


def check_wandb(run_dir: Path) -> None:
    run_id = json.loads((run_dir / "run.json").read_text())["run_id"]
    folders = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert folders and all(f.name.endswith(f"-{run_id}") for f in folders)
    steps: list[int] = []
    config_seen = False
    for folder in folders:
        for record in wandb_records(folder / f"run-{run_id}.wandb"):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                assert record.run.run_id == run_id
                config_seen |= any(item.key == "train" for item in record.run.config.update)
            elif kind == "history":
                steps.append(record.history.step.num)
    # train and eval records of one step share it; across attempts steps never go back or repeat a step.
    distinct = [s for i, s in enumerate(steps) if i == 0 or s != steps[i - 1]]
    assert distinct == sorted(set(distinct)), distinct
    assert distinct[-1] == 300 and config_seen


def test_usr2_twice_by_hand_resumes_bitwise_in_its_run_dir(reference, tmp_path):
    """slurm_templates/ddp.sbatch sbatched by hand with a config (no ddpjob on the login node: the batch script makes
    the run directory), ``scancel --signal=USR2`` twice at random steps: a requeued attempt is itself requeued (a third
    time would repeat that, at a minute of CI per attempt), each attempt finds the run directory and starts exactly
    where the last stopped, one W&B run across them, and the uninterrupted run's weights. (Through ddpjob submit:
    the other tests here; the template through scripts/submit.sh: test_sbatch_template_job_requeues_itself.)"""
    seed = random.randrange(1 << 30)
    script = ROOT / "slurm_templates" / "ddp.sbatch"
    write_shadowing_files(tmp_path)  # the submit directory: its jobs.py and ddp_core.py are never imported
    out = subprocess.run(
        ["sbatch", "--parsable", f"--output={tmp_path}/%j.out", str(script), DIGITS, *CONFIG, SLOW,
         "wandb.mode=offline", f"run.root={tmp_path / 'runs'}"],
        capture_output=True, text=True, timeout=60, cwd=tmp_path, check=True,
        env=dict(os.environ, DDPJOB_PYTHON=sys.executable),  # as a user would activate their venv
    )  # fmt: skip
    job_id = out.stdout.strip().split(";")[0]
    run_dir = tmp_path / "runs" / f"digits-{job_id}"
    stopped = interrupt(job_id, run_dir, 2, random.Random(seed))
    assert wait_gone(job_id) == "COMPLETED", f"seed {seed}"
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == [f"digits-{job_id}"]  # one run directory
    starts, interrupted = events(run_dir, "start"), events(run_dir, "interrupted")
    assert [e["kind"] for e in interrupted] == ["preemption"] * 2
    assert len(events(run_dir, "requeued")) == 2
    # steps lost: 0 — each attempt starts exactly where the previous one stopped
    assert [s["step"] for s in starts] == [0, *stopped]
    assert {e["job_id"] for e in starts} == {job_id}
    assert [s["restart_count"] for s in starts] == [0, 1, 2]
    d = digests(rank_logs(run_dir, job_id))
    assert d == {0: reference, 1: reference}, f"seed {seed}"
    train_steps = metric_steps(run_dir)
    assert train_steps == sorted(set(train_steps)) and train_steps[-1] == 300
    check_wandb(run_dir)


def test_scontrol_requeue_then_kill9_during_a_save_resume_bitwise(reference, tmp_path):
    # Checkpoints every 5 steps, so that a kill can land in a write.
    job_id, run_dir = submit(tmp_path, "checkpoint.every_steps=5", "checkpoint.keep_last=100")
    # scontrol requeue: SIGTERM to every rank; they save, Slurm requeues, the next attempt resumes
    wait_training(run_dir, 1, 30)
    subprocess.run(["scontrol", "requeue", job_id], check=True)
    wait_for(lambda: len(events(run_dir, "start")) >= 2, 90, "the requeued attempt")
    term = events(run_dir, "interrupted")
    assert [e["kind"] for e in term] == ["terminated"] and events(run_dir, "start")[1]["step"] == term[0]["step"]
    # kill -9 of rank 0, the writer, the moment a checkpoint's temp file exists (the OOM killer, a segfault): the batch
    # script's watcher restarts the ranks in the allocation, which resume from the newest complete checkpoint. (A rank
    # other than 0 killed mid-training: test_slurm_jobs.py and test_node_exclusion.py.)
    wait_training(run_dir, 2, term[0]["step"] + 40)
    pid = wait_for(lambda: rank_pid(job_id, 0), 30, "rank 0's pid")
    # Rank 0 runs on the batch host, which the requeued attempt chose (n1 or n2, as the other lane left them).
    host = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%B"], capture_output=True, text=True).stdout.strip()
    ckpts = run_dir / "checkpoints"
    wait_for(lambda: any(p.name.startswith(".step_") for p in ckpts.iterdir()), 60, "a checkpoint write", poll=0.0005)
    os.kill(pid, signal.SIGKILL)
    killed_at = time.time()
    last_logged = max(metric_steps(run_dir))
    assert wait_gone(job_id, 180) == "COMPLETED"
    (failure,) = events(run_dir, "failure")
    assert (failure["kind"], failure["rank"], failure["host"]) == ("infrastructure", 0, host), failure
    assert failure["error"] == "killed by a signal (Killed)" and failure["job_id"] == job_id
    # Restarted as a new job step of the same attempt's allocation (no requeue), from the newest complete checkpoint.
    assert [(e["kind"], e["restart_count"], e["launch"]) for e in events(run_dir, "restarted")] == [
        ("infrastructure", 1, 1)
    ]
    third = events(run_dir, "start")[2]
    assert (third["restart_count"], third["launch"]) == (1, 1) and 0 <= last_logged - third["step"] <= 5 + 5
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    resumed = [r for r in map(json.loads, lines) if r["split"] == "train" and r["time"] > killed_at]
    print(f"kill -9 -> first step logged after the restart: {resumed[0]['time'] - killed_at:.1f} s")
    assert digests(rank_logs(run_dir, job_id)) == {0: reference, 1: reference}


def test_requeue_budget_exhausted_then_resume(reference, tmp_path):
    job_id, run_dir = submit(tmp_path, "slurm.max_preemptions=0")
    interrupt(job_id, run_dir, 1, random.Random(1))
    assert wait_gone(job_id) == "FAILED"
    final = events(run_dir)[-1]
    assert final["event"] == "budget_exhausted"
    assert final["reason"] == "requeue budget exhausted after 1 preemption (slurm.max_preemptions=0)"
    assert "requeue budget exhausted after 1 preemption" in rank_logs(run_dir, job_id)[0]
    assert sacct_state(job_id) == "FAILED"
    proc = run_cli("resume", job_id, "--wait", cwd=tmp_path)  # by job id: found under ./runs
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert digests(rank_logs(run_dir, field(proc.stdout, "job"))) == {0: reference, 1: reference}


def test_extending_a_finished_run_ends_on_a_longer_runs_bits(pytestconfig, tmp_path_factory, tmp_path):
    """``ddpjob resume RUN train.max_steps=300`` on a run that finished at 170, with a schedule that does not depend on
    max_steps, ends on the bits of a run 300 steps long from the start. The shorter run's final evaluation (at 170,
    off the eval cadence of 100: the longer run evaluates there never) drew its DataLoader's seed from the training's
    torch stream before the final checkpoint saved it, and the continued run's dropout masks were another run's."""
    constant = [*CONFIG, "optim.schedule=constant"]

    def run() -> str:
        d = final_digests(run_trainer(DIGITS, tmp_path_factory.mktemp("ref") / "run", constant, nproc=2))
        assert len(d) == 2 and len(set(d)) == 1
        return d[0]

    longer = cached_reference(pytestconfig, "extended", [DIGITS, *constant, "nproc=2"], run)
    short = run_cli("submit", DIGITS, *constant, "train.max_steps=170", "--wait", cwd=tmp_path)
    assert short.returncode == 0, short.stdout + short.stderr
    run_dir = Path(field(short.stdout, "run dir"))
    assert [e["event"] for e in events(run_dir)] == ["start", "completed"]
    extended = run_cli("resume", str(run_dir), "train.max_steps=300", "--wait", cwd=tmp_path)
    assert extended.returncode == 0, extended.stdout + extended.stderr
    assert "exactness:" not in extended.stdout  # nothing that breaks it to say
    logs = rank_logs(run_dir, field(extended.stdout, "job"))
    assert "resumed from step_00000170.pt" in logs[0], logs[0]
    assert digests(logs) == {0: longer, 1: longer}


@pytest.mark.slurm_interface
def test_time_limit_warning_counts_as_timeout(slurm_cluster, tmp_path):
    # A 3-minute job warned 110 s before its limit (Slurm sends timed signals up to ~60 s early): the signal
    # comes 10-70 s in. With no timeout budget the run ends in its terminal state instead of requeueing.
    job_id, run_dir = submit(
        tmp_path, "train.max_steps=100000", "slurm.time_min=3", "slurm.signal_lead_s=110", "slurm.max_timeouts=0"
    )
    assert wait_gone(job_id, 150) == "FAILED"
    assert [e["kind"] for e in events(run_dir, "interrupted")] == ["timeout"]
    assert events(run_dir)[-1]["reason"] == "requeue budget exhausted after 1 timeout (slurm.max_timeouts=0)"
    assert not events(run_dir, "requeued")


@pytest.mark.slurm_interface
@pytest.mark.cluster_user
def test_sbatch_template_job_requeues_itself(reference, tmp_path):
    # The plain-sbatch path (no submitit): same signal, same self-requeue, same final weights. The submit directory
    # holds a user's jobs.py and ddp_core.py: submit.sh, the batch script and its tasks never import them.
    write_shadowing_files(tmp_path)
    proc = subprocess.run(
        [str(ROOT / "scripts" / "submit.sh"), DIGITS, *CONFIG, SLOW, f"run.root={tmp_path / 'runs'}"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    job_id, run_dir = field(proc.stdout, "job"), Path(field(proc.stdout, "run dir"))
    interrupt(job_id, run_dir, 1, random.Random(2))
    assert wait_gone(job_id) == "COMPLETED"
    assert [e["event"] for e in events(run_dir)].count("requeued") == 1
    assert digests(rank_logs(run_dir, job_id)) == {0: reference, 1: reference}


def test_refused_requeue_fails_the_job_and_says_how_to_resume(slurm_cluster, tmp_path):
    """`scontrol requeue` refused (JobRequeue=0, a site policy): the checkpoint is written, the job must not end
    COMPLETED with a run half done, and the log and attempts.jsonl say how to continue."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "scontrol").write_text(
        "#!/bin/sh\n"
        '[ "$1" = requeue ] && { echo "slurm_requeue error: Requested operation is presently disabled" >&2; exit 1; }\n'
        'exec /usr/bin/scontrol "$@"\n'
    )
    (fake / "scontrol").chmod(0o755)
    # One rank: rank 0 alone asks for the requeue.
    job, run_dir = submit(tmp_path, "slurm.tasks_per_node=1", f"slurm.setup=['export PATH={fake}:$PATH']")
    wait_training(run_dir, 1, 20)
    subprocess.run(["scancel", "--signal=USR2", job], check=True)
    assert wait_gone(job) == "FAILED"
    failed = events(run_dir, "requeue_failed")
    assert len(failed) == 1 and failed[0]["step"] == events(run_dir, "interrupted")[0]["step"]
    assert "presently disabled" in failed[0]["error"]  # scontrol's own words, asked once: a refusal for good
    assert (run_dir / "checkpoints" / f"step_{failed[0]['step']:08d}.json").exists()
    assert f"continue with: ddpjob resume {run_dir}" in rank_logs(run_dir, job)[0]
    assert "COMPLETED" not in sacct_state(job)
