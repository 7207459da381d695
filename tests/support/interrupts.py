"""Interrupting a running job: ``scancel --signal=USR2`` at random training steps, each time once its attempt trains."""

from __future__ import annotations

import random
import subprocess
import time
from pathlib import Path

from tests.support.helpers import events, metric_steps, wait_for


def wait_training(run_dir: Path, attempt: int, past_step: int) -> None:
    """Until attempt number ``attempt`` (1-based) logged a training step beyond ``past_step``."""
    wait_for(
        lambda: len(events(run_dir, "start")) >= attempt and max(metric_steps(run_dir), default=-1) > past_step,
        120,
        f"attempt {attempt} to train past step {past_step}",
    )


def interrupt(job_id: str, run_dir: Path, times: int, rng: random.Random) -> list[int]:
    """``scancel --signal=USR2`` the job ``times`` times at random steps; returns the steps it stopped at."""
    stopped = [0]
    for i in range(times):
        wait_training(run_dir, i + 1, stopped[-1] + 3)
        time.sleep(rng.uniform(0.1, 1.2))  # a random step
        subprocess.run(["scancel", "--signal=USR2", job_id], check=True)
        done = wait_for(lambda n=i: len(events(run_dir, "interrupted")) > n, 60, f"interruption {i + 1}")
        assert done
        stopped.append(events(run_dir, "interrupted")[-1]["step"])
    return stopped[1:]
