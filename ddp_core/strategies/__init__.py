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


def build_strategy(
    cfg: StrategyConfig,
    env: DistEnv,
    device: torch.device,
    task: Optional[Task] = None,
    invariant_seed: Optional[int] = None,
) -> Strategy:
    """``task``: where pipeline and model_parallel find the model's blocks (``Task.pipeline_blocks``).
    ``invariant_seed``: train.seed of a ``train.invariant`` run (ddp only, checked at submit), which seeds each
    micro-batch shard (``strategies.invariant``); None for every other run."""
    if invariant_seed is not None:
        assert cfg.name is StrategyName.ddp, cfg.name  # config.batch.validate_invariant refused the others
        from ddp_core.strategies.invariant import InvariantDDPStrategy

        invariant = InvariantDDPStrategy(cfg, env, device)
        invariant.seed, invariant.task = invariant_seed, task
        return invariant
    module, name = _STRATEGIES[cfg.name]
    cls: type[Strategy] = getattr(importlib.import_module(module), name)
    strategy = cls(cfg, env, device)
    strategy.task = task
    return strategy


__all__ = ["Strategy", "build_strategy"]
