"""Values checked against the config's dataclass tree, before OmegaConf sees them: the type a dotted key holds
(``hint_at``), a key that names a part of a list (``list_prefix``), a value of the wrong shape (``check_value``: a
bool key takes true/false only, a section a mapping, ...), and a saved config built straight into the dataclasses
(``from_plain``). Generic over the schema: the root dataclass is a parameter.
"""

from __future__ import annotations

import dataclasses
from enum import Enum
from functools import cache
from typing import Any, TypeGuard, Union, get_args, get_origin, get_type_hints

from ddp_core.config.input import MISSING
from ddp_core.errors import DdpJobError


@cache
def _fields(cls: type) -> dict[str, Any]:
    return get_type_hints(cls)


def _is_section(hint: Any) -> TypeGuard[type]:
    """Whether a schema type is a config section (a dataclass); the schema holds classes, never instances."""
    return isinstance(hint, type) and dataclasses.is_dataclass(hint)


def hint_at(root: type, key: str) -> Any:
    """The schema's type at a dotted override key under ``root`` (the config's dataclass), or None where OmegaConf
    will name the key as unknown."""
    hint: Any = root
    for part in key.split("."):
        if _is_section(hint):
            if part not in _fields(hint):
                return None
            hint = _fields(hint)[part]
        elif get_origin(hint) is dict:
            hint = get_args(hint)[1]
        elif hint is not Any:
            return None  # into a scalar or a list (OmegaConf's own error names it)
    return hint


def list_prefix(root: type, key: str) -> str | None:
    """The leading part of a dotted ``key`` that the schema types as a list when ``key`` goes on below it
    (``wandb.tags.x`` -> ``wandb.tags``), else None: OmegaConf cannot merge such an override into the list."""
    hint: Any = root
    parts = key.split(".")
    for i, part in enumerate(parts):
        if get_origin(hint) is Union:  # Optional[List[int]]
            hint = next(arg for arg in get_args(hint) if arg is not type(None))
        if hint is list or get_origin(hint) is list:
            return ".".join(parts[:i])
        if _is_section(hint) and part in _fields(hint):
            hint = _fields(hint)[part]
        elif get_origin(hint) is dict:
            hint = get_args(hint)[1]
        else:
            return None
    return None


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _bad_value(key: str, value: Any, hint: str) -> DdpJobError:
    return DdpJobError(f"bad value for config key '{key}': {_short(value)}", hint)


def _type_name(hint: Any) -> str:
    if isinstance(hint, type):
        return "a mapping of its keys" if _is_section(hint) else hint.__name__
    return str(hint).replace("typing.", "")


def check_value(value: Any, hint: Any, key: str) -> None:
    """Refuse what OmegaConf would coerce or choke on: a bool that is not true/false, a list or mapping where the
    schema has a scalar (and the reverse), a non-string key, a YAML type with no config equivalent (bytes, sets).
    Everything else (ints for float keys, enum names, ranges) is OmegaConf's and ``ddp_core.config.validate``'s."""
    if value is None or (isinstance(value, str) and "${" in value):
        return  # null is OmegaConf's to refuse (it names the key); an interpolation is checked once resolved
    if get_origin(hint) is Union:  # Optional[X]: None is handled above
        hint = next(arg for arg in get_args(hint) if arg is not type(None))
    where = key or "the top level"
    if isinstance(value, dict):
        for name in value:
            if not isinstance(name, str):
                raise DdpJobError(
                    f"config key {_short(name)} under '{where}' is not a string",
                    f"keys are names: quote it, e.g. '{name}': ...",
                )
    if _is_section(hint):
        if not isinstance(value, dict):
            raise _bad_value(where, value, f"'{where}' is a section: a mapping of its keys, e.g. {{key: value}}")
        for name, item in value.items():
            if name in _fields(hint):  # unknown keys: OmegaConf names them with a spelling suggestion
                check_value(item, _fields(hint)[name], f"{key}.{name}" if key else name)
        return
    origin = get_origin(hint)
    if origin is list:
        if not isinstance(value, list):
            raise _bad_value(key, value, f"give a list, e.g. {key}=[a,b]")
        for i, item in enumerate(value):
            check_value(item, get_args(hint)[0], f"{key}[{i}]")
    elif origin is dict:
        if not isinstance(value, dict):
            raise _bad_value(key, value, f"give a mapping, e.g. {key}={{a: 1}}")
        for name, item in value.items():
            check_value(item, get_args(hint)[1], f"{key}.{name}")
    elif hint is Any:
        if isinstance(value, (dict, list)):
            for name, item in value.items() if isinstance(value, dict) else enumerate(value):
                check_value(item, Any, f"{key}.{name}" if isinstance(value, dict) else f"{key}[{name}]")
        elif not isinstance(value, (str, int, float, bool)):
            raise _bad_value(
                key, value, f"a config holds strings, numbers, booleans, lists and mappings, not {type(value).__name__}"
            )
    elif hint is bool:
        if not (isinstance(value, bool) or (isinstance(value, str) and value.lower() in ("true", "false"))):
            raise _bad_value(key, value, "use true or false")
    elif isinstance(value, (dict, list)) or not isinstance(value, (str, int, float, bool)):
        raise _bad_value(key, value, f"give a single value of type {_type_name(hint)}")


def _missing(value: Any) -> bool:
    if dataclasses.is_dataclass(value):
        return any(_missing(getattr(value, f.name)) for f in dataclasses.fields(value))
    return isinstance(value, str) and value == MISSING


class NotPlain(Exception):
    """``from_plain`` met a value that is not already of its key's type: OmegaConf must read it."""


def from_plain(hint: Any, value: Any) -> Any:
    """``value`` (as ``CheckLoader`` reads a file that ``Dumper`` wrote) built into ``hint``, the schema's type:
    dataclasses from mappings, enums from their values, an int where a float is due, and nothing else. Raises
    ``NotPlain`` at the first value OmegaConf would have to convert or resolve (a number for a string key, an
    unknown key, any ``${``), so that the caller reads the file through OmegaConf instead: this is a fast path for
    files this package wrote, never a second reading of the config language."""
    if get_origin(hint) is Union:  # Optional[X], or a choice of scalar types (slurm.nodes: int or "MIN-MAX")
        if value is None and type(None) in get_args(hint):
            return None
        choices = [arg for arg in get_args(hint) if arg is not type(None)]
        for choice in choices[:-1]:
            try:
                return from_plain(choice, value)
            except NotPlain:
                pass
        hint = choices[-1]
    if _is_section(hint):
        if not isinstance(value, dict) or not value.keys() <= _fields(hint).keys():
            raise NotPlain
        built = hint(**{name: from_plain(_fields(hint)[name], item) for name, item in value.items()})
        if _missing(built):
            raise NotPlain  # a required key left out (here or in a section's defaults): OmegaConf names it
        return built
    origin = get_origin(hint)
    if isinstance(value, dict) and (origin is dict or hint is Any):
        if not all(isinstance(k, str) for k in value):
            raise NotPlain
        item = get_args(hint)[1] if origin is dict else Any
        return {k: from_plain(item, v) for k, v in value.items()}
    if isinstance(value, list) and (origin is list or hint is Any):
        item = get_args(hint)[0] if origin is list else Any
        return [from_plain(item, v) for v in value]
    if origin is not None:
        raise NotPlain  # a list or mapping key holding something else: OmegaConf names it
    if isinstance(value, str) and ("${" in value or value == MISSING):
        raise NotPlain  # an interpolation (or an escaped literal one), or OmegaConf's mark of a missing value
    if isinstance(hint, type) and issubclass(hint, Enum) and isinstance(value, str):
        try:
            return hint(value)
        except ValueError:
            raise NotPlain from None
    if hint is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    kinds = (str, int, float, bool) if hint is Any else (hint,)
    if isinstance(value, kinds) and not (hint is int and isinstance(value, bool)):
        return value
    raise NotPlain
