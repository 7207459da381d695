"""Adaptive sweep specifications (Optuna): a ``search:`` section of a sweep YAML, or ``ddpjob sweep CONFIG --search
tpe --trials 64 --parallel 8 key=loguniform(1e-5,1e-2) ...``, parsed and validated before anything is created.

Distributions are ``random:``'s (``jobs.sweeps.spec``: uniform, loguniform, randint with high excluded, choice) plus
``log: true`` and ``step: S``. On the command line ``key=DIST(a,b)`` names one (``choice(a,b,c)``), ``key=v1,v2`` is a
choice, ``key=range(a,b[,s])`` a stepped randint, and ``key=value`` a fixed override. Every key is checked against the
config schema by loading the config at each distribution's bounds and at every choice (``load_config``): a bad key
or value fails here, in one line, not in a worker hours later.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence, cast

from omegaconf import OmegaConf

from ddp_core.config import Config, load_config
from ddp_core.config.metric import Metric, parse_metric
from ddp_core.errors import DdpJobError
from ddp_core.search.study import PRUNERS, SAMPLERS, grid_space
from ddp_core.search.worker import override
from jobs.sweeps.values import NAME, RANGE, as_mapping, bad, check_dist, fmt_value, one_line_errors, split_values

SEARCH_KEYS = ("sampler", "metric", "direction", "trials", "parallelism", "pruner", "seed", "params")
_CALL = re.compile(r"(uniform|loguniform|randint|choice)\((.*)\)")
# Keys every trial shares: its worker's Slurm request, the sweep's directory, the binding the worker writes.
_SHARED = ("slurm.", "run.", "trial.", "script.")


@dataclass(frozen=True)
class SearchSpec:
    name: str
    base: Path
    fixed: dict[str, str]  # key -> override text, applied to the base before any sampled value
    params: dict[str, dict[str, Any]]  # key -> distribution (random:'s syntax plus log/step)
    sampler: str = "tpe"
    metric: str = "eval/loss"  # split/name of the eval metric the study optimises
    direction: str = "minimize"
    trials: int = 32
    parallelism: int = 4
    pruner: str = "none"
    seed: int = 0
    base_config: Optional[Config] = field(default=None, compare=False, repr=False)  # base + fixed, validated

    def study_spec(self) -> dict[str, Any]:
        """What search.json records of the spec (the worker and the trainer's reporter read it)."""
        keys = ("name", "params", "sampler", "metric", "direction", "pruner", "seed")
        return {k: getattr(self, k) for k in keys} | {"budget": self.trials, "parallelism": self.parallelism}


def search_metric(text: str, direction: Optional[str] = None) -> Metric:
    """``search.metric`` through the one metric spec (``ddp_core.config.metric``: ``eval/loss`` is minimised, as by
    ``checkpoint.monitor``, ``status`` and ``report``); ``search.direction``, if given, decides for a metric without
    a ``min:``/``max:`` prefix and must agree with one that has it."""
    metric = parse_metric(text, "sweep key 'search.metric'")
    if direction is None:
        return metric
    if direction not in ("minimize", "maximize"):
        raise bad("search.direction", f"= {direction!r} is invalid", "use minimize or maximize")
    if metric.said and direction != metric.direction:
        raise bad("search.direction", f"= {direction} contradicts metric {text!r}", "drop one of them")
    return Metric(metric.key, direction == "minimize")


def check_param(key: str, spec: Any) -> dict[str, Any]:
    """``random:``'s distribution check, plus ``log`` (uniform, randint) and ``step`` (uniform, randint)."""
    where = f"search.params.{key}"
    if not isinstance(spec, dict):
        raise bad(where, f"must be a mapping, got {spec!r}", "e.g. {dist: loguniform, low: 1e-5, high: 1e-2}")
    extra = {k: spec[k] for k in ("log", "step") if k in spec}
    try:
        check_dist(key, {k: v for k, v in spec.items() if k not in extra})
    except DdpJobError as err:  # random:'s check names its own section
        raise DdpJobError(err.message.replace("'random.params.", "'search.params.", 1), err.hint) from None
    dist = spec["dist"]
    if extra and dist in ("choice", "loguniform"):
        raise bad(where, f"({dist}) takes no {'/'.join(extra)}", "log and step apply to uniform and randint")
    if "log" in extra and not isinstance(extra["log"], bool):
        raise bad(where, f"has log={extra['log']!r}", "log must be true or false")
    if extra.get("log") and spec["low"] <= 0:
        raise bad(where, f"(log) has low={spec['low']!r} <= 0", "a log scale needs 0 < low")
    if "step" in extra:
        step = extra["step"]
        ok = isinstance(step, int) if dist == "randint" else isinstance(step, (int, float))
        if isinstance(step, bool) or not ok or step <= 0 or extra.get("log"):
            kind = "int" if dist == "randint" else "number"
            raise bad(where, f"has step={step!r}", f"step must be a positive {kind} and cannot combine with log")
    return dict(spec)


def parse_cli_param(key: str, text: str) -> Optional[dict[str, Any]]:
    """``loguniform(1e-5,1e-2)``, ``choice(a,b)``, ``v1,v2``, ``range(a,b[,s])`` -> a distribution; a plain value ->
    None (a fixed override)."""
    match, ranged = _CALL.fullmatch(text), RANGE.fullmatch(text)
    if match:
        dist, args = match[1], [_value(v) for v in split_values(match[2])]
        if dist == "choice":
            return {"dist": dist, "values": args}
        if len(args) != 2:
            raise bad(key, f"= {text} needs two bounds", f"{dist}(low,high)")
        return {"dist": dist, "low": args[0], "high": args[1]}
    if ranged:
        bounds = [_value(v) for v in split_values(ranged[1])]
        if len(bounds) not in (2, 3):
            raise bad(key, f"= {text} is not range(low,high[,step])", "e.g. range(32,257,32): 256 is excluded")
        return {"dist": "randint", "low": bounds[0], "high": bounds[1], **({"step": bounds[2]} if bounds[2:] else {})}
    values = split_values(text)
    return {"dist": "choice", "values": [_value(v) for v in values]} if len(values) > 1 else None


def _value(text: str) -> Any:
    # from_dotlist makes a DictConfig, which converts to a dict
    return cast(dict[str, Any], OmegaConf.to_container(OmegaConf.from_dotlist([f"v={text}"])))["v"]


@one_line_errors
def load_search_file(path: Path, extra: Sequence[str] = (), name: Optional[str] = None, **cli: Any) -> SearchSpec:
    """A sweep YAML with ``search:``; ``extra`` (key=value / key=DIST(...)) and ``cli`` (trials, parallelism, sampler,
    pruner, seed, metric given as flags) win over the file."""
    data = OmegaConf.to_container(OmegaConf.load(path))
    assert isinstance(data, dict), "is_sweep_file read it as a mapping"
    for key in ("grid", "random"):
        if key in data:
            raise bad(key, "cannot sit beside search:", "an adaptive search samples every key itself: use params")
    section = as_mapping(data["search"], "search")
    for key in sorted(set(section) - set(SEARCH_KEYS)):
        raise bad(f"search.{key}", "is not a search: key", f"use {', '.join(SEARCH_KEYS)}")
    if "base" not in data:
        raise bad("base", "is missing", "add base: ../digits.yaml (relative to the sweep file)")
    base = Path(path).parent / str(data["base"])
    fixed = {k: fmt_value(v) for k, v in as_mapping(data.get("overrides", {}), "overrides").items()}
    params = {k: check_param(k, v) for k, v in as_mapping(section.get("params") or {}, "search.params").items()}
    options = {k: section[k] for k in SEARCH_KEYS if k in section and k != "params"}
    options |= {k: v for k, v in cli.items() if v is not None}
    return build(name or str(data.get("name", Path(path).stem)), base, fixed, params, extra, options)


@one_line_errors
def parse_cli_search(config: Path, args: Sequence[str], name: Optional[str] = None, **cli: Any) -> SearchSpec:
    """``ddpjob sweep CONFIG --search SAMPLER ...``: CONFIG is a base config."""
    return build(
        name or f"{Path(config).stem}-search",
        Path(config),
        {},
        {},
        args,
        {k: v for k, v in cli.items() if v is not None},
    )


def build(
    name: str,
    base: Path,
    fixed: dict[str, str],
    params: dict[str, dict[str, Any]],
    extra: Sequence[str],
    options: Mapping[str, Any],
) -> SearchSpec:
    fixed, params = dict(fixed), dict(params)
    for arg in extra:
        key, eq, text = (part.strip() for part in arg.partition("="))
        if not eq or not key:
            raise DdpJobError(f"sweep argument '{arg}' is not key=value", "e.g. optim.lr=loguniform(1e-5,1e-2)")
        fixed.pop(key, None)
        params.pop(key, None)
        dist = parse_cli_param(key, text)
        if dist is None:
            fixed[key] = text
        else:
            params[key] = check_param(key, dist)
    if not NAME.fullmatch(name):
        raise bad("name", f"= {name!r} is not a plain name", "letters, digits, '.', '_', '-': it names a directory")
    if not params:
        raise bad("search.params", "is empty", "e.g. optim.lr=loguniform(1e-5,1e-2) or params: in search:")
    for key in params:
        if key.startswith(_SHARED):
            raise bad(key, "cannot be searched", "the trials share the workers' Slurm request, run root and binding")
    sampler, pruner = options.get("sampler", "tpe"), options.get("pruner", "none")
    if sampler not in SAMPLERS:
        raise bad("search.sampler", f"= {sampler!r} is unknown", f"use one of {', '.join(SAMPLERS)}")
    if pruner not in PRUNERS:
        raise bad("search.pruner", f"= {pruner!r} is unknown", f"use one of {', '.join(PRUNERS)}")
    if sampler == "cmaes" and importlib.util.find_spec("cmaes") is None:
        raise bad("search.sampler", "= cmaes needs the cmaes package", "pip install cmaes, or use tpe")
    if sampler == "grid":
        coarse = [k for k, p in params.items() if p["dist"] in ("uniform", "loguniform") and "step" not in p]
        if coarse:
            raise bad(f"search.params.{coarse[0]}", "has no grid", "a grid needs choice, randint or uniform with step")
    ints = {k: options.get(k, d) for k, d in (("trials", 32), ("parallelism", 4), ("seed", 0))}
    for key, value in ints.items():
        if isinstance(value, bool) or not isinstance(value, int) or (key != "seed" and value < 1):
            raise bad(f"search.{key}", f"= {value!r} is invalid", f"{key} must be an int{' >= 1' * (key != 'seed')}")
    chosen = search_metric(options.get("metric", "eval/loss"), options.get("direction"))
    metric, direction = chosen.key, chosen.direction
    cfg = _check_keys(base, fixed, params)
    if cfg.script.enabled:
        raise DdpJobError(
            "an adaptive search runs the built-in trainer, not a script",
            "sweep a script with grid: or random:; its trials report no intermediate values to a study",
        )
    if sampler == "grid":
        size = 1
        for values in grid_space(params).values():
            size *= len(values)
        if ints["trials"] > size:
            raise bad("search.trials", f"= {ints['trials']} is more than the grid's {size} points", f"trials: {size}")
    return SearchSpec(
        name,
        base,
        fixed,
        params,
        sampler,
        metric,
        direction,
        ints["trials"],
        ints["parallelism"],
        pruner,
        ints["seed"],
        cfg,
    )


def candidates(dist: Mapping[str, Any]) -> list[Any]:
    """The values that bound a distribution: each choice, low and the largest value it can draw."""
    if dist["dist"] == "choice":
        return list(dist["values"])
    return [dist["low"], dist["high"] - 1 if dist["dist"] == "randint" else dist["high"]]


def _check_keys(base: Path, fixed: Mapping[str, str], params: Mapping[str, Mapping[str, Any]]) -> Config:
    """Load the base with the fixed overrides, then once per bound and choice of every param."""
    items = [f"{k}={v}" for k, v in fixed.items()]
    try:
        cfg = load_config(base, items)
    except DdpJobError as err:
        raise DdpJobError(f"search base config is invalid: {err.message}", err.hint) from None
    for key, dist in params.items():
        for value in candidates(dist):
            try:
                load_config(base, [*items, override(key, value)])
            except DdpJobError as err:
                raise DdpJobError(f"search param '{key}' at {value!r} is invalid: {err.message}", err.hint) from None
    return dataclasses.replace(cfg)
