"""Parallelism strategies behind one interface; ``build_strategy`` picks one by ``strategy.name``."""

from __future__ import annotations

import torch

from ddp_core.config import StrategyConfig, StrategyName
from ddp_core.dist_env import DistEnv
from ddp_core.strategies.base import Strategy
from ddp_core.strategies.ddp import DDPStrategy
from ddp_core.strategies.dp import DPStrategy
from ddp_core.strategies.fsdp import FSDPStrategy
from ddp_core.strategies.model_parallel import ModelParallelStrategy
from ddp_core.strategies.pipeline import PipelineStrategy

_STRATEGIES: dict[StrategyName, type[Strategy]] = {
    StrategyName.ddp: DDPStrategy,
    StrategyName.dp: DPStrategy,
    StrategyName.model_parallel: ModelParallelStrategy,
    StrategyName.pipeline: PipelineStrategy,
    StrategyName.fsdp: FSDPStrategy,
}


def build_strategy(cfg: StrategyConfig, env: DistEnv, device: torch.device) -> Strategy:
    return _STRATEGIES[cfg.name](cfg, env, device)


__all__ = ["Strategy", "build_strategy"]
