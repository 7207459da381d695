"""DistributedDataParallel: one process per GPU (or CPU task), gradients all-reduced every step."""

from __future__ import annotations

from typing import Any, ContextManager

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ddp_core.distributed import rng
from ddp_core.strategies.base import Strategy
from ddp_core.strategies.units import candidate_units, checkpoint_activations
from ddp_core.tasks.base import Task


class DDPStrategy(Strategy):
    def wrap(self, model: nn.Module) -> nn.Module:
        model = model.to(self.device)
        if self.cfg.activation_checkpointing:
            checkpoint_activations(candidate_units(model, self.cfg.wrap_classes))
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

    def prime(self, task: Task, model: nn.Module, batch: Any) -> None:
        """One discarded forward/backward so that every counted step reduces with DDP's final bucket layout.

        DDP reduces a process's first backward in one bucket of all parameters, in registration order, then
        rebuilds its buckets in the order gradients became ready (unless find_unused_parameters). With three or
        more ranks a ring all-reduce adds an element's terms in an order set by the element's offset in its bucket,
        and floating-point addition of three terms is not associative: the first step of a resumed attempt would
        then differ in the last bits from the same step of an uninterrupted run. Priming every attempt, fresh or
        resumed, gives each step the same layout. RNG streams, buffers (batch-norm statistics) and gradients are
        restored; the cost is one step's compute and all-reduce per attempt.
        """
        if not isinstance(model, DistributedDataParallel) or self.cfg.find_unused_parameters:
            return
        saved_rng = rng.rng_state()
        buffers = [b.detach().clone() for b in model.buffers()]
        task.compute(model, batch).loss.backward()
        model.zero_grad(set_to_none=True)
        with torch.no_grad():
            for saved, live in zip(buffers, model.buffers(), strict=True):
                live.copy_(saved)
        rng.set_rng_state(saved_rng)
