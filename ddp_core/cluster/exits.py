"""The compute side's exit policy: what an attempt does at its end, and how the process ends, with which code.

**What an attempt leads to** (rank 0 decides, every rank returns the same code): ``after_stop`` for a signal
(requeue within ``slurm.max_timeouts`` / ``max_preemptions``, preempted and not requeued, stopped outside Slurm, a
refused requeue), ``after_hang`` for the watchdog's hang (requeue within ``slurm.max_hangs``). The trainer, the
runtime helper of script mode and the watchdog all call these, and so does the after-failure policy
(``cluster.policy``, for the batch script's watcher, the node-loss check and a search's trial step: requeue within
``slurm.max_failures`` after an infrastructure failure, none after a user error): one set of budgets and events.

Every compute-side exit goes through ``leave`` (and, for the functions submitit calls, through ``after_submitit``):
nothing else calls ``os._exit`` or ``sys.exit``. Torch-free, so the runtime helper and the torchrun agent use it
before torch is loaded.

**Why no interpreter teardown.** A process that has run torch.distributed over gloo can abort in CPython's teardown
after a successful run (``terminate called without an active exception``, exit 134): gloo's worker threads still
hold tensors whose release needs the GIL, or a C++ thread object is destroyed while joinable. Seen in CI on the
plain DDP tutorial under torchrun (3 of 12 runs on a loaded 2-core machine) and on a submitit task of script mode.
So a process ends with ``os._exit`` once its outcome is recorded, after Python's exit handlers where they matter
(W&B's finish, a user script's own ``atexit``).
"""

from __future__ import annotations

import atexit
import enum
import functools
import logging
import os
import sys
import time
from pathlib import Path
from types import TracebackType
from typing import Any, Callable, NoReturn, Optional, TypeVar

from ddp_core.cluster import preemption, signals
from ddp_core.cluster.env import DistEnv
from ddp_core.cluster.preemption import Interruption
from ddp_core.cluster.slurm import NODE_GATEWAY, SlurmGateway
from ddp_core.config import Config, SlurmConfig
from ddp_core.run.rundir import RunDir

log = logging.getLogger("ddp_core")


class ExitCode(enum.IntEnum):
    """What an attempt's exit code tells Slurm (and a person reading ``sacct``)."""

    OK = 0
    REQUEUED = 0  # Slurm ends and restarts the job; the code is never seen by anyone
    FAILED = 1  # an exception on this rank (its log names the rank, host and error)
    USAGE = 2  # a config or run directory this process cannot use (the log says which and how to fix it)
    BUDGET_SPENT = 3  # a requeue budget (slurm.max_timeouts / max_preemptions / max_hangs) is spent
    STOPPED = 4  # a signal outside Slurm: checkpointed, nobody requeues; continue by starting it on the run dir
    REQUEUE_FAILED = 5  # inside Slurm, but `scontrol requeue` was refused: the job must not look COMPLETED
    HUNG = 6  # the watchdog ended a stalled attempt outside Slurm (stacks in RUN/hangs/): nobody requeues
    NOT_STARTED = 7  # the batch script's check before srun requeued the job off a node the run excludes (node_loss)
    # Rank 0 decided to requeue but has no scontrol (a container image without Slurm's commands): the batch script's
    # watcher, outside the image, requeues the job once srun returns (``requeue_deferred``)
    REQUEUE_DEFERRED = 8
    # A requeued attempt of a job whose run had already completed (Slurm 24.11 requeues a job preempted once more when
    # its next attempt ends): the batch script's check before srun says so, and the script ends COMPLETED (exit 0).
    ALREADY_COMPLETE = 9
    # The batch script's watcher, after a failed job step: run the ranks again as a new step in this allocation (the
    # batch script's loop of steps reads it; never a job's exit code).
    RESTART = 10
    TERMINATED = 143  # 128 + SIGTERM, the shell convention


def after_stop(
    cfg: Config,
    run_dir: RunDir,
    env: DistEnv,
    signum: int,
    step: Optional[int],
    rerun: str,
    received_at: float,
    deadline: bool = False,
) -> int:
    """Rank 0 decides what an attempt interrupted by ``signum`` (received at ``received_at``, epoch seconds) after
    ``step`` (its checkpoint) leads to (``preemption.decide``): requeue, or leave. Returns the exit code. Every rank
    returns the same code for a signal; rank 0's tells Slurm whether its requeue failed. ``rerun``: the command that
    continues it outside Slurm. Shared by the trainer, ``ddp_core.runtime.requeue`` and a plain script's held warning
    (script mode): one set of budgets and events. ``deadline``: rank 0 stopped the ranks itself before the time limit
    (``cluster.deadline``): a timeout, signal or not."""
    warning = signals.warning_signal(cfg.slurm.warning)
    if not env.slurm_job_id:
        # Outside Slurm nothing requeues: not a timeout or a preemption, and not a success either.
        if env.is_main:
            run_dir.log_event("interrupted", kind=Interruption.stopped.value, job_id=env.job_id, step=step)
            log.warning("stopped at step %s by a signal outside Slurm; continue with: %s", step, rerun)
        return ExitCode.STOPPED
    code = ExitCode.TERMINATED if signum != warning else ExitCode.REQUEUED
    if not env.is_main:
        return code  # rank 0 decides; the teardown barrier keeps this rank until it has requeued
    job = NODE_GATEWAY.show_job(env.slurm_job_id)
    mode = NODE_GATEWAY.preempt_mode(job) if job is not None and job.preempt_time else None
    left = preemption.time_left(job, received_at or time.time(), os.environ.get("SLURM_JOB_END_TIME"))
    decision = preemption.decide(signum, warning, job, mode, env.restart_count, left, cfg.slurm.signal_lead_s, deadline)
    kind = decision.kind
    run_dir.log_event("interrupted", kind=kind.value, job_id=env.job_id, step=step)
    log.info("stopped at step %s: %s", step, decision.why)
    if decision.ends_preempted:
        run_dir.log_event("preempted", job_id=env.job_id, step=step)
        log.warning(
            "preempted at step %s and not requeued by this partition; continue with: ddpjob resume %s",
            step,
            run_dir.path,
        )
        return ExitCode.TERMINATED
    if not decision.requeue:
        return code
    limit = cfg.slurm.max_timeouts if kind is Interruption.timeout else cfg.slurm.max_preemptions
    spent = sum(
        1
        for e in run_dir.events()
        if e["event"] == "interrupted" and e.get("kind") == kind.value and e.get("job_id") == env.job_id
    )
    after = f"its checkpoint at step {step}"
    return requeue_within(run_dir, env, kind.value, spent, limit, step, after, defer=True, slurm=cfg.slurm)


def requeue_within(
    run_dir: RunDir,
    env: DistEnv,
    kind: str,
    spent: int,
    limit: int,
    step: Optional[int],
    after: str,
    read: str = "",
    defer: bool = False,
    gateway: SlurmGateway = NODE_GATEWAY,
    slurm: Optional[SlurmConfig] = None,
) -> int:
    """Rank 0 (or a hang's coordinator) requeues the job unless this submission spent its ``slurm.max_<kind>s``
    budget; records what happened and returns the exit code. ``defer``: a rank inside the job's step, whose batch
    script's watcher can requeue the job for it when this process has no scontrol (a container image): it records
    ``requeue_deferred`` and exits ``REQUEUE_DEFERRED``, and the watcher does the rest (``requeue_deferred``).
    ``gateway``: the caller's, through which it asks Slurm. A packed sweep's trial (``DistEnv.packed``) defers every
    requeue it may defer to its worker (``search.pack``)."""
    if spent > limit:
        reason = f"requeue budget exhausted after {spent} {kind}{'' if spent == 1 else 's'} (slurm.max_{kind}s={limit})"
        run_dir.log_event("budget_exhausted", reason=reason, job_id=env.job_id, step=step)
        log.error("%s; %scontinue with: ddpjob resume %s", reason, read, run_dir.path)
        return ExitCode.BUDGET_SPENT
    if defer and env.packed:  # the pack's worker requeues the allocation once, after every slot's trial has saved
        run_dir.log_event("requeue_deferred", kind=kind, job_id=env.job_id, step=step, error="packed")
        log.info("a packed trial: its allocation is requeued once every slot's trial has saved")
        return ExitCode.REQUEUE_DEFERRED
    # Recorded before asking: once Slurm accepts, it may end this step before a line written after scontrol returns
    # (seen in CI under load: a requeued attempt without its event). A refusal is recorded after this one.
    run_dir.log_event("requeued", kind=kind, job_id=env.job_id, step=step, count=spent)
    if (refused := preemption.requeue(env, gateway, slurm=slurm)) is not None:
        if defer and refused.missing:
            run_dir.log_event("requeue_deferred", kind=kind, job_id=env.job_id, step=step, error=refused.why)
            log.info("no scontrol here (%s): the batch script requeues the job once the ranks have left", refused.why)
            return ExitCode.REQUEUE_DEFERRED
        return requeue_refused(run_dir, env, kind, step, refused.why, f"the job could not requeue itself after {after}")
    return ExitCode.REQUEUED


def requeue_refused(run_dir: RunDir, env: DistEnv, kind: Any, step: Any, why: str, what: str) -> int:
    """A requeue Slurm refused (or no scontrol could ask for): recorded, said with how to go on, REQUEUE_FAILED."""
    run_dir.log_event("requeue_failed", kind=kind, job_id=env.job_id, step=step, error=why)
    log.error("%s (%s); continue with: ddpjob resume %s", what, why, run_dir.path)
    return ExitCode.REQUEUE_FAILED


def requeue_deferred(
    run_dir: RunDir,
    env: DistEnv,
    events: list[dict[str, Any]],
    status: int,
    gateway: SlurmGateway,
    slurm: Optional[SlurmConfig] = None,
) -> Optional[int]:
    """Outside the container (the batch script's watcher, or a search's worker for its trial's step): when the step
    ended ``REQUEUE_DEFERRED`` and ``events`` (the step's) hold rank 0's ``requeue_deferred`` (no scontrol inside the
    image), makes the requeue it decided. Records ``requeued_by_batch`` or ``requeue_failed``; returns the exit code:
    0 once Slurm accepted, else ``REQUEUE_FAILED``. None when rank 0 deferred nothing."""
    deferred = [e for e in events if e["event"] == "requeue_deferred"]
    if not deferred or status != ExitCode.REQUEUE_DEFERRED:
        return None
    kind, step = deferred[-1].get("kind"), deferred[-1].get("step")
    refused = preemption.requeue(env, gateway, slurm=slurm)
    if refused is None:
        run_dir.log_event("requeued_by_batch", kind=kind, job_id=env.job_id, step=step)
        return ExitCode.OK
    return requeue_refused(
        run_dir, env, kind, step, refused.why, f"the batch script could not requeue the job after step {step}"
    )


def after_hang(cfg: Config, run_dir: RunDir, env: DistEnv, folder: Path, summary: str, step: Optional[int]) -> int:
    """The rank that coordinates a hang (any rank: rank 0 may be the one stuck) records it and requeues the job
    within ``slurm.max_hangs``. Returns its exit code; the other ranks end with the job."""
    run_dir.log_event("hang", job_id=env.job_id, step=step, rank=env.rank, stacks=str(folder), summary=summary)
    if not env.slurm_job_id:
        log.error("attempt ended by the hang watchdog; continue with: python -m ddp_core %s", run_dir.path)
        return ExitCode.HUNG
    spent = sum(1 for e in run_dir.events() if e["event"] == "hang" and e.get("job_id") == env.job_id)
    read = f"read {folder / 'summary.txt'}, then "
    return requeue_within(
        run_dir, env, "hang", spent, cfg.slurm.max_hangs, step, "a hang", read, defer=True, slurm=cfg.slurm
    )


def leave(code: int, *, exit_handlers: bool = False, teardown: bool = False) -> NoReturn:
    """End this process now with ``code``, without the interpreter's teardown (see the module docstring).
    ``exit_handlers``: run Python's ``atexit`` handlers first (a user script's, W&B's finish). ``teardown``: the
    interpreter's own exit instead, for a process that never started torch.distributed (a config it cannot use)."""
    if teardown:
        raise SystemExit(int(code))
    if exit_handlers:
        atexit._run_exitfuncs()  # what teardown would run first; the rest of it is what aborts
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken stream: nothing left to say on it
            pass
    os._exit(int(code))


def without_result(code: int) -> NoReturn:
    """Inside a function submitit calls: end an attempt that did not finish (requeued, stopped, failed), so submitit
    writes no result for it (``ddpjob submit --wait`` keeps following a requeued job). ``after_submitit`` then ends
    the process with ``code``."""
    raise SystemExit(int(code))  # not an Exception: submitit lets it through without pickling an error


class _SubmititEnd:
    """What the function submitit called ended with; read by the exit handler registered before it ran."""

    code: Optional[int] = None
    uncaught = False


_end = _SubmititEnd()
F = TypeVar("F", bound=Callable[..., Any])


def after_submitit(fn: F) -> F:
    """Wrap a function submitit calls on a task (``ddp_core.launch.run``, ``ddp_core.script.run``) so the process
    ends through ``leave`` once submitit has written its result.

    submitit returns from the call, pickles the result (or the error), and then the interpreter exits; this adds an
    exit handler, registered before ``fn`` runs, so handlers registered while it runs (W&B's, the script's own) still
    come first, then the process leaves with the code the interpreter would have used: 0 after a result, the
    ``SystemExit`` code ``fn`` raised, 1 after an uncaught exception."""

    @functools.wraps(fn)
    def entry(*args: Any, **kwargs: Any) -> Any:
        atexit.register(_end_after_submitit)
        previous = sys.excepthook

        def excepthook(kind: type[BaseException], value: BaseException, tb: Optional[TracebackType]) -> None:
            _end.uncaught = True  # submitit re-raises what fn raised, after writing the error; so does its own failure
            previous(kind, value, tb)

        sys.excepthook = excepthook
        try:
            result = fn(*args, **kwargs)
        except SystemExit as exit_:
            _end.code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
            raise
        except BaseException:
            _end.code = ExitCode.FAILED
            raise
        _end.code = ExitCode.OK
        return result

    return entry  # type: ignore[return-value]


def _end_after_submitit() -> None:
    if _end.uncaught:
        leave(ExitCode.FAILED)
    if _end.code is not None:
        leave(_end.code)
