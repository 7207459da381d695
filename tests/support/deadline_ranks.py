"""Ranks that exchange the stop flag (``ddp_core.cluster.preemption.StopFlag``) after every "step", as the trainer's
loop does, with rank 0 holding a deadline (``ddp_core.cluster.deadline.Deadline``) whose clock the test sets: it
reads ``START + TICK * k`` at its k-th check, whatever the wall clock says. Run under torchrun (``-m
torch.distributed.run --standalone --nproc-per-node=N``) with ``END MARGIN SAVE`` as arguments; each rank prints
``rank R stops at call C on SIGNUM by_deadline B steps S`` (S: the horizons rank 0's deadline was asked about)."""

from __future__ import annotations

import itertools
import logging
import os
import sys

import torch.distributed as dist

from ddp_core.cluster.deadline import Deadline
from ddp_core.cluster.preemption import StopFlag

START, TICK, CALLS = 1000.0, 100.0, 40


class Recorded(Deadline):
    """The deadline, keeping the horizon of each check."""

    steps: list[int]

    def check(self, steps: int, step_s: float) -> bool:
        self.steps.append(steps)
        return super().check(steps, step_s)


def main() -> None:
    logging.basicConfig(level=logging.INFO)
    end, margin, save = (float(a) for a in sys.argv[1:4])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    flag = StopFlag("USR2", 0.0, handlers=False)  # stop_check_ms=0: an exchange after every step
    if rank == 0:
        ticks = itertools.count()
        deadline = Recorded(end, margin, lambda: save, clock=lambda: START + TICK * next(ticks))
        deadline.steps = []
        flag.deadline = deadline
    stopped = (0, 0)
    for call in range(1, CALLS + 1):
        signum = flag.agree()
        if signum:
            stopped = (call, signum)
            break
    flag.settle()
    steps = sorted(set(flag.deadline.steps)) if isinstance(flag.deadline, Recorded) else []
    # One write of the whole line: the two ranks share the stdout pipe, and print's text and newline could
    # interleave with the other rank's line (seen under load: "steps [2]rank 1 stops ...").
    line = f"rank {rank} stops at call {stopped[0]} on {stopped[1]} by_deadline {flag.by_deadline} steps {steps}\n"
    os.write(sys.stdout.fileno(), line.encode())
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
