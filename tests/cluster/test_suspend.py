"""Slurm suspension (PreemptMode=SUSPEND, ``scontrol suspend``/``resume``) pauses a job longer than its collectives'
timeout, and longer than the hang watchdog's stall allowance: the job must continue and end with the weights of an
uninterrupted run, with no hang declared (``ddp_core.distributed.suspend``, ``ddp_core.trainer.watchdog``)."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from tests.support.cli_runner import field, run_cli
from tests.support.helpers import (
    ROOT,
    digests,
    events,
    final_digests,
    metric_steps,
    rank_logs,
    run_trainer,
    wait_for,
    wait_gone,
)

DIGITS = str(ROOT / "configs" / "digits.yaml")
TIMEOUT_S = 3
CONFIG = [
    "task.target=tests.support.tasks:StragglerDigitsTask", "train.max_steps=100", "train.log_every=5",
    "train.eval_every=0", "checkpoint.every_steps=1000", "wandb.mode=disabled", f"dist.timeout_s={TIMEOUT_S}",
    "slurm.nodes=2", "slurm.tasks_per_node=1",
    "watchdog.stall_s=2",  # below the collectives' timeout; a suspension 4x as long must not count as a hang
]  # fmt: skip


def scontrol(*args: str) -> None:
    subprocess.run(["scontrol", *args], check=True, capture_output=True, timeout=30)


def test_suspension_longer_than_the_collective_timeout(slurm_cluster, tmp_path):
    proc = run_cli("submit", DIGITS, *CONFIG, "task.data.pause_s=0.04", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    job_id, run_dir = field(proc.stdout, "job"), Path(field(proc.stdout, "run dir"))
    wait_for(lambda: metric_steps(run_dir), 120, "training to start", poll=0.05)

    scontrol("suspend", job_id)  # SIGTSTP now, SIGSTOP 2 s later (Slurm's suspend_grace_time)
    suspended_at = time.monotonic()
    # The uninterrupted reference (torchrun, 2 ranks on this machine: the digest of 2 ranks on 2 nodes) runs while
    # the job is stopped, and the suspension lasts at least twice the collectives' timeout.
    reference = final_digests(run_trainer(DIGITS, tmp_path / "reference", CONFIG, nproc=2))
    time.sleep(max(0.0, 2 + 2.5 * TIMEOUT_S - (time.monotonic() - suspended_at)))
    stopped_at = max(metric_steps(run_dir))
    scontrol("resume", job_id)
    suspended_s = time.monotonic() - suspended_at

    assert wait_gone(job_id, 120) == "COMPLETED"
    assert suspended_s > 2 + 2 * TIMEOUT_S and stopped_at < 100  # stopped mid-training, for long enough
    assert len(reference) == 2 and len(set(reference)) == 1
    assert set(digests(rank_logs(run_dir, job_id)).values()) == set(reference)
    assert [e["event"] for e in events(run_dir)] == ["start", "completed"]  # no interruption, no restart
