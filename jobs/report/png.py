"""``report.png`` with matplotlib: for a sweep, the metric against each swept key (log axes where it was swept on a
log scale) and the curves of the metrics with more than one point, the best trial in red; for a run or a folder of
unrelated runs, every metric's curves as before. The PNG records its panels (title and pixel box) in a text chunk,
so a reader (the tests) can find and check each one.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING

from jobs.report.figures import BEST_COLOR, DRAW_ORDER, PALETTE, STATE_COLORS, curve_keys
from jobs.report.table import metric_keys
from jobs.report.trials import NO_METRICS, Sweep

if TYPE_CHECKING:
    from matplotlib.axes import Axes

PNG_SIZE = (1200, 800)  # pixels: figsize x dpi with no tight bbox, so the size never depends on the content
PNG_DPI = 100
LEGEND_MAX = 12  # more runs than this: a legend would cover the curves, so the PNG leaves it to the HTML
MAX_SLICES = 4
MAX_CURVES = 4
PANELS_KEY = "ddpjob:panels"  # the PNG text chunk that lists the panels: [{"title", "box": [x0, y0, x1, y1]}]


def _short(name: str, limit: int = 32) -> str:
    # Sweep runs share a prefix and differ at the end (trial id, timestamp): keep both ends.
    return name if len(name) <= limit else f"{name[: limit // 2 - 1]}…{name[-(limit // 2) :]}"


def _slice(ax: Axes, sweep: Sweep, key: str) -> None:
    best, choice = sweep.best, sweep.scales.get(key) == "choice"
    for state in DRAW_ORDER:
        color = STATE_COLORS[state]
        group = [(t.params[key], t.value) for t in sweep.trials if t.state == state and key in t.params]
        shown = [(str(x) if choice else x, v) for x, v in group if v is not None and math.isfinite(v)]
        if not shown:
            continue  # a legend entry for a state no trial is in is noise
        ax.scatter([x for x, _ in shown], [v for _, v in shown], s=14, color=color, alpha=0.75, label=state)
    if best is not None and best.value is not None and key in best.params:
        x = str(best.params[key]) if choice else best.params[key]
        ax.scatter([x], [best.value], s=160, marker="*", color=BEST_COLOR, edgecolors="k", zorder=5, label="best")
    if sweep.scales.get(key) == "log":
        ax.set_xscale("log")
    ax.set_title(f"{sweep.metric} vs {key}")
    ax.set_xlabel(key + (" (log)" if sweep.scales.get(key) == "log" else ""))


def _curves(ax: Axes, sweep: Sweep, key: str, highlight: bool) -> None:
    from matplotlib.collections import LineCollection

    best = sweep.best
    if highlight:  # a sweep: the rest faint, in one collection (a thousand Line2D cost seconds), the best on top
        rest = [t.curves.get(key, []) for t in sweep.trials if t is not best]
        ax.add_collection(LineCollection([p for p in rest if p], colors="#8899aa", linewidths=0.8, alpha=0.5))
        ax.autoscale_view()
        if best is not None and best.curves.get(key):
            points = best.curves[key]
            ax.plot([s for s, _ in points], [v for _, v in points], color=BEST_COLOR, linewidth=2.5, marker="o",
                    markersize=4, zorder=3)  # fmt: skip
    else:
        for i, t in enumerate(sweep.trials):
            points = t.curves.get(key, [])
            ax.plot(
                [s for s, _ in points],
                [v for _, v in points],
                color=PALETTE[i % len(PALETTE)],
                marker="o" if len(points) <= 30 else None,
                markersize=3,
            )
    ax.set_title(key)
    ax.set_xlabel("step")


def write_png(sweep: Sweep, title: str, out: Path) -> None:
    # matplotlib is imported here only: the package must stay importable in a millisecond on a login node.
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.image import imsave
    from matplotlib.lines import Line2D

    # A bare Figure + Agg canvas, not pyplot: no global figure registry, no GUI backend, nothing to close.
    # Fixed margins, no layout engine: constrained layout measured every label's box twice per draw, a second or
    # more of a 2-core login node's time, for panels whose layout never changes.
    fig = Figure(figsize=(PNG_SIZE[0] / PNG_DPI, PNG_SIZE[1] / PNG_DPI), dpi=PNG_DPI)
    fig.subplots_adjust(left=0.06, right=0.98, top=0.91, bottom=0.07, hspace=0.42, wspace=0.22)
    canvas = FigureCanvasAgg(fig)
    slices = sweep.keys[:MAX_SLICES]
    keys = metric_keys(sweep)
    curves = curve_keys(sweep, keys)[:MAX_CURVES] if slices else keys
    many = len(sweep.trials) > LEGEND_MAX and not slices
    fig.suptitle(f"{title} ({len(sweep.trials)} runs; legend in report.html)" if many else title)
    panels = len(slices) + len(curves)
    if not panels:
        fig.text(0.5, 0.5, NO_METRICS, ha="center", va="center", fontsize=20, color="#666")
    cols = 1 if panels == 1 else 2 if panels <= 4 else 3
    for index in range(panels):
        ax = fig.add_subplot(math.ceil(panels / cols), cols, index + 1)
        if index < len(slices):
            _slice(ax, sweep, slices[index])
        else:
            _curves(ax, sweep, curves[index - len(slices)], bool(slices))
        ax.grid(alpha=0.3)
    if slices and fig.axes:
        fig.axes[0].legend(fontsize="small")
    elif curves and len(sweep.trials) <= LEGEND_MAX:
        handles = [Line2D([], [], color=PALETTE[i % len(PALETTE)]) for i in range(len(sweep.trials))]
        labels = [_short(t.name) + ("" if t.curves else f" ({NO_METRICS})") for t in sweep.trials]
        fig.axes[0].legend(handles, labels, fontsize="small")
    canvas.draw()  # once: the pixels are written from this drawing (savefig would draw again)
    height = PNG_SIZE[1]
    boxes = []
    for ax in fig.axes:
        box = ax.get_window_extent()
        corners = [round(box.x0), round(height - box.y1), round(box.x1), round(height - box.y0)]
        boxes.append({"title": ax.get_title(), "box": corners})
    imsave(out, np.asarray(canvas.buffer_rgba()), format="png", dpi=PNG_DPI, metadata={PANELS_KEY: json.dumps(boxes)})
