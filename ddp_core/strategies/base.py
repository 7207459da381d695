"""The strategy interface: how a model is placed and wrapped, how its state is saved, how data is sharded."""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from typing import Any, ContextManager

import torch
from torch import nn

from ddp_core.config import StrategyConfig
from ddp_core.dist_env import DistEnv


class Strategy(ABC):
    def __init__(self, cfg: StrategyConfig, env: DistEnv, device: torch.device) -> None:
        self.cfg = cfg
        self.env = env
        self.device = device

    @abstractmethod
    def wrap(self, model: nn.Module) -> nn.Module:
        """Place ``model`` on its device(s) and wrap it; the result is what the loop calls."""

    @abstractmethod
    def unwrap(self, model: nn.Module) -> nn.Module:
        """The plain user module inside a wrapped one (state_dict keys without wrapper prefixes)."""

    def no_sync(self, model: nn.Module) -> ContextManager[Any]:
        """Context for accumulation micro-steps that should skip gradient communication."""
        return contextlib.nullcontext()

    @property
    def data_rank(self) -> int:
        """This process's index among data-parallel replicas (sampler shard)."""
        return self.env.rank

    @property
    def data_world(self) -> int:
        """Number of data-parallel replicas; the global batch is batch_size * data_world * grad_accum."""
        return self.env.world_size

    def model_state(self, model: nn.Module) -> dict[str, torch.Tensor]:
        return self.unwrap(model).state_dict()

    def load_model_state(self, model: nn.Module, state: dict[str, torch.Tensor]) -> None:
        self.unwrap(model).load_state_dict(state)
