"""How user text becomes config values, before OmegaConf sees it.

The YAML reader (PyYAML's safe loader, reading plain scalars as OmegaConf does except that only true/false are
booleans; repeated keys, alias bombs and deep nesting refused), the ``key=value`` override syntax, the refusal of
secret-looking ``${oc.env:...}`` interpolations (``secrets``, on the text as YAML decoded it), and shape checks of
values against the dataclass tree (a bool key takes true/false only, a section a mapping, ...). Every problem is one
``DdpJobError`` line naming the file or the override; OmegaConf's own errors are translated the same way
(``explain``).

Shape checks of values against the dataclass tree are ``shapes``; generic over the schema (the root dataclass is a
parameter), neither module imports the schema that ``load`` builds ``load_config`` and ``check_override`` from.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from ddp_core.config.secrets import refuse_env_interpolation
from ddp_core.errors import DdpJobError

if TYPE_CHECKING:  # imported where a config is loaded: the trainer, handed one, never imports OmegaConf
    from omegaconf.errors import OmegaConfBaseException

# omegaconf.MISSING, the value OmegaConf reads as "required, not given" (the schema's default for required keys).
# OmegaConf itself is imported by load_config only: the trainer, which is handed a Config, does not pay its imports.
MISSING = "???"

# What str.splitlines() breaks a line at, and other control characters: escaped in messages, which are one line.
_LINE_BREAKS = re.compile(r"[\x00-\x1f\x7f\x85\u2028\u2029]")


def one_line(text: str) -> str:
    """``text`` with control characters and line breaks escaped (``\\n``): error messages are one line."""
    return _LINE_BREAKS.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), text)


def _clip(text: str, limit: int = 80) -> str:
    """User text as shown in a one-line error: control characters and line breaks escaped, at most ``limit``."""
    shown = one_line(text)
    return shown if len(shown) <= limit else shown[: limit - 3] + "..."


OVERRIDE_HINT = "values are YAML: quote a string with special characters, e.g. run.name='\"a b\"'"

_OVERRIDE_KEY = re.compile(r"[^\s.\[\]=]+(?:\.[^\s.\[\]=]+)*")


def parse_override(item: str) -> tuple[str, Any]:
    """A ``key=value`` override's dotted key and its value as ``CheckLoader`` reads it, or one ``DdpJobError``:
    not key=value, a key that is not dotted names, a secret-looking interpolation, invalid YAML. Whether the value
    has the key's shape is the caller's (``check_value`` at ``hint_at(root, key)``)."""
    key, eq, text = item.partition("=")
    if not eq or not key:
        raise DdpJobError(
            f"override '{_clip(item)}' is not of the form key=value",
            "write e.g. optim.lr=3e-4; a bare key would silently become null",
        )
    if not _OVERRIDE_KEY.fullmatch(key):
        # OmegaConf's list indexes (tags[0]=x) merge a mapping into the list unless the same dotlist made it.
        raise DdpJobError(
            f"override '{_clip(item)}' does not start with a dotted config key",
            "write key=value with no spaces around '=' and no [index] (set a whole list: wandb.tags=[a,b])",
        )
    value = _override_value(item, text)
    refuse_env_interpolation(f"override '{key}'", value)  # as YAML decoded it: an escape spells nothing new
    return key, value


def _override_value(item: str, text: str) -> Any:
    """An override's value as ``CheckLoader`` reads it; the same YAML errors as a file, naming the override."""
    where = f"override '{_clip(item)}'"
    try:
        root = yaml.compose(text, Loader=CheckLoader)
        if root is None:
            return None
        _check_nodes(where, root)
        return yaml.load(text, Loader=CheckLoader)
    except RecursionError:
        raise DdpJobError(f"{where} nests deeper than {_MAX_DEPTH} levels", OVERRIDE_HINT) from None
    except yaml.YAMLError as err:
        raise DdpJobError(f"{where} is not valid YAML: {yaml_problem(err)}", OVERRIDE_HINT) from None


def omegaconf_load(path: Path) -> Any:
    from omegaconf import OmegaConf

    try:
        return OmegaConf.load(path)
    except yaml.YAMLError as err:  # OmegaConf's own alias limits (ratio of expansion) can be stricter than ours
        raise DdpJobError(
            f"config file '{path}' cannot be read by OmegaConf: {yaml_problem(err)}",
            "write the values out instead of repeating YAML aliases",
        ) from None


def yaml_problem(err: yaml.YAMLError) -> str:
    """The first sentence of a YAML error: PyYAML's own str spans several lines (marks, snippets)."""
    problem = getattr(err, "problem", None) or str(err).splitlines()[0]
    return str(problem).split(". See ")[0]


# YAML as OmegaConf's loader reads it (its float resolver is copied here: the expression is the one OmegaConf
# adds to PyYAML's YAML 1.1 resolvers, so ``1e-4`` is a float and not a string).
_FLOAT_TAG = "tag:yaml.org,2002:float"
_BOOL_TAG = "tag:yaml.org,2002:bool"
_OMEGACONF_FLOAT = re.compile(
    r"""^(?:
     [-+]?[0-9]+(?:_[0-9]+)*\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?[0-9]+(?:_[0-9]+)*(?:[eE][-+]?[0-9]+)
    |\.[0-9]+(?:_[0-9]+)*(?:[eE][-+][0-9]+)?
    |[-+]?[0-9]+(?:_[0-9]+)*(?::[0-5]?[0-9])+\.[0-9_]*
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""",
    re.X,
)


class CheckLoader(yaml.SafeLoader):
    """Reads plain scalars as OmegaConf does (``1e-4`` a float, dates stay strings), except that only true/false
    are booleans: YAML 1.1's yes/no/on/off stay strings, so a bool key can refuse them instead of OmegaConf
    coercing them (and 2, and "yes") to True."""


CheckLoader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag not in (_BOOL_TAG, "tag:yaml.org,2002:timestamp")]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
CheckLoader.add_implicit_resolver(_BOOL_TAG, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))
CheckLoader.add_implicit_resolver(_FLOAT_TAG, _OMEGACONF_FLOAT, list("-+0123456789."))


class SavedLoader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):  # type: ignore[misc]
    """``CheckLoader``'s reading with libyaml's parser where PyYAML has it (a config: 2.4 against 24 ms here), for
    the files this package wrote (``ddp_core.config.load_saved``); errors are reported by reading with
    ``CheckLoader``."""


SavedLoader.yaml_implicit_resolvers = CheckLoader.yaml_implicit_resolvers


class Dumper(yaml.SafeDumper):
    """Quotes every string that OmegaConf's loader would read as something else (``1e3`` is a float there)."""


Dumper.add_implicit_resolver(_FLOAT_TAG, _OMEGACONF_FLOAT, list("-+0123456789."))


# Aliases make a tiny YAML file expand to gigabytes ("billion laughs") once the tree is copied; real configs
# have a few hundred nodes.
_MAX_NODES = 100_000
# Real configs nest 3 or 4 levels; OmegaConf's recursive merge overflows Python's stack near 100.
_MAX_DEPTH = 32


def read_yaml_mapping(path: Path) -> dict[str, Any]:
    """A YAML file's top-level mapping (as PyYAML reads it), or one ``DdpJobError`` naming the file (and line)
    and what is wrong: syntax, encoding, tags, a repeated key, alias bombs, deep nesting, a top level that is not a
    mapping, a secret-looking ``${oc.env:...}``."""
    return read_yaml(path, yaml.SafeLoader)


def is_file(path: Path) -> bool:
    """Whether ``path`` names a file; False, not an exception, for a name too long or with a NUL byte."""
    try:
        return path.is_file()
    except (OSError, ValueError):
        return False


def read_yaml(path: Path, loader: type) -> dict[str, Any]:
    hint = "a config is a YAML mapping of sections (run:, task:, optim:, ...), e.g. configs/digits.yaml"
    if not is_file(path):
        raise DdpJobError(f"config file '{path}' not found", "pass a YAML file, e.g. configs/digits.yaml")
    try:
        text = path.read_text(encoding="utf-8")
        root = yaml.compose(text, Loader=loader)
        if root is not None:
            _check_nodes(f"config file '{path}'", root)
        data = yaml.load(text, Loader=loader)  # a safe loader: no !!python tags
        refuse_env_interpolation(f"config file '{path}'", data)  # as YAML decoded it: an escape spells nothing new
    except OSError as err:
        raise DdpJobError(f"config file '{path}' cannot be read: {err.strerror}", hint) from None
    except UnicodeDecodeError as err:
        raise DdpJobError(f"config file '{path}' is not UTF-8 text ({err.reason} at byte {err.start})", hint) from None
    except RecursionError:
        raise DdpJobError(f"config file '{path}' nests deeper than {_MAX_DEPTH} levels", hint) from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise DdpJobError(f"config file '{path}' is not valid YAML{where}: {yaml_problem(err)}", hint) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise DdpJobError(f"config file '{path}' holds a {type(data).__name__}, not a mapping of sections", hint)
    return data


def _check_nodes(where: str, root: yaml.Node) -> None:
    """Refuse a repeated key (safe_load keeps the last one silently), an alias that contains itself, nesting past
    ``_MAX_DEPTH`` and a tree that aliases expand past ``_MAX_NODES``. Each node is visited once, aliased or not:
    linear in the text, not in its expansion."""
    size: dict[int, int] = {}  # values in the node's subtree once aliases are copied out
    height: dict[int, int] = {}
    seen: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:  # depth first, each node's children finished before the node itself
        node, finished = stack.pop()
        children = (
            [c for pair in node.value for c in pair]
            if isinstance(node, yaml.MappingNode)
            else (node.value if isinstance(node, yaml.SequenceNode) else [])
        )
        if finished:
            if any(id(c) not in size for c in children):  # a child still open is an ancestor: a cycle
                raise DdpJobError(f"{where} has a YAML alias that contains itself", "write the values out")
            size[id(node)] = min(_MAX_NODES + 1, 1 + sum(size[id(c)] for c in children))
            height[id(node)] = 1 + max((height[id(c)] for c in children), default=0)
            continue
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, yaml.MappingNode):
            keys: set[str] = set()
            for key, _ in node.value:
                if isinstance(key, yaml.ScalarNode):
                    if key.value in keys:
                        raise DdpJobError(
                            f"{where} repeats the key '{key.value}' at line {key.start_mark.line + 1}",
                            "keep one of them (YAML keeps the last silently)",
                        )
                    keys.add(key.value)
        stack.append((node, True))
        stack.extend((c, False) for c in children if id(c) not in seen)
    if size[id(root)] > _MAX_NODES:
        raise DdpJobError(
            f"{where} expands to more than {_MAX_NODES} values through YAML aliases",
            "write the values out; aliases that multiply like this are a YAML bomb",
        )
    if height[id(root)] > _MAX_DEPTH:
        raise DdpJobError(f"{where} nests deeper than {_MAX_DEPTH} levels", "real configs nest a few levels")


def explain(err: OmegaConfBaseException) -> DdpJobError:
    from omegaconf.errors import ConfigKeyError, MissingMandatoryValue, ValidationError

    key = _clip(str(getattr(err, "full_key", None) or "?"))
    first_line = _clip(str(err).splitlines()[0], 200) if str(err) else type(err).__name__
    if isinstance(err, MissingMandatoryValue):
        return DdpJobError(f"config key '{key}' is required but has no value", f"set it: {key}=...")
    if isinstance(err, ConfigKeyError):
        return DdpJobError(
            f"unknown config key '{key}': {first_line}",
            "check the spelling against docs/configuration.md",
        )
    if isinstance(err, ValidationError):
        return DdpJobError(f"bad value for config key '{key}': {first_line}", "give a value of the key's type")
    return DdpJobError(f"invalid config at '{key}': {first_line}", "check the value and any ${...} interpolation in it")
