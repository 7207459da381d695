"""Naive model parallelism: consecutive top-level layers of one model on consecutive GPUs of one process.

For a model too big for one GPU, not for speed: stage i waits for stage i-1, so one GPU computes at a time.
The wrapper only moves activations between devices; the layers stay inside the user's module, so its
state_dict keys, and hence checkpoints, are the plain model's. On a machine without GPUs every stage is
on the CPU, through the same code.
"""

from __future__ import annotations

import logging
from typing import Any, Optional, Sequence

import torch
from torch import nn

from ddp_core.errors import DdpJobError
from ddp_core.strategies.base import SingleProcessStrategy
from ddp_core.strategies.dp import local_devices, require_single_process
from ddp_core.strategies.units import model_blocks, ties_across_stages

log = logging.getLogger(__name__)


def balanced_split(sizes: Sequence[int], parts: int) -> list[int]:
    """Layers per stage: ``sizes`` cut into at most ``parts`` non-empty runs, minimising the largest run's sum."""
    n, parts = len(sizes), min(parts, len(sizes))
    prefix = [0]
    for size in sizes:
        prefix.append(prefix[-1] + size)
    # best[k][i]: the smallest possible largest sum when the first i layers form k stages; cut: where the last starts.
    best = [[float("inf")] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0
    for k in range(1, parts + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    counts, i = [], n
    for k in range(parts, 0, -1):
        counts.append(i - cut[k][i])
        i = cut[k][i]
    return counts[::-1]


def _move(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (list, tuple)):
        return type(value)(_move(v, device) for v in value)
    return value


def refuse_ties_across_devices(blocks: list[nn.Module], split: list[int], model: nn.Module, devices: int) -> None:
    """One process holds each parameter once: a weight tied between stages on different GPUs would be used on a
    device it is not on. Refused rather than copied (the copies would need keeping equal by hand)."""
    ties = ties_across_stages(blocks, split, model) if devices > 1 else {}
    if ties:
        name, holders = next(iter(ties.items()))
        raise DdpJobError(
            f"strategy.name='model_parallel' would put stages {holders}, which share the tied parameter {name!r}, "
            "on different GPUs",
            "set strategy.split so the blocks that share it are in one stage, untie it, or use strategy.name=pipeline",
        )


class StagedModel(nn.Module):
    """Runs the stages in order, each on its device, and returns the output on the first stage's device
    (where the trainer put the targets), so any task's loss works unchanged."""

    def __init__(self, module: nn.Module, stages: list[tuple[torch.device, list[nn.Module]]]) -> None:
        super().__init__()
        self.module = module  # the only registered child: parameters() and state_dict() see the user's model
        self._stages = stages  # plain list, not registered: the same layers, already counted under module

    def forward(self, x: Any) -> Any:
        for device, layers in self._stages:
            x = _move(x, device)
            for layer in layers:
                x = layer(x)
        return _move(x, self._stages[0][0])


class ModelParallelStrategy(SingleProcessStrategy):
    def wrap(self, model: nn.Module) -> nn.Module:
        require_single_process("model_parallel", self.env.world_size)
        layers = model_blocks(model, self.task, "model_parallel")
        devices = local_devices(self.device)
        split = self._split(layers, devices, self.cfg.split)
        refuse_ties_across_devices(layers, split, model, len(devices))
        # Layer by layer from the CPU: the whole model never has to fit on one GPU.
        stages: list[tuple[torch.device, list[nn.Module]]] = []
        start = 0
        for i, count in enumerate(split):
            # One device (the CPU, or a single GPU) takes every stage, through the same path as several GPUs.
            device = devices[i] if len(devices) > 1 else devices[0]
            group = [layer.to(device) for layer in layers[start : start + count]]
            n = sum(p.numel() for layer in group for p in layer.parameters())
            log.info("model_parallel stage %d on %s: layers %d-%d, %d params", i, device, start, start + count - 1, n)
            stages.append((device, group))
            start += count
        return StagedModel(model, stages)

    @staticmethod
    def _split(layers: list[nn.Module], devices: list[torch.device], split: Optional[list[int]]) -> list[int]:
        if split is None:
            return balanced_split([sum(p.numel() for p in layer.parameters()) for layer in layers], len(devices))
        if sum(split) != len(layers):
            names = ", ".join(type(layer).__name__ for layer in layers)
            raise DdpJobError(
                f"config key 'strategy.split' = {list(split)} places {sum(split)} layers, but the model has "
                f"{len(layers)} top-level layers ({names})",
                f"give counts that sum to {len(layers)}, or strategy.split=null to balance by parameter count",
            )
        if len(devices) > 1 and len(split) > len(devices):
            raise DdpJobError(
                f"config key 'strategy.split' = {list(split)} has {len(split)} stages, but this process sees "
                f"{len(devices)} GPUs",
                "request more GPUs (slurm.gpus_per_node) or use fewer stages",
            )
        return list(split)

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module if isinstance(model, StagedModel) else model
