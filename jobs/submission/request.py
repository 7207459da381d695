"""A job's Slurm request, derived once from a config: ``SlurmRequest.resolve(cfg, partition)``.

Everything Slurm is asked for is decided here and nowhere else: the task layout (one task per rank, or one per node
for a torchrun agent), CPUs per task (``slurm.cpus_per_task``, or its default from the partition's CPUs per GPU),
GPUs (per node, or per task with ``slurm.gpu_bind=task``), the warning signal and requeue, the srun arguments, the
environment every rank starts with, and the command each task starts (behind the prefix that holds the warning
signal), inside the container image when ``slurm.container`` names one (``container_words``). It is step 2 of the
submission pipeline (``jobs.submission.checks.resolve``): resolved once per submission and passed along. The renderer
only lays it out (``jobs.submission.render``: the job's script, an array's, a search's workers', the plain template,
``--dry-run``); the search's trial step takes its srun line (``task_command``), and the partition check its numbers
(``check_fits``).
"""

from __future__ import annotations

import logging
import math
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import ddp_core
from ddp_core import python_m
from ddp_core.cluster import signals
from ddp_core.cluster.exits import ExitCode
from ddp_core.cluster.supervise import MARKER
from ddp_core.config import DEFAULT_CPUS_PER_GPU, Config, ranks_per_node
from ddp_core.errors import DdpJobError
from jobs.submission import partitions as cluster

log = logging.getLogger("ddpjob")

# Each rank gets the CPUs Slurm gave its task: oversubscribed OpenMP threads cost 3x on small nodes.
THREADS_SETUP = "export OMP_NUM_THREADS=${SLURM_CPUS_PER_TASK:-1}"


def cpus_per_rank(cfg: Config, part: Optional[cluster.Partition] = None) -> int:
    """``slurm.cpus_per_task``, or its default: 1 on CPU clusters; on GPU clusters the node's CPUs per GPU (times the
    GPUs each rank drives), from ``part`` when the partition is known, else 4 per GPU."""
    s = cfg.slurm
    if s.cpus_per_task is not None:
        return s.cpus_per_task
    if s.gpus_per_node == 0:
        return 1
    per_gpu = DEFAULT_CPUS_PER_GPU
    if part is not None and part.gpus_per_node > 0:
        per_gpu = max(1, part.cpus_per_node // part.gpus_per_node)
    return per_gpu * max(1, s.gpus_per_node // ranks_per_node(cfg))


def environment(cfg: Config, ranks_per_task: int) -> list[str]:
    """``export`` lines for every rank, set in the batch script (the trainer reads its environment, never writes
    it). A value the user exported before submitting wins (``${VAR:-default}``)."""
    lines = [THREADS_SETUP]
    if ranks_per_task > 1:
        # A torchrun agent's task holds the CPUs of all of its node's ranks: each rank's threads get their share.
        lines = [f"export OMP_NUM_THREADS=$(( ${{SLURM_CPUS_PER_TASK:-{ranks_per_task}}} / {ranks_per_task} ))"]
    if cfg.slurm.gpus_per_node:
        # NCCL errors and timeouts abort the communicator and raise on every rank instead of hanging (torch's
        # default since 2.2; explicit, so an older torch or a site profile cannot turn it off unnoticed).
        lines.append("export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-3}")
        if cfg.train.deterministic:
            # cuBLAS is deterministic only with a fixed workspace; without it use_deterministic_algorithms raises.
            lines.append("export CUBLAS_WORKSPACE_CONFIG=${CUBLAS_WORKSPACE_CONFIG:-:4096:8}")
    return lines


def entry_module(cfg: Config) -> str:
    """What every task runs, ``python -m MODULE RUN_DIR``: the one place that picks the trainer or the user's script.
    The template's srun line runs it; the submitit path calls the same module's ``run(RUN_DIR)``."""
    return "ddp_core.script" if cfg.script.enabled else "ddp_core"


def library_root() -> Path:
    """The folder that holds ``ddp_core``: bound into a container so its ranks import the ddpjob that submitted."""
    return Path(ddp_core.__file__).resolve().parent.parent


def container_binds(cfg: Config, run_root: Path) -> list[str]:
    """Every bind a container job needs, as both runtimes write one (``SRC[:DST[:OPTIONS]]``): the run root (run
    directories, sweeps and code snapshots), ddpjob's own package, both at the same paths, then the config's."""
    return [str(run_root), str(library_root() / "ddp_core"), *cfg.slurm.container.binds]


def container_words(cfg: Config, run_root: Path) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(srun arguments, words before the image's interpreter) that run each task inside ``slurm.container``'s image:
    apptainer as a command in front of the interpreter (``--nv`` with GPUs); pyxis as srun's ``--container-*``
    options. The host's environment crosses in as it is (Slurm's and torchrun's variables; never ``--cleanenv``),
    with ``PYTHONPATH`` naming the bound ddpjob only (the host's would put the host's packages before the image's)."""
    c = cfg.slurm.container
    if c.image is None:
        return (), ()
    binds = container_binds(cfg, run_root)
    pythonpath = f"PYTHONPATH={library_root()}"
    if c.runtime == "pyxis":
        mounts = ",".join(bind if ":" in bind else f"{bind}:{bind}" for bind in binds)  # pyxis wants both paths
        # The task command runs inside the image; pyxis' other options (home mount, workdir) keep the site's defaults.
        return (f"--container-image={c.image}", f"--container-mounts={mounts}"), ("env", pythonpath)
    nv = ("--nv",) if cfg.slurm.gpus_per_node else ()
    return (), ("apptainer", "exec", *nv, "--env", pythonpath, "--bind", ",".join(binds), c.image)


def mem_option(mem_gb: Optional[float]) -> Optional[str]:
    """sbatch's ``--mem`` for ``slurm.mem_gb`` (Slurm's G is 1024 M): whole gigabytes as ``NG``, a fraction in
    megabytes rounded up (sbatch takes no ``0.5GB``: "Invalid --mem specification"); None: the cluster's default."""
    if not mem_gb:
        return None
    return f"{mem_gb:g}G" if float(mem_gb).is_integer() else f"{math.ceil(mem_gb * 1024)}M"


@dataclass(frozen=True)
class SlurmRequest:
    """One job's request, in Slurm's terms. ``resolve`` builds it; nothing else derives these numbers."""

    job_name: str
    min_nodes: int  # slurm.nodes: a count (min == max), or MIN-MAX, which Slurm's --nodes takes as such
    max_nodes: int
    ranks_per_node: int  # processes per node: one per GPU or CPU task, one for dp/model_parallel
    tasks_per_node: int  # Slurm tasks per node (--ntasks-per-node)
    cpus_per_task: int  # CPUs of each task (--cpus-per-task)
    ranks_per_task: int  # processes each task runs: 1 (srun), or the node's ranks (a torchrun agent's workers)
    cpus_per_rank: int  # what the run's config.yaml records as slurm.cpus_per_task
    time_min: int
    gpus_per_node: int  # slurm.gpus_per_node
    # --signal, to every task (no "B:"): each rank sets its flag and they agree; None: no --signal (slurm.signal: none,
    # the trainer's deadline stop alone)
    signal: Optional[str]
    gpus: dict[str, int] = field(default_factory=dict)  # gpus_per_node, or gpus_per_task with gpu_bind=task
    where: dict[str, str] = field(default_factory=dict)  # partition, account, qos, mem: those that are set
    additional: dict[str, Any] = field(default_factory=dict)  # slurm.additional, as sbatch options
    environment: tuple[str, ...] = ()  # export lines every rank starts with
    setup: tuple[str, ...] = ()  # slurm.setup: the config's own lines, after the environment
    srun_args: tuple[str, ...] = ()
    # The interpreter each task starts, behind the signal-holding prefix (and the container's command, if any).
    task_python: tuple[str, ...] = ()
    entry_module: str = "ddp_core"
    host_python: str = sys.executable  # the batch script's own steps (its watcher), on the node, outside any image
    container: tuple[str, ...] = ()  # the words of task_python that start the image ("apptainer exec ... IMAGE")
    spare_nodes: int = 0  # slurm.spare_nodes: allocated beyond min/max_nodes, idle until a node of a step fails
    # --dependency (``submit --after``, a pipeline's steps: jobs.pipelines.after): e.g. afterok:5301,afterany:5302
    dependency: Optional[str] = None

    @classmethod
    def resolve(
        cls,
        cfg: Config,
        part: Optional[cluster.Partition] = None,
        python: str = sys.executable,
        run_root: Optional[Path] = None,
        dependency: Optional[str] = None,
    ) -> SlurmRequest:
        """``python``: the submitting interpreter (the tasks', unless a container's image has its own); ``run_root``:
        the folder of the run directories a container binds in (default: ``run.root``, resolved here); ``dependency``:
        sbatch's ``--dependency``, the jobs this one waits for."""
        s = cfg.slurm
        ranks, per_rank = ranks_per_node(cfg), cpus_per_rank(cfg, part)
        torchrun = cfg.script.enabled and cfg.script.launcher == "torchrun"
        tasks, per_task = (1, ranks) if torchrun else (ranks, 1)
        gpus: dict[str, int] = {}
        if s.gpus_per_node and s.gpu_bind == "task":
            assert per_task == 1, "config validation refuses gpu_bind=task with one task per node"
            gpus["gpus_per_task"] = s.gpus_per_node // ranks  # each task sees only its own GPU(s)
        elif s.gpus_per_node:
            gpus["gpus_per_node"] = s.gpus_per_node  # every task sees all of its node's GPUs
        where = {
            "partition": s.partition,
            "account": s.account,
            "qos": s.qos,
            "mem": mem_option(s.mem_gb),
        }
        container_srun, container = container_words(cfg, run_root or Path(cfg.run.root).resolve())
        task_python = s.container.python if s.container.enabled else python
        return cls(
            job_name=s.job_name or cfg.run.name,
            min_nodes=s.min_nodes,
            max_nodes=s.max_nodes,
            ranks_per_node=ranks,
            tasks_per_node=tasks,
            cpus_per_task=per_rank * per_task,  # a torchrun agent's task holds the CPUs of all of its ranks
            ranks_per_task=per_task,
            cpus_per_rank=per_rank,
            time_min=s.time_min,
            gpus_per_node=s.gpus_per_node,
            signal=f"{s.warning.upper().removeprefix('SIG')}@{s.signal_lead_s}" if s.sends_signal else None,
            gpus=gpus,
            where={k: v for k, v in where.items() if v is not None},
            additional={k.replace("_", "-"): v for k, v in s.additional.items()},
            environment=tuple(environment(cfg, per_task)),
            setup=tuple(s.setup),
            # --kill-on-bad-exit: a rank that exits non-zero takes the whole step down instead of leaving peers
            # blocked in a collective. --cpu-bind: each rank runs on the CPUs Slurm allocated to its task.
            # --cpus-per-task again on srun: since Slurm 22.05 srun does not take it from the allocation
            # (ddp_core.cluster.releases), and a step would give each task one CPU.
            srun_args=(
                "--kill-on-bad-exit=1",
                "--open-mode=append",  # a restarted job step adds to the ranks' logs of the steps before it
                f"--cpu-bind={s.cpu_bind}",
                f"--cpus-per-task={per_rank * per_task}",
                *container_srun,
            ),
            task_python=(*signals.task_prefix(s.warning, python), *container, task_python),
            entry_module=entry_module(cfg),
            host_python=python,
            container=container,
            spare_nodes=s.spare_nodes,
            dependency=dependency,
        )

    @property
    def cpus_per_node(self) -> int:
        return self.tasks_per_node * self.cpus_per_task

    @property
    def elastic(self) -> bool:
        return self.min_nodes != self.max_nodes

    @property
    def nodes(self) -> int | str:
        """``--nodes``: the count, or ``MIN-MAX``, with the spare nodes; the tasks are always per node
        (``--ntasks-per-node``), so an elastic job's task count follows the nodes it got."""
        low, high = self.min_nodes + self.spare_nodes, self.max_nodes + self.spare_nodes
        return low if low == high else f"{low}-{high}"

    @property
    def ranked_nodes(self) -> int | str:
        """``slurm.nodes`` as configured: the nodes the ranks run on, without the spares."""
        return self.min_nodes if not self.elastic else f"{self.min_nodes}-{self.max_nodes}"

    def check_fits(self, part: cluster.Partition) -> None:
        """Raise ``DdpJobError`` naming the key when this request can never be scheduled on ``part``. A range whose
        MAX exceeds the partition can start (Slurm gives at most what the partition has): a warning, not a refusal."""
        if self.min_nodes > part.nodes:
            least = f", and a job needs MIN {self.min_nodes} to start" if self.elastic else ""
            raise DdpJobError(
                f"config key 'slurm.nodes' = {self.ranked_nodes} exceeds partition '{part.name}' "
                f"({part.nodes} nodes{least})",
                f"use slurm.nodes<={part.nodes}" + (f", or a range with MIN<={part.nodes}" if self.elastic else ""),
            )
        if self.min_nodes + self.spare_nodes > part.nodes:
            raise DdpJobError(
                f"config key 'slurm.spare_nodes' = {self.spare_nodes}: with slurm.nodes = {self.ranked_nodes} a job "
                f"needs {self.min_nodes + self.spare_nodes} nodes, and partition '{part.name}' has {part.nodes}",
                f"use slurm.spare_nodes<={max(0, part.nodes - self.min_nodes)}, or a partition with more nodes",
            )
        if self.max_nodes + self.spare_nodes > part.nodes and self.spare_nodes:
            log.warning(
                "slurm.nodes = %s with slurm.spare_nodes = %d: partition '%s' has %d nodes, so the ranks run on at "
                "most %d of them",
                self.ranked_nodes, self.spare_nodes, part.name, part.nodes, part.nodes - self.spare_nodes,
            )  # fmt: skip
        elif self.max_nodes > part.nodes:
            log.warning(
                "slurm.nodes = %s: partition '%s' has %d nodes, so attempts run on at most %d (MAX %d is never "
                "reached); slurm.nodes=%d-%d says so",
                self.ranked_nodes,
                part.name,
                part.nodes,
                part.nodes,
                self.max_nodes,
                self.min_nodes,
                part.nodes,
            )
        if self.gpus_per_node > part.gpus_per_node:
            raise DdpJobError(
                f"config key 'slurm.gpus_per_node' = {self.gpus_per_node} exceeds partition '{part.name}' "
                f"({part.gpus_per_node} GPUs per node)",
                f"use slurm.gpus_per_node<={part.gpus_per_node}, or a GPU partition via slurm.partition",
            )
        if self.cpus_per_node > part.cpus_per_node:
            key = "slurm.gpus_per_node" if self.gpus_per_node else "slurm.tasks_per_node"
            raise DdpJobError(
                f"config key '{key}' = {self.ranks_per_node} ranks x slurm.cpus_per_task = {self.cpus_per_rank} needs "
                f"{self.cpus_per_node} CPUs per node; partition '{part.name}' nodes have {part.cpus_per_node}",
                "lower tasks_per_node or cpus_per_task, or add nodes",
            )

    def sbatch_options(self) -> dict[str, Any]:
        """The #SBATCH options, by their sbatch names (the template's lines)."""
        return {
            "job-name": self.job_name,
            "nodes": self.nodes,
            "ntasks-per-node": self.tasks_per_node,
            "cpus-per-task": self.cpus_per_task,
            "time": self.time_min,
            **{k.replace("_", "-"): v for k, v in {**self.where, **self.gpus}.items()},
            **({"signal": self.signal} if self.signal else {}),
            "requeue": True,
            # With a node to run without (a spare, or fewer for an elastic job), a node that dies does not end the
            # allocation: the batch script's next job step runs without it. Not otherwise: Slurm (22.05) keeps a
            # --no-kill job RUNNING, with nothing left in it, when its batch node dies, while without it Slurm ends and
            # requeues the job (NODE_FAIL), so the batch node's death goes through the queue.
            **({"no-kill": True} if self.spare_nodes or self.elastic else {}),
            # A dependency that can never be satisfied (the earlier job failed, for afterok) cancels this job rather
            # than leave it pending forever (Slurm's default: reason DependencyNeverSatisfied).
            **({"dependency": self.dependency, "kill-on-invalid-dep": "yes"} if self.dependency else {}),
            **self.additional,
        }

    def watch_lines(self, run_dir: str, batch_log: str, module_runner: Optional[str] = None) -> list[str]:
        """The batch script's first lines: this attempt's marker in its log, the EXIT trap that hands a failed status
        to the attempt's watcher (``ddp_core.cluster.supervise``), the start check of a requeued attempt, and
        ``ddpjob_steps``, which runs the job steps: srun, and again in the same allocation after an infrastructure
        failure the watcher restarts there (within ``slurm.max_restarts``), else as the watcher decided.
        ``run_dir``, ``batch_log`` and ``module_runner`` (what runs a module, as ``python -m`` would): shell words
        (quoted paths, or expansions evaluated when the trap runs); it defaults to the submitting interpreter
        (outside any container: the watcher may requeue the job, which needs Slurm's commands) with
        ``ddp_core.python_m``'s words, which a user's ``ddp_core.py`` in the submit directory cannot shadow."""
        marker = MARKER.format(restart="${SLURM_RESTART_COUNT:-0}", job="${SLURM_JOB_ID}")
        runner = module_runner or shlex.join([self.host_python, *python_m.RUN_MODULE])
        return [
            f'echo "{marker} on $(hostname)" >&2',
            # Python starts only after a failure: a job that trained to its end ends as srun did, whatever happens.
            f'ddpjob_watch() {{ [ "$1" = 0 ] && exit 0; {runner} ddp_core.cluster.supervise {run_dir} {batch_log} '
            '"$1"; exit $?; }',
            "trap 'ddpjob_watch $?' EXIT",
            # A requeued attempt first accounts for a previous one that a node's death ended (node_loss); a non-zero
            # answer ends this attempt before srun, already decided: the watcher has nothing to add. ALREADY_COMPLETE:
            # the run had completed (Slurm 24.11's extra requeue), the job ends COMPLETED.
            'ddpjob_begin() { [ "${SLURM_RESTART_COUNT:-0}" = 0 ] && return 0; '
            f"{runner} ddp_core.cluster.supervise --begin {run_dir} && return 0; "
            f'set -- $?; trap - EXIT; [ "$1" = {int(ExitCode.ALREADY_COMPLETE)} ] && exit 0; exit $1; }}',
            # The job steps: `ddpjob_steps srun ARGS...` runs srun, and after a failure asks the watcher, which either
            # restarts the ranks in this allocation (exit RESTART, printing the next step's srun options: its nodes)
            # or ends the attempt as it decided (a requeue, a failure); srun's first step leaves the spares idle.
            f"ddpjob_steps() {{ local launch=0 code next picked=({self.first_step_options()}); while :; do "
            'export DDPJOB_LAUNCH=$launch; "$1" "${picked[@]}" "${@:2}" && exit 0; code=$?; next=0; '
            f'picked=($({runner} ddp_core.cluster.supervise --in-allocation {run_dir} {batch_log} "$code")) || '
            f'next=$?; [ "$next" = {int(ExitCode.RESTART)} ] || {{ trap - EXIT; exit "$next"; }}; '
            f'launch=$((launch + 1)); echo "{marker} on $(hostname), job step $launch" >&2; done; }}',
        ]

    def first_step_options(self) -> str:
        """srun's options for an attempt's first job step, as shell words: with spare nodes, all but the spares, and
        the batch node among the spares (it runs the batch script and its watcher: a rank's failure never takes them
        down with it); without, none (srun takes the whole allocation)."""
        if not self.spare_nodes:
            return ""
        nodes = f"$((SLURM_JOB_NUM_NODES - {self.spare_nodes}))"
        return f'--nodes={nodes} --ntasks=$(({nodes} * {self.tasks_per_node})) --exclude="$(hostname)"'

    def task_command(self) -> list[str]:
        """What each task runs, before its run directory: ``python -u -m MODULE`` behind the prefix, in the form a
        user's file in the submit directory cannot shadow (``ddp_core.python_m``)."""
        return [*self.task_python, "-u", *python_m.words(self.entry_module)]
