"""What a report draws: the Plotly figures of its HTML page, the panels of its PNG (each checked not blank)."""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path
from typing import Any

from jobs.report.png import PANELS_KEY


def png_panels(path: Path) -> list[dict[str, Any]]:
    """The panels the PNG lists in its text chunk, each checked to hold a drawing (not a blank box)."""
    from matplotlib.image import imread

    data = path.read_bytes()
    found = re.search(
        rb"tEXt" + PANELS_KEY.encode() + rb"\x00(.*?)....IEND|tEXt" + PANELS_KEY.encode() + rb"\x00", data
    )
    assert found is not None, "no panel list in the PNG"
    start = data.index(b"tEXt" + PANELS_KEY.encode() + b"\x00") + len(PANELS_KEY) + 5
    length = struct.unpack(">I", data[start - len(PANELS_KEY) - 9 : start - len(PANELS_KEY) - 5])[0]
    panels = json.loads(data[start : start - len(PANELS_KEY) - 1 + length])
    pixels = imread(path)
    for panel in panels:
        x0, y0, x1, y1 = panel["box"]
        region = pixels[y0:y1, x0:x1, :3]
        assert region.size and (region < 0.9).any(axis=2).mean() > 0.005, f"panel {panel['title']} is blank"
    return panels


def figures(page: str) -> dict[str, dict[str, Any]]:
    """data-chart name -> the Plotly figure (data, layout) the page draws there."""
    found = re.findall(r'<section class="chart" data-chart="([^"]+)">.*?var f=(.*?);Plotly\.newPlot', page, re.S)
    return {name: json.loads(text) for name, text in found}
