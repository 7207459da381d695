"""Tasks for packed sweeps' cluster tests (tests/cluster/test_packed_sweeps.py): faults from inside a trial, at a
chosen batch, never raced from outside."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ddp_core.cluster.env import PACKED_VAR
from ddp_core.tasks.digits import DigitsTask
from tests.support.gated_tasks import wait_at
from tests.support.tasks import CrashingTask


class PackSignalDigitsTask(DigitsTask):
    """Digits for a packed sweep's warning signal. In the job's first attempt, rank 0 of the trial in slot 0 sends the
    whole allocation its warning signal at its ``signal_at``-th training batch (``scancel --signal=USR2 JOB``: every
    running step gets it, as the time limit's warning reaches them all), and rank 0 of every packed trial waits at that
    batch until the signal has reached its own process (its handler, the trainer's, wrapped), so every trial running
    then is stopped by it, whatever its speed. Outside a pack it never fires. Numerics unchanged."""

    def __init__(self, signal_at: int = 0, wait_s: float = 120.0, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.signal_at, self.wait_s, self.batches, self.got = signal_at, wait_s, 0, threading.Event()

    def split(self, batch: tuple) -> tuple:
        self.batches += 1
        first = os.environ.get("SLURM_RESTART_COUNT", "0") == "0"
        rank0 = not dist.is_initialized() or dist.get_rank() == 0
        if first and rank0 and PACKED_VAR in os.environ:
            if self.batches == 1:  # the trainer's handler is in place by the first batch
                self.watch()
            if self.batches == self.signal_at:
                if os.environ[PACKED_VAR] == "0":
                    subprocess.run(["scancel", "--signal=USR2", os.environ["SLURM_JOB_ID"]], check=True, timeout=60)
                deadline = time.monotonic() + self.wait_s
                while not self.got.is_set():
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"no warning signal within {self.wait_s:g} s")
                    time.sleep(0.02)  # the handler runs between these, on this (the main) thread
        return super().split(batch)

    def watch(self) -> None:
        trainers = signal.getsignal(signal.SIGUSR2)

        def seen(signum: int, frame: Any) -> None:
            self.got.set()
            if callable(trainers):
                trainers(signum, frame)

        signal.signal(signal.SIGUSR2, seen)


class HeldCrashingTask(CrashingTask):
    """``CrashingTask`` whose rank 0 also waits at its ``hold_at``-th batch, in a packed sweep whose test set
    ``DDPJOB_TEST_PACK_GATE=D``, for the test's ``D/go-hold``: the healthy trials hold their slots until the test has
    seen the crashed trial's slot take the next trial. Numerics unchanged."""

    def __init__(self, hold_at: int = 0, **kwargs: object) -> None:
        super().__init__(**kwargs)
        self.hold_at, self.held = hold_at, 0

    def split(self, batch: tuple) -> tuple:
        self.held += 1
        gate = os.environ.get("DDPJOB_TEST_PACK_GATE")
        if gate and self.held == self.hold_at and (not dist.is_initialized() or dist.get_rank() == 0):
            wait_at(Path(gate), "hold", 300, "pack gate", poll_s=0.05)
        return super().split(batch)
