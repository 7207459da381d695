"""Builders for the optimizer and the LR schedule (warmup, then constant / cosine / linear decay)."""

from __future__ import annotations

import math

import torch
from torch import nn

from ddp_core.config import OptimConfig, OptimizerName, Schedule


def build_optimizer(cfg: OptimConfig, model: nn.Module) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    if cfg.name is OptimizerName.sgd:
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)


def build_scheduler(
    cfg: OptimConfig, optimizer: torch.optim.Optimizer, max_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    warmup, schedule = cfg.warmup_steps, cfg.schedule

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, max_steps - warmup))
        if schedule is Schedule.cosine:
            return 0.5 * (1.0 + math.cos(math.pi * progress))
        if schedule is Schedule.linear:
            return 1.0 - progress
        return 1.0

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
