"""Login-node check of how the strategy will cut the model, on the task's model built on the ``meta`` device
(shapes without memory): wrap classes that exist, a model fsdp would shard as one unit, a model pipeline or
model_parallel can split into the configured stages, and parameters tied across stages. The rules are the ones
the strategies apply on the compute node (``ddp_core.strategies.units``), so what passes here passes there.

Called by ``ddpjob submit`` (``--dry-run`` included) and ``ddpjob sweep`` after ``check_task``. A model that
cannot be built on ``meta`` (a task that reads files in ``build_model``) skips the check with a warning.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from ddp_core.config import Config, StrategyName
from ddp_core.errors import DdpJobError
from ddp_core.strategies.units import model_blocks, shard_units, ties_across_stages, wrap_class_names
from ddp_core.tasks.base import Task, load_task

log = logging.getLogger(__name__)

_SPLITS = (StrategyName.pipeline, StrategyName.model_parallel)


def check_model(cfg: Config) -> None:
    """Raise ``DdpJobError`` (one line) for a model the configured strategy could not cut as asked."""
    s = cfg.strategy
    if not (s.name is StrategyName.fsdp or s.name in _SPLITS or s.activation_checkpointing):
        return
    task, model = meta_model(cfg)
    if model is None:
        return
    if s.name is StrategyName.fsdp or s.activation_checkpointing:
        wrap_class_names(model, s.wrap_classes)  # raises for a class the model does not have
    if s.name is StrategyName.fsdp and not shard_units(model, s.wrap_classes) and s.single_unit == "fail":
        holders = sum(1 for m in model.modules() if any(True for _ in m.parameters(recurse=False)))
        if holders >= 2:
            raise DdpJobError(
                f"strategy.name='fsdp' would shard {type(model).__name__} ({holders} modules with parameters) as one "
                "unit (strategy.single_unit=fail)",
                "name its block class in strategy.wrap_classes (e.g. [GPT2Block])",
            )
    if s.name in _SPLITS:
        check_split(cfg, task, model)


def meta_model(cfg: Config) -> tuple[Task, nn.Module | None]:
    """The task and its model on the meta device; (task, None) when the model cannot be built there."""
    task = load_task(cfg.task)
    try:
        with torch.device("meta"):
            return task, task.build_model(**cfg.task.model)
    except DdpJobError:
        raise
    except Exception as err:  # e.g. a build_model that loads weights from a file: checked on the compute node
        log.warning(
            "login-node model check skipped: %s.build_model failed on the meta device (%s: %s)",
            type(task).__name__,
            type(err).__name__,
            err,
        )
        return task, None


def check_split(cfg: Config, task: Task, model: nn.Module) -> None:
    from ddp_core.strategies.model_parallel import balanced_split, refuse_ties_across_devices

    s = cfg.strategy
    blocks = model_blocks(model, task, s.name.value)
    sizes = [sum(p.numel() for p in b.parameters()) for b in blocks]
    if s.name is StrategyName.pipeline:
        if len(blocks) < s.stages:
            raise DdpJobError(
                f"config key 'strategy.stages' = {s.stages} exceeds the model's {len(blocks)} top-level layers",
                f"use strategy.stages<={len(blocks)}",
            )
        counts = s.split or balanced_split(sizes, s.stages)
    else:
        devices = max(1, cfg.slurm.gpus_per_node)
        counts = s.split or balanced_split(sizes, devices)
        if sum(counts) != len(blocks):
            raise DdpJobError(
                f"config key 'strategy.split' = {list(counts)} places {sum(counts)} layers, but the model has "
                f"{len(blocks)} blocks",
                f"give counts that sum to {len(blocks)}, or strategy.split=null to balance by parameter count",
            )
        refuse_ties_across_devices(blocks, list(counts), model, devices)
        return
    if sum(counts) != len(blocks):
        raise DdpJobError(
            f"config key 'strategy.split' = {list(counts)} must have {s.stages} entries summing to "
            f"{len(blocks)} layers",
            "fix strategy.split or leave it null (balanced by parameter count)",
        )
    for name, stages in ties_across_stages(blocks, counts, model).items():
        log.info("pipeline: %s is tied across stages %s: kept on each, gradients summed between them", name, stages)
