"""The one config tree of a run: structured dataclasses, loaded from YAML + ``key=value`` overrides.

Both sides use it: the login node (``jobs``) validates it before submitting, the compute node
(``ddp_core``) reloads the resolved copy saved in the run directory. Only this module and ``config_input`` touch
OmegaConf; everything past ``load_config`` works with plain dataclass instances.

Here: the schema, ``load_config``, ``check_override``, ``validate`` (ranges and combinations) and ``to_yaml``.
How user text is read before OmegaConf sees it (the YAML reader, override syntax, shape checks against the
schema, one-line errors) is ``ddp_core.config_input``.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import yaml

from ddp_core.config_input import (
    MISSING,
    OVERRIDE_HINT,
    CheckLoader,
    Dumper,
    NotPlain,
    SavedLoader,
    check_value,
    explain,
    from_plain,
    hint_at,
    list_prefix,
    omegaconf_load,
    parse_override,
    read_yaml,
    yaml_problem,
)
from ddp_core.errors import DdpJobError
from ddp_core.pruning import TrialConfig
from ddp_core.pruning import validate_config as validate_trial
from ddp_core.script import SWEPT_ARG_PREFIX, ScriptConfig
from ddp_core.script import validate_config as validate_script
from ddp_core.snapshot import SnapshotConfig
from ddp_core.snapshot import validate_config as validate_snapshot
from ddp_core.watchdog import WatchdogConfig
from ddp_core.watchdog import validate as validate_watchdog


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
    # median's, progress line after progress line (ddp_core/straggler.py).
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
    # See ddp_core/collective_guard.py. null: off.
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


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    watchdog: WatchdogConfig = field(default_factory=WatchdogConfig)
    script: ScriptConfig = field(default_factory=ScriptConfig)  # set: a user's script trains (ddp_core.script)
    snapshot: SnapshotConfig = field(default_factory=SnapshotConfig)  # the code every attempt runs (ddp_core.snapshot)
    trial: TrialConfig = field(default_factory=TrialConfig)  # set: one trial of an adaptive sweep (ddp_core.pruning)


def ranks_per_node(cfg: Config) -> int:
    """Processes Slurm starts per node: one for dp/model_parallel (it drives all GPUs), else one per GPU/task."""
    if cfg.strategy.name in SINGLE_PROCESS_STRATEGIES:
        return 1
    return cfg.slurm.ranks_per_node


def load_config(path: str | Path | None, overrides: Sequence[str] = ()) -> Config:
    """YAML file (optional) + dotlist overrides over the schema → validated ``Config``."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    for item in overrides:
        check_override(item)
    layers = [OmegaConf.structured(Config)]
    try:
        if path is not None:
            # One clear error for a file that is not a sane YAML mapping, then the shape of every value.
            check_value(read_yaml(Path(path), CheckLoader), Config, "")
            layers.append(omegaconf_load(Path(path)))  # OmegaConf's YAML: 1e-4 is a float (PyYAML reads a string)
        try:
            layers.append(OmegaConf.from_dotlist(list(overrides)))
        except yaml.YAMLError as err:  # what PyYAML accepted in check_override and libyaml does not: one line too
            raise DdpJobError(f"an override is not valid YAML: {yaml_problem(err)}", OVERRIDE_HINT) from None
        merged = OmegaConf.merge(*layers)
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        raise explain(err) from None
    assert isinstance(cfg, Config)
    validate(cfg)
    return cfg


def load_saved(path: Path) -> Config:
    """A run directory's config.yaml, which ``to_yaml`` wrote: plain values of the schema's own types, built into
    the dataclasses straight from PyYAML. Every rank of every attempt reads it before its first step, and OmegaConf's
    import and merge cost 0.2 s of that here. What ``to_yaml`` does not write (a hand edit: an interpolation, a
    number for a string key, an unknown key) goes through ``load_config``, which resolves it or names the problem."""
    try:
        if any(mark in path.read_text(encoding="utf-8", errors="replace") for mark in "&*"):
            raise NotPlain  # YAML anchors and aliases (or a string with & or *): OmegaConf's expansion limits apply
        cfg = from_plain(Config, read_yaml(path, SavedLoader))
    except (NotPlain, DdpJobError, OSError):
        return load_config(path)  # OmegaConf's reading; a file it cannot read is named as for any config file
    validate(cfg)
    return cfg


def check_override(item: str) -> None:
    """What a ``key=value`` override must be before OmegaConf sees it: a dotted key, no secret interpolation,
    valid YAML, and a value of the right shape (a bool key takes true/false only, a section a mapping, ...)."""
    key, value = parse_override(item)
    inside = list_prefix(Config, key)
    if inside is not None:
        hint = f"set the whole list: {inside}=[a, b]"
        if key.startswith(SWEPT_ARG_PREFIX):  # a sweep's script.args.NAME key given to a single run
            hint = (f"{key}=v1,v2 is a sweep key (ddpjob sweep); for one run, put the argument after --: "
                    f"ddpjob submit --script train.py -- --{key[len(SWEPT_ARG_PREFIX):]}=VALUE")  # fmt: skip
        raise DdpJobError(f"config key '{inside}' is a list: '{key}' names no part of it", hint)
    hint = hint_at(Config, key)
    if hint is not None:
        check_value(value, hint, key)


def _require(ok: bool, key: str, value: Any, why: str) -> None:
    if not ok:
        raise DdpJobError(f"config key '{key}' = {value!r} is invalid: {why}", f"fix it in the YAML or with {key}=...")


def _floats(node: Any, prefix: str = "") -> Any:
    """(key, value) of every float in the tree (dotted keys), task arguments and sbatch options included."""
    if dataclasses.is_dataclass(node):
        items = [(f"{prefix}{f.name}", getattr(node, f.name)) for f in dataclasses.fields(node)]
    elif isinstance(node, dict):
        items = [(f"{prefix}{name}", value) for name, value in node.items()]
    else:
        items = [(f"{prefix[:-1]}[{i}]", value) for i, value in enumerate(node)]
    for key, value in items:
        if isinstance(value, float):
            yield key, value
        elif dataclasses.is_dataclass(value) or isinstance(value, (dict, list)):
            yield from _floats(value, f"{key}.")


# Upper bounds that no real run comes near; past them a value is a typo (or 1e20) that would fail only after the
# queue wait, or be rendered for sbatch to reject.
_AT_MOST = {
    "data.batch_size": 1 << 20,
    "data.eval_batch_size": 1 << 20,
    "data.num_workers": 256,
    "train.grad_accum": 1 << 16,
    "train.max_steps": 1 << 40,
    "slurm.nodes": 1 << 16,
    "slurm.gpus_per_node": 64,
    "slurm.tasks_per_node": 1024,
    "slurm.cpus_per_task": 4096,
    "slurm.time_min": 366 * 24 * 60,  # a year
}


def validate(cfg: Config) -> None:
    """Checks that need no cluster: ranges and combinations. Raises ``DdpJobError`` naming the key."""
    for key, value in _floats(cfg):
        _require(math.isfinite(value), key, value, "must be a finite number")
    for key, limit in _AT_MOST.items():
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if value is not None:
            _require(value <= limit, key, value, f"must be at most {limit}")
    _require(0 <= cfg.train.seed < 2**63, "train.seed", cfg.train.seed, "must be in [0, 2**63)")
    _require(0 <= cfg.optim.momentum < 1, "optim.momentum", cfg.optim.momentum, "must be in [0, 1)")
    _require(cfg.checkpoint.sigterm_budget_s >= 0, "checkpoint.sigterm_budget_s", cfg.checkpoint.sigterm_budget_s,
             "must be >= 0 (0: never save on SIGTERM)")  # fmt: skip
    if cfg.slurm.mem_gb is not None:
        _require(cfg.slurm.mem_gb > 0, "slurm.mem_gb", cfg.slurm.mem_gb, "must be > 0, or null for the default")
    positive = {
        "data.batch_size": cfg.data.batch_size,
        "data.eval_batch_size": cfg.data.eval_batch_size,
        "train.max_steps": cfg.train.max_steps,
        "train.grad_accum": cfg.train.grad_accum,
        "train.log_every": cfg.train.log_every,
        "checkpoint.keep_last": cfg.checkpoint.keep_last,
        "slurm.nodes": cfg.slurm.nodes,
        "slurm.cpus_per_task": 1 if cfg.slurm.cpus_per_task is None else cfg.slurm.cpus_per_task,
        "slurm.time_min": cfg.slurm.time_min,
        "dist.timeout_s": cfg.dist.timeout_s,
        "dist.init_timeout_s": cfg.dist.init_timeout_s,
    }
    for key, value in positive.items():
        _require(value > 0, key, value, "must be > 0")
    non_negative = {
        "data.num_workers": cfg.data.num_workers,
        "train.eval_every": cfg.train.eval_every,
        "checkpoint.every_steps": cfg.checkpoint.every_steps,
        "optim.warmup_steps": cfg.optim.warmup_steps,
        "optim.weight_decay": cfg.optim.weight_decay,
        "optim.grad_clip": cfg.optim.grad_clip,
        "slurm.gpus_per_node": cfg.slurm.gpus_per_node,
    }
    for key, value in non_negative.items():
        _require(value >= 0, key, value, "must be >= 0")
    _require(cfg.optim.lr > 0, "optim.lr", cfg.optim.lr, "must be > 0")
    _require(
        cfg.slurm.signal.upper().removeprefix("SIG") in {"USR1", "USR2"},
        "slurm.signal",
        cfg.slurm.signal,
        "must be USR1 or USR2 (SIGTERM is Slurm's own kill signal and is handled anyway)",
    )
    _require(
        0 <= cfg.slurm.signal_lead_s < cfg.slurm.time_min * 60,
        "slurm.signal_lead_s",
        cfg.slurm.signal_lead_s,
        f"must be >= 0 and below the time limit ({cfg.slurm.time_min * 60} s)",
    )
    _require(cfg.slurm.array_parallelism > 0, "slurm.array_parallelism", cfg.slurm.array_parallelism, "must be > 0")
    for key in ("max_timeouts", "max_preemptions", "max_hangs"):
        _require(getattr(cfg.slurm, key) >= 0, f"slurm.{key}", getattr(cfg.slurm, key), "must be >= 0")
    _require(cfg.slurm.tasks_per_node > 0, "slurm.tasks_per_node", cfg.slurm.tasks_per_node, "must be > 0")
    _require(
        cfg.optim.warmup_steps < cfg.train.max_steps or cfg.optim.warmup_steps == 0,
        "optim.warmup_steps",
        cfg.optim.warmup_steps,
        f"must be smaller than train.max_steps ({cfg.train.max_steps})",
    )
    _require(cfg.slurm.gpu_bind in GPU_BIND, "slurm.gpu_bind", cfg.slurm.gpu_bind, f"must be one of {GPU_BIND}")
    _require(cfg.slurm.cpu_bind in CPU_BIND, "slurm.cpu_bind", cfg.slurm.cpu_bind, f"must be one of {CPU_BIND}")
    _validate_guard(cfg.dist.guard)
    validate_watchdog(cfg.watchdog, cfg.dist.timeout_s)
    validate_snapshot(cfg.snapshot)
    validate_trial(cfg.trial)
    _require(cfg.train.straggler_factor >= 1, "train.straggler_factor", cfg.train.straggler_factor, "must be >= 1")
    _require(cfg.train.stop_check_ms >= 0, "train.stop_check_ms", cfg.train.stop_check_ms, "must be >= 0")
    _validate_trainer_extras(cfg)
    _validate_script_strings(cfg)
    validate_script(cfg.script, cfg.slurm)
    _validate_script_mode(cfg)
    _validate_strategy(cfg)
    module, _, cls = cfg.task.target.partition(":")
    _require(
        cls.isidentifier() and all(part.isidentifier() for part in module.split(".")),
        "task.target",
        cfg.task.target,
        "must look like 'package.module:ClassName'",
    )
    _require(bool(cfg.run.name.strip()) and "/" not in cfg.run.name, "run.name", cfg.run.name, "must be a plain name")


def _validate_trainer_extras(cfg: Config) -> None:
    """The optimizer's, the monitor's and the data pipeline's keys, each checked by the module that owns them
    (imported here: they import this module's dataclasses)."""
    from ddp_core import monitor, optim

    optim.validate(cfg.optim, cfg.train.max_steps)
    monitor.validate(cfg.checkpoint.monitor, cfg.train.early_stop_patience, cfg.train.eval_every)
    _require(cfg.train.eval_batches >= 0, "train.eval_batches", cfg.train.eval_batches, "must be >= 0 (0: all)")
    if cfg.train.precision is Precision.fp16:
        # A skipped step (inf/NaN gradients) must be skipped on every rank: with gradients sharded (fsdp) or split
        # into stages (pipeline), each rank's scaler would see only its own part and could decide differently.
        _require(cfg.strategy.name in (StrategyName.ddp, StrategyName.dp, StrategyName.model_parallel),
                 "train.precision", "fp16", f"is supported with strategy.name ddp, dp or model_parallel, not "
                 f"{cfg.strategy.name.value!r}; use bf16 there")  # fmt: skip


_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
# Whitespace, control characters and shell metacharacters: none may appear in a value of an #SBATCH line.
_UNSAFE_WORD = re.compile(r"[\s\x00-\x1f\x7f'\"`$\\;&|<>]")
_OPTION = re.compile(r"[a-z][a-z0-9-]*")
_WORD_RULE = "no whitespace, control characters or shell metacharacters: it goes into #SBATCH lines"


def _validate_script_strings(cfg: Config) -> None:
    """Strings that reach a batch script. ``#SBATCH`` lines are read line by line and unquoted by submitit: a
    newline would start a shell line (and end the directives sbatch reads), whitespace another option. Setup
    lines are shell code by design, but one item is one line."""
    s = cfg.slurm
    words = {"run.name": cfg.run.name, "run.root": cfg.run.root, "slurm.job_name": s.job_name,
             "slurm.partition": s.partition, "slurm.account": s.account, "slurm.qos": s.qos}  # fmt: skip
    for key, value in words.items():
        if value is not None:
            _require(not _UNSAFE_WORD.search(value), key, value, _WORD_RULE)
    for i, line in enumerate(s.setup):
        _require(not _CONTROL.search(line), f"slurm.setup[{i}]", line, "one line per item: no newlines")
    for name, value in s.additional.items():
        option = str(name).replace("_", "-")
        _require(bool(_OPTION.fullmatch(option)), "slurm.additional", name,
                 "option names are sbatch's long options without '--', e.g. constraint or mail-type")  # fmt: skip
        _require(isinstance(value, (str, bool, int, float)), f"slurm.additional.{name}", value,
                 "one value per option: a word, a number, or true for a flag")  # fmt: skip
        if isinstance(value, str):
            _require(not _UNSAFE_WORD.search(value), f"slurm.additional.{name}", value, _WORD_RULE)


# Sections only the built-in trainer reads: in script mode a value there would be silently ignored.
_TRAINER_SECTIONS = ("task", "data", "optim", "train")
# strategy.name values that still mean something to a script: one process per node (it drives all the node's GPUs).
_SCRIPT_STRATEGIES = (StrategyName.ddp, *SINGLE_PROCESS_STRATEGIES)


def _validate_script_mode(cfg: Config) -> None:
    if not cfg.script.enabled:
        return
    plain = to_dict(cfg)
    for section in _TRAINER_SECTIONS:
        given, default = plain[section], _plain(dataclasses.asdict(type(getattr(cfg, section))()))
        changed = sorted(k for k in given if given[k] != default[k])
        if changed:
            raise DdpJobError(
                f"config key '{section}.{changed[0]}' is set, but {section}.* applies to the built-in trainer, not "
                "to script mode",
                f"drop it (your script takes its own arguments: ddpjob submit --script train.py -- ARGS), or use a "
                f"config without a {section} section",
            )
    strategy, default_strategy = plain["strategy"], _plain(dataclasses.asdict(StrategyConfig()))
    changed = sorted(k for k in strategy if k != "name" and strategy[k] != default_strategy[k])
    if changed or cfg.strategy.name not in _SCRIPT_STRATEGIES:
        key = f"strategy.{changed[0]}" if changed else "strategy.name"
        raise DdpJobError(
            f"config key '{key}' is set, but in script mode the script chooses its own parallelism",
            "drop it; strategy.name=dp or model_parallel only asks for one process per node",
        )


def _validate_guard(guard: Optional[str]) -> None:
    if guard is None or guard == "gpu":
        return
    items = [item.partition(":") for item in guard.split(",")]
    ok = all(
        (sep and dev.strip() in {"cpu", "cuda"} and backend.strip() in {"gloo", "nccl"})
        or (not sep and dev.strip() in {"gloo", "nccl"})
        for dev, sep, backend in items
    )
    _require(ok, "dist.guard", guard, "must be 'gpu' or a backend spec such as 'cpu:gloo,cuda:nccl' or 'nccl'")


def _validate_strategy(cfg: Config) -> None:
    name = cfg.strategy.name.value
    if cfg.strategy.name in SINGLE_PROCESS_STRATEGIES:
        if cfg.slurm.nodes > 1:
            raise DdpJobError(
                f"config key 'strategy.name' = {name!r} runs one process on one node, but 'slurm.nodes' = "
                f"{cfg.slurm.nodes}",
                "set slurm.nodes=1, or strategy.name=ddp to train across nodes",
            )
    mixed = cfg.strategy.mixed_precision
    if mixed is not None:
        _require(mixed in MIXED_PRECISION, "strategy.mixed_precision", mixed, "must be null or 'bf16'")
        _require(
            cfg.strategy.name is StrategyName.fsdp,
            "strategy.mixed_precision",
            mixed,
            f"applies to strategy.name=fsdp only (this is {name!r}); use train.precision=bf16 for autocast",
        )
    split = cfg.strategy.split
    if split is not None:
        _require(bool(split) and all(n > 0 for n in split), "strategy.split", split, "entries must be > 0")
        gpus = cfg.slurm.gpus_per_node
        _require(
            gpus == 0 or len(split) <= gpus or cfg.strategy.name is not StrategyName.model_parallel,
            "strategy.split",
            split,
            f"{len(split)} stages need {len(split)} GPUs; slurm.gpus_per_node = {gpus}",
        )
    if cfg.strategy.name is StrategyName.pipeline:
        _validate_pipeline(cfg)
    _validate_model_options(cfg)


def _validate_model_options(cfg: Config) -> None:
    """strategy.wrap_classes / single_unit / activation_checkpointing and train.compile: which strategies take them
    (whether the classes exist in the model is checked on a meta-device model, ``ddp_core.model_check``)."""
    s, name = cfg.strategy, cfg.strategy.name.value
    _require(s.single_unit in SINGLE_UNIT, "strategy.single_unit", s.single_unit, f"must be one of {SINGLE_UNIT}")
    if s.wrap_classes is not None:
        _require(all(c.isidentifier() for c in s.wrap_classes), "strategy.wrap_classes", s.wrap_classes,
                 "must be a list of class names, e.g. [GPT2Block]")  # fmt: skip
        why = f"applies to strategy.name=fsdp or strategy.activation_checkpointing=true (this is {name!r})"
        _require(
            s.name is StrategyName.fsdp or s.activation_checkpointing, "strategy.wrap_classes", s.wrap_classes, why
        )
    for key, on in (
        ("strategy.activation_checkpointing", s.activation_checkpointing),
        ("train.compile", cfg.train.compile),
    ):
        _require(not on or s.name in MODEL_OPTION_STRATEGIES, key, on,
                 f"works with strategy.name=ddp or fsdp (this is {name!r})")  # fmt: skip


def _validate_pipeline(cfg: Config) -> None:
    s = cfg.strategy
    world = cfg.slurm.nodes * ranks_per_node(cfg)
    _require(s.stages >= 1, "strategy.stages", s.stages, "must be >= 1")
    _require(
        world % s.stages == 0,
        "strategy.stages",
        s.stages,
        f"must divide the world size ({world} = slurm.nodes x ranks per node); the quotient is the number of "
        "data-parallel replicas",
    )
    _require(s.schedule in PIPELINE_SCHEDULES, "strategy.schedule", s.schedule, f"must be one of {PIPELINE_SCHEDULES}")
    _require(s.microbatches >= 1, "strategy.microbatches", s.microbatches, "must be >= 1")
    _require(
        cfg.data.batch_size % s.microbatches == 0,
        "strategy.microbatches",
        s.microbatches,
        f"must divide data.batch_size ({cfg.data.batch_size}): every micro-batch has the same shape",
    )
    if s.split is not None:
        _require(len(s.split) == s.stages, "strategy.split", s.split, f"needs one entry per stage ({s.stages})")


def _plain(value: Any) -> Any:
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def to_dict(cfg: Config) -> dict[str, Any]:
    """Plain, JSON-able dict (enums as strings) for W&B, checkpoints and the saved config.yaml."""
    return _plain(dataclasses.asdict(cfg))


def to_yaml(cfg: Config) -> str:
    # Plain YAML of plain values: loads back to an equal Config, ~100x faster than OmegaConf.structured
    # (which dominated submitting a 1,000-trial sweep). Strings are quoted where OmegaConf would read them as
    # numbers, and a literal "${" is escaped: load_config would otherwise resolve it on the compute node.
    return yaml.dump(escape_interpolations(to_dict(cfg)), Dumper=Dumper, sort_keys=False, default_flow_style=False)


_INTERPOLATION_START = re.compile(r"(\\*)\$\{")


def escape_interpolations(value: Any) -> Any:
    """Values (not keys) with every ``${`` escaped the way OmegaConf reads it back literally: ``\\${``, and the
    backslashes before it doubled."""
    if isinstance(value, str):
        return _INTERPOLATION_START.sub(lambda m: m.group(1) * 2 + "\\${", value)
    if isinstance(value, dict):
        return {k: escape_interpolations(v) for k, v in value.items()}
    if isinstance(value, list):
        return [escape_interpolations(v) for v in value]
    return value
