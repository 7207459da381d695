"""Turn a validated config into a Slurm job: sbatch parameters, submitit executor, the run directory.

The login node validates everything (config, task import and keys, the request against the partition)
before it creates a run directory; if submission fails the directory is removed, so a rejected submit
leaves nothing behind.
"""

from __future__ import annotations

import shlex
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from ddp_core.cluster import signals
from ddp_core.cluster.slurm import GATEWAY
from ddp_core.config import DEFAULT_CPUS_PER_GPU, Config, ranks_per_node
from ddp_core.errors import DdpJobError
from ddp_core.run.rundir import RunDir, atomic_write_text
from jobs import cluster, snapshot

# Each rank gets the CPUs Slurm gave its task: oversubscribed OpenMP threads cost 3x on small nodes.
THREADS_SETUP = "export OMP_NUM_THREADS=${SLURM_CPUS_PER_TASK:-1}"


def environment(cfg: Config) -> list[str]:
    """``export`` lines for every rank, set in the batch script (the trainer reads its environment, never writes
    it). A value the user exported before submitting wins (``${VAR:-default}``)."""
    lines = [THREADS_SETUP]
    ranks = task_layout(cfg).ranks_per_task
    if ranks > 1:
        # A torchrun agent's task holds the CPUs of all of its node's ranks: each rank's threads get their share.
        lines = [f"export OMP_NUM_THREADS=$(( ${{SLURM_CPUS_PER_TASK:-{ranks}}} / {ranks} ))"]
    if cfg.slurm.gpus_per_node:
        # NCCL errors and timeouts abort the communicator and raise on every rank instead of hanging (torch's
        # default since 2.2; explicit, so an older torch or a site profile cannot turn it off unnoticed).
        lines.append("export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-3}")
        if cfg.train.deterministic:
            # cuBLAS is deterministic only with a fixed workspace; without it use_deterministic_algorithms raises.
            lines.append("export CUBLAS_WORKSPACE_CONFIG=${CUBLAS_WORKSPACE_CONFIG:-:4096:8}")
    return lines


def srun_args(cfg: Config) -> list[str]:
    # --kill-on-bad-exit: a rank that exits non-zero takes the whole step down instead of leaving peers blocked
    # in a collective. --cpu-bind: each rank runs on the CPUs Slurm allocated to its task.
    return ["--kill-on-bad-exit=1", f"--cpu-bind={cfg.slurm.cpu_bind}"]


def cpus_per_task(cfg: Config, part: Optional[cluster.Partition] = None) -> int:
    """``slurm.cpus_per_task``, or its default: 1 on CPU clusters; on GPU clusters the node's CPUs per GPU
    (times the GPUs each rank drives), from ``part`` when the partition is known, else 4 per GPU."""
    s = cfg.slurm
    if s.cpus_per_task is not None:
        return s.cpus_per_task
    if s.gpus_per_node == 0:
        return 1
    per_gpu = DEFAULT_CPUS_PER_GPU
    if part is not None and part.gpus_per_node > 0:
        per_gpu = max(1, part.cpus_per_node // part.gpus_per_node)
    return per_gpu * max(1, s.gpus_per_node // ranks_per_node(cfg))


@dataclass(frozen=True)
class TaskLayout:
    """How a node's ranks map onto Slurm tasks."""

    tasks_per_node: int  # Slurm tasks per node (--ntasks-per-node)
    cpus_per_task: int  # CPUs of each task (--cpus-per-task)
    ranks_per_task: int  # processes each task runs: 1 (srun), or the node's ranks (a torchrun agent's workers)


def task_layout(cfg: Config, part: Optional[cluster.Partition] = None) -> TaskLayout:
    """One task per rank (srun: each task is a rank), or with ``script.launcher: torchrun`` one task per node that
    holds the CPUs of all of the node's ranks (its torchrun agent starts them). ``slurm.cpus_per_task`` stays the
    CPUs of one rank either way, so a node's request is the same size in both."""
    ranks, per_rank = ranks_per_node(cfg), cpus_per_task(cfg, part)
    if cfg.script.enabled and cfg.script.launcher == "torchrun":
        return TaskLayout(tasks_per_node=1, cpus_per_task=ranks * per_rank, ranks_per_task=ranks)
    return TaskLayout(tasks_per_node=ranks, cpus_per_task=per_rank, ranks_per_task=1)


def sbatch_parameters(cfg: Config) -> dict[str, Any]:
    """The job's one Slurm request (submitit SlurmExecutor parameters, Slurm's own names): one task per rank, or one
    per node for a torchrun agent (``task_layout``). The submitit path, the sbatch template, ``--dry-run`` and sweeps
    all render from it."""
    s = cfg.slurm
    ranks = ranks_per_node(cfg)
    layout = task_layout(cfg)
    params: dict[str, Any] = {
        "job_name": s.job_name or cfg.run.name,
        "nodes": s.nodes,
        "ntasks_per_node": layout.tasks_per_node,
        "cpus_per_task": layout.cpus_per_task,
        "time": s.time_min,
        "setup": [*environment(cfg), *s.setup],
        "srun_args": srun_args(cfg),
    }
    gpus: dict[str, Any] = {}
    if s.gpus_per_node and s.gpu_bind == "task":
        assert layout.ranks_per_task == 1, "validate_config refuses gpu_bind=task with one task per node"
        gpus["gpus_per_task"] = s.gpus_per_node // ranks  # each task sees only its own GPU(s)
    elif s.gpus_per_node:
        gpus["gpus_per_node"] = s.gpus_per_node  # every task sees all of its node's GPUs
    optional = {
        "partition": s.partition,
        "account": s.account,
        "qos": s.qos,
        "mem": f"{s.mem_gb:g}GB" if s.mem_gb else None,
        **gpus,
    }
    params.update({k: v for k, v in optional.items() if v is not None})
    extra: dict[str, Any] = {
        # To every task, not only the batch shell (no "B:"): each rank sets its flag and they agree.
        "signal": f"{s.signal.upper().removeprefix('SIG')}@{s.signal_lead_s}",
        "requeue": True,
    }
    extra.update({k.replace("_", "-"): v for k, v in s.additional.items()})
    params["additional_parameters"] = extra
    return params


def task_python(cfg: Config, python: str = sys.executable) -> list[str]:
    """The interpreter every task starts, ``python`` behind the prefix that makes it hold the warning signal and
    SIGTERM from its first instruction (``ddp_core.cluster.signals``). Every renderer's task command starts with it."""
    return [*signals.task_prefix(cfg.slurm.signal, python), python]


def submitit_python(cfg: Config, python: str = sys.executable) -> str:
    """``task_python`` as submitit's ``python`` parameter: the start of its task command, a shell word list."""
    return shlex.join(task_python(cfg, python))


def submitit_command(cfg: Config, folder: Path, python: str = sys.executable) -> str:
    """The task command submitit puts on its srun line (its executor builds the same from ``submitit_python``):
    what ``--dry-run`` shows for a run and for a sweep's array."""
    return f"{submitit_python(cfg, python)} -u -m submitit.core._submit {shlex.quote(str(folder))}"


def entry_module(cfg: Config) -> str:
    """What every task runs, ``python -m MODULE RUN_DIR``: the one place that picks the trainer or the user's script.
    The template's srun line runs it; the submitit path calls the same module's ``run(RUN_DIR)`` (task_function)."""
    return "ddp_core.script" if cfg.script.enabled else "ddp_core"


def task_function(cfg: Config) -> Callable[[str], Any]:
    """``entry_module``'s ``run(run_dir)``, which submitit pickles and calls on every task."""
    if entry_module(cfg) == "ddp_core.script":
        from ddp_core.script.mode import run as run_script

        return run_script
    from ddp_core.launch import run  # torch: imported at submit only, as before

    return run


def render_submitit_script(cfg: Config, run_dir: RunDir, python: str = sys.executable) -> str:
    """The exact sbatch script ``submit`` would hand to sbatch (submitit's own renderer)."""
    from submitit.slurm.slurm import _make_sbatch_string

    command = submitit_command(cfg, run_dir.slurm, python)
    return _make_sbatch_string(command=command, folder=run_dir.slurm, **sbatch_parameters(cfg))


def check_cluster(cfg: Config) -> cluster.Partition:
    """Check the request against the partition; fills ``slurm.cpus_per_task`` (when null) from its nodes."""
    part = cluster.pick_partition(cluster.query_partitions(), cfg.slurm.partition)
    cfg.slurm.cpus_per_task = cpus_per_task(cfg, part)
    layout = task_layout(cfg, part)
    cluster.check_request(cfg.slurm, part, ranks_per_node(cfg), layout.tasks_per_node * layout.cpus_per_task)
    return part


def validate_for_submit(cfg: Config, local: bool, cluster_check: bool = True) -> None:
    """Everything that can be checked before a run directory exists. Resolves ``slurm.cpus_per_task``."""
    if cfg.script.enabled:
        # The user's script is the job: it must be there and readable now; its absolute path and hash are recorded.
        from ddp_core.script.prepare import resolve_for_submit

        resolve_for_submit(cfg.script)
    else:
        from ddp_core.strategies.check import check_model  # the strategy's cut of a meta-device model
        from ddp_core.tasks.base import check_task  # imports the user's task module (and torch): submit-time only

        check_task(cfg.task)
        check_model(cfg)
    if local and cfg.slurm.nodes > 1:
        raise DdpJobError("config key 'slurm.nodes' > 1 cannot run with --local", "drop --local or set slurm.nodes=1")
    if not local and cluster_check:
        check_cluster(cfg)
    cfg.slurm.cpus_per_task = cpus_per_task(cfg)  # the request's value, recorded in the run's config.yaml


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

    if local:
        executor: submitit.Executor = submitit.LocalExecutor(folder=run_dir.slurm)
        executor.update_parameters(
            tasks_per_node=task_layout(cfg).tasks_per_node, timeout_min=cfg.slurm.time_min, setup=environment(cfg)
        )
        return executor
    executor = submitit.SlurmExecutor(folder=run_dir.slurm, python=submitit_python(cfg))
    executor.update_parameters(**sbatch_parameters(cfg))
    return executor


def submit(cfg: Config, run_dir: RunDir, local: bool = False, fresh: bool = True) -> Submitted:
    """Initialise ``run_dir`` (a new one when ``fresh``) and submit the trainer (or the config's script) on it. A
    failed submission leaves no job behind, and no run directory (fresh) or the run's config as it was (resume)."""
    run = task_function(cfg)
    # Sized before anything exists (too big: refused here). A resumed run keeps the code it was submitted with.
    code = snapshot.plan(cfg) if fresh else None
    previous = None if fresh or not run_dir.config_file.exists() else run_dir.config_file.read_text()
    run_dir.initialize(cfg)
    before = set() if fresh or local else set(GATEWAY.queued_from(run_dir.slurm))
    try:
        snapshot.take(code, run_dir)
        job = make_executor(cfg, run_dir, local).submit(run, str(run_dir.path))
    except Exception as err:
        withdrawn = [] if local else withdraw(run_dir.slurm, before, err)
        if fresh:
            shutil.rmtree(run_dir.path, ignore_errors=True)
        elif previous is not None:  # a resume that did not submit leaves the run's config as it was
            atomic_write_text(run_dir.config_file, previous)
        cancelled = f" (cancelled job {', '.join(withdrawn)}, which sbatch had queued)" if withdrawn else ""
        raise DdpJobError(f"submission failed: {reason(err)}{cancelled}") from err
    run_dir.record_job(str(job.job_id), "local" if local else "submitit")
    return Submitted(job, run_dir)


def reason(err: BaseException) -> str:
    """One line for a failed submission: sbatch's last error line, else the first line of what submitit said."""
    lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower()]
    return errors[-1] if errors else lines[0] if lines else type(err).__name__


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
    """Poll squeue (cheap, unlike sacct) until the job left the queue; then its final sacct state."""
    while GATEWAY.squeue_ids([job_id]):
        time.sleep(poll_s)
    for _ in range(20):  # accounting lags the queue by a moment
        state = slurm_state(job_id)
        if state and state not in {"RUNNING", "PENDING", "COMPLETING", "REQUEUED"}:
            return state
        time.sleep(poll_s)
    return slurm_state(job_id) or "UNKNOWN"


def wait(submitted: Submitted) -> tuple[bool, Optional[dict[str, float]], str]:
    """Block until the job ends: (succeeded, final eval metrics, state or error line)."""
    import submitit

    job = submitted.job
    job.wait()
    error: Optional[str] = None
    result = None
    try:
        result = job.results()[0]  # one result per task; rank 0's holds the final eval
    except Exception as err:  # submitit raises its own errors for failed jobs
        lines = [line for line in str(err).strip().splitlines() if line.strip()]
        error = lines[-1] if lines else type(err).__name__
    if isinstance(job, submitit.SlurmJob):
        # Result files appear before the ranks have torn down: --wait returns once Slurm says the job ended.
        state = wait_until_gone(submitted.job_id)
        if error is None and state != "COMPLETED":
            error = state
    if error is not None:
        return False, None, error
    return True, result, "COMPLETED"
