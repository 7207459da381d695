"""Turn a validated config into a Slurm job: sbatch parameters, submitit executor, the run directory.

The login node validates everything (config, task import and keys, the request against the partition)
before it creates a run directory; if submission fails the directory is removed, so a rejected submit
leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import logging
import shlex
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from ddp_core.cluster.slurm import GATEWAY
from ddp_core.config import Config
from ddp_core.errors import DdpJobError
from ddp_core.run.rundir import RunDir, atomic_write_text
from jobs.submission import partitions as cluster
from jobs.submission import snapshot
from jobs.submission.request import SlurmRequest, entry_module

log = logging.getLogger(__name__)
RESULT_GRACE_S = 15.0  # submitit's own wait for a result file on a slow shared file system


def submitit_command(request: SlurmRequest, folder: Path) -> str:
    """The task command submitit puts on its srun line (its executor builds the same from ``submitit_python``):
    what ``--dry-run`` shows for a run and for a sweep's array."""
    return f"{request.submitit_python()} -u -m submitit.core._submit {shlex.quote(str(folder))}"


def task_function(cfg: Config) -> Callable[[str], Any]:
    """``entry_module``'s ``run(run_dir)``, which submitit pickles and calls on every task."""
    if entry_module(cfg) == "ddp_core.script":
        from ddp_core.script.mode import run as run_script

        return run_script
    from ddp_core.launch import run  # torch: imported at submit only, as before

    return run


def render_submitit_script(cfg: Config, run_dir: RunDir, python: str = sys.executable) -> str:
    """The exact sbatch script ``submit`` would hand to sbatch (submitit's own renderer)."""
    from submitit.slurm.slurm import _make_sbatch_string  # pinned: pyproject.toml, and a real job's test compares

    request = SlurmRequest.resolve(cfg, python=python, run_root=run_dir.path.parent)
    return _make_sbatch_string(
        command=submitit_command(request, run_dir.slurm),
        folder=run_dir.slurm,
        **request.submitit_parameters(run_dir.path),
    )


def check_cluster(cfg: Config) -> cluster.Partition:
    """Check the request against the partition; fills ``slurm.cpus_per_task`` (when null) from its nodes."""
    part = cluster.pick_partition(cluster.query_partitions(), cfg.slurm.partition)
    request = SlurmRequest.resolve(cfg, part)
    cfg.slurm.cpus_per_task = request.cpus_per_rank
    request.check_fits(part)
    return part


def check_code(cfg: Config) -> None:
    """The code one run will import, checked here, whichever way it is submitted (``submit``, ``resume``, each
    distinct trial of a sweep, a search's base config): the script (it must be there and readable now; its absolute
    path and sha256 are recorded), or the task (its module imported, with torch) and the strategy's cut of its model
    (a meta-device model: fsdp wrap classes, pipeline stages, ties across stages)."""
    if cfg.script.enabled:
        from ddp_core.script.prepare import resolve_for_submit

        resolve_for_submit(cfg.script)
        return
    from ddp_core.strategies.check import check_model
    from ddp_core.tasks.base import check_task

    check_task(cfg.task)
    check_model(cfg)


def absolute_image(cfg: Config) -> None:
    """An image file's path made absolute, as the config records it: the nodes do not start where ddpjob ran."""
    container = cfg.slurm.container
    if container.image_is_file:
        container.image = str(Path(str(container.image)).absolute())


def check_cluster_side(cfg: Config) -> None:
    """What the cluster must hold for the run, asked of it (``sinfo``, the image's file): the partition fits the
    request (filling ``slurm.cpus_per_task`` when null), and the container image is there."""
    check_cluster(cfg)
    cluster.check_image(cfg.slurm.container)


def validate_for_submit(cfg: Config, local: bool, cluster_check: bool = True) -> None:
    """Everything that can be checked before a run directory exists. Resolves ``slurm.cpus_per_task``."""
    check_code(cfg)
    if local and cfg.slurm.max_nodes > 1:
        raise DdpJobError(
            f"config key 'slurm.nodes' = {cfg.slurm.nodes!r}: more than one node cannot run with --local",
            "drop --local or set slurm.nodes=1",
        )
    container = cfg.slurm.container
    if local and container.enabled:
        raise DdpJobError(
            f"config key 'slurm.container.image' = {container.image!r}: --local runs the ranks as processes here, "
            "not inside an image",
            "drop --local, or set slurm.container.image=null to run locally without the image",
        )
    absolute_image(cfg)
    if not local and cluster_check:
        check_cluster_side(cfg)
    cfg.slurm.cpus_per_task = SlurmRequest.resolve(cfg).cpus_per_rank  # the request's, recorded in config.yaml


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


def make_executor(cfg: Config, run_dir: RunDir, local: bool) -> Any:
    import submitit

    request = SlurmRequest.resolve(cfg, run_root=run_dir.path.parent)
    if local:
        executor: submitit.Executor = submitit.LocalExecutor(folder=run_dir.slurm)
        executor.update_parameters(
            tasks_per_node=request.tasks_per_node, timeout_min=request.time_min, setup=list(request.environment)
        )
        return executor
    executor = submitit.SlurmExecutor(folder=run_dir.slurm, python=request.submitit_python())
    executor.update_parameters(**request.submitit_parameters(run_dir.path))
    return executor


def submit(cfg: Config, run_dir: RunDir, local: bool = False, fresh: bool = True) -> Submitted:
    """Initialise ``run_dir`` (a new one when ``fresh``) and submit the trainer (or the config's script) on it. A
    failed submission leaves no job behind, and no run directory (fresh) or the run's config as it was (resume)."""
    run = task_function(cfg)
    # Sized before anything exists (too big: refused here). A resumed run keeps the code it was submitted with.
    code = snapshot.plan(cfg) if fresh else None
    previous = None if fresh or not run_dir.config_file.exists() else run_dir.config_file.read_text()
    run_dir.initialize(cfg)

    def undo() -> None:
        if fresh:
            shutil.rmtree(run_dir.path, ignore_errors=True)
        elif previous is not None:  # a resume that did not submit leaves the run's config as it was
            atomic_write_text(run_dir.config_file, previous)

    with submitted_or_withdrawn(run_dir.slurm, "submission", undo=undo, queued=not local, new_folder=fresh):
        snapshot.take(code, run_dir)
        job = make_executor(cfg, run_dir, local).submit(run, str(run_dir.path))
    run_dir.record_job(str(job.job_id), "local" if local else "submitit")
    return Submitted(job, run_dir)


def reason(err: BaseException) -> str:
    """One line for a failed submission: sbatch's last error line, else the first line of what submitit said."""
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
        raise DdpJobError(f"{what} failed: {reason(err)}{cancelled}{earlier}", hint) from err


def withdraw(folder: Path, before: set[str], err: BaseException) -> list[str]:
    """Cancel the jobs queued from ``folder`` since ``before``: submitit still moves files and writes the job id
    after sbatch accepts a job, and a job whose submission then failed cannot start correctly. Returns their ids;
    raises if scancel fails, so the caller keeps what the job needs and the user learns its id."""
    stray = [job_id for job_id in GATEWAY.queued_from(folder) if job_id not in before]
    if stray and GATEWAY.cancel(stray).returncode != 0:
        raise DdpJobError(
            f"submission failed after sbatch queued job {', '.join(stray)}, which could not be cancelled: "
            f"{reason(err)}",
            f"scancel {' '.join(stray)}",
        ) from err
    return stray


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
