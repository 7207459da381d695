"""The ``log`` section: the experiment trackers rank 0 sends a run's hyperparameters and metrics to, besides
``RUN/metrics.jsonl`` (docs/watching-runs.md), with its checks.

``validate_log`` is the shape check every load runs; ``check_installed`` is the login node's check at submit that
each configured tracker's package can be imported where ddpjob runs (``tensorboard`` and ``mlflow`` are optional
extras: ``pip install 'ddpjob[trackers]'``). The trackers themselves are ``ddp_core.trackers``.
"""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass, field
from typing import List, Optional

from ddp_core.config.problems import require
from ddp_core.errors import DdpJobError

# Tracker name -> the package it imports (csv: the standard library's).
TRACKERS = {"wandb": "wandb", "tensorboard": "tensorboard", "mlflow": "mlflow", "csv": "csv"}
_URI = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*:\S+")  # scheme:rest (http://host:5000, sqlite:///path, file:///path)


@dataclass
class TensorBoardConfig:
    """TensorBoard event files (log.trackers: tensorboard)."""

    # Where the event files go. null: RUN/tensorboard. Else a folder, or a URL TensorBoard's file systems write
    # (s3://bucket/logs), in which each run writes a subfolder named after its run directory: `tensorboard --logdir`
    # on it shows every run.
    dir: Optional[str] = None


@dataclass
class MlflowConfig:
    """MLflow (log.trackers: mlflow)."""

    # Where the run is recorded: a tracking server (http://host:5000), or a store (sqlite:///path/mlflow.db). null:
    # a SQLite store in the run directory (RUN/mlflow/mlflow.db), for compute nodes without network; `ddpjob sync
    # RUN --mlflow-uri URL` uploads it.
    tracking_uri: Optional[str] = None
    experiment: str = "ddpjob"  # the MLflow experiment the run goes into (created if missing)


@dataclass
class LogConfig:
    """Experiment trackers, driven by rank 0: the hyperparameters once, the metrics by step, the run's outcome at the
    end. Every attempt of a run continues the same tracker run, and no step is logged twice (docs/watching-runs.md)."""

    # Any of wandb, tensorboard, mlflow and csv (RUN/metrics.csv), several at once, e.g. [tensorboard,csv]; []: only
    # RUN/metrics.jsonl. W&B's own settings are the wandb section.
    trackers: List[str] = field(default_factory=lambda: ["wandb"])
    tensorboard: TensorBoardConfig = field(default_factory=TensorBoardConfig)
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)


def validate_log(log: LogConfig) -> None:
    """Shape checks of the ``log`` section at every load: one ``DdpJobError`` line naming the key."""
    names = ", ".join(TRACKERS)
    for name in log.trackers:
        require(name in TRACKERS, "log.trackers", list(log.trackers), f"{name!r} is not a tracker (one of {names})")
    require(len(set(log.trackers)) == len(log.trackers), "log.trackers", list(log.trackers), "names one twice")
    uri = log.mlflow.tracking_uri
    if uri is not None:
        require(bool(_URI.fullmatch(uri)), "log.mlflow.tracking_uri", uri, "must be a URI such as http://host:5000")
    require(bool(log.mlflow.experiment.strip()), "log.mlflow.experiment", log.mlflow.experiment, "must not be empty")
    if log.tensorboard.dir is not None:
        require(bool(log.tensorboard.dir.strip()), "log.tensorboard.dir", log.tensorboard.dir, "must not be empty")


def check_installed(log: LogConfig, wandb_enabled: bool = True) -> None:
    """At submit: each configured tracker's package is importable here (the ranks run this environment, or an image
    built from it). One ``DdpJobError`` line naming the tracker and how to install it."""
    for name in log.trackers:
        if name == "wandb" and not wandb_enabled:
            continue
        if importlib.util.find_spec(TRACKERS[name]) is None:
            raise DdpJobError(
                f"config key 'log.trackers' has {name}, but the {TRACKERS[name]} package is not installed",
                f"pip install 'ddpjob[trackers]' (or {TRACKERS[name]}), or drop {name} from log.trackers",
            )
