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


def flat_grads(params: list[nn.Parameter]) -> torch.Tensor:
    """The parameters' gradients in one flat buffer (zeros for a parameter this backward did not reach)."""
    return torch.cat([p.grad.reshape(-1) if p.grad is not None else p.new_zeros(p.numel()) for p in params])


class DDPStrategy(Strategy):
    recomputing = False  # activation checkpointing turned on in this attempt (``recompute_activations``)

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

    def local_model(self, model: nn.Module) -> nn.Module:
        return self.unwrap(model)  # DDP's forward may broadcast buffers; its backward hooks stay idle without it

    def recompute_activations(self, model: nn.Module) -> bool:
        """Activation checkpointing from now on (``trainer.redo``): the same units ``strategy.activation_checkpointing``
        would recompute; recomputation restores the RNG state, so dropout masks, and so the bits, are kept."""
        if self.recomputes():
            return False
        checkpoint_activations(candidate_units(model, self.cfg.wrap_classes))
        self.recomputing = True
        return True

    def recomputes(self) -> bool:
        return self.recomputing or self.cfg.activation_checkpointing

    def sync_buffers(self, model: nn.Module) -> None:
        """DDP's forward broadcasts rank 0's buffers (``broadcast_buffers``): the same before each step, once."""
        if isinstance(model, DistributedDataParallel) and model.broadcast_buffers:
            for buffer in model.module.buffers():
                dist.broadcast(buffer, src=0)

    def reduce_gradients(self, model: nn.Module) -> None:
        """DDP's arithmetic, without its buckets: each gradient divided by the replicas, then summed over them, in one
        flat all-reduce (at 2 ranks the same bits as DDP's: a sum of two is the same in either order)."""
        if not dist.is_initialized() or self.data_world == 1:
            return
        params = [p for p in model.parameters() if p.requires_grad]
        flat = flat_grads(params).div_(self.data_world)
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        self.set_grads(params, flat)

    @staticmethod
    def set_grads(params: list[nn.Parameter], flat: torch.Tensor) -> None:
        for p, part in zip(params, torch.split(flat, [p.numel() for p in params]), strict=True):
            p.grad = part.view_as(p).to(p.dtype)

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
