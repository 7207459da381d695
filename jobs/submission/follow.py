"""After step 4 of the submission pipeline: what ``submit`` and ``resume`` print for a queued job, and ``--wait``,
which follows it to its end through the Slurm gateway and reads its result (rank 0's final evaluation)."""

from __future__ import annotations

import logging
import sys
import time
from typing import Any, Optional

from ddp_core.cluster.slurm import GATEWAY
from jobs.submission.submit import Submitted

log = logging.getLogger(__name__)

RESULT_GRACE_S = 15.0  # submitit's own wait for a result file on a slow shared file system


def slurm_state(job_id: str) -> str:
    """The job's state from sacct (first word: 'CANCELLED by 0' → 'CANCELLED'), '' if unknown yet."""
    return GATEWAY.sacct_state(job_id)


def wait_until_gone(job_id: str, poll_s: float = 0.5) -> str:
    """Poll squeue (cheap, unlike sacct) until the job left the queue; then its final state from accounting, or,
    where accounting does not answer, from the controller's memory of it (a warning line says so)."""
    while GATEWAY.squeue_ids([job_id]):
        time.sleep(poll_s)
    for _ in range(20):  # accounting lags the queue by a moment
        state, no_accounting = GATEWAY.job_end(job_id)
        if no_accounting is not None:  # waiting longer would not make accounting answer
            log.warning("no accounting (%s): job %s's final state is the controller's: %s", no_accounting, job_id,
                        state or "UNKNOWN (it forgot the job)")  # fmt: skip
            return state or "UNKNOWN"
        if state and state not in {"RUNNING", "PENDING", "COMPLETING", "REQUEUED"}:
            return state
        time.sleep(poll_s)
    return slurm_state(job_id) or "UNKNOWN"


def results_written(job: Any, state: str, grace_s: float = RESULT_GRACE_S) -> bool:
    """Whether every task of the ended job left its result file (a failed rank's holds its error): a job killed
    from outside (cancelled, its node lost) leaves none. A completed job's may reach this machine a moment late."""
    deadline = time.monotonic() + (grace_s if state == "COMPLETED" else 0.0)
    while True:
        if all(job.task(i).paths.result_pickle.exists() for i in range(job.num_tasks)):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.2)


def wait(submitted: Submitted) -> tuple[bool, Optional[dict[str, float]], str]:
    """Block until the job ends: (succeeded, final eval metrics, state or error line)."""
    import submitit

    job = submitted.job
    state = None
    if isinstance(job, submitit.SlurmJob):
        # submitit's watcher takes an attempt's end for the job's (NODE_FAIL, which Slurm then requeues), result files
        # appear before the ranks have torn down, and without accounting it never sees a job end that left no result
        # (its job.wait() would wait forever): --wait follows the queue, then reads results only where they exist.
        state = wait_until_gone(submitted.job_id)
        if not results_written(job, state):
            return False, None, state if state != "COMPLETED" else "COMPLETED, but a task left no result file"
    else:
        job.wait()
    error: Optional[str] = None
    result = None
    try:
        result = job.results()[0]  # one result per task; rank 0's holds the final eval
    except Exception as err:  # submitit raises its own errors for failed jobs
        lines = [line for line in str(err).strip().splitlines() if line.strip()]
        error = lines[-1] if lines else type(err).__name__
    if error is None and state not in (None, "COMPLETED"):
        error = state
    if error is not None:
        return False, None, error
    return True, result, "COMPLETED"


def print_submitted(sub: Submitted) -> None:
    """What ``submit`` and ``resume`` print once the job is queued."""
    print(f"job:     {sub.job_id}")
    print(f"run dir: {sub.run_dir.path}")
    print(f"log:     {sub.log_path}")
    sys.stdout.flush()


def follow(sub: Submitted) -> int:
    """``--wait``: follow the job to its end; 0 when it completed, else 1 with its state and where its logs are."""
    started = time.monotonic()
    ok, result, state = wait(sub)
    print(f"job {sub.job_id} {'COMPLETED' if ok else 'FAILED'} after {time.monotonic() - started:.1f} s")
    if not ok:
        print(f"error: {state}")
        print(f"logs:  {sub.run_dir.slurm}")
        return 1
    from ddp_core.checkpoint import store as checkpoint

    if result:
        print("final eval: " + " ".join(f"{k} {v:.4f}" for k, v in sorted(result.items())))
    latest = checkpoint.find_latest(sub.run_dir.recorded_checkpoints())
    print(f"checkpoint: {latest.path if latest else 'none'}")
    offline = sorted(sub.run_dir.wandb.glob("offline-run-*"))
    if offline:
        print(f"W&B (offline): {offline[-1]}  (upload: ddpjob sync {sub.run_dir.path})")
    return 0
