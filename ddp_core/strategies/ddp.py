"""DistributedDataParallel: one process per GPU (or CPU task), gradients all-reduced every step."""

from __future__ import annotations

from typing import Any, ContextManager

import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ddp_core.strategies.base import Strategy


class DDPStrategy(Strategy):
    def wrap(self, model: nn.Module) -> nn.Module:
        model = model.to(self.device)
        if not dist.is_initialized():  # plain single process: nothing to synchronise
            return model
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        return DistributedDataParallel(
            model, device_ids=device_ids, find_unused_parameters=self.cfg.find_unused_parameters
        )

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module if isinstance(model, DistributedDataParallel) else model

    def no_sync(self, model: nn.Module) -> ContextManager[Any]:
        if isinstance(model, DistributedDataParallel):
            return model.no_sync()
        return super().no_sync(model)
