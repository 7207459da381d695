"""After step 4 of the submission pipeline: ``submit --wait`` and ``resume --wait``, which follow the job to its
end and read its result (rank 0's final evaluation).

While it waits, one live line: the job's state and pending reason with Slurm's start estimate, then its step, speed,
loss, ETA and restarts from the run's own files (what ``ddpjob status`` shows). It asks Slurm through the login
node's one watcher (``jobs.runs.watcher``): one ``squeue`` on a back-off of 2 s growing to 30 s, sooner only when
the files record the attempt's end."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from ddp_core.cluster.backoff import Backoff
from ddp_core.cluster.slurm import GATEWAY, QueuedJob, SlurmGateway
from ddp_core.run.permissions import check_trusted
from jobs.runs import throughput
from jobs.runs.status import ACTIVE_STATES
from jobs.runs.watcher import LINE_REFRESH_S, Line, Poll, watch

if TYPE_CHECKING:
    from ddp_core.run.rundir import RunDir
    from jobs.submission.submit import Submitted

log = logging.getLogger(__name__)

INTERRUPTED = 130  # the shell's code for Ctrl-C
# The first question after the submission, then the back-off's doubling: the run's files say when the job starts and
# ends (an end asks again at once), so Slurm is asked only for the pending reason and that the job left the queue.
FIRST_ASK_S = 5.0
RESULT_GRACE_S = 15.0  # submitit's own wait for a result file on a slow shared file system


def slurm_state(job_id: str) -> str:
    """The job's state from sacct (first word: 'CANCELLED by 0' → 'CANCELLED'), '' if unknown yet."""
    return GATEWAY.sacct_state(job_id)


class Follow:
    """``--wait``'s refresh (``jobs.runs.watcher.watch``): the job's live line from its run's files, and one
    ``squeue`` (state, pending reason, start estimate) when the watcher's back-off says so. The files say when it
    runs and at which step; an end recorded there (``completed``, ``requeued``, ...) asks Slurm soon after."""

    def __init__(self, job_id: str, run_dir: RunDir, gateway: SlurmGateway = GATEWAY) -> None:
        self.job_id, self.run_dir, self.gateway = job_id, run_dir, gateway
        self.queued: Optional[QueuedJob] = None
        self.seen = len(run_dir.events())
        self.max_steps = throughput.max_steps_in(run_dir)

    def __call__(self, poll: Poll[Any]) -> tuple[str, bool]:
        events, metrics = self.run_dir.events(), self.run_dir.metrics()
        if len(events) != self.seen and events[-1]["event"] != "start":  # an end: Slurm says when the job left
            poll.hurry()
        self.seen = len(events)
        rows = poll.ask(self.job_id, lambda: self.gateway.queue_states([self.job_id]))
        self.queued = next((q for q in rows if self.job_id in (q.job_id, q.raw_id)), None)
        active = self.queued is not None and self.queued.state in ACTIVE_STATES
        return throughput.live_line(self.job_id, self.queued, events, metrics, self.max_steps), active


def final_state(job_id: str, poll_s: float = 0.5) -> str:
    """A job that left the queue: its final state from accounting, or, where accounting does not answer, from the
    controller's memory of it (a warning line says so)."""
    for _ in range(20):  # accounting lags the queue by a moment
        state, no_accounting = GATEWAY.job_end(job_id)
        if no_accounting is not None:  # waiting longer would not make accounting answer
            log.warning("no accounting (%s): job %s's final state is the controller's: %s", no_accounting, job_id,
                        state or "UNKNOWN (it forgot the job)")  # fmt: skip
            return state or "UNKNOWN"
        if state and state not in ACTIVE_STATES:
            return state
        time.sleep(poll_s)
    return slurm_state(job_id) or "UNKNOWN"


def wait_until_gone(sub: Submitted) -> str:
    """Follow the job on its live line until it left the queue (Ctrl-C stops waiting: KeyboardInterrupt); its final
    state."""
    poll: Poll[Any] = Poll(Backoff(first_s=FIRST_ASK_S))
    if watch(Follow(sub.job_id, sub.run_dir), LINE_REFRESH_S, Line(), poll, INTERRUPTED) == INTERRUPTED:
        raise KeyboardInterrupt
    return final_state(sub.job_id)


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


def check_results(job: Any, run_dir: RunDir) -> None:
    """Before ``--wait`` unpickles the tasks' results here: each one, and its folder up to the run directory, refused
    in one line if another user owns it or can write it (``ddp_core.run.permissions``)."""
    results = [Path(job.task(i).paths.result_pickle) for i in range(job.num_tasks)]
    check_trusted([p for p in results if p.exists()], top=run_dir.path)


def wait(submitted: Submitted) -> tuple[bool, Optional[dict[str, float]], str]:
    """Block until the job ends: (succeeded, final eval metrics, state or error line)."""
    import submitit

    job = submitted.job
    state = None
    if isinstance(job, submitit.SlurmJob):
        # submitit's watcher takes an attempt's end for the job's (NODE_FAIL, which Slurm then requeues), result files
        # appear before the ranks have torn down, and without accounting it never sees a job end that left no result
        # (its job.wait() would wait forever): --wait follows the queue, then reads results only where they exist.
        state = wait_until_gone(submitted)
        if not results_written(job, state):
            return False, None, state if state != "COMPLETED" else "COMPLETED, but a task left no result file"
    else:
        job.wait()
    error: Optional[str] = None
    result = None
    check_results(job, submitted.run_dir)
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
