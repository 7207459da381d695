"""The value syntax shared by grid sweeps (``jobs.sweeps.spec``) and adaptive searches (``jobs.sweeps.search_spec``):
comma-separated values, distributions, the sweep key's errors, and how a YAML value is written back as override text.
"""

from __future__ import annotations

import functools
import json
import math
import re
from typing import Any, Callable, TypeVar

from ddp_core.config.input import one_line
from ddp_core.errors import DdpJobError

T = TypeVar("T")
DISTRIBUTIONS = {
    "uniform": ("low", "high"),
    "loguniform": ("low", "high"),  # uniform in log space: for learning rates, weight decay
    "randint": ("low", "high"),  # low <= n < high, like range()
    "choice": ("values",),
}
RANGE = re.compile(r"range\((.*)\)")
NAME = re.compile(r"[A-Za-z0-9][\w.-]*")
# Strings written bare into an override must read back as the same string; these would become bool/null.
PLAIN = re.compile(r"[A-Za-z_][\w./-]*")
YAML_WORDS = {"true", "false", "yes", "no", "on", "off", "y", "n", "null", "nan", "inf"}


def one_line_errors(fn: Callable[..., T]) -> Callable[..., T]:
    """Keys, values and paths of a sweep come from the user verbatim: a newline in one would split the CLI's one
    error line. Every error leaving this module's entry points is made one line here, whatever built it."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> T:
        try:
            return fn(*args, **kwargs)
        except DdpJobError as err:
            raise DdpJobError(one_line(err.message), one_line(err.hint)) from None

    return wrapper


def split_values(text: str) -> list[str]:
    """Split on top-level commas only: ``1,[a,b],{x: 1, y: 2},'c,d'`` is four values."""
    items, depth, quote, start = [], 0, "", 0
    for i, ch in enumerate(text):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            items.append(text[start:i].strip())
            start = i + 1
    return [*items, text[start:].strip()]


def bad(key: str, why: str, hint: str) -> DdpJobError:
    return DdpJobError(f"sweep key '{key}' {why}", hint)


def as_mapping(value: Any, key: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise bad(key, f"must be a mapping of config keys, got {value!r}", f"e.g. {key}: {{optim.lr: ...}}")
    return dict(value)


def check_dist(key: str, spec: Any) -> dict[str, Any]:
    where = f"random.params.{key}"
    dist = spec.get("dist") if isinstance(spec, dict) else None
    if dist not in DISTRIBUTIONS:
        raise bad(where, f"has unknown distribution {dist!r}", f"use dist: one of {', '.join(DISTRIBUTIONS)}")
    if set(spec) != {"dist", *DISTRIBUTIONS[dist]}:
        raise bad(where, f"({dist}) has keys {sorted(spec)}", f"{dist} takes exactly {', '.join(DISTRIBUTIONS[dist])}")
    if dist == "choice":
        if not isinstance(spec["values"], list) or not spec["values"]:
            raise bad(where, "(choice) needs a non-empty values list", "e.g. {dist: choice, values: [adamw, sgd]}")
        return spec
    low, high = spec["low"], spec["high"]
    kinds = (int,) if dist == "randint" else (int, float)
    if any(isinstance(b, bool) or not isinstance(b, kinds) for b in (low, high)):
        raise bad(where, f"({dist}) has low={low!r} high={high!r}", f"{dist} bounds must be {kinds[-1].__name__}s")
    if dist != "randint" and not all(finite_float(b) for b in (low, high)):  # randint draws ints of any size
        raise bad(where, f"({dist}) has low={low!r} high={high!r}", "bounds must be finite numbers")
    if low > high or (dist == "randint" and low == high):
        raise bad(where, f"({dist}) has low={low!r} > high={high!r}", "need low <= high (randint: low < high)")
    if dist == "loguniform" and low <= 0:
        raise bad(where, f"(loguniform) has low={low!r} <= 0", "loguniform needs 0 < low <= high")
    return spec


def finite_float(value: int | float) -> bool:
    try:
        return math.isfinite(float(value))
    except OverflowError:  # an int past float's range
        return False


def fmt_value(value: Any, nested: bool = False) -> str:
    """A YAML value as override text that loads back to the same value (floats by repr: they round-trip)."""
    if isinstance(value, bool) or value is None:
        return {True: "true", False: "false", None: "null"}[value]
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(fmt_value(v, True) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{fmt_value(k, True)}: {fmt_value(v, True)}" for k, v in value.items()) + "}"
    text = str(value)
    plain = not nested and PLAIN.fullmatch(text) and text.lower() not in YAML_WORDS
    return text if plain else _SURROGATE_PAIR.sub(_astral, json.dumps(text))


# JSON escapes a character past U+FFFF as a UTF-16 surrogate pair, which YAML (libyaml) refuses: \U escapes it.
# The pair's backslash must not itself be escaped (an even run of backslashes before it).
_SURROGATE_PAIR = re.compile(r"(?<!\\)((?:\\\\)*)\\u(d[89ab][0-9a-f]{2})\\u(d[c-f][0-9a-f]{2})")


def _astral(match: re.Match[str]) -> str:
    high, low = int(match[2], 16), int(match[3], 16)
    return f"{match[1]}\\U{0x10000 + ((high - 0xD800) << 10) + (low - 0xDC00):08x}"
