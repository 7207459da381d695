"""The config schema: every section of a run's config as a dataclass, with its defaults and what each key means.

Torch-free and OmegaConf-free: ``load`` builds these from YAML and overrides, ``validate`` checks ranges and
combinations. The sections of features besides training (script, snapshot, watchdog, trial) are in ``features``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Dict, List, Optional

from ddp_core.config.input import MISSING


class StrategyName(str, Enum):
    ddp = "ddp"
    dp = "dp"
    model_parallel = "model_parallel"
    fsdp = "fsdp"
    pipeline = "pipeline"


# Strategies whose single process per node drives all of that node's GPUs (no process group across nodes).
SINGLE_PROCESS_STRATEGIES = (StrategyName.dp, StrategyName.model_parallel)
PIPELINE_SCHEDULES = ("gpipe", "1f1b")
# strategy.mixed_precision values: fsdp's parameter dtype during forward/backward (gradients reduce in fp32).
MIXED_PRECISION = ("bf16",)
SINGLE_UNIT = ("warn", "fail")  # strategy.single_unit
MODEL_OPTION_STRATEGIES = (StrategyName.ddp, StrategyName.fsdp)  # activation_checkpointing, train.compile


class Precision(str, Enum):
    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"  # autocast to float16 with a GradScaler (its state is checkpointed): GPUs without bf16


class OptimizerName(str, Enum):
    adamw = "adamw"
    sgd = "sgd"


class OptimizerImpl(str, Enum):
    """How torch.optim runs the update (torch.optim's ``foreach``/``fused`` arguments)."""

    for_loop = "for_loop"  # one parameter at a time, in Python: torch's own default on a CPU
    foreach = "foreach"  # all parameters per operation (torch's default on a GPU)
    fused = "fused"  # one kernel per step: fastest, but its rounding differs from the other two


class Schedule(str, Enum):
    constant = "constant"
    cosine = "cosine"
    linear = "linear"


class WandbMode(str, Enum):
    online = "online"
    offline = "offline"
    disabled = "disabled"


@dataclass
class RunConfig:
    name: str = MISSING  # required: names the run directory, the Slurm job and the W&B run
    # Run directories are created as <root>/<name>-<timestamp>; relative roots resolve against the cwd.
    root: str = "runs"


@dataclass
class TaskConfig:
    # "package.module:Class" of the user's task (see README "Plugging in your own model").
    target: str = "ddp_core.tasks.digits:DigitsTask"
    # Keyword arguments of the task's build_model(); they define the model's shape.
    model: Dict[str, Any] = field(default_factory=dict)
    # Keyword arguments of the task's build_datasets().
    data: Dict[str, Any] = field(default_factory=dict)


@dataclass
class DataConfig:
    batch_size: int = 64  # per data-parallel replica (per rank for DDP)
    eval_batch_size: int = 256
    num_workers: int = 0
    shuffle: bool = True


@dataclass
class OptimConfig:
    name: OptimizerName = OptimizerName.adamw
    lr: float = 1e-3
    weight_decay: float = 0.0
    momentum: float = 0.9  # sgd only
    schedule: Schedule = Schedule.cosine
    warmup_steps: int = 0
    grad_clip: float = 0.0  # max grad norm; 0 disables clipping
    betas: List[float] = field(default_factory=lambda: [0.9, 0.999])  # adamw only
    eps: float = 1e-8  # adamw only
    # Parameters whose name contains one of these fragments get no weight decay, e.g. [bias, norm, ln_].
    no_decay: List[str] = field(default_factory=list)
    min_lr: float = 0.0  # the cosine / linear decay ends here instead of at 0
    # foreach on every device: on a CPU, where torch would loop over the parameters in Python, it cut AdamW's step
    # for the digits MLP from 550 to 415 us, with bitwise the same result (tests/test_train_hooks.py).
    implementation: OptimizerImpl = OptimizerImpl.foreach


@dataclass
class TrainConfig:
    max_steps: int = 500  # optimizer steps
    grad_accum: int = 1  # micro-batches per optimizer step
    precision: Precision = Precision.fp32
    seed: int = 0
    eval_every: int = 100  # 0: evaluate only at the end
    log_every: int = 20
    deterministic: bool = False
    # Stop (non-zero exit, a clear message) when the logged loss is NaN or infinite: checked at each progress
    # line, where the loss is read back anyway, so it costs nothing per step.
    stop_on_nan: bool = True
    # `ddpjob status` names a rank whose own work per step (data wait + forward) stays this many times the
    # median's, progress line after progress line (ddp_core/dist/straggler.py).
    straggler_factor: float = 1.5
    # How often, in time, the ranks exchange their signal flags (preemption.StopFlag): every k steps, k agreed from
    # the measured step time. A signal stops the run within about twice this; 0: after every step (a collective
    # per step, ~0.7 ms with 2 ranks on 2 cores).
    stop_check_ms: float = 100.0
    # Log the gradient norm (train/grad_norm) also without clipping (with optim.grad_clip > 0 it always is).
    log_grad_norm: bool = False
    # Evaluate on at most this many batches per rank (0: the whole eval set).
    eval_batches: int = 0
    # End the run when checkpoint.monitor has not improved for this many evaluations (0: never).
    early_stop_patience: int = 0
    # torch.compile the model's forward in place (nn.Module.compile): parameter names, hence checkpoints, stay the
    # uncompiled model's. ddp and fsdp only; needs a C++ compiler on CPU nodes.
    compile: bool = False


@dataclass
class CheckpointConfig:
    every_steps: int = 100  # 0: only at the end
    keep_last: int = 3
    # On SIGTERM Slurm kills the job KillWait seconds later (often 30): save only if the last save took less.
    sigterm_budget_s: float = 20.0
    # Training blocks only while the state is copied (to host memory, pinned on CUDA); the files are written in
    # the background and the manifest appears once they are durable. Full checkpoints then keep a host copy of
    # the state between saves. A signal's save and the last one are synchronous.
    async_save: bool = False
    # "min:eval/loss" or "max:eval/accuracy": the checkpoint of the best evaluation so far is kept apart from
    # keep_last (never pruned; ddpjob export --best). null: none.
    monitor: Optional[str] = None


@dataclass
class WandbConfig:
    project: str = "ddpjob"
    entity: Optional[str] = None
    group: Optional[str] = None
    tags: List[str] = field(default_factory=list)
    mode: WandbMode = WandbMode.offline


@dataclass
class StrategyConfig:
    name: StrategyName = StrategyName.ddp
    find_unused_parameters: bool = False  # ddp only
    # model_parallel / pipeline: consecutive top-level layers per GPU / stage, e.g. [3, 2]; null = balanced by
    # parameter count.
    split: Optional[List[int]] = None
    # pipeline only: stages across ranks (world size / stages = data-parallel replicas, a 2-D dp x pp mesh),
    # the schedule (gpipe or 1f1b), and micro-batches per step (must divide data.batch_size).
    stages: int = 2
    schedule: str = "1f1b"
    microbatches: int = 4
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
    # A collective that takes longer raises on every rank (NCCL aborts its communicator) instead of hanging.
    timeout_s: float = 600.0
    # Joining the process group: every rank must reach the rendezvous in this time (node start-up, imports and
    # data from a cold shared filesystem take longer than one collective).
    init_timeout_s: float = 1200.0
    # Rehearse a GPU node's process groups on a CPU machine: "gpu" (the trainer's own GPU backends) or a backend
    # spec such as "cpu:gloo,cuda:nccl". A collective the GPU node would not serve then fails here.
    # See ddp_core/dist/guard.py. null: off.
    guard: Optional[str] = None


@dataclass
class SlurmConfig:
    partition: Optional[str] = None
    nodes: int = 1
    gpus_per_node: int = 0  # GPU clusters: one rank per GPU
    # How the GPUs are made visible: "node" (--gpus-per-node: every rank sees all of its node's GPUs and takes
    # cuda:LOCAL_RANK; NCCL can use peer-to-peer between them) or "task" (--gpus-per-task=1: each rank sees only
    # its own GPU, as cuda:0).
    gpu_bind: str = "node"
    tasks_per_node: int = 1  # CPU clusters (gpus_per_node == 0): ranks per node
    # CPUs per rank (data-loader workers, threads). null: 1 on CPU clusters; on GPU clusters the node's CPUs
    # divided by its GPUs when the partition is known at submit time (sinfo), else 4.
    cpus_per_task: Optional[int] = None
    # srun --cpu-bind for the ranks: each task is pinned to the CPUs Slurm allocated it ("cores"), or "none".
    # Takes effect where the cluster's TaskPlugin binds (task/affinity, task/cgroup).
    cpu_bind: str = "cores"
    mem_gb: Optional[float] = None
    time_min: int = 60
    account: Optional[str] = None
    qos: Optional[str] = None
    job_name: Optional[str] = None  # default: run.name
    # Warning signal sent to every rank signal_lead_s before the time limit; the trainer checkpoints at the
    # next step and requeues the job. Timeouts and preemptions are budgeted separately, per submission.
    signal: str = "USR2"
    signal_lead_s: int = 120
    max_timeouts: int = 20
    max_preemptions: int = 20
    max_hangs: int = 3  # attempts ended by the hang watchdog (watchdog.stall_s) that requeue the job
    array_parallelism: int = 32  # sweeps: at most this many trials of an array run at once (%N)
    # Shell lines run in the batch script before the ranks start (module load, conda activate, ...).
    setup: List[str] = field(default_factory=list)
    # Extra sbatch options without the leading "--", e.g. {constraint: a100, exclusive: true}.
    additional: Dict[str, Any] = field(default_factory=dict)

    @property
    def ranks_per_node(self) -> int:
        return self.gpus_per_node if self.gpus_per_node > 0 else self.tasks_per_node


GPU_BIND = ("node", "task")
CPU_BIND = ("cores", "threads", "sockets", "ldoms", "none")
# cpus_per_task for a GPU job when the partition's nodes are unknown (a hand-run sbatch template).
DEFAULT_CPUS_PER_GPU = 4
