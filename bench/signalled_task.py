"""The char LM task of ``bench/gpu_check.py``'s exact-resume check, which stops itself at a chosen batch.

``DDPJOB_GPU_CHECK_SIGNAL_AT=BATCH`` (the attempt's environment: the resumed attempt has none) makes every rank send
itself the warning signal in its BATCH-th ``split()`` (1-based; every strategy calls it once per micro-batch), as
Slurm signals every task of a step. The interruption then comes at a chosen step instead of a moment raced from
outside, which once let a short run finish before the signal. Numerics are CharLMTask's.
"""

from __future__ import annotations

import os
import signal
from typing import Any

from ddp_core.tasks.charlm import CharLMTask

SIGNAL_AT = "DDPJOB_GPU_CHECK_SIGNAL_AT"


class SignalledCharLMTask(CharLMTask):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.signal_at, self.batches = int(os.environ.get(SIGNAL_AT, "0")), 0

    def split(self, batch: Any) -> tuple[Any, Any]:
        self.batches += 1
        if self.batches == self.signal_at:
            os.kill(os.getpid(), signal.SIGUSR2)
        return super().split(batch)
