"""The fan-out: every configured tracker (``log.trackers``) from one call, steps an earlier attempt already sent
skipped in one place, and a tracker's failure never fatal to training (it is dropped for the attempt, one warning).

``Records`` (the trainer) and ``runtime.log`` (script mode) call it on rank 0 only.
"""

from __future__ import annotations

import functools
import importlib
import logging
from typing import Any, Callable, Optional

from ddp_core.config import Config, to_dict
from ddp_core.config.tree import flatten
from ddp_core.run.rundir import RunDir
from ddp_core.trackers.base import Outcome, Tracker

log = logging.getLogger(__name__)

# log.trackers name -> the backend module (``open_tracker``), imported only when configured.
BACKENDS = {
    "wandb": "ddp_core.trackers.wandb_run",
    "tensorboard": "ddp_core.trackers.tensorboard_events",
    "mlflow": "ddp_core.trackers.mlflow_run",
    "csv": "ddp_core.trackers.csv_file",
}


class Trackers:
    """This attempt's trackers. ``skip_through``: the last step an earlier attempt logged (it died after its last
    checkpoint, and this attempt trains those steps again): steps up to it are not sent again, so every tracker
    holds each step once across attempts, while RUN/metrics.jsonl is rewound instead."""

    def __init__(self, trackers: list[Tracker], skip_through: int = -1) -> None:
        self.trackers, self.skip_through = trackers, skip_through

    def params(self, values: dict[str, Any]) -> None:
        for tracker in list(self.trackers):
            self._guard(tracker, "params", functools.partial(tracker.params, values))

    def metrics(self, values: dict[str, float], step: int) -> None:
        if step <= self.skip_through:
            return
        for tracker in list(self.trackers):
            self._guard(tracker, "metrics", functools.partial(tracker.metrics, values, step))

    def finish(self, outcome: Outcome) -> None:
        """Close every tracker (idempotent)."""
        trackers, self.trackers = self.trackers, []
        for tracker in trackers:
            try:
                tracker.finish(outcome)
            except Exception as err:  # Slurm signals every process of a step: a tracker's helper may be gone
                log.warning("%s finish failed (%s: %s)", tracker.name, type(err).__name__, one_line(err))

    def _guard(self, tracker: Tracker, what: str, call: Callable[[], None]) -> None:
        try:
            call()
        except Exception as err:  # a tracker's trouble must never end a training run
            log.warning(
                "%s %s failed (%s: %s); %s logging stops for this attempt",
                tracker.name,
                what,
                type(err).__name__,
                one_line(err),
                tracker.name,
            )
            self.trackers.remove(tracker)


def open_trackers(cfg: Config, run_dir: RunDir, skip_through: int) -> Trackers:
    """Rank 0, at an attempt's start: each configured tracker continues the run's tracker run (or creates it) and
    gets the hyperparameters. A tracker that cannot start (its package missing, its server unreachable) is left out
    with one warning: the run trains on."""
    run_id = str(run_dir.read_meta().get("run_id", run_dir.name))
    opened: list[Tracker] = []
    for name in cfg.log.trackers:
        tracker = _open(name, cfg, run_dir, run_id)
        if tracker is not None:
            opened.append(tracker)
    trackers = Trackers(opened, skip_through)
    trackers.params(flatten(to_dict(cfg)))
    return trackers


def _open(name: str, cfg: Config, run_dir: RunDir, run_id: str) -> Optional[Tracker]:
    try:
        backend = importlib.import_module(BACKENDS[name])
        tracker: Optional[Tracker] = backend.open_tracker(cfg, run_dir, run_id)
    except Exception as err:
        log.warning("%s disabled for this attempt: %s: %s", name, type(err).__name__, one_line(err))
        return None
    return tracker


def one_line(err: BaseException) -> str:
    """A library's errors span lines (the error, then what it was retrying): a warning stays one log line."""
    return " ".join(str(err).split())
