"""``ddpjob sync RUN``: upload a run's offline W&B records (``wandb sync``)."""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys

from ddp_core.errors import DdpJobError
from jobs.runs.lookup import resolve


def cmd_sync(args: argparse.Namespace) -> int:
    from ddp_core.run.rundir import RunDir

    run_dir = RunDir(resolve(args.run_dir))
    offline = sorted(str(p) for p in run_dir.wandb.glob("offline-run-*"))
    if not offline:
        raise DdpJobError(f"no offline W&B records in {run_dir.wandb}", "was the run started with wandb.mode=disabled?")
    command = [sys.executable, "-m", "wandb", "sync", "--include-offline", *offline]
    print(shlex.join(command))
    if args.dry_run:
        return 0
    return subprocess.call(command)
