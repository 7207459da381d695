"""Checks of a whole config that need no cluster: finite numbers, ranges, combinations of sections, and the
strings that go into ``#SBATCH`` lines. Each failure is one ``DdpJobError`` naming the key and the fix.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Optional

from ddp_core.config.batch import check_micro_batch, fixed_micro, is_auto, is_auto_value, validate_batches
from ddp_core.config.checkpoint_dir import validate_checkpoint_dir
from ddp_core.config.container import validate_container
from ddp_core.config.features import validate_script, validate_snapshot, validate_trial, validate_watchdog
from ddp_core.config.local_tier import validate_local_tier
from ddp_core.config.metric import parse_metric
from ddp_core.config.nodes import node_range
from ddp_core.config.perf_checks import validate_perf
from ddp_core.config.problems import require
from ddp_core.config.schema import (
    CPU_BIND,
    GPU_BIND,
    SINGLE_PROCESS_STRATEGIES,
    OptimConfig,
    Precision,
    StrategyConfig,
    StrategyName,
)
from ddp_core.config.secrets import validate_secrets
from ddp_core.config.strategy_checks import validate_strategy
from ddp_core.config.tracking import validate_log
from ddp_core.config.tree import Config, plain, to_dict
from ddp_core.errors import DdpJobError

BUDGETS = ("max_timeouts", "max_preemptions", "max_hangs", "max_failures", "max_health_failures", "max_restarts",
           "spare_nodes")  # the slurm section's budgets and counts, each >= 0 (0: none)  # fmt: skip


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
    "slurm.gpus_per_node": 64,
    "slurm.tasks_per_node": 1024,
    "slurm.cpus_per_task": 4096,
    "slurm.time_min": 366 * 24 * 60,  # a year
}


def validate(cfg: Config) -> None:
    """Checks that need no cluster: ranges and combinations. Raises ``DdpJobError`` naming the key."""
    node_range(cfg.slurm.nodes)  # a count or MIN-MAX, in range: one line naming slurm.nodes
    _validate_ranges(cfg)
    _validate_guard(cfg.dist.guard)
    validate_watchdog(cfg.watchdog, cfg.dist.timeout_s)
    validate_snapshot(cfg.snapshot)
    validate_container(cfg.slurm.container)
    validate_trial(cfg.trial)
    validate_log(cfg.log)
    require(cfg.train.straggler_factor >= 1, "train.straggler_factor", cfg.train.straggler_factor, "must be >= 1")
    require(cfg.train.stop_check_ms >= 0, "train.stop_check_ms", cfg.train.stop_check_ms, "must be >= 0")
    _validate_trainer_extras(cfg)
    validate_perf(cfg.train)
    validate_local_tier(cfg.checkpoint, cfg.script.enabled)
    validate_checkpoint_dir(cfg.checkpoint.dir, cfg.script.enabled)
    _validate_script_strings(cfg)
    validate_script(cfg.script, cfg.slurm)
    _validate_script_mode(cfg)
    validate_strategy(cfg)
    module, _, cls = cfg.task.target.partition(":")
    require(
        cls.isidentifier() and all(part.isidentifier() for part in module.split(".")),
        "task.target",
        cfg.task.target,
        "must look like 'package.module:ClassName'",
    )
    require(bool(cfg.run.name.strip()) and "/" not in cfg.run.name, "run.name", cfg.run.name, "must be a plain name")
    validate_secrets(cfg)  # the one guard: no credential in any key (ddp_core.config.secrets)


def _validate_ranges(cfg: Config) -> None:
    """Every number finite and within its range; the Slurm keys' values among those Slurm takes."""
    for key, value in _floats(cfg):
        require(math.isfinite(value), key, value, "must be a finite number")
    check_micro_batch(cfg.data)  # first: "auto" is the one word data.batch_size may be, checked below as a number
    for key, limit in _AT_MOST.items():
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if value is not None and not is_auto_value(key, value):
            require(value <= limit, key, value, f"must be at most {limit}")
    require(0 <= cfg.train.seed < 2**63, "train.seed", cfg.train.seed, "must be in [0, 2**63)")
    require(0 <= cfg.optim.momentum < 1, "optim.momentum", cfg.optim.momentum, "must be in [0, 1)")
    require(
        cfg.checkpoint.sigterm_budget_s >= 0,
        "checkpoint.sigterm_budget_s",
        cfg.checkpoint.sigterm_budget_s,
        "must be >= 0 (0: never save on SIGTERM)",
    )
    if cfg.slurm.mem_gb is not None:
        require(cfg.slurm.mem_gb > 0, "slurm.mem_gb", cfg.slurm.mem_gb, "must be > 0, or null for the default")
    positive = {
        "data.batch_size": 1 if is_auto(cfg.data) else fixed_micro(cfg.data),  # auto: check_micro_batch
        "data.eval_batch_size": cfg.data.eval_batch_size,
        "train.max_steps": cfg.train.max_steps,
        "train.grad_accum": cfg.train.grad_accum,
        "train.log_every": cfg.train.log_every,
        "checkpoint.keep_last": cfg.checkpoint.keep_last,
        "slurm.cpus_per_task": 1 if cfg.slurm.cpus_per_task is None else cfg.slurm.cpus_per_task,
        "slurm.time_min": cfg.slurm.time_min,
        "dist.timeout_s": cfg.dist.timeout_s,
        "dist.init_timeout_s": cfg.dist.init_timeout_s,
    }
    for key, value in positive.items():
        require(value > 0, key, value, "must be > 0")
    non_negative = {
        "data.num_workers": cfg.data.num_workers,
        "train.eval_every": cfg.train.eval_every,
        "checkpoint.every_steps": cfg.checkpoint.every_steps,
        "checkpoint.local_every_steps": cfg.checkpoint.local_every_steps,
        "optim.warmup_steps": cfg.optim.warmup_steps,
        "optim.weight_decay": cfg.optim.weight_decay,
        "optim.grad_clip": cfg.optim.grad_clip,
        "slurm.gpus_per_node": cfg.slurm.gpus_per_node,
    }
    for key, value in non_negative.items():
        require(value >= 0, key, value, "must be >= 0")
    require(cfg.optim.lr > 0, "optim.lr", cfg.optim.lr, "must be > 0")
    _validate_time_limit(cfg)
    require(cfg.slurm.array_parallelism > 0, "slurm.array_parallelism", cfg.slurm.array_parallelism, "must be > 0")
    for key in BUDGETS:
        require(getattr(cfg.slurm, key) >= 0, f"slurm.{key}", getattr(cfg.slurm, key), "must be >= 0")
    require(cfg.slurm.tasks_per_node > 0, "slurm.tasks_per_node", cfg.slurm.tasks_per_node, "must be > 0")
    require(
        cfg.optim.warmup_steps < cfg.train.max_steps or cfg.optim.warmup_steps == 0,
        "optim.warmup_steps",
        cfg.optim.warmup_steps,
        f"must be smaller than train.max_steps ({cfg.train.max_steps})",
    )
    require(cfg.slurm.gpu_bind in GPU_BIND, "slurm.gpu_bind", cfg.slurm.gpu_bind, f"must be one of {GPU_BIND}")
    require(cfg.slurm.cpu_bind in CPU_BIND, "slurm.cpu_bind", cfg.slurm.cpu_bind, f"must be one of {CPU_BIND}")


def _validate_time_limit(cfg: Config) -> None:
    """The warning signal, and each lead before the time limit (the signal's, the deadline stop's) below that limit."""
    s = cfg.slurm
    signal_ok = not s.sends_signal or str(s.signal).upper().removeprefix("SIG") in {"USR1", "USR2"}
    why = "must be USR1, USR2 or none (SIGTERM is Slurm's own kill signal and is handled anyway)"
    require(signal_ok, "slurm.signal", s.signal, why)
    limit = s.time_min * 60
    lead = {"slurm.signal_lead_s": s.signal_lead_s} if s.sends_signal else {}  # without a signal it means nothing
    for key, value in {"slurm.deadline_margin_s": s.deadline_margin_s, **lead}.items():
        if value < 0:
            raise DdpJobError(f"config key '{key}' = {value} is invalid: must be >= 0", f"set {key}=0 or more")
        if value >= limit:
            why = f"config key '{key}' = {value} is invalid: must be below the time limit ({limit} s)"
            raise DdpJobError(why, f"set {key} below {limit}, or raise slurm.time_min")


def _validate_trainer_extras(cfg: Config) -> None:
    """The optimizer's, the monitor's and the data pipeline's keys."""
    validate_optim(cfg.optim, cfg.train.max_steps)
    validate_monitor(cfg.checkpoint.monitor, cfg.train.early_stop_patience, cfg.train.eval_every)
    require(cfg.train.eval_batches >= 0, "train.eval_batches", cfg.train.eval_batches, "must be >= 0 (0: all)")
    validate_batches(cfg)
    if cfg.train.precision is Precision.fp16:
        # A skipped step (inf/NaN gradients) must be skipped on every rank: with gradients sharded (fsdp) or split
        # into stages (pipeline), each rank's scaler would see only its own part and could decide differently.
        require(
            cfg.strategy.name in (StrategyName.ddp, StrategyName.dp, StrategyName.model_parallel),
            "train.precision",
            "fp16",
            f"is supported with strategy.name ddp, dp or model_parallel, not "
            f"{cfg.strategy.name.value!r}; use bf16 there",
        )


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
    words = {
        "run.name": cfg.run.name,
        "run.root": cfg.run.root,
        "slurm.job_name": s.job_name,
        "slurm.partition": s.partition,
        "slurm.account": s.account,
        "slurm.qos": s.qos,
    }
    for key, value in words.items():
        if value is not None:
            require(not _UNSAFE_WORD.search(value), key, value, _WORD_RULE)
    for i, line in enumerate(s.setup):
        require(not _CONTROL.search(line), f"slurm.setup[{i}]", line, "one line per item: no newlines")
    for name, value in s.additional.items():
        option = str(name).replace("_", "-")
        require(
            bool(_OPTION.fullmatch(option)),
            "slurm.additional",
            name,
            "option names are sbatch's long options without '--', e.g. constraint or mail-type",
        )
        require(
            isinstance(value, (str, bool, int, float)),
            f"slurm.additional.{name}",
            value,
            "one value per option: a word, a number, or true for a flag",
        )
        if isinstance(value, str):
            require(not _UNSAFE_WORD.search(value), f"slurm.additional.{name}", value, _WORD_RULE)


# Sections only the built-in trainer reads: in script mode a value there would be silently ignored.
_TRAINER_SECTIONS = ("task", "data", "optim", "train")
# strategy.name values that still mean something to a script: one process per node (it drives all the node's GPUs).
_SCRIPT_STRATEGIES = (StrategyName.ddp, *SINGLE_PROCESS_STRATEGIES)


def _validate_script_mode(cfg: Config) -> None:
    if not cfg.script.enabled:
        return
    values = to_dict(cfg)
    for section in _TRAINER_SECTIONS:
        given, default = values[section], plain(dataclasses.asdict(type(getattr(cfg, section))()))
        changed = sorted(k for k in given if given[k] != default[k])
        if changed:
            raise DdpJobError(
                f"config key '{section}.{changed[0]}' is set, but {section}.* applies to the built-in trainer, not "
                "to script mode",
                f"drop it (your script takes its own arguments: ddpjob submit --script train.py -- ARGS), or use a "
                f"config without a {section} section",
            )
    strategy, default_strategy = values["strategy"], plain(dataclasses.asdict(StrategyConfig()))
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
    require(ok, "dist.guard", guard, "must be 'gpu' or a backend spec such as 'cpu:gloo,cuda:nccl' or 'nccl'")


MONITOR_HINT = "set checkpoint.monitor to an eval metric, e.g. eval/loss (lower is better) or max:eval/accuracy"


def validate_monitor(spec: Optional[str], patience: int, eval_every: int) -> None:
    """Login-node checks of ``checkpoint.monitor`` and ``train.early_stop_patience``."""
    if spec is not None:
        parse_metric(spec, "config key 'checkpoint.monitor'")
    if patience < 0:
        raise DdpJobError(
            f"config key 'train.early_stop_patience' = {patience} is invalid: must be >= 0 (0: off)",
            "fix it in the YAML or with train.early_stop_patience=...",
        )
    if patience > 0 and spec is None:
        raise DdpJobError(
            "config key 'train.early_stop_patience' is set, but checkpoint.monitor is not: nothing to watch",
            MONITOR_HINT,
        )
    if patience > 0 and eval_every == 0:
        raise DdpJobError(
            "config key 'train.early_stop_patience' is set, but train.eval_every = 0 evaluates only at the end",
            "set train.eval_every to the steps between evaluations",
        )


def validate_optim(cfg: OptimConfig, max_steps: int) -> None:
    """The optimizer's keys beyond their ranges."""
    require(
        len(cfg.betas) == 2 and all(0 <= b < 1 for b in cfg.betas),
        "optim.betas",
        cfg.betas,
        "must be two numbers in [0, 1), e.g. [0.9, 0.95]",
    )
    require(cfg.eps > 0, "optim.eps", cfg.eps, "must be > 0")
    require(0 <= cfg.min_lr <= cfg.lr, "optim.min_lr", cfg.min_lr, f"must be in [0, optim.lr] ({cfg.lr})")
    require(
        all(isinstance(p, str) and p for p in cfg.no_decay),
        "optim.no_decay",
        cfg.no_decay,
        "must be a list of non-empty name fragments, e.g. [bias, norm]",
    )
