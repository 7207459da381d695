"""What a report is drawn from, put together (``load``), and where it learns what was swept: ``search.json`` and
the Optuna study (adaptive sweeps), ``sweep.json`` (grid and random sweeps: each trial's overrides, loaded values and
each key's scale), or, for a plain folder of runs, the config keys whose values differ between runs.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Optional

from ddp_core.errors import DdpJobError
from ddp_core.run.rundir import CONFIG_FILE, RunDir
from jobs.report.trials import (
    IDENTITY_KEYS,
    Sweep,
    Trial,
    curves,
    override_value,
    read_config,
    scales_of,
    state_of,
    sweep_record,
)
from jobs.runs.lookup import find_runs
from jobs.runs.ranking import ranking_metric

DEFAULT_METRIC = "eval/accuracy"
MAX_VARIED = 8  # a folder of unrelated runs: at most this many differing config keys become columns


def describe(path: Path, trials: list[Trial], single: bool) -> Sweep:
    """The sweep's keys, scales and default metric, with each trial's params, state and overrides filled in."""
    from jobs.sweeps import search

    if not single and search.is_search(path):
        return _search(path, trials)
    record = None if single else sweep_record(path)
    if record is not None:
        return _recorded(path, trials, record)
    for t in trials:
        t.config = read_config(t.path)
    if single:
        return Sweep(path, "run", trials, [], {}, _default_metric(trials), False)
    config_keys = sorted({k for t in trials for k in t.config} - IDENTITY_KEYS)
    varied = [k for k in config_keys if len({repr(t.config.get(k)) for t in trials}) > 1][:MAX_VARIED]
    for t in trials:
        t.params = {k: t.config[k] for k in varied if k in t.config}
    return Sweep(path, "runs", trials, varied, scales_of(varied, trials, {}), _default_metric(trials), False)


def _default_metric(trials: list[Trial]) -> str:
    monitor = trials[0].config.get("checkpoint.monitor") if trials else None
    return monitor if isinstance(monitor, str) and monitor else DEFAULT_METRIC


def _recorded(path: Path, trials: list[Trial], record: dict[str, Any]) -> Sweep:
    overrides: dict[str, list[str]] = {str(k): list(v) for k, v in record["trials"].items()}
    loaded: dict[str, dict[str, Any]] = record.get("params") or {}
    if not loaded:  # recorded before sweep.json kept loaded values: the override texts that differ
        texts = {tid: dict(o.partition("=")[::2] for o in items) for tid, items in overrides.items()}
        every = sorted({k for t in texts.values() for k in t})
        varied = [k for k in every if len({t.get(k) for t in texts.values()}) > 1]
        loaded = {tid: {k: override_value(t[k]) for k in varied if k in t} for tid, t in texts.items()}
    keys = list(dict.fromkeys(k for params in loaded.values() for k in params))
    # The trials share one base and differ in the swept keys only: one config.yaml says what they all monitor
    # and whether they run a script (reading a thousand would cost seconds).
    shared = read_config(trials[0].path) if trials else {}
    for t in trials:
        t.config = shared
        t.params = dict(loaded.get(t.path.name, {}))
        t.overrides = tuple(overrides.get(t.path.name, ()))
    scales = scales_of(keys, trials, dict(record.get("scales") or {}))
    base = record.get("base_config")
    return Sweep(path, "sweep", trials, keys, scales, _default_metric(trials), False, base_config=base)


def _search(path: Path, trials: list[Trial]) -> Sweep:
    from ddp_core.search.study import RUN_DIR_ATTR
    from jobs.sweeps import search
    from jobs.sweeps.values import fmt_value

    info = search.summary(path)
    spec = info["spec"]
    by_dir = {Path(str(t.user_attrs[RUN_DIR_ATTR])).name: t for t in info["trials"] if RUN_DIR_ATTR in t.user_attrs}
    fixed = [f"{k}={v}" for k, v in dict(spec.get("fixed") or {}).items()]
    shared = read_config(trials[0].path) if trials else {}
    for t in trials:
        t.config = shared
        study_trial = by_dir.get(t.path.name)
        if study_trial is not None:
            t.params = dict(study_trial.params)
            t.state = info["states"].get(t.path.name, t.state.upper()).lower()  # the study's word wins
            t.overrides = (*fixed, *(f"{k}={fmt_value(v)}" for k, v in t.params.items()))
    keys = list(spec["params"])
    scales = {k: _search_scale(p) for k, p in spec["params"].items()}
    metric = search.own_metric(spec)
    return Sweep(path, "search", trials, keys, scales, metric, False, base_config=spec.get("base_config"), study=info)


def _search_scale(param: dict[str, Any]) -> str:
    if param["dist"] == "choice":
        return "choice"
    return "log" if param["dist"] == "loguniform" or param.get("log") else "linear"


def load(path: Path, metric: Optional[str] = None) -> Sweep:
    """Everything a report of ``path`` shows. ``metric`` None: an adaptive sweep's own, else the trials'
    ``checkpoint.monitor``, else eval/accuracy."""
    path = Path(path)
    run_dirs = find_runs(path)
    if not run_dirs:
        raise DdpJobError(f"no run directories in '{path}' (no {CONFIG_FILE} in it or below it)", "pass a run or sweep")
    if metric is not None:
        ranking_metric(metric)  # a typo fails before anything is read
    base = path if run_dirs != [path] else path.parent  # names relative to the sweep: nested trial ids stay unique
    trials = []
    for d in run_dirs:
        run = RunDir(d)
        found = curves(run.metrics())
        trials.append(Trial(d.relative_to(base).as_posix(), d, found, state=state_of(run, bool(found))))
    sweep = describe(path, trials, run_dirs == [path])  # what the sweep recorded at submit: keys, values, scales
    chosen = ranking_metric(metric or sweep.metric)
    sweep.metric, sweep.minimise = chosen.key, chosen.minimize
    monitor = trials[0].config.get("checkpoint.monitor") if trials[0].config else None
    if isinstance(monitor, str) and monitor and ranking_metric(monitor) == chosen:
        sweep.monitored = True
    for t in trials:
        points = [v for _, v in t.curves.get(sweep.metric, []) if math.isfinite(v)]
        if sweep.monitored and points:
            t.value = min(points) if sweep.minimise else max(points)
        else:
            t.value = t.final(sweep.metric)
    return sweep
