"""What ``ddpjob status`` and ``ddpjob report`` rank runs and trials by: ``--metric`` read through the one metric
spec (``ddp_core.config.metric``), an eval metric or a train one."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ddp_core.config.metric import Metric

RANKED_SPLITS = ("eval", "train")  # what status and report rank trials by


def ranking_metric(text: str) -> Metric:
    """``--metric`` of ``ddpjob status`` and ``ddpjob report`` through the one metric spec (``ddp_core.config.metric``):
    an eval metric or a train one, ``eval/loss`` minimised as everywhere."""
    from ddp_core.config.metric import parse_metric  # the config package reads YAML: not for importing a report

    return parse_metric(text, "--metric", RANKED_SPLITS)
