"""Slurm's own preemption on the local cluster (scripts/slurm-local up --profile ...): a job in a preemptible
partition (or QOS) is preempted by submitting higher-priority work, the way a real cluster does it.

Every requeued run is 4 ranks on 2 nodes (2 x 2) and must end with the weights of one uninterrupted 4-rank
run; a run that ends instead (preempted for good) is one rank. Other world sizes resume exactly through the warning
signal elsewhere: 1 rank (tests/cluster/test_search_slurm.py's requeued worker, tests/cluster/test_sweep.py's array
task), 2 ranks (tests/cluster/test_preemption.py) and 3 ranks (tests/unit/ddp_core/trainer/test_trainer.py, without
Slurm); a larger world takes the same path.
"""

from __future__ import annotations

import random
import subprocess
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
    rank_logs,
    run_trainer,
    sacct_state,
    wait_for,
    wait_gone,
    wait_idle,
)
from tests.support.interrupts import wait_training

DIGITS = str(ROOT / "configs" / "digits.yaml")
CONFIG = [
    "task.target=tests.support.tasks:SlowDigitsTask", "train.max_steps=120", "train.log_every=5", "train.eval_every=0",
    "checkpoint.every_steps=20", "checkpoint.keep_last=20", "data.batch_size=16", "task.model.dropout=0.2",
    "wandb.mode=disabled", "slurm.nodes=2", "slurm.tasks_per_node=2",
]  # fmt: skip
SLOW = "task.data.pause_s=0.04"


@pytest.fixture(scope="module")
def reference(slurm_cluster, tmp_path_factory, pytestconfig) -> str:
    """The uninterrupted run, under torchrun on this machine (1 node x 4 equals 2 nodes x 2, bitwise). Each profile
    pass needs it: computed once per source tree."""

    def run() -> str:
        d = final_digests(run_trainer(DIGITS, tmp_path_factory.mktemp("ref") / "run", CONFIG, nproc=4))
        assert len(d) == 4 and len(set(d)) == 1
        return d[0]

    return cached_reference(pytestconfig, "slurm_preemption", [DIGITS, *CONFIG, "nproc=4"], run)


def submit(cwd: Path, *extra: str) -> tuple[str, Path]:
    wait_idle()
    proc = run_cli("submit", DIGITS, *CONFIG, SLOW, *extra, cwd=cwd)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return field(proc.stdout, "job"), Path(field(proc.stdout, "run dir"))


def preempt(*how: str, hold_s: int = 2, cpus: int = 4) -> str:
    """Submit work that needs every CPU of both nodes (``cpus`` each), in the high partition or QOS: Slurm preempts
    the job."""
    out = subprocess.run(
        ["sbatch", "--parsable", *how, "-N2", "--ntasks-per-node=1", f"--cpus-per-task={cpus}", "-o", "/dev/null",
         "--wrap", f"sleep {hold_s}"],
        capture_output=True, text=True, check=True, timeout=60,
    )  # fmt: skip
    return out.stdout.strip().split(";")[0]


def preempt_times(
    job_id: str, run_dir: Path, times: int, how: list[str], save_at: int = -1, cpus: int = 4
) -> list[int]:
    """Preempt the job ``times`` times at random steps (the ``save_at``-th time while a checkpoint is written);
    returns the steps it stopped at."""
    rng, stopped, ckpts = random.Random(), [0], run_dir / "checkpoints"
    for i in range(times):
        wait_training(run_dir, i + 1, stopped[-1] + 3)
        if i == save_at:
            wait_for(lambda: any(p.name.startswith(".step_") for p in ckpts.iterdir()), 60, "a checkpoint write",
                     poll=0.0005)  # fmt: skip
        else:
            time.sleep(rng.uniform(0.1, 1.0))
        preempt(*how, cpus=cpus)
        wait_for(lambda n=i: len(events(run_dir, "interrupted")) > n, 60, f"preemption {i + 1}")
        stopped.append(events(run_dir, "interrupted")[-1]["step"])
    return stopped[1:]


def check_requeued_exactly(reference: str, job_id: str, run_dir: Path, stopped: list[int]) -> None:
    assert wait_gone(job_id, 240) == "COMPLETED"
    starts = events(run_dir, "start")
    assert [e["kind"] for e in events(run_dir, "interrupted")] == ["preemption"] * len(stopped)
    assert [e["kind"] for e in events(run_dir, "requeued")] == ["preemption"] * len(stopped)
    assert [s["step"] for s in starts] == [0, *stopped]  # no step lost
    assert {e["job_id"] for e in starts} == {job_id}  # the same job, requeued
    assert set(digests(rank_logs(run_dir, job_id)).values()) == {reference}


@pytest.mark.cluster_profile("preempt")
def test_partition_preemption_twice_once_during_a_save(reference, tmp_path):
    """PreemptMode=REQUEUE with GraceTime: SIGTERM, checkpoint, rank 0 requeues the job inside the grace time
    (leaving earlier would end it FAILED, never requeued); each attempt resumes where the last stopped."""
    job_id, run_dir = submit(tmp_path, "slurm.partition=low", "checkpoint.every_steps=5")
    stopped = preempt_times(job_id, run_dir, 2, ["-p", "high"], save_at=1)
    check_requeued_exactly(reference, job_id, run_dir, stopped)
    assert "preempted (PreemptMode=REQUEUE)" in rank_logs(run_dir, job_id)[0]


@pytest.mark.cluster_profile("preempt")
def test_cancel_mode_preemption_ends_preempted_with_a_checkpoint(slurm_cluster, tmp_path):
    """PreemptMode=CANCEL: the job saves and ends PREEMPTED, never requeued, and status says so. One rank: what Slurm
    does to the job does not depend on its size. Its resume is any ended run's (``ddpjob resume`` from the newest
    checkpoint, to the uninterrupted weights: test_preemption.py's test_requeue_budget_exhausted_then_resume)."""
    job_id, run_dir = submit(tmp_path, "slurm.partition=low-cancel", "slurm.nodes=1", "slurm.tasks_per_node=1")
    (stopped,) = preempt_times(job_id, run_dir, 1, ["-p", "high"])
    wait_gone(job_id, 120)
    assert [e["event"] for e in events(run_dir)][-2:] == ["interrupted", "preempted"]
    assert not events(run_dir, "requeued")
    assert (run_dir / "checkpoints" / f"step_{stopped:08d}.json").exists()
    status = run_cli("status", str(run_dir), cwd=tmp_path)
    assert "PREEMPTED" in status.stdout, status.stdout + status.stderr


@pytest.mark.cluster_profile("preempt-signal")
@pytest.mark.slurm_interface
def test_preempt_send_user_signal_counts_as_preemption(reference, tmp_path):
    """SlurmctldParameters=preempt_send_user_signal: the job's warning signal arrives at preemption; it is a
    preemption (PreemptTime is set), not a timeout, whatever the time left."""
    job_id, run_dir = submit(tmp_path, "slurm.partition=low", "slurm.time_min=3", "slurm.signal_lead_s=60")
    stopped = preempt_times(job_id, run_dir, 1, ["-p", "high"])  # more than once: the partition test
    check_requeued_exactly(reference, job_id, run_dir, stopped)
    assert "USR2" in rank_logs(run_dir, job_id)[0]


@pytest.mark.cluster_profile("site")
@pytest.mark.cluster_user
@pytest.mark.slurm_interface
def test_a_users_scavenger_job_is_preempted_by_her_qos_and_resumes(reference, tmp_path):
    """On the site profile, as ddpjob-alice (the user pass): her run under the scavenger QOS "low" is preempted by
    work under her QOS "site" (2 CPUs a node there, and memory counted), requeued by its own rank 0 within the
    QOS's GraceTime, and ends bitwise."""
    job_id, run_dir = submit(tmp_path, "slurm.qos=low")
    stopped = preempt_times(job_id, run_dir, 1, ["--qos=site"], cpus=2)
    check_requeued_exactly(reference, job_id, run_dir, stopped)
    assert sacct_state(job_id) == "COMPLETED"
