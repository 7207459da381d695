"""Tasks that tell a test where they are without stopping: rank 0 writes a file at a chosen batch and goes on, so the
test acts from outside (a node killed whole) at that step rather than at a raced moment."""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch.distributed as dist

from tests.support.tasks import SlowFirstAttemptDigitsTask


class MarkedSlowFirstAttemptTask(SlowFirstAttemptDigitsTask):
    """``SlowFirstAttemptDigitsTask`` (``pause_s`` per batch in the job's first attempt only) whose rank 0 writes
    ``mark_file`` (the time) at its ``mark_at``-th batch of that attempt, then trains on. Numerics unchanged."""

    def __init__(self, mark_file: str = "", mark_at: int = 5, **kwargs: object) -> None:
        super().__init__(**kwargs)
        self.mark_file, self.mark_at, self.batches = mark_file, mark_at, 0

    def split(self, batch: tuple) -> tuple:
        self.batches += 1
        first = os.environ.get("SLURM_RESTART_COUNT", "0") == "0"
        rank = dist.get_rank() if dist.is_initialized() else 0
        if first and rank == 0 and self.batches == self.mark_at and self.mark_file:
            Path(self.mark_file).write_text(f"{time.time():.3f}\n")
        return super().split(batch)
