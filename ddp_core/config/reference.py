"""The configuration reference, ``docs/configuration.md``, generated from the config dataclasses themselves.

Every key's type and default come from its dataclass field, its description from the ``#`` comments the source
has for it: the comment lines directly above the field, then a comment on the field's own line(s). An enum-typed
key also lists its values' comments. ``render(root)`` takes the root dataclass (``Config``), so a made-up tree
renders the same way; ``fields_without_docs(root)`` names the keys with no description.

Regenerate the page with ``python -m ddp_core.config.reference > docs/configuration.md``;
``tests/unit/ddp_core/config/test_config_reference.py`` fails when the page is out of date or a key is undocumented.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import textwrap
import tokenize
import types
from enum import Enum
from functools import cache
from typing import Any, NamedTuple, Union, get_args, get_origin, get_type_hints

from ddp_core.config.input import MISSING
from ddp_core.config.tree import Config

COMMAND = "python -m ddp_core.config.reference > docs/configuration.md"
# Trailing comments that are directives to a tool, not documentation.
_PRAGMAS = ("fmt:", "noqa", "type:", "pragma:")


class Row(NamedTuple):
    """One key of the table: its dotted name, type, default and description (lines: the field's comments, then
    its enum values' comments), as markdown text before ``cell`` escapes it."""

    key: str
    type: str
    default: str
    doc: str


class Section(NamedTuple):
    """One section of the root (``optim``): its name, its class's docstring and its keys."""

    name: str
    doc: str
    rows: list[Row]


@cache
def _class_source(cls: type) -> tuple[ast.ClassDef, dict[int, str], dict[int, str]]:
    """``cls``'s class statement, and its comments by line: those alone on their line, and those after code."""
    source = textwrap.dedent(inspect.getsource(cls))
    node = ast.parse(source).body[0]
    if not isinstance(node, ast.ClassDef):
        raise TypeError(f"the source of {cls.__qualname__} does not start with its class statement")
    alone: dict[int, str] = {}
    after: dict[int, str] = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type != tokenize.COMMENT:
            continue
        line, text = token.start[0], token.string.lstrip("#").strip()
        if token.line[: token.start[1]].strip():
            if not text.startswith(_PRAGMAS):
                after[line] = text
        else:
            alone[line] = text
    return node, alone, after


def comments(cls: type) -> dict[str, str]:
    """Each attribute of ``cls`` (a dataclass's fields, an enum's members) and its comments, joined into one line:
    the comment lines directly above it (no blank line between), then the comment on its own line(s)."""
    node, alone, after = _class_source(cls)
    found: dict[str, str] = {}
    for stmt in node.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            name = stmt.target.id
        elif isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
            name = stmt.targets[0].id
        else:
            continue
        first = stmt.lineno - 1
        while first in alone:
            first -= 1
        above = [alone[line] for line in range(first + 1, stmt.lineno)]
        own = [after[line] for line in range(stmt.lineno, (stmt.end_lineno or stmt.lineno) + 1) if line in after]
        found[name] = " ".join(text for text in above + own if text)
    return found


def class_doc(cls: type) -> str:
    """The docstring written in ``cls``'s source, as one paragraph ("" without one; not dataclass's signature)."""
    doc = ast.get_docstring(_class_source(cls)[0]) or ""
    return " ".join(doc.split())


def type_text(hint: Any) -> str:
    """A resolved annotation as the reference shows it: ``Optional[float]`` -> ``float or null``, an enum -> its
    values joined by `` / ``, ``List[int]`` -> ``list[int]``."""
    origin, args = get_origin(hint), get_args(hint)
    if origin is Union or origin is types.UnionType:
        shown = [type_text(arg) for arg in args if arg is not type(None)]
        return " or ".join(shown + (["null"] if type(None) in args else []))
    if isinstance(hint, type) and issubclass(hint, Enum):
        return " / ".join(str(member.value) for member in hint)
    if origin is not None:
        name = getattr(origin, "__name__", str(origin))
        return f"{name}[{', '.join(type_text(arg) for arg in args)}]" if args else name
    if hint is Any:
        return "Any"
    return hint.__name__ if isinstance(hint, type) else str(hint)


def value_text(value: Any) -> str:
    """A default as YAML's flow style writes it: ``null``, ``true``, ``[0.9, 0.999]``, ``{}``."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, Enum):
        return value_text(value.value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(value_text(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{value_text(k)}: {value_text(v)}" for k, v in value.items()) + "}"
    if isinstance(value, str):
        return value if value.strip() == value and value else repr(value)
    return repr(value)


def default_text(f: dataclasses.Field[Any]) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "required"
    return "required" if value == MISSING else f"`{value_text(value)}`"


def _enum_of(hint: Any) -> type[Enum] | None:
    for arg in (hint, *get_args(hint)):
        if isinstance(arg, type) and issubclass(arg, Enum):
            return arg
    return None


def rows(cls: type, prefix: str) -> list[Row]:
    """The keys of dataclass ``cls`` under ``prefix`` (``optim``), in field order; a dataclass-typed field's keys
    are listed in its place."""
    hints, docs = get_type_hints(cls), comments(cls)
    found: list[Row] = []
    for f in dataclasses.fields(cls):
        key, hint = f"{prefix}.{f.name}", hints[f.name]
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):
            found += rows(hint, key)
            continue
        doc = docs.get(f.name, "")
        enum = _enum_of(hint)
        values = comments(enum) if enum is not None else {}
        documented = [f"`{member.value}`: {values[member.name]}" for member in enum or () if values.get(member.name)]
        found.append(Row(key, type_text(hint), default_text(f), "\n".join(filter(None, [doc, *documented]))))
    return found


def sections(root: type = Config) -> list[Section]:
    """The root dataclass's sections, in field order: each field of ``root`` is one (a dataclass)."""
    hints = get_type_hints(root)
    found = []
    for f in dataclasses.fields(root):
        cls = hints[f.name]
        if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
            raise TypeError(f"{root.__qualname__}.{f.name} is not a section (a dataclass)")
        found.append(Section(f.name, class_doc(cls), rows(cls, f.name)))
    return found


def fields_without_docs(root: type = Config) -> list[str]:
    """The dotted keys under ``root`` whose field has no comment to describe it."""
    return [row.key for section in sections(root) for row in section.rows if not row.doc.strip()]


def cell(text: str) -> str:
    """Text made safe inside a markdown table cell: ``|`` escaped, ``<``/``>`` outside `code` as entities (not
    HTML tags), a line break as ``<br>``."""
    pieces = text.split("`")
    pieces[::2] = [piece.replace("<", "&lt;").replace(">", "&gt;") for piece in pieces[::2]]
    return "`".join(pieces).replace("|", "\\|").replace("\n", "<br>")


def render(root: type = Config) -> str:
    """The markdown of the configuration reference of the config tree ``root``."""
    parts = sections(root)
    lines = [
        "# Configuration reference",
        "",
        f"<!-- Generated from the config dataclasses by `{COMMAND}`: edit the comments in ddp_core/config/, "
        "not this page. -->",
        "",
        "Every key of a run's config, its type, its default and what it does. This page is generated from the "
        "config dataclasses themselves (`ddp_core/config/schema.py` and `features.py`, the root `Config` in "
        "`tree.py`): the descriptions are the comments on each field in the source. After changing a key, "
        f"regenerate it with `{COMMAND}`; `tests/unit/ddp_core/config/test_config_reference.py` fails when the page "
        "is out of date or a key has no description.",
        "",
        "A config is a YAML file with one mapping per section below (`configs/digits.yaml` is an example; see "
        "[step 2 of the README](../README.md#2-a-config)). Overrides follow it on the command line as `key=value` "
        "with the dotted key, and win over the file: `ddpjob submit my.yaml optim.lr=3e-4 train.max_steps=1000`, "
        "`ddpjob resume RUN train.max_steps=2000` ([step 3 of the README](../README.md#3-submit)). Values are "
        "YAML: a whole list or mapping is written in flow style (`wandb.tags=[a,b]`), a key inside a mapping key "
        "is dotted (`task.model.hidden=256`), and a string with special characters is quoted "
        "(`run.name='\"a b\"'`). A boolean is only `true` or `false`, every number is bounded, and a bad value or "
        "an unknown key is one `ddpjob: error:` line naming the key, before anything is submitted. Sweeps give a "
        "key several values: [sweeps.md](sweeps.md).",
        "",
        "Sections: " + " · ".join(f"[{s.name}](#{s.name})" for s in parts) + ".",
    ]
    for section in parts:
        lines += ["", f"## {section.name}", ""]
        if section.doc:
            lines += [section.doc, ""]
        lines += ["| key | type | default | what it does |", "|---|---|---|---|"]
        lines += [
            f"| `{cell(row.key)}` | {cell(row.type)} | {cell(row.default)} | {cell(row.doc)} |" for row in section.rows
        ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(render(), end="")
