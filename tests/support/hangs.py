"""What the watchdog's tests run: short digits runs, a task that hangs, and where a hang's dump lands."""

from __future__ import annotations

from pathlib import Path

from ddp_core.cluster.env import DistEnv
from ddp_core.trainer.watchdog import attempt_folder

QUICK = ["train.max_steps=60", "train.log_every=5", "train.eval_every=0", "checkpoint.every_steps=20",
         "optim.warmup_steps=2", "wandb.mode=disabled"]  # fmt: skip
HANGING = ["task.target=tests.support.tasks:HangingTask", "watchdog.stall_s=8", "dist.timeout_s=120"]


def hang_folder(run: Path, job: str | None = None) -> Path:
    """The hang's folder: a Slurm job's first attempt's (a later attempt may leave a folder too: seen once, on a
    loaded machine), else the run's only one."""
    if job is not None:
        return attempt_folder(run / "hangs", DistEnv(job_id=job))
    (folder,) = [p for p in (run / "hangs").iterdir() if p.is_dir()]
    return folder
