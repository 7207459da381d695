"""The HTML report's charts as Plotly figures: the slice of the metric against each swept key and the curves over
steps are plain figure dicts (a thousand trials' curves are thousands of traces, which Plotly's Python objects would
validate one by one for seconds); parallel coordinates, importances and the search's history are Optuna's own
(``optuna.visualization``). Every figure is JSON for ``Plotly.newPlot`` in the page.
"""

from __future__ import annotations

import json
import math
from typing import Any, Optional

from jobs.report.table import label
from jobs.report.trials import Sweep, Trial

# A trial's state, the same colour in every chart and in the PNG.
STATE_COLORS = {"complete": "#1f77b4", "running": "#7f7f7f", "pruned": "#ff7f0e", "fail": "#d62728"}
# Ended early (fail, pruned) or not ended (running) first, complete on top: a failed or pruned trial's value is
# where it stopped, not where its hyperparameters lead, and a tenth of them must not hide the trend.
DRAW_ORDER = ("fail", "pruned", "running", "complete")
BEST_COLOR = "#d62728"
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")
TOP_CURVES = 10  # curves drawn at first (the best ones); the rest are in the legend, one click away
DASH = {"complete": "solid", "running": "dot", "pruned": "dash", "fail": "dashdot", "pending": "solid"}
SLICE_COLUMNS = 3


def finite(value: Optional[float]) -> bool:
    return value is not None and math.isfinite(value)


def to_json(figure: Any) -> str:
    """A figure dict (or an Optuna/Plotly figure) as JSON that is safe inside a <script> element."""
    if hasattr(figure, "to_json"):
        text = figure.to_json()
    else:
        text = json.dumps(figure, default=str, allow_nan=False)
    return text.replace("</", "<\\/")


def _slice_axes(sweep: Sweep, index: int, rows: int, cols: int) -> dict[str, Any]:
    key = sweep.keys[index]
    row, col = divmod(index, cols)
    suffix = "" if index == 0 else str(index + 1)
    gap_x, gap_y = 0.04, 0.08 / rows
    kind = {"log": "log", "choice": "category"}.get(sweep.scales.get(key, "linear"), "linear")
    return {
        f"xaxis{suffix}": {
            "domain": [col / cols + gap_x, (col + 1) / cols - gap_x],
            "anchor": f"y{suffix}",
            "type": kind,
            "title": {"text": key + (" (log)" if kind == "log" else "")},
            # A log axis labels 1, 2 and 5 of each decade in plain numbers: Plotly's default labels every digit and
            # writes 100µ beside 0.001, which reads as clutter on a slice of a few values.
            **({"dtick": "D2", "exponentformat": "power"} if kind == "log" else {}),
        },
        f"yaxis{suffix}": {
            "domain": [1 - (row + 1) / rows + gap_y, 1 - row / rows - gap_y],
            "anchor": f"x{suffix}",
            "title": {"text": sweep.metric if col == 0 else ""},
        },
    }


def slice_figure(sweep: Sweep) -> dict[str, Any]:
    """The metric against each swept key, one panel per key, coloured by state; the best trial a red star."""
    cols = min(SLICE_COLUMNS, len(sweep.keys))
    rows = math.ceil(len(sweep.keys) / cols)
    best = sweep.best
    size = 8 if len(sweep.trials) <= 200 else 5  # a thousand markers of 8 px cover each other and the best region
    layout: dict[str, Any] = {"height": 320 * rows, "margin": {"t": 30}, "hovermode": "closest"}
    data: list[dict[str, Any]] = []
    for index, key in enumerate(sweep.keys):
        layout |= _slice_axes(sweep, index, rows, cols)
        axes = {"xaxis": f"x{index + 1 if index else ''}", "yaxis": f"y{index + 1 if index else ''}"}
        for state in DRAW_ORDER:
            color = STATE_COLORS[state]
            group = [t for t in sweep.trials if t.state == state and finite(t.value) and key in t.params]
            data.append(
                {
                    "type": "scatter",
                    "mode": "markers",
                    "name": state,
                    "legendgroup": state,
                    "showlegend": index == 0,
                    "x": [_x(t.params[key], sweep.scales.get(key)) for t in group],
                    "y": [t.value for t in group],
                    "text": [f"{t.name}: {label(t, sweep.keys)}" for t in group],
                    "marker": {"color": color, "size": size, "opacity": 0.7, "symbol": "x" if state == "fail" else 0},
                    "hovertemplate": f"%{{text}}<br>{sweep.metric}=%{{y}}<extra>{state}</extra>",
                    **axes,
                }
            )
        if best is not None and key in best.params:
            data.append(
                {
                    "type": "scatter",
                    "mode": "markers",
                    "name": f"best: {best.name}",
                    "legendgroup": "best",
                    "showlegend": index == 0,
                    "x": [_x(best.params[key], sweep.scales.get(key))],
                    "y": [best.value],
                    "marker": {"color": BEST_COLOR, "size": 16, "symbol": "star", "line": {"width": 1}},
                    **axes,
                }
            )
    return {"data": data, "layout": layout}


def _x(value: Any, scale: Optional[str]) -> Any:
    return str(value) if scale == "choice" or isinstance(value, (bool, list, dict)) else value


def curve_figure(sweep: Sweep, key: str) -> dict[str, Any]:
    """One metric over steps, a trace per trial labelled by its swept values. The best trial is drawn thick and
    red; the next ones thin; past TOP_CURVES the traces start hidden (the legend and the buttons show them)."""
    ranked, best = sweep.ranked(), sweep.best
    order = [t for t in ranked if t is not best] + ([best] if best is not None else [])  # the best drawn on top
    data, visible = [], []
    top = {id(t) for t in ranked[: TOP_CURVES if sweep.keys else len(ranked)]}
    place = {id(t): i for i, t in enumerate(ranked)}
    for i, t in enumerate(order):
        points = [(s, v) for s, v in t.curves.get(key, []) if math.isfinite(v)]
        if not points:
            continue
        is_best = t is best
        name = label(t, sweep.keys) + ("" if t.state == "complete" else f" ({t.state})")
        color = BEST_COLOR if is_best else PALETTE[i % len(PALETTE)] if id(t) in top else "#9aa5b1"
        shown = id(t) in top or is_best
        visible.append((is_best, shown))
        data.append(
            {
                "type": "scatter",
                "mode": "lines+markers" if len(points) <= 40 else "lines",
                "name": ("★ " if is_best else "") + name,
                "legendrank": 1 if is_best else 1000 + place[id(t)],
                "x": [s for s, _ in points],
                "y": [v for _, v in points],
                "visible": True if shown else "legendonly",
                "line": {"color": color, "width": 4 if is_best else 1.5, "dash": DASH.get(t.state, "solid")},
                "marker": {"size": 7 if is_best else 4},
                "hovertemplate": f"{t.name}<br>step %{{x}}<br>{key}=%{{y}}<extra></extra>",
            }
        )
    buttons = [
        {
            "label": f"top {TOP_CURVES}",
            "method": "restyle",
            "args": [{"visible": [v or "legendonly" for _, v in visible]}],
        },
        {"label": "all", "method": "restyle", "args": [{"visible": [True] * len(visible)}]},
        {"label": "best only", "method": "restyle", "args": [{"visible": [b or "legendonly" for b, _ in visible]}]},
    ]
    layout: dict[str, Any] = {
        "title": {"text": key},
        "xaxis": {"title": {"text": "step"}},
        "yaxis": {"title": {"text": key}},
        "height": 420,
        "margin": {"t": 50},
        "legend": {"font": {"size": 10}},
    }
    if sweep.keys and len(visible) > 1:
        layout["updatemenus"] = [{"type": "buttons", "direction": "right", "x": 0, "y": 1.15, "buttons": buttons}]
    return {"data": data, "layout": layout}


def curve_keys(sweep: Sweep, keys: list[str]) -> list[str]:
    """The metrics worth a curve: of a sweep, those with more than one point in some trial (an eval only at the end
    is a single dot per trial, which the slices and the table show better); of a run, every one."""
    if sweep.kind == "run":
        return keys
    return [k for k in keys if any(len(t.curves.get(k, [])) > 1 for t in sweep.trials)]


def optuna_figures(sweep: Sweep, study: Any) -> dict[str, Any]:
    """Optuna's own views of the study, where they say something: parallel coordinates (two keys or more),
    importances (enough finished trials), the optimisation history (an adaptive sweep, where order matters)."""
    from optuna import visualization

    out: dict[str, Any] = {}
    if not study.trials:
        return out
    if len(study.trials[0].params) >= 2:
        out["parallel"] = visualization.plot_parallel_coordinate(study, target_name=sweep.metric)
    if sweep.kind == "search":
        out["history"] = visualization.plot_optimization_history(study, target_name=sweep.metric)
    return out


def importance_figure(shares: dict[str, float], metric: str) -> dict[str, Any]:
    keys = list(shares)[::-1]  # the largest on top
    return {
        "data": [
            {
                "type": "bar",
                "orientation": "h",
                "x": [shares[k] for k in keys],
                "y": keys,
                "text": [f"{shares[k]:.2f}" for k in keys],
                "textposition": "outside",
                "marker": {"color": "#1f77b4"},
                "hovertemplate": "%{y}: %{x:.3f}<extra></extra>",
            }
        ],
        "layout": {
            "title": {"text": f"share of the variance of {metric} each key explains alone"},
            "xaxis": {"range": [0, 1.05], "title": {"text": "importance"}},
            "height": 120 + 40 * len(keys),
            "margin": {"l": 180, "t": 50},
        },
    }


def trials_without_value(sweep: Sweep) -> list[Trial]:
    return [t for t in sweep.trials if not finite(t.value)]
