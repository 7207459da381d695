"""The tracker interface rank 0 drives: the hyperparameters once, the metrics by step, the run's outcome at the end.

A backend is a module of this package with ``open_tracker(cfg, run_dir, run_id) -> Tracker``; it imports its
library inside that function only (``import ddp_core.trackers`` stays light, and torch-free). Steps are skipped in
one place, the fan-out (``fanout.Trackers``): a backend logs every step it is given.
"""

from __future__ import annotations

from typing import Any, Literal, Protocol

# How an attempt ended: the run is complete, it stopped to be continued (a requeue, a resume), or it failed.
Outcome = Literal["finished", "stopped", "failed"]


class Tracker(Protocol):
    """One experiment tracker's run, continued by every attempt of the ddpjob run (its id: ``run.json``)."""

    name: str

    def params(self, values: dict[str, Any]) -> None:
        """The run's hyperparameters (the config as dotted keys), at each attempt's start: a backend records them
        once per run, when this attempt created the tracker's run."""

    def metrics(self, values: dict[str, float], step: int) -> None:
        """``split/name`` values at ``step``; steps arrive increasing, each at most once across attempts. A few
        values are text (``train/slowest_host``): a backend that takes numbers only leaves them out (``numbers``)."""

    def finish(self, outcome: Outcome) -> None:
        """Close this attempt's writer, recording how the attempt ended."""


def numbers(values: dict[str, Any]) -> dict[str, float]:
    """The values that are numbers (bools as 0 and 1), as floats."""
    return {k: float(v) for k, v in values.items() if isinstance(v, (int, float))}


def scalar_params(values: dict[str, Any]) -> dict[str, Any]:
    """Dotted config keys with values every tracker takes: numbers, strings and bools as they are, the rest (None,
    lists, mappings) as their text."""
    return {k: v if isinstance(v, (bool, int, float, str)) else str(v) for k, v in values.items()}
