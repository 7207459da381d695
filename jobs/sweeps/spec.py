"""Sweep specifications: many trials of one base config, expanded and validated before anything is submitted.

A sweep comes from the command line (``optim.lr=1e-4,3e-4 task.model.hidden=range(64,257,64)``) or from a
sweep YAML under ``configs/sweeps/`` (``grid:`` and/or ``random:``). Either way the result is one ``Sweep``:
the base config and an ordered tuple of ``Trial``s, each a list of ``key=value`` overrides that
``ddp_core.config.load_config`` accepts. Every trial is validated here, so one bad value fails the whole sweep
before any run directory exists. Pure Python, no Slurm, no torch: ``ddpjob sweep`` submits the result.

A file is a sweep YAML when it has a top-level ``grid:``, ``random:`` or ``search:`` key (``search:``: an adaptive
sweep, ``jobs.sweeps.search_spec``) (no config section has those names).
``randint`` draws from ``[low, high)``: high is exclusive, like ``range()`` and numpy.

A sweep of a script (``script.path`` / ``script.module``, e.g. from ``ddpjob sweep --script train.py``) needs no base
config, and its keys ``script.args.NAME`` are the script's arguments, not config keys: the config package owns their
syntax (``ddp_core.config.features.with_swept_args``) and loads every trial's config (``ddp_core.config.trials``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import math
import os
import random
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, TypeVar

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ddp_core.config import Config, escape_interpolations
from ddp_core.config.features import arg_value, swept_arg_name
from ddp_core.config.input import is_file, read_yaml_mapping
from ddp_core.config.trials import validated_configs, value_at
from ddp_core.errors import DdpJobError
from jobs.sweeps.record import infer_scale
from jobs.sweeps.values import (
    NAME,
    RANGE,
    as_mapping,
    bad,
    check_dist,
    fmt_value,
    one_line_errors,
    split_values,
)

T = TypeVar("T")
SWEEP_FILE_KEYS = ("base", "name", "overrides", "grid", "random", "search")  # search: jobs.sweeps.search_spec
_KEY = re.compile(r"[A-Za-z_][\w-]*(\.[\w-]+)*")
# More trials than any cluster queues at once (Slurm's MaxArraySize defaults to 1001): a typo such as
# range(0,10**9) or a grid of 20 keys is refused before it is expanded.
MAX_TRIALS = 10_000


@dataclass(frozen=True)
class Trial:
    index: int
    trial_id: str  # 10 hex of sha256 over the trial's override keys -> values as loaded: 1e-3 == 0.001
    overrides: tuple[str, ...]  # fixed + varying, key=value, in the order load_trial_config applies them
    params: dict[str, Any] = field(default_factory=dict, hash=False)  # varying keys only, loaded values, JSON-able


@dataclass(frozen=True)
class Sweep:
    name: str  # directory under run.root and W&B group
    base_config: Path | None  # None: a script's sweep from the defaults (`ddpjob sweep --script train.py ...`)
    trials: tuple[Trial, ...]
    sweep_id: str  # over the name, the base config's contents and every trial
    configs: tuple[Config, ...] = field(default=(), compare=False, repr=False)  # trial i's validated config
    # swept key -> log | linear | choice: how its axis is drawn in reports (random: the distribution; grid: its values)
    scales: dict[str, str] = field(default_factory=dict, compare=False)
    # What every trial shares beyond its trial id: the base config as read (not its text: comments and order do not
    # count). A rerun whose base changed would mix old and new trials under the same ids (jobs.sweeps.arrays.plan).
    base_digest: str | None = None

    def run_subdir(self, trial: Trial) -> Path:
        return Path(self.name) / trial.trial_id


@one_line_errors
def load_sweep(
    config: Path | None,
    args: Sequence[str] = (),
    trials: int | None = None,
    seed: int | None = None,
    name: str | None = None,
    script: str | None = None,
    script_args: Sequence[str] | None = None,
) -> Sweep:
    """What ``ddpjob sweep [--script S] [CONFIG] [key=value ...] [-- ARGS]`` calls: CONFIG is a sweep YAML or a base
    config (optional with a script); ``script`` and ``script_args`` become fixed ``script.path`` / ``script.args``
    keys, written so that they load back exactly as given (never read as YAML, nor ``${...}`` resolved)."""
    given = [f"script.path={fmt_value(escape_interpolations(script))}"] if script is not None else []
    given += [f"script.args={fmt_value(escape_interpolations(list(script_args)))}"] if script_args is not None else []
    args = [*given, *args]
    if config is not None and is_sweep_file(Path(config)):
        return load_sweep_file(Path(config), trials=trials, seed=seed, extra=args, name=name)
    if trials is not None or seed is not None:
        raise DdpJobError(f"--trials/--seed need a sweep file with random:; '{config}' is none", "see configs/sweeps/")
    return parse_cli_sweep(None if config is None else Path(config), args, name=name)


@one_line_errors
def is_sweep_file(path: Path) -> bool:
    # A file that is not a YAML mapping is refused here, naming the file and line (not "nothing to sweep").
    return bool({"grid", "random", "search"} & set(read_yaml_mapping(Path(path))))


@one_line_errors
def parse_cli_sweep(config: Path | None, args: Sequence[str], name: str | None = None) -> Sweep:
    """Base config (None: a script's, from the defaults) + ``key=v1,v2`` / ``key=range(a,b)`` grid arguments + plain
    ``key=value`` fixed ones."""
    fixed, grid = _parse_args(args)
    stem = Path(config).stem if config is not None else _script_stem(fixed)
    return _build(name or f"{stem}-sweep", None if config is None else Path(config), fixed, grid, {}, None, None)


def _script_stem(fixed: Mapping[str, str]) -> str:
    """What names a sweep without a base config: its script (``train.py`` -> ``train``, ``pkg.train`` -> ``train``)."""
    if "script.path" in fixed:
        return Path(arg_value(fixed["script.path"])).stem or "script"
    return arg_value(fixed.get("script.module", "script")).rpartition(".")[2] or "script"


def _scripted(*tables: Mapping[str, Any]) -> bool:
    return any(key in table for table in tables for key in ("script.path", "script.module"))


@one_line_errors
def load_sweep_file(
    path: Path,
    trials: int | None = None,
    seed: int | None = None,
    extra: Sequence[str] = (),
    *,
    name: str | None = None,
    base: Path | None = None,
) -> Sweep:
    """A sweep YAML; ``trials``/``seed``/``extra`` (command-line ``key=value``s) win over the file's entries."""
    path = Path(path)
    read_yaml_mapping(path)  # one clear error, naming the file and line, for what is not a sane YAML mapping
    try:
        data = OmegaConf.to_container(OmegaConf.load(path))  # OmegaConf's YAML reads 1e-4 as a float, PyYAML not
    except (OSError, yaml.YAMLError, OmegaConfBaseException) as err:
        raise DdpJobError(
            f"cannot read sweep file '{path}': {str(err).splitlines()[0]}", "check the path and the YAML syntax"
        ) from None
    if not isinstance(data, dict):
        raise DdpJobError(f"sweep file '{path}' is not a mapping", f"use the keys {', '.join(SWEEP_FILE_KEYS)}")
    for key in sorted(set(data) - set(SWEEP_FILE_KEYS)):
        raise bad(key, "is not a sweep file key", f"use {', '.join(SWEEP_FILE_KEYS)}; config keys go in overrides:")
    if base is None and "base" in data:
        base = Path(os.path.normpath(path.parent / str(data["base"])))
    fixed = {k: fmt_value(v) for k, v in as_mapping(data.get("overrides", {}), "overrides").items()}
    grid = {k: _grid_values(k, v) for k, v in as_mapping(data.get("grid", {}), "grid").items()}
    if "grid" in data and not grid:
        raise bad("grid", "is empty", "map keys to value lists, or drop it")
    params: dict[str, dict[str, Any]] = {}
    if "random" in data:
        section = as_mapping(data["random"], "random")
        for key in sorted(set(section) - {"trials", "seed", "params"}):
            raise bad(f"random.{key}", "is not a random: key", "use trials, seed and params")
        if not section.get("params"):
            raise bad("random.params", "is missing or empty", "e.g. {optim.lr: {dist: uniform, low: 0, high: 1}}")
        params = {k: check_dist(k, v) for k, v in as_mapping(section["params"], "random.params").items()}
        trials = section.get("trials") if trials is None else trials
        seed = section.get("seed", 0) if seed is None else seed
        if trials is None:
            raise bad("random.trials", "is missing", "add trials: N to the file or pass --trials N")
    elif trials is not None or seed is not None:
        raise DdpJobError(f"--trials/--seed need a random: section; sweep file '{path}' has none", "add random:")
    _disjoint(fixed, grid, params)  # within the file; the command line may replace any of them below
    cli_fixed, cli_grid = _parse_args(extra)
    for key in [*cli_fixed, *cli_grid]:
        for table in (fixed, grid, params):
            table.pop(key, None)
    fixed.update(cli_fixed)
    grid.update(cli_grid)
    if base is None and not _scripted(fixed, grid, params):
        raise bad(
            "base",
            "is missing",
            "add base: ../digits.yaml (relative to the sweep file) or pass a config; "
            "a script's sweep needs none (script.path in overrides:, or --script train.py)",
        )
    return _build(name or str(data.get("name", path.stem)), base, fixed, grid, params, trials, seed)


def _expand(key: str, text: str) -> list[str]:
    values: list[str] = []
    for item in split_values(text):
        if not item:
            raise bad(key, f"has an empty value in '{key}={text}'", f"give values: {key}=1,2,3 or {key}=range(1,4)")
        match = RANGE.fullmatch(item)
        values += _range(key, match.group(1)) if match else [item]
    return values


def _range(key: str, args: str) -> list[str]:
    try:
        bounds = [int(a) for a in args.split(",")]
    except ValueError:
        bounds = []
    if not 1 <= len(bounds) <= 3 or (len(bounds) == 3 and bounds[2] == 0) or not range(*bounds):
        raise bad(key, f"has range({args}): not a non-empty range of ints", "range(start, stop[, step]); stop excluded")
    if range(*bounds)[MAX_TRIALS:]:  # len() of a range past sys.maxsize raises OverflowError; a slice does not
        raise bad(key, f"has range({args}) of more than {MAX_TRIALS} values", "a sweep has at most that many trials")
    return [str(v) for v in range(*bounds)]


def _parse_args(args: Sequence[str]) -> tuple[dict[str, str], dict[str, list[str]]]:
    fixed: dict[str, str] = {}
    grid: dict[str, list[str]] = {}
    for arg in args:
        key, eq, text = arg.partition("=")
        key, text = key.strip(), text.strip()
        if not eq or not key:
            raise DdpJobError(f"sweep argument '{arg}' is not key=value or key=v1,v2,...", "e.g. optim.lr=1e-4,3e-4")
        if key in fixed or key in grid:
            raise bad(key, "is given twice", "give each key once; list its values with commas")
        values = _expand(key, text)
        if len(values) == 1 and not RANGE.fullmatch(text):
            fixed[key] = values[0]
        else:
            grid[key] = values
    return fixed, grid


def _grid_values(key: str, values: Any) -> list[str]:
    if isinstance(values, str):
        return _expand(key, values)  # "range(1,4)" or "1e-4,3e-4" as on the command line
    if not isinstance(values, list) or not values:
        raise bad(f"grid.{key}", f"must be a non-empty list of values, got {values!r}", f"e.g. {key}: [1, 2]")
    return [fmt_value(v) for v in values]


def _draw(rng: random.Random, spec: dict[str, Any]) -> Any:
    dist = spec["dist"]
    if dist == "choice":
        return rng.choice(spec["values"])
    low, high = spec["low"], spec["high"]  # check_dist: every other distribution has exactly these bounds
    if dist == "randint":
        return rng.randrange(low, high)
    if dist == "uniform":
        return rng.uniform(low, high)
    return min(max(math.exp(rng.uniform(math.log(low), math.log(high))), low), high)  # exp/log may round past


def _disjoint(fixed: Mapping[str, Any], grid: Mapping[str, Any], params: Mapping[str, Any]) -> None:
    keys = [*fixed, *grid, *params]
    for a, b in itertools.permutations(keys, 2):
        # script.args (the fixed list) and script.args.NAME (one more argument each) add up, they do not overlap.
        appended = a == "script.args" and swept_arg_name(b) is not None
        if a == b or (b.startswith(a + ".") and not appended):
            raise bad(b, f"is given twice (also as '{a}') across overrides, grid and random", "give each key once")


def _build(
    name: str,
    base: Path | None,
    fixed: dict[str, str],
    grid: dict[str, list[str]],
    params: dict[str, dict[str, Any]],
    trials: Any,
    seed: Any,
) -> Sweep:
    if not NAME.fullmatch(name):
        raise bad("name", f"= {name!r} is not a plain name", "letters, digits, '.', '_', '-': it names a directory")
    for key in [*fixed, *grid, *params]:
        if not _KEY.fullmatch(key) and swept_arg_name(key) is not None:
            raise bad(key, "is not script.args.NAME with NAME an option name", "e.g. script.args.lr=1e-4,3e-4")
        if not _KEY.fullmatch(key):
            raise bad(key, "is not a dotted config key", "write keys like optim.lr or task.model.hidden")
    _disjoint(fixed, grid, params)
    if not grid and not params:
        raise DdpJobError("nothing to sweep: no key has more than one value", "e.g. optim.lr=1e-4,3e-4")
    if base is None:
        if not _scripted(fixed, grid, params):
            raise DdpJobError("no config given", "ddpjob sweep CONFIG.yaml key=v1,v2 ..., or --script train.py")
        if "run.name" not in fixed:  # required by every config; each trial is named after the sweep anyway
            fixed = {"run.name": fmt_value(name), **fixed}
    elif not is_file(base):
        raise DdpJobError(f"config file {str(base)!r} not found", "pass a YAML file, e.g. configs/digits.yaml")
    if params:
        for key, value in (("random.trials", trials), ("random.seed", seed)):
            if isinstance(value, bool) or not isinstance(value, int) or (key == "random.trials" and value < 1):
                raise bad(key, f"= {value!r} is invalid", "trials must be an int >= 1 and seed an int")
    count = math.prod(len(values) for values in grid.values()) * (trials if params else 1)
    if count > MAX_TRIALS:
        raise DdpJobError(
            f"sweep '{name}' has {count} trials, more than {MAX_TRIALS}", "sweep fewer values, or split the sweep"
        )
    draws: list[dict[str, str]] = [{}]
    natives: dict[str, Any] = {}  # override text -> the number drawn, so the fast path skips parsing it back
    if params:
        rng = random.Random(seed)  # never the global RNG: the same seed gives the same trials anywhere
        draws = []
        for _ in range(trials):
            draw = {key: _draw(rng, spec) for key, spec in params.items()}
            natives.update({fmt_value(v): v for k, v in draw.items() if params[k]["dist"] != "choice"})
            draws.append({k: fmt_value(v) for k, v in draw.items()})
    # Every grid point gets the same random draws: grid values are then compared on equal terms.
    points = [dict(zip(grid, values, strict=True)) for values in itertools.product(*grid.values())]
    combos = [{**point, **draw} for point in points for draw in draws]
    fixed_list = [f"{k}={v}" for k, v in fixed.items()]
    configs = validated_configs(base, fixed_list, combos, natives)
    trials_out: list[Trial] = []
    seen: dict[str, int] = {}
    for index, (combo, cfg) in enumerate(zip(combos, configs, strict=True)):
        overrides = (*fixed_list, *(f"{k}={v}" for k, v in combo.items()))
        values = {k: _loaded(cfg, k, text) for k, text in [*fixed.items(), *combo.items()]}
        loaded = json.loads(json.dumps(values, default=_plain))
        trial_id = _digest(loaded)
        if trial_id in seen:
            raise DdpJobError(
                f"sweep trials {seen[trial_id]} and {index} are the same config ({' '.join(overrides)})",
                "drop duplicate values (1e-3 and 0.001 are one value) or widen the random ranges",
            )
        seen[trial_id] = index
        trials_out.append(Trial(index, trial_id, overrides, {k: loaded[k] for k in combo}))
    listing = [[t.trial_id, *t.overrides] for t in trials_out]
    sweep_id = _digest({"name": name, "base": base.read_text() if base else None, "trials": listing})
    scales = {k: infer_scale([t.params[k] for t in trials_out]) for k in grid}
    scales |= {k: {"choice": "choice", "loguniform": "log"}.get(p["dist"], "linear") for k, p in params.items()}
    shared = _digest(json.loads(json.dumps(read_yaml_mapping(base), default=str))) if base else None
    return Sweep(name, base, tuple(trials_out), sweep_id, tuple(configs), scales, shared)


def _loaded(cfg: Config, key: str, text: str) -> Any:
    """A key's value in the trial's loaded config; for a script argument, the text the script receives."""
    return arg_value(text) if swept_arg_name(key) is not None else value_at(cfg, key)


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:10]


def _plain(value: Any) -> Any:
    if isinstance(value, Enum):
        return value.value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    raise TypeError(f"cannot hash {value!r}")
