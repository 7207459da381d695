"""The digits config (configs/digits.yaml) and what tests of several modules run it with."""

from __future__ import annotations

from pathlib import Path

from tests.support.helpers import ROOT, run_trainer

DIGITS = str(ROOT / "configs" / "digits.yaml")
# Short Slurm jobs of it. W&B offline costs a job seconds (its service process): only the test that checks its records
# keeps it.
QUICK = ["train.max_steps=60", "checkpoint.every_steps=20", "train.eval_every=0", "train.log_every=20",
         "wandb.mode=disabled"]  # fmt: skip
# The same on two nodes of partition "wide", one rank each (n1 and n2 on an idle cluster: the spare n3 weighs more).
TWO = [*QUICK, "slurm.nodes=2", "slurm.tasks_per_node=1", "slurm.partition=wide"]


def trainer(run_dir: Path, *overrides: str, nproc: int = 1, env: dict | None = None, stopped: bool = False) -> str:
    """``python -m ddp_core`` of the digits config outside Slurm (``run_trainer``); returns its log."""
    return run_trainer(DIGITS, run_dir, overrides, nproc, env, stopped)
