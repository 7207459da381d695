"""Preemption and time limits: signal handlers that only set a flag, a per-step agreement between ranks,
and the decision (requeue or stop) after the checkpoint is written.

Slurm delivers the warning signal (``slurm.signal``, default USR2, ``slurm.signal_lead_s`` before the time
limit) and SIGTERM (preemption, ``scontrol requeue``, scancel) to every task, but not at the same instant and
not always to every rank. Each rank's handler records the signal; at each step boundary the ranks all-reduce
it (MAX), so they all stop after the same step, checkpoint together, and rank 0 requeues the job.

The all-reduce is asynchronous and on the CPU (gloo, also on GPU nodes: see ``ddp_core.distributed``): the one
started after step N is read after step N+1, by when it has long completed. No rank waits for its peers at a
step boundary, and the CUDA stream never waits for the flag. Every rank reads the same result at the same step,
so they still all stop after the same step, one step after the signal's.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import time
from datetime import datetime
from enum import Enum
from types import FrameType
from typing import Optional

import torch
import torch.distributed as dist

from ddp_core.dist_env import DistEnv

log = logging.getLogger(__name__)

# Timed signals arrived up to ~1 min earlier than asked on the test cluster; allow for it when classifying.
_TIMEOUT_SLACK_S = 90


class Interruption(str, Enum):
    timeout = "timeout"  # the warning signal, near the time limit: requeue
    preemption = "preemption"  # the warning signal, earlier (scancel --signal, preemption notice): requeue
    terminated = "terminated"  # SIGTERM: Slurm is ending or requeueing the job itself; save and leave
    stopped = "stopped"  # a signal outside Slurm (torchrun, a plain process): save and exit non-zero


class StopFlag:
    """Installs handlers for the warning signal and SIGTERM; the handlers only record which arrived."""

    def __init__(self, warning_signal: str) -> None:
        self.warning = signal.Signals[f"SIG{warning_signal.upper().removeprefix('SIG')}"]
        self.received = 0  # signal number; SIGTERM wins over the warning signal
        self.received_at = 0.0
        self._pending: Optional[tuple[dist.Work, torch.Tensor]] = None  # the all-reduce started a step ago
        for sig in (self.warning, signal.SIGTERM):
            # Replaces submitit's handlers: its USR2 handler checkpoints rank 0 alone, inside the handler.
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: Optional[FrameType]) -> None:
        if self.received != signal.SIGTERM:
            self.received = signum
            self.received_at = time.time()

    def agree(self) -> int:
        """Called by every rank after every step: the signal any rank had received by the previous call (0 if
        none), the same on every rank. Starts the exchange of this step's flag, read at the next call."""
        if not dist.is_initialized():
            return self.received
        agreed = self.settle()
        value = torch.tensor([self.received], dtype=torch.int64)  # a CPU tensor: gloo, never the CUDA stream
        # The warning signal's number is smaller than SIGTERM's on Linux (USR1 10, USR2 12, TERM 15), so
        # MAX makes SIGTERM win if any rank saw it.
        work = dist.all_reduce(value, op=dist.ReduceOp.MAX, async_op=True)
        self._pending = (work, value)
        return agreed

    def settle(self) -> int:
        """Wait for the exchange in flight (every rank, before the group is used for anything it must not overlap
        or is destroyed) and return its result."""
        if self._pending is None:
            return 0
        work, value = self._pending
        self._pending = None
        work.wait()
        return int(value.item())


def classify(time_left_s: Optional[float], lead_s: int) -> Interruption:
    """A warning signal inside Slurm: a timeout near the job's end, a preemption earlier. (SIGTERM and a signal
    outside Slurm are told apart before this, by ``launch``.)"""
    if time_left_s is None or time_left_s <= lead_s + _TIMEOUT_SLACK_S:
        return Interruption.timeout
    return Interruption.preemption


def job_end_time(job_id: Optional[str]) -> Optional[float]:
    """The job's scheduled end (epoch seconds) from squeue; None outside Slurm or when unknown."""
    if not job_id:
        return None
    try:
        out = subprocess.run(
            ["squeue", "-h", "-j", job_id, "-o", "%e"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
        return datetime.fromisoformat(out).timestamp() if out and out[0].isdigit() else None
    except (OSError, subprocess.TimeoutExpired, ValueError):
        return None


def requeue(env: DistEnv) -> bool:
    """Put this job back in the queue (same job id). Rank 0 only; True if Slurm accepted."""
    if not env.slurm_job_id:
        log.warning("not running in a Slurm job: nothing to requeue; continue later with `ddpjob resume`")
        return False
    proc = subprocess.run(["scontrol", "requeue", env.slurm_job_id], capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        log.error("scontrol requeue %s failed: %s", env.slurm_job_id, proc.stderr.strip())
        return False
    log.info("requeued job %s", env.slurm_job_id)
    return True
