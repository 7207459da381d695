"""config: the one config tree of a run. Torch-free; imports nothing of ddp_core but ``errors`` and ``locations``.

Both sides use it: the login node (``jobs``) validates a config before submitting, the compute node reloads the
resolved copy saved in the run directory. Only ``load``, ``input`` and ``trials`` touch OmegaConf; everything past
``load_config`` works with plain dataclass instances.

- ``schema``: the training sections (run, task, data, optim, train, checkpoint, wandb, strategy, dist, slurm);
  ``features``: the sections of script mode, snapshots, the watchdog and adaptive-search trials; ``tree``:
  ``Config``, the root, and ``ranks_per_node``.
- ``load``: ``load_config`` (YAML + overrides), ``load_saved``, ``check_override``, ``to_yaml``/``to_dict``.
- ``validate``: ranges and combinations, one error line naming the key and the fix (``problems.require``); a
  section's own checks beside it (``strategy_checks``, ``local_tier``, ``features``); ``nodes``: ``slurm.nodes``'s
  count or MIN-MAX range.
- ``metric``: ``Metric`` and ``parse_metric``, how a metric and its direction are named everywhere
  (``checkpoint.monitor``, ``search.metric``, ``ddpjob status/report --metric``).
- ``batch``: the global batch (``data.global_batch_size``), the accumulation each attempt derives from its
  data-parallel replicas, and their checks.
- ``input``: how user text is read before OmegaConf sees it (YAML reader, override syntax, one-line errors);
  ``shapes``: values checked against the dataclass tree.
- ``trials``: a sweep's trial configs (one base, each trial's overrides), loaded fast.
- ``reference``: docs/configuration.md, rendered from the sections' fields and their comments (not imported here).

The names most code needs are re-exported here.
"""

from ddp_core.config.features import (
    ARG_STYLES,
    LAUNCHERS,
    SWEPT_ARG_PREFIX,
    ScriptConfig,
    SnapshotConfig,
    TrialConfig,
    WatchdogConfig,
)
from ddp_core.config.load import check_override, escape_interpolations, load_config, load_saved, to_dict, to_yaml
from ddp_core.config.metric import Metric, parse_metric
from ddp_core.config.schema import (
    CPU_BIND,
    DEFAULT_CPUS_PER_GPU,
    GPU_BIND,
    MIXED_PRECISION,
    MODEL_OPTION_STRATEGIES,
    PIPELINE_SCHEDULES,
    SINGLE_PROCESS_STRATEGIES,
    SINGLE_UNIT,
    CheckpointConfig,
    DataConfig,
    DistConfig,
    OptimConfig,
    OptimizerImpl,
    OptimizerName,
    Precision,
    RunConfig,
    Schedule,
    SlurmConfig,
    StrategyConfig,
    StrategyName,
    TaskConfig,
    TrainConfig,
    WandbConfig,
    WandbMode,
)
from ddp_core.config.tree import Config, ranks_per_node
from ddp_core.config.validate import MONITOR_HINT, validate

__all__ = [
    "ARG_STYLES",
    "CPU_BIND",
    "DEFAULT_CPUS_PER_GPU",
    "GPU_BIND",
    "LAUNCHERS",
    "MIXED_PRECISION",
    "MODEL_OPTION_STRATEGIES",
    "MONITOR_HINT",
    "PIPELINE_SCHEDULES",
    "SINGLE_PROCESS_STRATEGIES",
    "SINGLE_UNIT",
    "SWEPT_ARG_PREFIX",
    "CheckpointConfig",
    "Config",
    "DataConfig",
    "DistConfig",
    "Metric",
    "OptimConfig",
    "OptimizerImpl",
    "OptimizerName",
    "Precision",
    "RunConfig",
    "Schedule",
    "ScriptConfig",
    "SlurmConfig",
    "SnapshotConfig",
    "StrategyConfig",
    "StrategyName",
    "TaskConfig",
    "TrainConfig",
    "TrialConfig",
    "WandbConfig",
    "WandbMode",
    "WatchdogConfig",
    "check_override",
    "escape_interpolations",
    "load_config",
    "load_saved",
    "parse_metric",
    "ranks_per_node",
    "to_dict",
    "to_yaml",
    "validate",
]
