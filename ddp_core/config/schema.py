"""The config schema: every section of a run's config as a dataclass, with its defaults and what each key means.

Torch-free and OmegaConf-free: ``load`` builds these from YAML and overrides, ``validate`` checks ranges and
combinations. The sections of features besides training (script, snapshot, watchdog, trial) are in ``features``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Dict, List, Optional, Union

from ddp_core.config.container import ContainerConfig
from ddp_core.config.input import MISSING
from ddp_core.config.nodes import node_range
from ddp_core.config.perf import ProfileConfig


class StrategyName(str, Enum):
    ddp = "ddp"  # one process per GPU, gradients all-reduced during backward; the only one that spans nodes
    dp = "dp"  # torch.nn.DataParallel: one process per node drives its GPUs with threads; single node
    model_parallel = "model_parallel"  # consecutive layers on different GPUs of one process; single node
    fsdp = "fsdp"  # FSDP2: parameters, gradients and optimizer state sharded over the ranks
    pipeline = "pipeline"  # torch.distributed.pipelining: the model's blocks cut into stages across ranks


# Strategies whose single process per node drives all of that node's GPUs (no process group across nodes).
SINGLE_PROCESS_STRATEGIES = (StrategyName.dp, StrategyName.model_parallel)
PIPELINE_SCHEDULES = ("gpipe", "1f1b")
# strategy.mixed_precision values: fsdp's parameter dtype during forward/backward (gradients reduce in fp32).
MIXED_PRECISION = ("bf16",)
SINGLE_UNIT = ("warn", "fail")  # strategy.single_unit
MODEL_OPTION_STRATEGIES = (StrategyName.ddp, StrategyName.fsdp)  # activation_checkpointing, train.compile


class Precision(str, Enum):
    fp32 = "fp32"  # no autocast
    bf16 = "bf16"  # autocast to bfloat16
    # autocast to float16 with a GradScaler (its state is checkpointed): GPUs without bf16; ddp, dp and
    # model_parallel only
    fp16 = "fp16"


class OptimizerName(str, Enum):
    adamw = "adamw"
    sgd = "sgd"


class OptimizerImpl(str, Enum):
    """How torch.optim runs the update (torch.optim's ``foreach``/``fused`` arguments)."""

    # one parameter at a time, in Python: torch's own default on a CPU; bitwise the same result as foreach
    for_loop = "for_loop"
    foreach = "foreach"  # all parameters per operation (torch's default on a GPU; ddpjob's on every device)
    fused = "fused"  # one kernel per step: fastest, but its rounding differs from the other two


class Schedule(str, Enum):
    constant = "constant"  # optim.lr throughout
    cosine = "cosine"  # cosine decay from optim.lr to optim.min_lr at train.max_steps
    linear = "linear"  # linear decay from optim.lr to optim.min_lr at train.max_steps


class WandbMode(str, Enum):
    online = "online"  # stream to W&B while training
    offline = "offline"  # write W&B records into RUN/wandb; upload them later with `ddpjob sync RUN`
    disabled = "disabled"  # no W&B at all


@dataclass
class RunConfig:
    """What the run is called and where its directory is created."""

    name: str = MISSING  # required: names the run directory, the Slurm job and the W&B run
    # Where run directories are created, as <root>/<name>-<time>-<id>; a relative root is relative to the submit
    # directory (where ddpjob runs). It must be on a filesystem every node sees.
    root: str = "runs"
    # Who may read the run: false, the umask decides (umask 022: everyone may read its configs, code, checkpoints
    # and logs); true, only you (folders 0700, files 0600), as DDPJOB_PRIVATE=1 in the environment asks too. No one
    # else may ever write what a job executes or unpickles, whatever the umask (docs/how-it-works.md).
    private: bool = False


@dataclass
class TaskConfig:
    """The user's code: model, datasets, loss and metrics (docs/models.md)."""

    # "package.module:Class" of your task, a subclass of ddp_core.task.Task (see docs/models.md, "Plugging in your
    # own model").
    target: str = "ddp_core.tasks.digits:DigitsTask"
    # Keyword arguments of the task's build_model(): they define the model's shape (`ddpjob resume` refuses to
    # change them: the checkpoint's weights have the old shape).
    model: Dict[str, Any] = field(default_factory=dict)
    # Keyword arguments of the task's constructor (the task is built as `Class(**task.data)` on every rank); its
    # build_datasets() reads them.
    data: Dict[str, Any] = field(default_factory=dict)


@dataclass
class DataConfig:
    """The training and evaluation data loaders."""

    # Per data-parallel replica (per rank for DDP; per node for dp): global batch = batch_size x ranks x
    # train.grad_accum. With data.global_batch_size set, the micro-batch: the samples of one forward on one replica;
    # "auto" (needs data.global_batch_size): each attempt probes the largest that fits in memory before its first
    # step, and halves it when a step runs out of memory (under train.invariant: chosen by the run's first attempt,
    # kept by every later one; docs/memory.md).
    batch_size: Union[int, str] = 64
    # data.batch_size=auto: the probe takes a micro-batch only if one this much larger fits too (0.25: 25% more
    # samples), room for a longer batch later and for the allocator's fragmentation.
    batch_headroom: float = 0.25
    # Samples per optimizer step, all replicas together; null: data.batch_size x replicas x train.grad_accum. Set,
    # it fixes the training whatever the world size: each attempt accumulates global_batch_size / (data.batch_size x
    # its replicas) micro-batches per replica (train.grad_accum is derived, leave it at 1), so it must be a multiple
    # of data.batch_size x replicas.
    global_batch_size: Optional[int] = None
    eval_batch_size: int = 256  # per rank, for evaluation (each rank evaluates its own strided share of the set)
    num_workers: int = 0  # DataLoader workers per rank (0: the rank's own process loads the data)
    # Shuffle the training set, seeded per epoch (train.seed + epoch): the same order on every attempt.
    shuffle: bool = True


@dataclass
class OptimConfig:
    """The optimizer and its learning-rate schedule."""

    name: OptimizerName = OptimizerName.adamw  # the optimizer: adamw or sgd
    lr: float = 1e-3  # learning rate: the peak, reached after optim.warmup_steps, then decayed per optim.schedule
    # Weight decay (AdamW's decoupled one, or SGD's); parameters matched by optim.no_decay get none.
    weight_decay: float = 0.0
    momentum: float = 0.9  # sgd only
    schedule: Schedule = Schedule.cosine  # the learning rate after the warmup
    warmup_steps: int = 0  # linear warmup from 0 to optim.lr over this many optimizer steps
    # Max gradient norm; 0 disables clipping. When on, train/grad_norm is logged.
    grad_clip: float = 0.0
    betas: List[float] = field(default_factory=lambda: [0.9, 0.999])  # adamw only
    eps: float = 1e-8  # adamw only
    # Parameters whose name contains one of these fragments get no weight decay, e.g. [bias, norm, ln_].
    no_decay: List[str] = field(default_factory=list)
    min_lr: float = 0.0  # the cosine / linear decay ends at this lr instead of at 0
    # How torch.optim updates. foreach on every device: on a CPU, where torch would loop over the parameters in
    # Python, it cut AdamW's step for the digits MLP from 550 to 415 us, with bitwise the same result
    # (tests/unit/ddp_core/trainer/test_train_hooks.py). A resumed run steps the way the config says, not the
    # checkpoint.
    implementation: OptimizerImpl = OptimizerImpl.foreach


@dataclass
class TrainConfig:
    """The built-in training loop: length, precision, seeding, evaluation, logging and stopping."""

    max_steps: int = 500  # optimizer steps
    grad_accum: int = 1  # micro-batches per optimizer step (DDP skips the all-reduce on all but the last)
    # Compute precision. fp16 works with strategy.name ddp, dp and model_parallel.
    precision: Precision = Precision.fp32
    # Seeds the model's initial weights (the same on every rank) and the data order; each rank's own random
    # streams (dropout, ...) are derived from it.
    seed: int = 0
    eval_every: int = 100  # optimizer steps between evaluations; 0: evaluate only at the end
    log_every: int = 20  # optimizer steps between progress lines / metric records (metrics.jsonl, W&B)
    deterministic: bool = False  # torch.use_deterministic_algorithms: deterministic kernels, or an error
    # Stop (non-zero exit, a clear message) when the logged loss is NaN or infinite: checked at each progress
    # line, where the loss is read back anyway, so it costs nothing per step.
    stop_on_nan: bool = True
    # `ddpjob status` names a rank whose own work per step (data wait + forward) stays this many times the
    # median's, progress line after progress line (ddp_core/distributed/straggler.py).
    straggler_factor: float = 1.5
    # How often, in time, the ranks exchange their signal flags (preemption.StopFlag): every k steps, k agreed from
    # the measured step time. A signal stops the run within about twice this; 0: after every step (a collective
    # per step, ~0.7 ms with 2 ranks on 2 cores).
    stop_check_ms: float = 100.0
    # Log the gradient norm also without clipping (with optim.grad_clip > 0 it always is): train/grad_norm (the
    # mean over the steps of a progress line) and train/grad_norm_max.
    log_grad_norm: bool = False
    # Evaluate on at most this many batches per rank (0: the whole eval set).
    eval_batches: int = 0
    # End the run when checkpoint.monitor has not improved for this many evaluations (0: never); recorded as
    # early_stopped in attempts.jsonl and shown by `ddpjob status`.
    early_stop_patience: int = 0
    # torch.compile the model's forward in place (nn.Module.compile): parameter names, hence checkpoints, stay the
    # uncompiled model's. ddp and fsdp only; needs a C++ compiler on CPU nodes.
    compile: bool = False
    # World-size-invariant training (docs/preemption.md): the final weights are bitwise identical at every world
    # size that divides the global batch's data.global_batch_size / data.batch_size micro-batch shards (a power of
    # two), across resumes at other world sizes too. ddp (or one process) only; each shard is seeded from
    # (train.seed, step, shard) and the gradients are summed in one fixed binary tree instead of DDP's all-reduce.
    invariant: bool = False
    # Throughput and efficiency in every progress line (samples/s, tokens/s, MFU, data wait, step-time p50/p95,
    # peak memory; docs/performance.md). false: loss, lr and step time only.
    telemetry: bool = True
    # The peak TFLOP/s of one GPU (or CPU rank) for MFU; null: from the built-in table of common GPUs by dtype.
    peak_tflops: Optional[float] = None
    # GPU utilisation, power and energy per rank through NVML (the nvidia-ml-py extra). null: where NVML is;
    # true: asked for (a warning where NVML is missing, never a failed job); false: off.
    gpu_telemetry: Optional[bool] = None
    # A torch.profiler trace per rank of steps start_step+1 .. start_step+steps, under RUN/profiles/.
    profile: ProfileConfig = field(default_factory=ProfileConfig)


@dataclass
class CheckpointConfig:
    """When checkpoints are written, how many are kept, and which one is the best."""

    every_steps: int = 100  # optimizer steps between checkpoints; 0: only at the end
    keep_last: int = 3  # checkpoints kept; older ones are pruned (checkpoint.monitor's best is kept apart)
    # On SIGTERM Slurm kills the job KillWait seconds later (often 30): save only if the last save took less.
    sigterm_budget_s: float = 20.0
    # Write checkpoints in the background: training blocks only while the state is copied (to host memory, pinned
    # on CUDA); full checkpoints copy the parameters and optimizer state during the next forward and backward. The
    # files are written in the background and the manifest appears once they are durable. Full checkpoints then
    # keep a host copy of the state between saves. A signal's save and the last one stay synchronous.
    async_save: bool = False
    # An eval metric, e.g. eval/loss (a name ending in loss, error or perplexity: lower is better) or eval/accuracy
    # (higher), or with the direction said: min:eval/NAME, max:eval/NAME (docs/sweeps.md, "Naming a metric"): the
    # checkpoint of the best evaluation so far is kept apart from keep_last (never pruned; its best value survives
    # resume); `ddpjob export RUN --best OUT.pt` exports it. null: none.
    monitor: Optional[str] = None
    # A node-local tier below the durable checkpoints: every this many steps the train state is copied in the
    # background to checkpoint.local_path on each node (2 newest kept); a failed attempt of the same job resumes from
    # there (docs/failures.md). 0: off. Below every_steps. Copies >= 0.5 s of training apart cost at most 3%.
    local_every_steps: int = 0
    # The node-local folder of checkpoint.local_every_steps, absolute on every node (/dev/shm counts against the job's
    # memory on many sites): copies in LOCAL_PATH/ddpjob-USER-JOBID/HOST/ (yours alone: 0700, checked; a folder that
    # fails is refused and the tier is off for the attempt), removed when the run completes.
    local_path: str = "/dev/shm"
    # Where the durable checkpoints go: null = RUN/checkpoints. An absolute path or an fsspec URL, e.g.
    # s3://BUCKET/PREFIX (pip install 'ddpjob[s3]'): each run's in DIR/<run dir's name>/, a trial's in
    # DIR/<sweep>/<trial>/; the run directory stays where it is. Credentials and a non-AWS endpoint come from the
    # AWS environment (AWS_PROFILE, AWS_ACCESS_KEY_ID, an instance role, AWS_ENDPOINT_URL), never from here.
    dir: Optional[str] = None


@dataclass
class WandbConfig:
    """Weights & Biases, logged from rank 0 (docs/watching-runs.md)."""

    project: str = "ddpjob"  # the W&B project
    entity: Optional[str] = None  # the W&B user or team; null: your W&B default
    group: Optional[str] = None  # the W&B group; null: none for a run, the sweep's name for a sweep's trials
    tags: List[str] = field(default_factory=list)  # the W&B run's tags
    mode: WandbMode = WandbMode.offline  # where the records go


@dataclass
class StrategyConfig:
    """How the model is spread over the ranks (docs/strategies.md)."""

    name: StrategyName = StrategyName.ddp  # see docs/strategies.md, "Choosing a strategy"
    # ddp only: DDP's find_unused_parameters, for a forward that leaves some parameters without a gradient.
    find_unused_parameters: bool = False
    # model_parallel / pipeline: consecutive top-level layers per GPU / stage, e.g. [3, 2]; null = balanced by
    # parameter count.
    split: Optional[List[int]] = None
    # pipeline only: stages across ranks; they must divide the world size (world size / stages = data-parallel
    # replicas, a 2-D dp x pp mesh).
    stages: int = 2
    schedule: str = "1f1b"  # pipeline only: the pipeline schedule, gpipe or 1f1b
    microbatches: int = 4  # pipeline only: micro-batches per optimizer step (must divide data.batch_size)
    # fsdp only: "bf16" gathers parameters and computes in bf16 and reduces gradients in fp32; null = fp32 throughout.
    mixed_precision: Optional[str] = None
    # fsdp only: free each block's gathered parameters after its forward (gathered again for backward): less memory
    # for one more all-gather per block.
    reshard_after_forward: bool = True
    # fsdp: module class names, e.g. [GPT2Block], each module of which is sharded as its own unit (gathered alone).
    # null: the model's _no_split_modules when it declares them (Hugging Face models do), else its top-level
    # children. Also the modules that strategy.activation_checkpointing recomputes (ddp and fsdp).
    wrap_classes: Optional[List[str]] = None
    # fsdp: what a model of several parameterised modules that still ends up as one unit (no memory saving) does:
    # "warn" (a log line) or "fail" (an error before the first step).
    single_unit: str = "warn"
    # ddp / fsdp: recompute each wrap-class module's activations in backward instead of keeping them.
    activation_checkpointing: bool = False


@dataclass
class DistConfig:
    """torch.distributed: timeouts, and rehearsing a GPU node's process groups on a CPU."""

    # A collective that takes longer raises on every rank (NCCL aborts its communicator) instead of hanging.
    timeout_s: float = 600.0
    # Joining the process group: every rank must reach the rendezvous in this time (node start-up, imports and
    # data from a cold shared filesystem take longer than one collective).
    init_timeout_s: float = 1200.0
    # Rehearse a GPU node's process groups on a CPU machine: "gpu" (the trainer's own GPU backends) or a backend
    # spec such as "cpu:gloo,cuda:nccl". A collective the GPU node would not serve then fails here.
    # See docs/gpu-clusters.md and ddp_core/distributed/guard.py. null: off.
    guard: Optional[str] = None


@dataclass
class SlurmConfig:
    """The Slurm request: where, how many nodes, ranks, GPUs and CPUs, how long, and the requeue budgets."""

    partition: Optional[str] = None  # sbatch --partition; null: the cluster's default
    # sbatch --nodes: a count, or "MIN-MAX" (e.g. 1-2) for an elastic job that starts on as many nodes as Slurm can
    # give at once, MIN at least; each attempt trains on the nodes it got (docs/preemption.md, "Elastic node counts").
    nodes: Union[int, str] = 1
    gpus_per_node: int = 0  # GPU clusters: one rank per GPU, so ranks per node = GPUs per node
    # How the GPUs are made visible: "node" (--gpus-per-node: every rank sees all of its node's GPUs and takes
    # cuda:LOCAL_RANK; NCCL can use peer-to-peer between them) or "task" (--gpus-per-task=1: each rank sees only
    # its own GPU, as cuda:0).
    gpu_bind: str = "node"
    tasks_per_node: int = 1  # CPU clusters (gpus_per_node == 0): ranks per node
    # CPU cores (and threads) per rank (data-loader workers, threads). null: 1 on CPU clusters; on GPU clusters the
    # node's CPUs divided by its GPUs when the partition is known at submit time (sinfo), else 4.
    cpus_per_task: Optional[int] = None
    # srun --cpu-bind for the ranks: each task is pinned to the CPUs Slurm allocated it ("cores"), or "none" to
    # turn it off. Takes effect where the cluster's TaskPlugin binds (task/affinity, task/cgroup).
    cpu_bind: str = "cores"
    mem_gb: Optional[float] = None  # memory per node, in GB (sbatch --mem); null: the cluster's default
    time_min: int = 60  # the job's time limit, in minutes (sbatch --time)
    account: Optional[str] = None  # sbatch --account; null: the cluster's default
    qos: Optional[str] = None  # sbatch --qos; null: the cluster's default
    job_name: Optional[str] = None  # the Slurm job's name; null: run.name
    # Warning signal sent to every rank slurm.signal_lead_s before the time limit; the trainer checkpoints at the
    # next step and requeues the job (docs/preemption.md). USR1 or USR2; none (or null): Slurm sends no signal, and
    # the trainer's deadline stop (slurm.deadline_margin_s) alone saves and requeues before the limit.
    signal: Optional[str] = "USR2"
    signal_lead_s: int = 120  # seconds before the time limit that slurm.signal is sent
    # The trainer stops by itself before the time limit, signal or not (whichever comes first): once the steps until
    # its next stop check, its measured save time and this many seconds more would reach the job's end, every rank
    # checkpoints and rank 0 requeues the job, a timeout (slurm.max_timeouts). It covers the requeue, the teardown
    # and an evaluation that falls in between (docs/preemption.md, "The deadline without a signal").
    deadline_margin_s: int = 30
    # Requeue budget, per submission: attempts ended by the time limit that requeue the job (timeouts, preemptions
    # and hangs are budgeted separately).
    max_timeouts: int = 20
    max_preemptions: int = 20  # requeue budget, per submission: attempts ended by a preemption that requeue the job
    # Requeue budget, per submission: attempts ended by the hang watchdog (watchdog.stall_s) that requeue the job.
    max_hangs: int = 3
    # Requeue budget, per submission: attempts that failed on infrastructure (a rank killed by a signal, a broken
    # collective, a device error) that requeue the job; a user error is never retried (docs/failures.md).
    max_failures: int = 3
    # Restart budget, per attempt: infrastructure failures after which the ranks are relaunched as a new job step in
    # the same allocation, from the newest state, with no trip through the queue; once spent (or when the allocation
    # cannot run them: too few live nodes), the job is requeued within slurm.max_failures (docs/failures.md). 0: always
    # requeue.
    max_restarts: int = 3
    # Nodes allocated beyond those the ranks need and kept idle (the batch node among them): a node that dies or keeps
    # failing is replaced by one of them for the next job step, with no requeue (docs/failures.md). Such jobs (and
    # elastic ones) are submitted with --no-kill, so a node's death does not end the allocation.
    spare_nodes: int = 0
    # A shell command each node's first rank runs before an attempt's first step (e.g. a site's node check); a
    # non-zero exit excludes the node and requeues the job (docs/failures.md). Its output goes to the rank's log.
    health_check: Optional[str] = None
    # Requeue budget, per submission: attempts ended by a failed health check (excluding the node each time).
    max_health_failures: int = 3
    array_parallelism: int = 32  # sweeps: at most this many trials of an array run at once (%N)
    # Shell lines run in the batch script before the ranks start (module load cuda, conda activate,
    # source venv/bin/activate, ...).
    setup: List[str] = field(default_factory=list)
    # Any other sbatch option, without the leading "--", e.g. {constraint: a100, exclusive: true}.
    additional: Dict[str, Any] = field(default_factory=dict)
    # The container image every rank runs in (docs/containers.md); no image: the ranks run on the nodes themselves.
    container: ContainerConfig = field(default_factory=ContainerConfig)

    @property
    def ranks_per_node(self) -> int:
        return self.gpus_per_node if self.gpus_per_node > 0 else self.tasks_per_node

    @property
    def sends_signal(self) -> bool:
        """Whether Slurm sends the warning signal (``slurm.signal`` is not none)."""
        return self.signal is not None and self.signal.strip().lower() != "none"

    @property
    def warning(self) -> str:
        """The signal the ranks take as the warning: ``slurm.signal``, or USR2 where Slurm sends none (the trainer's
        deadline stop is recorded as it; ``scancel --signal=USR2`` still stops the run)."""
        return self.signal if self.signal is not None and self.sends_signal else "USR2"

    @property
    def node_range(self) -> tuple[int, int]:
        """(MIN, MAX) of ``slurm.nodes``: equal for a plain count. Every reader of the node count goes through it."""
        return node_range(self.nodes)

    @property
    def min_nodes(self) -> int:
        return self.node_range[0]

    @property
    def max_nodes(self) -> int:
        return self.node_range[1]

    @property
    def elastic(self) -> bool:
        """Whether the job may start on any of several node counts (``slurm.nodes: MIN-MAX``, MIN < MAX)."""
        low, high = self.node_range
        return low != high


GPU_BIND = ("node", "task")
CPU_BIND = ("cores", "threads", "sockets", "ldoms", "none")
# cpus_per_task for a GPU job when the partition's nodes are unknown (a hand-run sbatch template).
DEFAULT_CPUS_PER_GPU = 4
