"""Step 4 of the submission pipeline, the same for every way in: queue the rendered script (``queue``: sbatch
through the Slurm gateway, with each task's pickled call where submitit's job entry reads it), inside one
submit-or-withdraw (``submitted_or_withdrawn``): a submission that fails cancels what sbatch had queued and puts back
what it had created, so a rejected submit leaves nothing behind. ``submit`` is one run's (``submit``, ``resume``,
``--local``); a sweep's arrays and a search's workers call ``queue`` themselves.

submitit's public pieces carry the call and read its outcome: ``DelayedSubmission`` (the pickled function and its
arguments), ``SlurmJob`` (the job's logs and results, for ``--wait``) and, for ``--local``, ``LocalExecutor``.
"""

from __future__ import annotations

import contextlib
import logging
import re
import shlex
import shutil
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

from ddp_core.cluster.slurm import GATEWAY
from ddp_core.config import Config
from ddp_core.errors import DdpJobError
from ddp_core.run.rundir import RunDir, atomic_write_text
from jobs.submission import limits, snapshot
from jobs.submission.render import Layout, render
from jobs.submission.request import SlurmRequest, entry_module

if TYPE_CHECKING:
    from submitit.core.utils import DelayedSubmission

log = logging.getLogger(__name__)
# A task that times out is requeued by submitit's job entry at most this often: submitit's default, kept.
MAX_TIMEOUTS = 3
SUBMITTED = re.compile(r"job (\d+)")  # sbatch's answer: "Submitted batch job 5301"


def task_function(cfg: Config) -> Callable[[str], Any]:
    """``entry_module``'s ``run(run_dir)``, which submitit pickles and calls on every task."""
    if entry_module(cfg) == "ddp_core.script":
        from ddp_core.script.mode import run as run_script

        return run_script
    from ddp_core.launch import run  # torch: imported at submit only, as before

    return run


@dataclass
class Submitted:
    job: Any  # submitit Job
    run_dir: RunDir

    @property
    def job_id(self) -> str:
        return str(self.job.job_id)

    @property
    def log_path(self) -> Path:
        return Path(self.job.paths.stderr)


def submit(cfg: Config, request: SlurmRequest, run_dir: RunDir, local: bool = False, fresh: bool = True) -> Submitted:
    """Initialise ``run_dir`` (a new one when ``fresh``: ``create_run_dir``'s) and submit the trainer (or the config's
    script) on it, as ``request`` asks. A failed submission leaves no job behind, and no run directory (fresh) or the
    run's config as it was (resume); it removes only a directory it created (``RunDir.created``)."""
    from submitit.core.utils import DelayedSubmission

    call = DelayedSubmission(task_function(cfg), str(run_dir.path))
    # Sized before anything exists (too big: refused here). A resumed run keeps the code it was submitted with.
    code = snapshot.plan(cfg) if fresh else None
    previous = None if fresh or not run_dir.config_file.exists() else run_dir.config_file.read_text()
    run_dir.initialize(cfg)

    def undo() -> None:
        if fresh and run_dir.created:  # never a directory this command did not make (another run's)
            shutil.rmtree(run_dir.path, ignore_errors=True)
        elif previous is not None:  # a resume that did not submit leaves the run's config as it was
            atomic_write_text(run_dir.config_file, previous)

    with submitted_or_withdrawn(run_dir.slurm, "submission", undo=undo, queued=not local, new_folder=fresh):
        snapshot.take(code, run_dir)
        if local:
            job = run_here(request, run_dir, call)
        else:
            (job,) = queue(request, Layout.run(run_dir.path), [call])
    run_dir.record_job(str(job.job_id), "local" if local else "submitit")
    return Submitted(job, run_dir)


def run_here(request: SlurmRequest, run_dir: RunDir, call: DelayedSubmission) -> Any:
    """``--local``: the run's tasks as processes on this machine (submitit's ``LocalExecutor``), no Slurm. Each task
    runs ``ddp_core.run.entry``, as a batch script's do: the pickled call is checked before it is loaded."""
    import submitit

    class CheckedLocalExecutor(submitit.LocalExecutor):
        @property
        def _submitit_command_str(self) -> str:  # submitit's hook for the task command (its _submit's, otherwise)
            return " ".join([self.python, "-u -m ddp_core.run.entry", shlex.quote(str(self.folder))])

    executor = CheckedLocalExecutor(folder=run_dir.slurm)
    executor.update_parameters(
        tasks_per_node=request.tasks_per_node, timeout_min=request.time_min, setup=list(request.environment)
    )
    return executor.submit(call.function, *call.args)


def queue(request: SlurmRequest, layout: Layout, calls: Sequence[DelayedSubmission]) -> list[Any]:
    """Render ``request`` in ``layout`` and sbatch it through the Slurm gateway: one job, or for an array layout an
    array of ``len(calls)`` tasks (even of one). Each task's call is pickled where submitit's job entry waits for it
    (``<job id>_submitted.pkl``) once sbatch has named the job; returns a submitit ``SlurmJob`` per call. Raises with
    sbatch's own message when it refuses, or when its answer names no job."""
    import submitit

    array, folder = layout.count is not None, layout.folder
    assert not array or layout.count == len(calls), "an array's layout counts its calls"
    folder.mkdir(parents=True, exist_ok=True)
    pickles = []
    for call in calls:
        pickles.append(folder / f"{uuid.uuid4().hex}.pkl")
        call.set_timeout(request.time_min, MAX_TIMEOUTS)
        call.dump(pickles[-1])
    path = folder / f".submission_file_{uuid.uuid4().hex}.sh"
    path.write_text(render(request, layout))
    answer = GATEWAY.sbatch(path)
    if answer.returncode != 0:
        raise RuntimeError(answer.stderr.strip() or f"sbatch exited {answer.returncode}")
    found = SUBMITTED.search(answer.stdout)
    if found is None:
        raise RuntimeError(f"sbatch's answer names no job id: {answer.stdout.strip()!r}")
    ids = [f"{found[1]}_{i}" for i in range(len(calls))] if array else [found[1]]
    tasks = list(range(request.min_nodes * request.tasks_per_node))
    jobs: list[Any] = [submitit.SlurmJob(folder=folder, job_id=job_id, tasks=tasks) for job_id in ids]
    for job, pickle in zip(jobs, pickles, strict=True):
        job.paths.move_temporary_file(pickle, "submitted_pickle")
    jobs[0].paths.move_temporary_file(path, "submission_file", keep_as_symlink=True)
    return jobs


def reason(err: BaseException) -> str:
    """One line for a failed submission: sbatch's last error line, else the first line of the error."""
    lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower()]
    return errors[-1] if errors else lines[0] if lines else type(err).__name__


@contextlib.contextmanager
def submitted_or_withdrawn(
    folder: Path,
    what: str,
    hint: str = "",
    undo: Callable[[], None] = lambda: None,
    earlier: str = "",
    queued: bool = True,
    new_folder: bool = False,
    unit: str = "job",
) -> Iterator[None]:
    """Submit-or-withdraw, for every way in (a run, a sweep's arrays, a search's workers): when the ``with`` block's
    submission fails, the jobs sbatch queued from ``folder`` meanwhile are cancelled (``withdraw``), ``undo`` puts
    back what the submission had created, and the failure is one line: ``WHAT failed: why (cancelled job N, which
    sbatch had queued)``, plus ``earlier`` (what went out before this one). ``queued``: False where nothing goes
    through sbatch (``--local``); ``new_folder``: nothing can be queued from it yet (no squeue to ask); ``unit``: what
    one sbatch queues (a ``job``, an ``array``)."""
    before = set(GATEWAY.queued_from(folder)) if queued and not new_folder else set()
    try:
        yield
    except Exception as err:
        withdrawn = withdraw(folder, before, err) if queued else []
        undo()
        cancelled = f" (cancelled {unit} {', '.join(withdrawn)}, which sbatch had queued)" if withdrawn else ""
        why, fix = limits.refusal(str(err)) or (reason(err), hint)  # a site's limit: named, with its fix
        raise DdpJobError(f"{what} failed: {why}{cancelled}{earlier}", fix) from err


def withdraw(folder: Path, before: set[str], err: BaseException) -> list[str]:
    """Cancel the jobs queued from ``folder`` since ``before``: the submission still moves files (the pickled calls,
    the script) after sbatch accepts a job, and a job whose submission then failed cannot start correctly. Returns
    their ids; raises if scancel fails, so the caller keeps what the job needs and the user learns its id."""
    stray = [job_id for job_id in GATEWAY.queued_from(folder) if job_id not in before]
    if stray and GATEWAY.cancel(stray).returncode != 0:
        raise DdpJobError(
            f"submission failed after sbatch queued job {', '.join(stray)}, which could not be cancelled: "
            f"{reason(err)}",
            f"scancel {' '.join(stray)}",
        ) from err
    return stray


def print_submitted(sub: Submitted) -> None:
    """What ``submit`` and ``resume`` print once the job is queued."""
    print(f"job:     {sub.job_id}")
    print(f"run dir: {sub.run_dir.path}")
    print(f"log:     {sub.log_path}")
    sys.stdout.flush()
