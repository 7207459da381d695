"""The login node's checks of the strategy section: which strategies take which options, and the pipeline's stages
against every world size the job can have."""

from __future__ import annotations

from ddp_core.config.batch import job_world_sizes
from ddp_core.config.problems import require
from ddp_core.config.schema import (
    MIXED_PRECISION,
    MODEL_OPTION_STRATEGIES,
    PIPELINE_SCHEDULES,
    SINGLE_PROCESS_STRATEGIES,
    SINGLE_UNIT,
    StrategyName,
)
from ddp_core.config.tree import Config
from ddp_core.errors import DdpJobError


def validate_strategy(cfg: Config) -> None:
    name = cfg.strategy.name.value
    if cfg.strategy.name in SINGLE_PROCESS_STRATEGIES:
        if cfg.slurm.max_nodes > 1:
            nodes = cfg.slurm.nodes
            what = f"the range {nodes!r}, which spans nodes" if cfg.slurm.elastic else repr(nodes)
            raise DdpJobError(
                f"config key 'strategy.name' = {name!r} runs one process on one node, but 'slurm.nodes' = {what}",
                "set slurm.nodes=1, or strategy.name=ddp to train across nodes",
            )
    mixed = cfg.strategy.mixed_precision
    if mixed is not None:
        require(mixed in MIXED_PRECISION, "strategy.mixed_precision", mixed, "must be null or 'bf16'")
        require(
            cfg.strategy.name is StrategyName.fsdp,
            "strategy.mixed_precision",
            mixed,
            f"applies to strategy.name=fsdp only (this is {name!r}); use train.precision=bf16 for autocast",
        )
    split = cfg.strategy.split
    if split is not None:
        require(bool(split) and all(n > 0 for n in split), "strategy.split", split, "entries must be > 0")
        gpus = cfg.slurm.gpus_per_node
        require(
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
    (whether the classes exist in the model is checked on a meta-device model, ``ddp_core.strategies.check``)."""
    s, name = cfg.strategy, cfg.strategy.name.value
    require(s.single_unit in SINGLE_UNIT, "strategy.single_unit", s.single_unit, f"must be one of {SINGLE_UNIT}")
    if s.wrap_classes is not None:
        require(
            all(c.isidentifier() for c in s.wrap_classes),
            "strategy.wrap_classes",
            s.wrap_classes,
            "must be a list of class names, e.g. [GPT2Block]",
        )
        why = f"applies to strategy.name=fsdp or strategy.activation_checkpointing=true (this is {name!r})"
        require(s.name is StrategyName.fsdp or s.activation_checkpointing, "strategy.wrap_classes", s.wrap_classes, why)
    for key, on in (
        ("strategy.activation_checkpointing", s.activation_checkpointing),
        ("train.compile", cfg.train.compile),
    ):
        require(
            not on or s.name in MODEL_OPTION_STRATEGIES,
            key,
            on,
            f"works with strategy.name=ddp or fsdp (this is {name!r})",
        )


def _validate_pipeline(cfg: Config) -> None:
    s = cfg.strategy
    require(s.stages >= 1, "strategy.stages", s.stages, "must be >= 1")
    for world in job_world_sizes(cfg):  # an elastic job's every size: each attempt cuts its own world into stages
        require(
            world % s.stages == 0,
            "strategy.stages",
            s.stages,
            f"must divide the world size ({world} = slurm.nodes x ranks per node); the quotient is the number of "
            "data-parallel replicas",
        )
    require(s.schedule in PIPELINE_SCHEDULES, "strategy.schedule", s.schedule, f"must be one of {PIPELINE_SCHEDULES}")
    require(s.microbatches >= 1, "strategy.microbatches", s.microbatches, "must be >= 1")
    if s.split is not None:
        require(len(s.split) == s.stages, "strategy.split", s.split, f"needs one entry per stage ({s.stages})")
