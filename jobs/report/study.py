"""The report's trials as an in-memory Optuna study, so that ``optuna.visualization`` draws a grid or random sweep
as it draws an adaptive one (parallel coordinates, optimisation history), and each swept key's importance. Only
trials with a finite value of the ranking metric enter them; the page's table lists every other trial with its state.

Importance here is the share of the metric's variance that each key explains alone (between-group variance over
total variance, numeric keys in up to ten quantile bins): fANOVA's first-order terms, without its random forest.
``optuna.importance`` imports scikit-learn's ensembles on first use, 3 to 4 s on a 2-core login node, which alone
would spend a third of the 1,000-trial report's budget.
"""

from __future__ import annotations

import math
from typing import Any, Optional

from jobs.report.trials import Sweep

MIN_IMPORTANCE_TRIALS = 8  # fewer finished trials than this: importances would be noise, the page says so
CHOICE_TYPES = (str, int, float, bool, type(None))


def distribution(values: list[Any], scale: str) -> Optional[Any]:
    """The Optuna distribution that spans ``values`` drawn on ``scale``; None when they cannot vary on it."""
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
    if scale == "choice" or not numbers:
        choices = list(dict.fromkeys(choice(v) for v in values))
        return CategoricalDistribution(choices) if len(choices) > 1 else None
    low, high = min(values), max(values)
    if low == high or not (math.isfinite(low) and math.isfinite(high)):
        return None
    logged = scale == "log" and low > 0
    if all(isinstance(v, int) for v in values):
        return IntDistribution(int(low), int(high), log=logged)
    return FloatDistribution(float(low), float(high), log=logged)


def choice(value: Any) -> Any:
    return value if isinstance(value, CHOICE_TYPES) else str(value)


def build(sweep: Sweep) -> Any:
    """An in-memory study of the sweep's trials that have a finite value (numbered in the report's order)."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    scored = [t for t in sweep.trials if t.value is not None and math.isfinite(t.value)]
    dists = {}
    for key in sweep.keys:
        values = [t.params[key] for t in scored if key in t.params]
        made = distribution(values, sweep.scales.get(key, "linear")) if values else None
        if made is not None:
            dists[key] = made
    study = optuna.create_study(direction="minimize" if sweep.minimise else "maximize")
    trials = []
    for t in scored:
        if not all(k in t.params for k in dists):
            continue  # a trial the sweep's record does not know (its values are unknown): the table still lists it
        params = {k: choice(t.params[k]) if isinstance(d, optuna.distributions.CategoricalDistribution) else t.params[k]
                  for k, d in dists.items()}  # fmt: skip
        trials.append(
            optuna.trial.create_trial(params=params, distributions=dists, value=t.value, user_attrs={"trial": t.name})
        )
    study.add_trials(trials)
    return study


def importances(sweep: Sweep) -> dict[str, float]:
    """Each swept key's share of the metric's variance, largest first; {} with too few trials or keys to say."""
    scored = [t for t in sweep.trials if t.value is not None and math.isfinite(t.value)]
    scored = [t for t in scored if all(k in t.params for k in sweep.keys)]
    if len(scored) < MIN_IMPORTANCE_TRIALS or len(sweep.keys) < 2:
        return {}
    values = [float(t.value or 0.0) for t in scored]
    mean = sum(values) / len(values)
    total = sum((v - mean) ** 2 for v in values)
    if total == 0:
        return {}
    out = {}
    for key in sweep.keys:
        groups: dict[Any, list[float]] = {}
        for group, value in zip(_groups([t.params[key] for t in scored]), values, strict=True):
            groups.setdefault(group, []).append(value)
        between = sum(len(g) * (sum(g) / len(g) - mean) ** 2 for g in groups.values())
        out[key] = between / total
    return dict(sorted(out.items(), key=lambda item: -item[1]))


def _groups(values: list[Any], bins: int = 10) -> list[Any]:
    """A group per distinct value, or for many distinct numbers, per quantile bin (by rank)."""
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
    if not numbers or len(set(values)) <= bins:
        return [repr(v) for v in values]
    order = sorted(range(len(values)), key=lambda i: values[i])
    out = [0] * len(values)
    for rank, i in enumerate(order):
        out[i] = rank * bins // len(values)
    return out
