"""Property-based tests (hypothesis) of everything a user, or an attacker, can feed the login-node parsers: config
files, ``key=value`` overrides, sweep specs and Slurm nodelists.

The property throughout: an input is either accepted, and then the result is valid (the config passes ``validate``
and the task check, and loads back equal from ``to_yaml``; a nodelist expands as an independent expander says),
or refused with one ``DdpJobError`` whose text is one line with a hint. Any other exception fails the test.
Examples are derandomized (the same inputs on every run and machine) and the whole module runs in well under a
minute on 2 cores. Every bug found (by hypothesis, or while writing its strategies) is pinned with ``@example``,
its comment saying what happened before the fix.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import re
import typing
from enum import Enum
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import event, example, given
from hypothesis import strategies as st

from ddp_core.cluster.env import expand_nodelist
from ddp_core.config import Config, load_config, load_saved, to_yaml, validate
from ddp_core.config.input import SavedLoader, read_yaml
from ddp_core.config.shapes import from_plain
from ddp_core.config.trials import load_trial_config
from ddp_core.errors import DdpJobError
from ddp_core.tasks.base import check_task
from jobs.submission.checks import check_and_resolve
from jobs.sweeps.spec import Sweep, load_sweep, parse_cli_sweep
from tests.support.cli_runner import run_cli
from tests.support.fuzz import fuzz
from tests.support.helpers import ROOT

DIGITS = ROOT / "configs" / "digits.yaml"
DIGITS_TARGET = "ddp_core.tasks.digits:DigitsTask"
DIGITS_DICT = yaml.safe_load(DIGITS.read_text())


def assert_user_error(err: DdpJobError) -> None:
    """What the CLI prints for it is exactly one line, with a hint that says the fix."""
    text = str(err)
    assert len(text.splitlines()) == 1, text
    assert err.hint.strip(), text


def refused_or_valid(path: Path | None, overrides: list[str], scratch: Path) -> Config | None:
    """Load; accepted means valid, task-checked and stable through the run directory's config.yaml."""
    try:
        cfg = load_config(path, overrides)
        validate(cfg)
        if cfg.task.target == DIGITS_TARGET:  # never import a module a random target names
            check_task(cfg.task)
    except DdpJobError as err:
        assert_user_error(err)
        event("refused")
        return None
    event("accepted")
    saved = scratch / "roundtrip.yaml"
    saved.write_text(to_yaml(cfg))
    assert load_config(saved) == cfg == load_saved(saved), saved.read_text()
    if "${" not in saved.read_text():  # what to_yaml writes is read without OmegaConf (load_saved's fast path)
        assert from_plain(Config, read_yaml(saved, SavedLoader)) == cfg, saved.read_text()
    return cfg


# ---------------------------------------------------------------------------------------------------------------
# The schema's keys and type-aware values


def _schema_keys(cls: type = Config, prefix: str = "") -> dict[str, Any]:
    """Dotted key -> type for every field of the config tree (sections included)."""
    keys: dict[str, Any] = {}
    for name, hint in typing.get_type_hints(cls).items():
        keys[f"{prefix}{name}"] = hint
        if dataclasses.is_dataclass(hint):
            keys.update(_schema_keys(hint, f"{prefix}{name}."))
    return keys


SCHEMA = _schema_keys()
KEYS = [*sorted(SCHEMA), "task.model.hidden", "task.model.depth", "task.model.dropout", "task.data.eval_fraction",
        "task.data.split_seed", "slurm.additional.constraint", "task.model.nosuch"]  # fmt: skip

# YAML scalars and shapes that OmegaConf, PyYAML or the shell treat specially.
TRICKY = [
    "", "~", "null", "NULL", "true", "True", "false", "yes", "no", "on", "off", "y", "2", "0", "1", "-1", "1.0",
    "1e3", "1e-4", ".5", "0x10", "0o7", "010", "1_000", "1:30", "+1", "-0", "9" * 30, ".inf", "-.inf", ".nan", "nan",
    "inf", "2001-01-01", "'true'", '"2"', "[]", "{}", "[1, 2]", "[a, b]", "{a: 1}", "{shuffle: 2}", "[[[]]]",
    "${oc.env:HOME}", "${oc.env:WANDB_API_KEY}", "${oc.env:NOPE_NOT_SET}", "${run.name}", "${nosuch}", "${",
    "\\${HOME}", "\\\\${run.name}", "???", "a b", "x\ny", "'a\nb'", '"a\\nb"', '"\\u2028"', "$(id)", "`id`", "a;b",
    "--partition=evil", "&a 1", "*a", "!!binary aGk=", "!!python/name:os.system", "!!set {a}", "[", "{", ": x",
    "@x", "%x", "#", "a #c", "...", "---", "'", "é", "💥", "\x00", "\x7f", "\u2028",
]  # fmt: skip
WORDS = st.from_regex(r"[A-Za-z_][A-Za-z0-9_.-]{0,10}", fullmatch=True)


def python_value(hint: Any) -> st.SearchStrategy[Any]:
    """Any value of a schema type, in range or not (huge, negative, non-finite, any text)."""
    origin = typing.get_origin(hint)
    if origin is typing.Union:
        inner = next(a for a in typing.get_args(hint) if a is not type(None))
        return st.none() | python_value(inner)
    if hint is bool:
        return st.booleans()
    if hint is int:
        return st.integers(-3, 70_000) | st.integers()
    if hint is float:
        return st.floats(0, 1e6) | st.floats()
    if hint is str:
        return WORDS | st.text(max_size=12)
    if isinstance(hint, type) and issubclass(hint, Enum):
        return st.sampled_from([m.value for m in hint]) | st.text(max_size=5)
    if origin is list:
        return st.lists(python_value(typing.get_args(hint)[0]), max_size=3)
    return ANY_VALUE


# Values a real config would hold, key by key, so that many drawn configs are accepted: those are the ones whose
# round trip through to_yaml is tested. Free-text keys (wandb.*, tags) take any text: escaping is tested there.
PLAUSIBLE: dict[str, st.SearchStrategy[Any]] = {
    "run.name": WORDS.filter(lambda w: "/" not in w),
    "run.root": st.sampled_from(["runs", "/tmp/ddpjob-runs", "${oc.env:HOME}/runs"]),
    "task.target": st.just(DIGITS_TARGET),
    "task.model.hidden": st.integers(1, 512),
    "task.model.depth": st.integers(0, 4),
    "task.model.dropout": st.floats(0, 0.9),
    "task.data.eval_fraction": st.floats(0.01, 0.9),
    "task.data.split_seed": st.integers(0, 2**63 - 1),
    "train.max_steps": st.integers(21, 10_000),
    "train.seed": st.integers(0, 2**63 - 1),
    "optim.lr": st.floats(1e-6, 10),
    "optim.momentum": st.floats(0, 0.99),
    "optim.warmup_steps": st.integers(0, 20),
    "strategy.name": st.sampled_from(["ddp", "fsdp"]),
    "strategy.split": st.none() | st.lists(st.integers(1, 4), min_size=1, max_size=3),
    "strategy.schedule": st.sampled_from(["gpipe", "1f1b"]),
    "strategy.mixed_precision": st.none(),
    "dist.guard": st.sampled_from([None, "gpu", "cpu:gloo,cuda:nccl", "nccl"]),
    "slurm.gpu_bind": st.sampled_from(["node", "task"]),
    "slurm.cpu_bind": st.sampled_from(["cores", "none"]),
    "slurm.signal": st.sampled_from(["USR1", "USR2", "SIGUSR2", "none", None]),
    "slurm.signal_lead_s": st.integers(0, 600),
    "slurm.deadline_margin_s": st.integers(0, 600),
    "slurm.time_min": st.integers(11, 10_000),
    "slurm.nodes": st.integers(1, 4),
    "slurm.setup": st.lists(st.text(st.characters(blacklist_categories=["Cc", "Zl", "Zp"]), max_size=15), max_size=2),
    "slurm.additional": st.dictionaries(st.sampled_from(["constraint", "mail-type", "exclusive"]),
                                        WORDS | st.booleans() | st.integers(0, 9), max_size=2),
    "wandb.tags": st.lists(st.text(max_size=10), max_size=3),
    "wandb.project": st.text(min_size=1, max_size=12),
    "wandb.entity": st.none() | st.text(max_size=12),
    "wandb.group": st.none() | st.text(max_size=12),
    "checkpoint.async_save": st.booleans(),
}  # fmt: skip
LEAVES = sorted(k for k in [*SCHEMA, *PLAUSIBLE] if not dataclasses.is_dataclass(SCHEMA.get(k)))


def plausible_value(key: str) -> st.SearchStrategy[Any]:
    if key in PLAUSIBLE:
        return PLAUSIBLE[key]
    hint = SCHEMA[key]
    if typing.get_origin(hint) is typing.Union:
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    if hint is bool:
        return st.booleans()
    if hint is int:
        return st.integers(1, 64)
    if hint is float:
        return st.floats(0.5, 1000)
    if isinstance(hint, type) and issubclass(hint, Enum):
        return st.sampled_from([m.value for m in hint])
    return WORDS


SCALARS = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10) | st.sampled_from(TRICKY)
ANY_VALUE = st.recursive(
    SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)  # fmt: skip


def set_dotted(tree: dict[str, Any], key: str, value: Any) -> None:
    *parents, last = key.split(".")
    for part in parents:
        child = tree.get(part)
        if not isinstance(child, dict):
            child = tree[part] = {}
        tree = child
    tree[last] = value


@st.composite
def settings_drawn(draw: st.DrawFn) -> list[tuple[str, Any]]:
    """(dotted key, value) pairs: half of the time all plausible, else with wild keys and values among them."""
    wild = draw(st.booleans())
    pairs = []
    for _ in range(draw(st.integers(0 if not wild else 1, 4))):
        if not wild or draw(st.booleans()):
            key = draw(st.sampled_from(LEAVES))
            pairs.append((key, draw(plausible_value(key))))
        else:
            key = draw(st.sampled_from(KEYS) | WORDS)
            pairs.append((key, draw(python_value(SCHEMA.get(key, Any)) | ANY_VALUE)))
    return pairs


@st.composite
def config_mappings(draw: st.DrawFn) -> dict[str, Any]:
    """digits.yaml with a few keys set to drawn values."""
    tree = json.loads(json.dumps(DIGITS_DICT))
    for key, value in draw(settings_drawn()):
        set_dotted(tree, key, value)
    return tree


@st.composite
def yamlish_texts(draw: st.DrawFn) -> str:
    """Lines of `key: value` at random indents, keys from the schema, values from the tricky list."""
    lines = []
    for _ in range(draw(st.integers(0, 8))):
        indent = " " * draw(st.sampled_from([0, 0, 2, 4, 1]))
        key = draw(st.sampled_from(KEYS)).split(".")[-1] if draw(st.booleans()) else draw(st.text(max_size=6))
        value = draw(st.sampled_from(TRICKY) | st.text(max_size=10))
        lines.append(f"{indent}{key}: {value}" if draw(st.integers(0, 5)) else f"{indent}- {value}")
    return "\n".join(lines) + "\n"


def override_text(key: str, value: Any) -> str:
    """``key=value`` as a user types it: strings bare (YAML reads them), anything else as JSON (flow YAML)."""
    return f"{key}={value if isinstance(value, str) else json.dumps(value)}"


@st.composite
def overrides(draw: st.DrawFn) -> list[str]:
    items = [override_text(k, v) for k, v in draw(settings_drawn()) if not (isinstance(v, float) and v != v)]
    for _ in range(draw(st.integers(0, 1))):  # raw text: tricky YAML after a known key, or not key=value at all
        key = draw(st.sampled_from(KEYS) | WORDS)
        items.append(draw(st.sampled_from(TRICKY).map(lambda v, k=key: f"{k}={v}") | st.text(max_size=15)))
    return items


def read_as_a_run_directory_config(path: Path) -> None:
    """The file as a hand-edited run directory's config.yaml: ``load_saved`` (a fast path for what ``to_yaml``
    writes) loads what ``load_config`` loads, or refuses it with the same line."""

    def outcome(load: Any) -> Any:
        try:
            return load(path)
        except DdpJobError as err:
            return str(err)

    assert outcome(load_saved) == outcome(load_config), path.read_text()


# ---------------------------------------------------------------------------------------------------------------
# (a) config files


@fuzz(60)
@given(tree=config_mappings())
@example(tree={**DIGITS_DICT, "data": {"shuffle": 2}})  # OmegaConf coerced 2 (and yes/on) to True
@example(tree={**DIGITS_DICT, "slurm": {"additional": [1]}})  # TypeError: Cannot merge incompatible container types
@example(tree={**DIGITS_DICT, "slurm": {"setup": [{"a": 1}]}})  # TypeError in the setup-line regex
@example(tree={**DIGITS_DICT, "run": {"name": "1e3"}})  # to_yaml wrote 1e3 bare: it came back as 1000.0
@example(tree={**DIGITS_DICT, "task": {"model": {"x": float("nan")}}})  # nan != nan: non-finite task args refused
@example(tree={**DIGITS_DICT, "slurm": {"setup": ["export P=\\${HOME}/bin"]}})  # literal ${ resolved on reload
@example(tree={**DIGITS_DICT, "task": {"model": {1: 2}}})  # int key: "invalid config at" without a hint
def test_structured_config_files(tmp_path, tree):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(tree, allow_unicode=True))
    refused_or_valid(path, [], tmp_path)
    read_as_a_run_directory_config(path)


@fuzz(40)
@given(text=yamlish_texts() | st.text(max_size=60))
@example(text="run: {name: x}\ntask: {model: {x: " + "[" * 60 + "]" * 60 + "}}\n")  # RecursionError in OmegaConf
@example(text="run: {name: x}\ntask:\n  model:\n    a: &a [" + "1, " * 120 + "1]\n    b: [" + "*a, " * 120 + "*a]\n")
@example(text="run: {name: x}\ntask: {model: {a: &a [*a]}}\n")  # an alias inside itself
@example(text="run: {name: x}\ndata: {shuffle: yes}\n")
def test_yamlish_config_text(tmp_path, text):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    refused_or_valid(path, [], tmp_path)
    read_as_a_run_directory_config(path)


@fuzz(30)
@given(content=st.binary(max_size=40))
@example(content=b"run: {name: \xff}\n")
def test_config_bytes(tmp_path, content):
    path = tmp_path / "c.yaml"
    path.write_bytes(content)
    refused_or_valid(path, [], tmp_path)


# ---------------------------------------------------------------------------------------------------------------
# (b) overrides


@fuzz(75)
@given(items=overrides())
@example(items=["slurm.additional=[1]"])  # TypeError from OmegaConf's merge
@example(items=["wandb.tags[0]=x"])  # TypeError: an {0: x} mapping merged into a list
@example(items=["optim.lr=["])  # yaml ParserError escaped load_config
@example(items=["task.model={a: 1, a: 2}"])  # ConstructorError (duplicate key) escaped load_config
@example(items=["task.model.hidden=abc"])  # accepted until the job built the model
@example(items=["task.data.eval_fraction=2.0"])  # accepted until the job split the data
@example(items=["data.shuffle=yes"])
@example(items=["run.name=x\ny"])  # a newline in the override made a two-line error
def test_overrides(tmp_path, items):
    refused_or_valid(DIGITS, items, tmp_path)


# ---------------------------------------------------------------------------------------------------------------
# (c) sweep specs


def check_sweep(sweep: Sweep) -> None:
    assert len(sweep.configs) == len(sweep.trials) >= 1
    for cfg in sweep.configs:
        validate(cfg)
    for trial in (sweep.trials[0], sweep.trials[-1]):  # the fast path's configs are load_config's own
        assert load_trial_config(sweep.base_config, trial.overrides) == sweep.configs[trial.index]


def sweep_outcome(load: Any) -> None:
    try:
        sweep = load()
    except DdpJobError as err:
        assert_user_error(err)
        assert "nothing to sweep" not in str(err) or "no key has more than one value" in str(err)
        event("refused")
        return
    event("accepted")
    check_sweep(sweep)


SWEEP_VALUE = st.sampled_from(TRICKY) | python_value(float) | WORDS | st.integers(-5, 300) | st.text(max_size=6)
SWEEP_KEYS = (
    st.sampled_from(
        [
            "optim.lr",
            "task.model.hidden",
            "data.shuffle",
            "train.seed",
            "optim.name",
            "task.model.dropout",
            "task.data.eval_fraction",
            "wandb.tags",
            "wandb.group",
        ]
    )
    | WORDS
)
DISTRIBUTION = st.fixed_dictionaries(
    {"dist": st.sampled_from(["uniform", "loguniform", "randint", "choice", "normal"])},
    optional={"low": SWEEP_VALUE, "high": SWEEP_VALUE, "values": st.lists(SWEEP_VALUE, max_size=3) | SWEEP_VALUE},
)


@st.composite
def sweep_specs(draw: st.DrawFn) -> Any:
    spec: dict[str, Any] = {"base": draw(st.sampled_from([str(DIGITS), "../nope.yaml", "", "x\0y"]))}
    if draw(st.booleans()):
        spec["name"] = draw(WORDS | st.text(max_size=8))
    if draw(st.booleans()):
        spec["overrides"] = draw(st.dictionaries(SWEEP_KEYS, SWEEP_VALUE, max_size=2) | SWEEP_VALUE)
    if draw(st.booleans()):
        spec["grid"] = draw(
            st.dictionaries(SWEEP_KEYS, st.lists(SWEEP_VALUE, min_size=1, max_size=3) | SWEEP_VALUE, max_size=2)
            | SWEEP_VALUE
        )
    if draw(st.booleans()) or "grid" not in spec:
        spec["random"] = draw(
            st.fixed_dictionaries(
                {},
                optional={
                    "trials": st.integers(-1, 3) | st.just(10**9) | SWEEP_VALUE,
                    "seed": st.integers(0, 5) | SWEEP_VALUE,
                    "params": st.dictionaries(SWEEP_KEYS, DISTRIBUTION, max_size=2),
                    "extra": SWEEP_VALUE,
                },
            )
        )
    if draw(st.integers(0, 9)) == 0:
        spec[draw(WORDS)] = draw(SWEEP_VALUE)
    return spec if draw(st.integers(0, 9)) else draw(st.sampled_from([[spec], "grid", 3]))


SWEEPABLE = ["optim.lr", "optim.weight_decay", "task.model.hidden", "task.model.depth", "task.model.dropout",
             "task.data.eval_fraction", "train.seed", "optim.name", "data.shuffle", "wandb.group",
             "wandb.tags"]  # fmt: skip
SWEEP_NAME = st.from_regex(r"[a-z][a-z0-9.-]{0,8}", fullmatch=True)


def distribution(draw: st.DrawFn, key: str) -> dict[str, Any]:
    hint = SCHEMA.get(key) or {"task.model.hidden": int, "task.model.depth": int}.get(key)
    if key in ("task.model.dropout", "task.data.eval_fraction") or hint is float:
        low, high = sorted(draw(st.lists(plausible_value(key), min_size=2, max_size=2)))
        return {"dist": draw(st.sampled_from(["uniform", "loguniform"])) if low > 0 else "uniform", "low": low,
                "high": high}  # fmt: skip
    if hint is int:
        low, high = sorted(draw(st.lists(plausible_value(key), min_size=2, max_size=2, unique=True)))
        return {"dist": "randint", "low": low, "high": high}
    return {"dist": "choice", "values": draw(st.lists(plausible_value(key), min_size=1, max_size=3))}


@st.composite
def plausible_sweeps(draw: st.DrawFn) -> dict[str, Any]:
    """Sweeps a user would write: known keys, values of their type, valid distributions, a few trials."""
    keys = draw(st.lists(st.sampled_from(SWEEPABLE), min_size=1, max_size=3, unique=True))
    split = draw(st.integers(0, len(keys)))
    spec: dict[str, Any] = {"base": str(DIGITS), "name": draw(SWEEP_NAME)}
    if split:
        spec["grid"] = {
            k: draw(st.lists(plausible_value(k), min_size=1, max_size=3, unique_by=repr)) for k in keys[:split]
        }
    if split < len(keys) or draw(st.booleans()):
        params = {k: distribution(draw, k) for k in keys[split:]}
        spec["random"] = {"trials": draw(st.integers(1, 3)), "seed": draw(st.integers(0, 9)), "params": params}
    if draw(st.booleans()):
        key = draw(st.sampled_from(LEAVES).filter(lambda k: k not in keys))
        spec["overrides"] = {key: draw(plausible_value(key))}
    return spec


def cli_value(value: Any) -> str:
    """A value as a user types it into ``key=v1,v2``: words bare, anything else as JSON (flow YAML)."""
    if isinstance(value, str) and re.fullmatch(r"[A-Za-z_][\w.-]*", value) and value.lower() not in YAML_WORDS:
        return value
    return json.dumps(value, ensure_ascii=False)


YAML_WORDS = {"true", "false", "yes", "no", "on", "off", "y", "n", "null", "nan", "inf"}


CHOICE = {"dist": "choice", "values": [1, 2]}


@fuzz(30)
@given(spec=sweep_specs() | plausible_sweeps())
@example(spec={"base": str(DIGITS), "grid": {"data.shuffle": ["true", 2]}})  # the fast path let 2 through
@example(spec={"base": "x\0y", "grid": {"optim.lr": [1, 2]}})  # ValueError: embedded null byte
@example(spec={"base": str(DIGITS), "grid": {"train.seed": "range(0,1000000000)"}})  # built a 10**9 list
@example(spec={"base": str(DIGITS), "random": {"trials": 10**9, "params": {"optim.lr": CHOICE}}})
@example(spec={"base": str(DIGITS), "random": {"trials": 2, "params": {"task.model.dropout": {
    "dist": "uniform", "low": float("nan"), "high": 0.5}}}})  # fmt: skip
@example(spec={"base": str(DIGITS), "grid": {"wandb.group": ["💥", "a"]}})  # JSON's surrogate pair: bad YAML
@example(spec={"base": str(DIGITS), "random": {"trials": 2, "params": {"optim.lr": {
    "dist": "uniform", "low": 1, "high": 10**400}}}})  # fmt: skip
@example(spec=[{"grid": {"optim.lr": [1, 2]}}])  # a list: must name the file, not say "nothing to sweep"
def test_sweep_files(tmp_path, spec):
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(spec, allow_unicode=True))
    sweep_outcome(lambda: load_sweep(path))


@fuzz(20)
@given(text=st.text(max_size=40).map(lambda t: "grid:\n  optim.lr: [1, 2]\n" + t) | st.binary(max_size=30))
@example(text=b"grid: {optim.lr: [1, \xff]}\n")  # UnicodeDecodeError escaped load_sweep_file
@example(text="grid: {optim.lr: [1, 2\n")
def test_sweep_file_text(tmp_path, text):
    path = tmp_path / "sweep.yaml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    sweep_outcome(lambda: load_sweep(path))


SWEEP_ARG = st.builds(
    lambda key, values: f"{key}={','.join(values)}",
    SWEEP_KEYS,
    st.lists(st.sampled_from(TRICKY) | st.from_regex(r"range\(-?[0-9]{0,3}(,-?[0-9]{1,3}){0,3}\)", fullmatch=True)
             | st.integers(-3, 200).map(str) | WORDS, min_size=1, max_size=3),
)  # fmt: skip


PLAUSIBLE_ARG = st.sampled_from(SWEEPABLE).flatmap(
    lambda key: st.lists(plausible_value(key), min_size=2, max_size=3, unique_by=repr).map(
        lambda values: f"{key}={','.join(cli_value(v) for v in values)}"
    )
)


@fuzz(60)
@given(args=st.lists(SWEEP_ARG | PLAUSIBLE_ARG | st.text(max_size=12), min_size=1, max_size=3))
@example(args=["data.shuffle=true,2"])  # the fast path let 2 through
@example(args=["optim.lr=range(0,10000000000)"])
@example(args=["train.seed=range(0,10000000000000000000000000000000)"])  # len() of the range: OverflowError
@example(args=["Mp6GRoaVFHp=x\ny"])  # the trial's overrides, newline and all, in a two-line error
def test_sweep_arguments(args):
    sweep_outcome(lambda: parse_cli_sweep(DIGITS, args))


# ---------------------------------------------------------------------------------------------------------------
# (d) Slurm nodelists

MAX_HOSTS = 65536


def reference_expand(items: list[list[Any]]) -> list[str] | None:
    """The grammar's meaning, independently: items in order, each the product of its parts, numbers zero-padded
    to their low end's width; None where it would name more than MAX_HOSTS hosts."""
    count = sum(_product(len(_range_numbers(p)) if isinstance(p, list) else 1 for p in item) for item in items)
    if count > MAX_HOSTS:
        return None
    hosts = []
    for item in items:
        choices = [_range_numbers(p) if isinstance(p, list) else [p] for p in item]
        hosts += ["".join(combo) for combo in itertools.product(*choices)]
    return hosts


def _product(numbers: Any) -> int:
    out = 1
    for n in numbers:
        out *= n
    return out


def _range_numbers(ranges: list[tuple[str, str | None]]) -> list[str]:
    out = []
    for lo, hi in ranges:
        stop = int(lo) if hi is None else int(hi)
        out += [f"{n:0{len(lo)}d}" for n in range(int(lo), stop + 1)]
    return out


def render(items: list[list[Any]]) -> str:
    def part(p: Any) -> str:
        return p if isinstance(p, str) else "[" + ",".join(lo if hi is None else f"{lo}-{hi}" for lo, hi in p) + "]"

    return ",".join("".join(part(p) for p in item) for item in items)


@st.composite
def ranges(draw: st.DrawFn) -> list[tuple[str, str | None]]:
    out = []
    for _ in range(draw(st.integers(1, 3))):
        lo = draw(st.integers(0, 120))
        width = draw(st.integers(1, 4))
        big = draw(st.integers(0, 9)) == 0  # now and then a range past the cap
        hi = None if draw(st.booleans()) else lo + draw(st.integers(0, 70_000 if big else 12))
        out.append((str(lo).zfill(width), None if hi is None else str(hi)))
    return out


LITERAL = st.from_regex(r"[a-z][a-z0-9._-]{0,5}", fullmatch=True)
HOSTLIST_ITEM = st.lists(LITERAL | ranges(), min_size=1, max_size=4).filter(
    lambda parts: not any(isinstance(a, str) and isinstance(b, str) for a, b in itertools.pairwise(parts))
)


@fuzz(200)
@given(items=st.lists(HOSTLIST_ITEM, min_size=1, max_size=4))
@example(items=[["a", [("1", "60000")], "b", [("1", "60000")]]])  # 3.6e9 hosts were built before the count
@example(items=[["rack", [("1", "2")], "-n", [("01", "03")]]])
def test_valid_nodelists_expand_like_the_reference(items):
    expected = reference_expand(items)
    event("over the cap" if expected is None else "expanded")
    if expected is None:
        with pytest.raises(DdpJobError, match="more than 65536 hosts") as err:
            expand_nodelist(render(items))
        assert_user_error(err.value)
    else:
        assert expand_nodelist(render(items)) == expected


NODELIST_SOUP = st.text(alphabet=st.sampled_from([*"ab01-9[],", " ", "\n", "²", "٣"]), max_size=20)


@fuzz(200)
@given(text=NODELIST_SOUP | st.text(max_size=20))
@example(text="n[1-²]")  # int('²') raised ValueError: str.isdigit() is true for it
@example(text="n[1-" + "9" * 5000 + "]")  # int() of more than 4300 digits raises ValueError
@example(text="n[[1]]")
@example(text="a b")
def test_any_nodelist_is_hosts_or_one_error(text):
    try:
        hosts = expand_nodelist(text)
    except DdpJobError as err:
        assert_user_error(err)
        event("refused")
        return
    event("accepted")
    assert 1 <= len(hosts) <= MAX_HOSTS
    for host in hosts:
        assert host and not re.search(r"[\s\[\],]", host), hosts


# ---------------------------------------------------------------------------------------------------------------
# The real CLI on a small sample: exit 0 or 2, one error line, what load_config says, and nothing created.

CLI_OVERRIDES = st.sampled_from(
    ["data.shuffle=2", "data.shuffle=yes", "task.model.hidden=abc", "task.data.eval_fraction=2.0", "optim.lr=[",
     "slurm.additional=[1]", "wandb.tags[0]=x", "run.name=x\ny", "slurm.job_name=a b", "optim.lr=.nan",
     "task.target=os:system", "slurm.account=$(id)", "task.model={a: 1, a: 2}", "train.max_steps=40",
     "wandb.entity=${oc.env:WANDB_API_KEY}", "slurm.setup=['export P=\\${HOME}']"]
)  # fmt: skip


def argv_item(item: str) -> bool:
    """Items that reach ddpjob's override parsing (argv has no NUL; a leading '-' is an option, argparse's error),
    and no drawn task.target: submit imports it."""
    return "\0" not in item and not item.startswith("-") and "task.target" not in item


@fuzz(6, scalable=False)
@given(items=st.lists(CLI_OVERRIDES | overrides().filter(bool).flatmap(st.sampled_from).filter(argv_item), max_size=2))
def test_cli_dry_run(tmp_path_factory, items):
    tmp = tmp_path_factory.mktemp("cli")
    root = tmp / "runs"
    proc = run_cli("submit", str(DIGITS), "--dry-run", "--local", *items, f"run.root={root}", cwd=tmp, timeout=120)
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.returncode in (0, 2), proc.stderr
    try:
        cfg = load_config(DIGITS, [*items, f"run.root={root}"])
        check_and_resolve(cfg, local=True)
        expected = None
    except DdpJobError as err:
        expected = f"ddpjob: error: {err}"
    event(f"exit {proc.returncode}")
    if proc.returncode == 2:
        assert proc.stderr.splitlines() == [expected], proc.stderr
    else:
        assert expected is None and "# sbatch script (nothing submitted)" in proc.stdout, proc.stderr
    assert not root.exists() and sorted(p.name for p in tmp.iterdir()) == [], "a dry run created files"


STEP_NAMES = st.sampled_from(["a", "b", "train", "x y", "", "1"])
STEP_VALUES = st.none() | st.integers(-2, 3) | st.text(max_size=8) | st.lists(st.text(max_size=6), max_size=3)
PIPELINE_STEP = st.dictionaries(
    st.sampled_from(["config", "script", "args", "overrides", "after", "afterr"]),
    STEP_VALUES | STEP_NAMES | st.lists(STEP_NAMES.map(lambda n: n + ":ok") | STEP_NAMES, max_size=3),
    max_size=4,
) | STEP_VALUES  # fmt: skip


@fuzz(40)
@given(
    spec=st.fixed_dictionaries(
        {"steps": st.dictionaries(STEP_NAMES, PIPELINE_STEP, max_size=4) | STEP_VALUES},
        optional={"name": STEP_VALUES, "root": STEP_VALUES, "stages": STEP_VALUES},
    )
)
@example(spec={"steps": {"a": {"script": "s.py", "after": ["b"]}, "b": {"script": "s.py", "after": "a:any"}}})
def test_pipeline_files(tmp_path, spec):
    """A pipeline file (jobs.pipelines.spec): refused in one line, or read with each step after those it waits for."""
    from jobs.pipelines.spec import load

    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(spec, allow_unicode=True))
    try:
        pipe = load(path)
    except DdpJobError as err:
        assert_user_error(err)
        event("refused")
        return
    event("accepted")
    seen: set[str] = set()
    for step in pipe.steps:
        assert {a.ref for a in step.after} <= seen and (step.config or step.script), pipe
        seen.add(step.name)
