"""Builders for the optimizer and the LR schedule (warmup, then constant / cosine / linear decay to ``min_lr``).

The optimizer comes from the task's ``configure_optimizer`` hook when it returns one, else from ``optim.*``:
AdamW (betas, eps) or SGD, with parameters whose names contain an ``optim.no_decay`` pattern in a second group
without weight decay, updated the way ``optim.implementation`` says (foreach by default). The schedule likewise
comes from ``Task.configure_scheduler`` or ``build_scheduler``.
"""

from __future__ import annotations

import contextlib
import logging
import math
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional

import torch
from torch import nn

from ddp_core.config import OptimConfig, OptimizerImpl, OptimizerName, Schedule

if TYPE_CHECKING:
    from ddp_core.tasks.base import Task

log = logging.getLogger(__name__)


def parameter_groups(cfg: OptimConfig, model: nn.Module) -> list[dict[str, Any]]:
    """Trainable parameters in one group, or two when ``optim.no_decay`` is set: those whose name contains one of
    its fragments get weight_decay 0 (norms and biases, by transformer convention)."""
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    if not cfg.no_decay:
        return [{"params": [p for _, p in named]}]
    plain = [p for name, p in named if not any(f in name for f in cfg.no_decay)]
    exempt = [p for name, p in named if any(f in name for f in cfg.no_decay)]
    if not exempt:
        log.warning("optim.no_decay %s matches no parameter name: every parameter decays", cfg.no_decay)
    groups: list[dict[str, Any]] = [{"params": plain}, {"params": exempt, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def implementation(cfg: OptimConfig) -> dict[str, bool]:
    """torch.optim's ``foreach``/``fused`` arguments for ``optim.implementation`` (also keys of every param group)."""
    if cfg.implementation is OptimizerImpl.fused:
        return {"foreach": False, "fused": True}
    return {"foreach": cfg.implementation is OptimizerImpl.foreach, "fused": False}


def build_optimizer(cfg: OptimConfig, model: nn.Module, task: Task | None = None) -> torch.optim.Optimizer:
    custom = task.configure_optimizer(model, cfg) if task is not None else None
    if custom is not None:
        return custom
    groups = parameter_groups(cfg, model)
    how = implementation(cfg)
    if cfg.name is OptimizerName.sgd:
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay, **how)
    betas = (float(cfg.betas[0]), float(cfg.betas[1]))
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=betas, eps=cfg.eps, weight_decay=cfg.weight_decay, **how)


@contextlib.contextmanager
def keeps_implementation(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Around loading a checkpoint's optimizer state: ``load_state_dict`` restores every param group's ``foreach``
    and ``fused`` flags as they were saved (a checkpoint from before ``optim.implementation``, or written under
    another value). How this attempt steps is how its optimizer was built."""
    built: list[dict[str, Any]] = [
        {k: group[k] for k in ("foreach", "fused") if k in group} for group in optimizer.param_groups
    ]
    yield
    for group, flags in zip(optimizer.param_groups, built, strict=True):
        group.update(flags)


def build_scheduler(
    cfg: OptimConfig, optimizer: torch.optim.Optimizer, max_steps: int, task: Task | None = None
) -> Any:
    """The task's scheduler (``configure_scheduler``; stepped once per optimizer step, checkpointed through its
    ``state_dict``), else warmup then the configured decay, floored at ``optim.min_lr``."""
    custom = task.configure_scheduler(optimizer, cfg, max_steps) if task is not None else None
    if custom is not None:
        return custom
    warmup, schedule = cfg.warmup_steps, cfg.schedule
    floor = cfg.min_lr / cfg.lr  # the decay goes from 1 to this fraction of each group's lr (0: to 0, as before)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, max_steps - warmup))
        if schedule is Schedule.cosine:
            return floor + (1.0 - floor) * (0.5 * (1.0 + math.cos(math.pi * progress)))
        if schedule is Schedule.linear:
            return floor + (1.0 - floor) * (1.0 - progress)
        return 1.0

    return WarmupDecay(optimizer, factor)


class WarmupDecay:
    """The built-in schedule: each group's lr is its initial lr times ``factor(step)``, set at every ``step()``
    (torch's ``LambdaLR`` with its per-call checks left out: they cost the tiny model's step 0.4%). It reads
    ``LambdaLR``'s ``last_epoch`` and ``base_lrs`` from a state dict: checkpoints written with one resume."""

    def __init__(self, optimizer: torch.optim.Optimizer, factor: Callable[[int], float]) -> None:
        self.optimizer, self.factor = optimizer, factor
        self.base_lrs = [group["lr"] for group in optimizer.param_groups]
        self.last_epoch = 0  # optimizer steps taken (torch's name)
        self.set_lrs()

    def step(self) -> None:
        """After each optimizer step."""
        self.last_epoch += 1
        self.set_lrs()

    def set_lrs(self) -> None:
        factor = self.factor(self.last_epoch)
        for group, base in zip(self.optimizer.param_groups, self.base_lrs, strict=True):
            group["lr"] = base * factor

    def get_last_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def state_dict(self) -> dict[str, Any]:
        return {"last_epoch": self.last_epoch, "base_lrs": list(self.base_lrs)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The groups' current lr comes with the optimizer's own state, as with ``LambdaLR``."""
        self.last_epoch, self.base_lrs = int(state["last_epoch"]), list(state["base_lrs"])


class OptimizerStep:
    """One optimizer step after the micro-batches' backward: unscale (fp16), clip or measure the gradient norm,
    step (skipped by the scaler on inf/NaN gradients), zero the gradients, advance the schedule.

    Under ``train.precision=fp16`` the strategy scales each loss through ``scaler`` before its backward; the
    scaler's state (scale, growth tracker) is part of the train state, so a resumed run scales as the uninterrupted
    one would. The norm is handed to ``on_norm`` as a device tensor (read back at the next progress line)."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        grad_clip: float,
        log_grad_norm: bool,
        scaler: Optional[torch.amp.GradScaler],
        on_norm: Callable[[torch.Tensor], None],
        clip_grad_norm: Callable[[float], Optional[torch.Tensor]],
    ) -> None:
        self.optimizer, self.scheduler, self.scaler, self.on_norm = optimizer, scheduler, scaler, on_norm
        self.clip_grad_norm = clip_grad_norm  # the strategy's, over the whole model: (max norm) -> norm before
        # Without clipping, the norm is measured through a clip at infinity: scale 1.0, the gradients unchanged.
        self.clip = grad_clip if grad_clip > 0 else (math.inf if log_grad_norm else 0.0)

    def __call__(self) -> None:
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)  # the norm and the clip see the true gradients
        if self.clip > 0:
            norm = self.clip_grad_norm(self.clip)
            if norm is not None:
                self.on_norm(norm)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()

    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict() if self.scaler is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)
