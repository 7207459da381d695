"""Tasks for packed sweeps' cluster tests (tests/cluster/test_packed_sweeps.py): faults from inside a trial, at a
chosen batch, never raced from outside."""

from __future__ import annotations

import os
import subprocess

import torch.distributed as dist

from ddp_core.cluster.env import PACKED_VAR
from ddp_core.tasks.digits import DigitsTask


class PackSignalDigitsTask(DigitsTask):
    """Digits whose rank 0, in slot 0 of a packed sweep's allocation and in the job's first attempt, sends the whole
    allocation its warning signal at its ``signal_at``-th training batch (``scancel --signal=USR2 JOB``: every running
    step gets it, as the time limit's warning reaches them all). Outside a pack it never fires. Numerics unchanged."""

    def __init__(self, signal_at: int = 0, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.signal_at, self.batches = signal_at, 0

    def split(self, batch: tuple) -> tuple:
        self.batches += 1
        first = os.environ.get("SLURM_RESTART_COUNT", "0") == "0"
        rank0 = not dist.is_initialized() or dist.get_rank() == 0
        if self.batches == self.signal_at and first and rank0 and os.environ.get(PACKED_VAR) == "0":
            subprocess.run(["scancel", "--signal=USR2", os.environ["SLURM_JOB_ID"]], check=True, timeout=60)
        return super().split(batch)
