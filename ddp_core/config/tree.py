"""The root of the config tree, ``Config``: one field per section."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from ddp_core.config.features import ScriptConfig, SnapshotConfig, TrialConfig, WatchdogConfig
from ddp_core.config.schema import (
    SINGLE_PROCESS_STRATEGIES,
    CheckpointConfig,
    DataConfig,
    DistConfig,
    OptimConfig,
    RunConfig,
    SlurmConfig,
    StrategyConfig,
    TaskConfig,
    TrainConfig,
    WandbConfig,
)
from ddp_core.config.tracking import LogConfig


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    log: LogConfig = field(default_factory=LogConfig)  # the experiment trackers: W&B, TensorBoard, MLflow, CSV
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    watchdog: WatchdogConfig = field(default_factory=WatchdogConfig)
    script: ScriptConfig = field(default_factory=ScriptConfig)  # set: a user's script trains (ddp_core.script)
    snapshot: SnapshotConfig = field(
        default_factory=SnapshotConfig
    )  # the code every attempt runs (ddp_core.run.snapshot)
    trial: TrialConfig = field(
        default_factory=TrialConfig
    )  # set: one trial of an adaptive sweep (ddp_core.search.pruning)


def ranks_per_node(cfg: Config) -> int:
    """Processes Slurm starts per node: one for dp/model_parallel (it drives all GPUs), else one per GPU/task."""
    if cfg.strategy.name in SINGLE_PROCESS_STRATEGIES:
        return 1
    return cfg.slurm.ranks_per_node


def plain(value: Any) -> Any:
    """A dataclass tree's ``asdict`` made JSON-able: enums as their values, tuples as lists."""
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def to_dict(cfg: Config) -> dict[str, Any]:
    """Plain, JSON-able dict (enums as strings) for W&B, checkpoints and the saved config.yaml."""
    return plain(dataclasses.asdict(cfg))


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested mapping as dotted keys, ``{"optim": {"lr": 1}}`` -> ``{"optim.lr": 1}``: a config as its override
    keys (``to_dict``'s, or a config.yaml read as plain YAML)."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        out |= flatten(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value}
    return out
