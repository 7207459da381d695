"""Parallelism strategies behind one interface; ``build_strategy`` picks one by ``strategy.name``.

Each strategy's module is imported only when a run uses it: fsdp and pipeline pull in DTensor, device meshes and
torch's pipelining (with dynamo), over a second of imports that a ddp run never needs.
"""

from __future__ import annotations

import importlib
from typing import Optional

import torch

from ddp_core.cluster.env import DistEnv
from ddp_core.config import StrategyConfig, StrategyName
from ddp_core.strategies.base import Strategy
from ddp_core.tasks.base import Task

# strategy name -> (module, class)
_STRATEGIES: dict[StrategyName, tuple[str, str]] = {
    StrategyName.ddp: ("ddp_core.strategies.ddp", "DDPStrategy"),
    StrategyName.dp: ("ddp_core.strategies.dp", "DPStrategy"),
    StrategyName.model_parallel: ("ddp_core.strategies.model_parallel", "ModelParallelStrategy"),
    StrategyName.pipeline: ("ddp_core.strategies.pipeline", "PipelineStrategy"),
    StrategyName.fsdp: ("ddp_core.strategies.fsdp", "FSDPStrategy"),
}


def build_strategy(cfg: StrategyConfig, env: DistEnv, device: torch.device, task: Optional[Task] = None) -> Strategy:
    """``task``: where pipeline and model_parallel find the model's blocks (``Task.pipeline_blocks``)."""
    module, name = _STRATEGIES[cfg.name]
    cls: type[Strategy] = getattr(importlib.import_module(module), name)
    strategy = cls(cfg, env, device)
    strategy.task = task
    return strategy


__all__ = ["Strategy", "build_strategy"]
