"""The monitored metric (``checkpoint.monitor``): which evaluation is the best so far, and early stopping.

``Monitor.update`` is called with every evaluation's metrics (the same, exactly averaged values on every rank, so
every rank decides alike). It says whether this evaluation is a new best (the trainer then checkpoints this step
and marks it best: ``checkpoint.mark_best``) and counts the evaluations since the last improvement against
``train.early_stop_patience``. Its state is part of the train state in each checkpoint, so the best value and
the patience count survive preemption and resume.
"""

from __future__ import annotations

import math
from typing import Any, Optional

from ddp_core.config import parse_metric
from ddp_core.errors import DdpJobError


class Monitor:
    """Best value of the monitored eval metric, the step it came from, and evaluations since it improved."""

    def __init__(self, spec: Optional[str], patience: int) -> None:
        # None: nothing monitored (no best checkpoint, no early stop).
        self.metric = parse_metric(spec, "config key 'checkpoint.monitor'") if spec else None
        self.patience = patience
        self.best: Optional[float] = None
        self.best_step = -1
        self.stale = 0  # evaluations since the best one

    def update(self, step: int, metrics: dict[str, float]) -> bool:
        """Record one evaluation; True when it is a new best (the first one always is)."""
        if self.metric is None:
            return False
        name = self.metric.name  # what the task's evaluation reports
        if name not in metrics:
            raise DdpJobError(
                f"checkpoint.monitor names {self.metric.key}, but the task's evaluation reports "
                f"{', '.join(f'eval/{k}' for k in sorted(metrics)) or 'no metrics'}",
                "name one of those in checkpoint.monitor (the task's Output.sums keys)",
            )
        value = metrics[name]
        better = math.isfinite(value) and (self.best is None or self.metric.better(value, self.best))
        if better:
            self.best, self.best_step, self.stale = value, step, 0
        else:
            self.stale += 1
        return better

    @property
    def should_stop(self) -> bool:
        return self.patience > 0 and self.stale >= self.patience

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "best_step": self.best_step, "stale": self.stale}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best, self.best_step, self.stale = state["best"], int(state["best_step"]), int(state["stale"])
