"""Reading a config: YAML file + ``key=value`` overrides -> a validated ``Config`` (``load_config``), a run
directory's saved copy (``load_saved``), one override checked before OmegaConf sees it (``check_override``), and
writing one back (``to_yaml``). Only this module and ``input`` touch OmegaConf.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Sequence

import yaml

from ddp_core.config.features import SWEPT_ARG_PREFIX
from ddp_core.config.input import (
    OVERRIDE_HINT,
    CheckLoader,
    Dumper,
    SavedLoader,
    explain,
    omegaconf_load,
    parse_override,
    read_yaml,
    yaml_problem,
)
from ddp_core.config.shapes import NotPlain, check_value, from_plain, hint_at, list_prefix
from ddp_core.config.tree import Config, to_dict
from ddp_core.config.validate import validate
from ddp_core.errors import DdpJobError


def load_config(path: str | Path | None, overrides: Sequence[str] = ()) -> Config:
    """YAML file (optional) + dotlist overrides over the schema → validated ``Config``."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    for item in overrides:
        check_override(item)
    layers = [OmegaConf.structured(Config)]
    try:
        if path is not None:
            # One clear error for a file that is not a sane YAML mapping, then the shape of every value.
            check_value(read_yaml(Path(path), CheckLoader), Config, "")
            layers.append(omegaconf_load(Path(path)))  # OmegaConf's YAML: 1e-4 is a float (PyYAML reads a string)
        try:
            layers.append(OmegaConf.from_dotlist(list(overrides)))
        except yaml.YAMLError as err:  # what PyYAML accepted in check_override and libyaml does not: one line too
            raise DdpJobError(f"an override is not valid YAML: {yaml_problem(err)}", OVERRIDE_HINT) from None
        merged = OmegaConf.merge(*layers)
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        raise explain(err) from None
    assert isinstance(cfg, Config)
    validate(cfg)
    return cfg


def load_saved(path: Path) -> Config:
    """A run directory's config.yaml, which ``to_yaml`` wrote: plain values of the schema's own types, built into
    the dataclasses straight from PyYAML. Every rank of every attempt reads it before its first step, and OmegaConf's
    import and merge cost 0.2 s of that here. What ``to_yaml`` does not write (a hand edit: an interpolation, a
    number for a string key, an unknown key) goes through ``load_config``, which resolves it or names the problem."""
    try:
        if any(mark in path.read_text(encoding="utf-8", errors="replace") for mark in "&*"):
            raise NotPlain  # YAML anchors and aliases (or a string with & or *): OmegaConf's expansion limits apply
        cfg = from_plain(Config, read_yaml(path, SavedLoader))
    except (NotPlain, DdpJobError, OSError):
        return load_config(path)  # OmegaConf's reading; a file it cannot read is named as for any config file
    validate(cfg)
    return cfg


def check_override(item: str) -> None:
    """What a ``key=value`` override must be before OmegaConf sees it: a dotted key, no secret interpolation,
    valid YAML, and a value of the right shape (a bool key takes true/false only, a section a mapping, ...)."""
    key, value = parse_override(item)
    inside = list_prefix(Config, key)
    if inside is not None:
        hint = f"set the whole list: {inside}=[a, b]"
        if key.startswith(SWEPT_ARG_PREFIX):  # a sweep's script.args.NAME key given to a single run
            hint = (
                f"{key}=v1,v2 is a sweep key (ddpjob sweep); for one run, put the argument after --: "
                f"ddpjob submit --script train.py -- --{key[len(SWEPT_ARG_PREFIX) :]}=VALUE"
            )
        raise DdpJobError(f"config key '{inside}' is a list: '{key}' names no part of it", hint)
    hint = hint_at(Config, key)
    if hint is not None:
        check_value(value, hint, key)


def to_yaml(cfg: Config) -> str:
    # Plain YAML of plain values: loads back to an equal Config, ~100x faster than OmegaConf.structured
    # (which dominated submitting a 1,000-trial sweep). Strings are quoted where OmegaConf would read them as
    # numbers, and a literal "${" is escaped: load_config would otherwise resolve it on the compute node.
    return yaml.dump(escape_interpolations(to_dict(cfg)), Dumper=Dumper, sort_keys=False, default_flow_style=False)


_INTERPOLATION_START = re.compile(r"(\\*)\$\{")


def escape_interpolations(value: Any) -> Any:
    """Values (not keys) with every ``${`` escaped the way OmegaConf reads it back literally: ``\\${``, and the
    backslashes before it doubled."""
    if isinstance(value, str):
        return _INTERPOLATION_START.sub(lambda m: m.group(1) * 2 + "\\${", value)
    if isinstance(value, dict):
        return {k: escape_interpolations(v) for k, v in value.items()}
    if isinstance(value, list):
        return [escape_interpolations(v) for v in value]
    return value
