"""docs/configuration.md is generated from the config dataclasses, and every key there has a description."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import Enum
from typing import List, Optional

from ddp_core.config import Config
from ddp_core.config.reference import COMMAND, fields_without_docs, render, sections
from tests.support.helpers import ROOT

PAGE = ROOT / "docs" / "configuration.md"


def test_the_committed_page_is_what_the_generator_renders():
    assert PAGE.read_text() == render(), f"docs/configuration.md is out of date: run `{COMMAND}`"


def test_every_key_of_every_section_is_a_row_with_a_description():
    shown = {section.name: [row.key for row in section.rows] for section in sections(Config)}
    assert list(shown) == [f.name for f in dataclasses.fields(Config)]

    def keys_of(value: object, prefix: str) -> list[str]:  # a dataclass-typed key (slurm.container) lists its keys
        keys = []
        for f in dataclasses.fields(value):  # type: ignore[arg-type]
            inner, key = getattr(value, f.name), f"{prefix}.{f.name}"
            keys += keys_of(inner, key) if dataclasses.is_dataclass(inner) else [key]
        return keys

    cfg = Config()
    for name, keys in shown.items():
        assert keys == keys_of(getattr(cfg, name), name)
    page = render()
    for keys in shown.values():
        for key in keys:
            assert f"| `{key}` |" in page, key
    assert fields_without_docs(Config) == [], "give these keys a # comment in ddp_core/config/"


class Colour(str, Enum):
    red = "red"  # the warm one
    blue = "blue"


@dataclass
class Paint:
    """A made-up section."""

    # How much paint, in
    # litres.
    litres: float = 1.5
    colour: Colour = Colour.red  # which colour
    brushes: List[str] = field(default_factory=lambda: ["flat|round"])
    thinner: Optional[int] = None


@dataclass
class Tree:
    paint: Paint = field(default_factory=Paint)


def test_an_undocumented_key_is_reported():
    """The check above can fail: of a made-up tree, the fields without a comment are named."""
    assert fields_without_docs(Tree) == ["paint.brushes", "paint.thinner"]
    [section] = sections(Tree)
    assert section.doc == "A made-up section."
    assert [(row.key, row.type, row.default) for row in section.rows] == [
        ("paint.litres", "float", "`1.5`"),
        ("paint.colour", "red / blue", "`red`"),
        ("paint.brushes", "list[str]", "`[flat|round]`"),
        ("paint.thinner", "int or null", "`null`"),
    ]
    assert section.rows[0].doc == "How much paint, in litres."
    assert section.rows[1].doc == "which colour\n`red`: the warm one"
    page = render(Tree)
    assert "## paint\n\nA made-up section.\n" in page
    assert "| `paint.brushes` | list[str] | `[flat\\|round]` |  |" in page
    assert "| `paint.colour` | red / blue | `red` | which colour<br>`red`: the warm one |" in page
