"""One metric spec (``ddp_core.config.metric``): the same string names the same metric and direction in
``checkpoint.monitor`` (the trainer's best checkpoint and early stop), ``search.metric`` (the study and its pruner),
``ddpjob status --metric`` and ``ddpjob report --metric``. A search on ``eval/loss`` used to climb it."""

from __future__ import annotations

import pytest

from ddp_core.config import load_config
from ddp_core.trainer.monitor import Monitor
from jobs.runs.ranking import ranking_metric
from jobs.runs.status import sort_by_metric
from jobs.sweeps.search_spec import parse_cli_search
from tests.support.helpers import ROOT

DIGITS = ROOT / "configs" / "digits.yaml"


class _Row:  # what status ranks: a run's metric value
    def __init__(self, name: str, metric: float) -> None:
        self.name, self.metric = name, metric


@pytest.mark.parametrize(
    ("text", "key", "minimize"),
    [
        ("eval/loss", "eval/loss", True),
        ("eval/accuracy", "eval/accuracy", False),
        ("eval/perplexity", "eval/perplexity", True),
        ("min:eval/accuracy", "eval/accuracy", True),
        ("max:eval/loss", "eval/loss", False),
        ("loss", "eval/loss", True),
    ],
)
def test_one_string_one_metric_and_direction_everywhere(text, key, minimize):
    name = key.removeprefix("eval/")
    # checkpoint.monitor: the config takes it, and the trainer's monitor keeps the better of two evaluations
    load_config(DIGITS, ["run.name=m", f"checkpoint.monitor={text}"])
    monitor = Monitor(text, patience=0)
    assert monitor.update(1, {name: 1.0}) and monitor.update(2, {name: 0.5}) is minimize
    # search.metric: the study's direction
    spec = parse_cli_search(DIGITS, ["optim.lr=uniform(1e-3,1e-2)"], metric=text)
    assert (spec.metric, spec.direction) == (key, "minimize" if minimize else "maximize")
    # status --metric: the best row first; report --metric: the same parse
    _, best = sort_by_metric([_Row("high", 2.0), _Row("low", 1.0)], text)  # type: ignore[list-item]
    assert best is not None and best.name == ("low" if minimize else "high")
    assert (ranking_metric(text).key, ranking_metric(text).minimize) == (key, minimize)


def test_a_search_direction_decides_only_where_the_metric_does_not():
    spec = parse_cli_search(DIGITS, ["optim.lr=uniform(1e-3,1e-2)"], metric="eval/f1", direction="minimize")
    assert (spec.metric, spec.direction) == ("eval/f1", "minimize")
    with pytest.raises(Exception, match="contradicts metric 'max:eval/loss'"):
        parse_cli_search(DIGITS, ["optim.lr=uniform(1e-3,1e-2)"], metric="max:eval/loss", direction="minimize")
