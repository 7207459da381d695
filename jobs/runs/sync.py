"""``ddpjob sync RUN``: upload what a run recorded offline, from a machine with network: its offline W&B records
(``wandb sync``) and its MLflow store (``RUN/mlflow/mlflow.db``, pushed to ``--mlflow-uri`` or
``MLFLOW_TRACKING_URI``; ``ddp_core.trackers.mlflow_push``). TensorBoard needs no upload: point it at the files."""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
from typing import Sequence

from ddp_core.errors import DdpJobError
from jobs.runs.lookup import resolve


def wandb_sync_command(offline: Sequence[str], python: str = sys.executable) -> list[str]:
    """The ``wandb sync`` of a run's offline records, named by path: the form every supported wandb accepts (0.17
    through 0.31; 0.30 removed ``--include-offline``, which a path never needed)."""
    return [python, "-m", "wandb", "sync", *offline]


def cmd_sync(args: argparse.Namespace) -> int:
    from ddp_core.run.rundir import RunDir
    from ddp_core.trackers.mlflow_push import offline_store, push

    run_dir = RunDir(resolve(args.run_dir))
    offline = sorted(str(p) for p in run_dir.wandb.glob("offline-run-*"))
    store = offline_store(run_dir)
    if not offline and store is None:
        raise DdpJobError(
            f"no offline W&B records in {run_dir.wandb}, and no MLflow store in {run_dir.path / 'mlflow'}",
            "was the run started with wandb.mode=disabled, and without mlflow in log.trackers?",
        )
    target = args.mlflow_uri or os.environ.get("MLFLOW_TRACKING_URI")
    if store is not None and not target:
        raise DdpJobError(
            f"{run_dir.path} has an offline MLflow store ({store}), and no server to push it to",
            "give --mlflow-uri http://HOST:PORT, or set MLFLOW_TRACKING_URI",
        )
    code = 0
    if offline:
        command = wandb_sync_command(offline)
        print(shlex.join(command))
        code = 0 if args.dry_run else subprocess.call(command)
    if store is not None:
        assert target is not None  # refused above
        print(f"MLflow: {store} -> {target}" if args.dry_run else push(run_dir, target))
    return code
