"""Offline loss/metric curves for one run or a whole sweep: ``report.png`` and a self-contained ``report.html``.

Reads only what rank 0 leaves in each run directory (``config.yaml`` marks a run, ``metrics.jsonl`` holds its
curves: the trainer's, or what a script gave ``ddp_core.runtime.log``, in the same records), so it works on a login
node or a laptop with no W&B, no network and no torch. The HTML draws its charts as inline SVG (no CDN scripts, no
external CSS) and ends with a table of runs, the best one marked.

    python -m jobs.report runs/my-sweep [--metric min:eval/loss] [--out DIR]
"""

from __future__ import annotations

import argparse
import html
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from ddp_core.errors import DdpJobError
from ddp_core.run.rundir import CONFIG_FILE, RunDir

# tab10, shared by the PNG and the HTML so a run has the same colour in both.
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")
PNG_SIZE = (1200, 800)  # pixels: figsize x dpi with no tight bbox, so the size never depends on the content
PNG_DPI = 100
LEGEND_MAX = 12  # more runs than this: a legend would cover the curves, so the PNG leaves it to the HTML
NO_METRICS = "no metrics yet"
_RECORD_KEYS = {"step", "time", "split"}  # bookkeeping fields of a metrics line, not metrics
_IDENTITY_KEYS = {"run.name", "run.root", "slurm.job_name"}  # differ per run but repeat the run column
_SVG_W, _SVG_H, _ML, _MR, _MT, _MB = 560, 300, 60, 24, 26, 40  # chart size and margins (left, right, top, bottom)

Points = list[tuple[int, float]]


@dataclass
class _Run:
    name: str
    curves: dict[str, Points]  # "train/loss", "eval/accuracy", ... -> (step, value) sorted by step
    config: dict[str, Any] = field(default_factory=dict)  # flattened config.yaml: {"optim.lr": 0.001, ...}

    def final(self, key: str) -> Optional[float]:
        points = self.curves.get(key)
        return points[-1][1] if points else None

    def last_step(self) -> Optional[int]:
        return max((pts[-1][0] for pts in self.curves.values()), default=None)

    @property
    def is_script(self) -> bool:
        return bool(self.config.get("script.path") or self.config.get("script.module"))


def find_runs(path: Path) -> list[Path]:
    """``path`` itself if it is a run directory, else the run directories one or two levels below it, sorted."""
    path = Path(path)
    if (path / CONFIG_FILE).is_file():
        return [path]
    runs = {p.parent for p in path.glob(f"*/{CONFIG_FILE}")}
    # Two levels deep only under folders that are not runs themselves: a run's own subfolders (wandb/...)
    # may hold files called config.yaml that are not run configs.
    runs |= {p.parent for p in path.glob(f"*/*/{CONFIG_FILE}") if p.parent.parent not in runs}
    return sorted(runs)


def _curves(records: list[dict[str, Any]]) -> dict[str, Points]:
    curves: dict[str, Points] = {}
    for record in records:
        for key, value in record.items():
            # NaN/inf are kept (a diverged run must show "nan" in the table); the plots skip them.
            if key not in _RECORD_KEYS and isinstance(value, (int, float)) and not isinstance(value, bool):
                curves.setdefault(f"{record['split']}/{key}", []).append((record["step"], float(value)))
    return {key: sorted(points) for key, points in curves.items()}


def _read_config(run_dir: Path) -> dict[str, Any]:
    import yaml  # lazily: keeps ``import jobs.report`` cheap

    try:
        data = yaml.safe_load((run_dir / CONFIG_FILE).read_text())
    except (OSError, ValueError, yaml.YAMLError):  # ValueError: not UTF-8
        return {}  # the table just shows no config columns for it; the curves still count

    def flatten(tree: dict[str, Any], prefix: str) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in tree.items():
            out |= flatten(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value}
        return out

    return flatten(data, "") if isinstance(data, dict) else {}


def parse_metric(metric: str) -> tuple[str, bool]:
    """``"min:eval/loss"`` -> ``("eval/loss", True)``. Without a prefix, names ending in loss/error are
    minimised and everything else (accuracy-like) maximised; ``max:`` forces maximisation."""
    direction, _, key = metric.rpartition(":")
    if direction not in ("", "min", "max") or not key:
        raise DdpJobError(f"bad metric '{metric}'", "use e.g. eval/accuracy, min:eval/loss or max:eval/f1")
    key = key if "/" in key else f"eval/{key}"
    return key, direction == "min" or (not direction and key.endswith(("loss", "error")))


def _best(runs: list[_Run], key: str, minimise: bool) -> Optional[_Run]:
    scored = [(value, run) for run in runs if (value := run.final(key)) is not None and math.isfinite(value)]
    if not scored:
        return None
    pick = min if minimise else max
    return pick(scored, key=lambda pair: pair[0])[1]  # ties: the first run in sorted order


def _chart_keys(runs: list[_Run]) -> list[str]:
    """train/loss, eval/*, and everything a script logged: a script logs what it chose to (``runtime.log``), while
    the trainer's train lines also carry lr, samples/s and straggler timings, which are not curves to compare."""
    keys = {key for run in runs for key in run.curves}
    first = [k for k in ("train/loss",) if k in keys] + sorted(k for k in keys if k.startswith("eval/"))
    chosen = {key for run in runs if run.is_script for key in run.curves}
    return first + sorted(chosen - set(first))


def _color(index: int) -> str:
    return PALETTE[index % len(PALETTE)]


def _short(name: str, limit: int = 32) -> str:
    # Sweep runs share a prefix and differ at the end (trial id, timestamp): keep both ends.
    return name if len(name) <= limit else f"{name[: limit // 2 - 1]}…{name[-(limit // 2) :]}"


def _fmt(value: Optional[float]) -> str:
    return "—" if value is None else f"{value:.6g}"


def _write_png(runs: list[_Run], keys: list[str], title: str, out: Path) -> None:
    # matplotlib is imported here only: the module must stay importable in a millisecond on a login node.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    # A bare Figure + Agg canvas, not pyplot: no global figure registry, no GUI backend, nothing to close.
    fig = Figure(figsize=(PNG_SIZE[0] / PNG_DPI, PNG_SIZE[1] / PNG_DPI), dpi=PNG_DPI, layout="constrained")
    FigureCanvasAgg(fig)
    fig.suptitle(title if len(runs) <= LEGEND_MAX else f"{title} ({len(runs)} runs; legend in report.html)")
    if not keys:
        fig.text(0.5, 0.5, NO_METRICS, ha="center", va="center", fontsize=20, color="#666")
    cols = 1 if len(keys) == 1 else 2
    for index, key in enumerate(keys):
        ax = fig.add_subplot(math.ceil(len(keys) / cols), cols, index + 1)
        for i, run in enumerate(runs):
            points = run.curves.get(key, [])
            steps, values = [s for s, _ in points], [v for _, v in points]
            ax.plot(steps, values, color=_color(i), marker="o" if len(points) <= 30 else None, markersize=3)
        ax.set_title(key)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    if keys and len(runs) <= LEGEND_MAX:
        handles = [Line2D([], [], color=_color(i)) for i in range(len(runs))]
        labels = [_short(run.name) + ("" if run.curves else f" ({NO_METRICS})") for run in runs]
        fig.axes[0].legend(handles, labels, fontsize="small")
    fig.savefig(out, dpi=PNG_DPI)


def _ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """'Nice' tick values (1, 2 or 5 x 10^k apart) whose first and last enclose [lo, hi]."""
    if hi <= lo:  # one point, or a flat curve: open up a range around it
        lo, hi = lo - (abs(lo) * 0.1 or 1.0), hi + (abs(hi) * 0.1 or 1.0)
    raw = (hi - lo) / count
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 5, 10) if m * magnitude >= raw)
    first = math.floor(lo / step) * step
    return [first + i * step for i in range(math.ceil((hi - first) / step - 1e-9) + 1)]


def _svg_chart(key: str, runs: list[_Run]) -> str:
    esc = html.escape
    finite = [
        (i, run.name, [(s, v) for s, v in run.curves.get(key, []) if math.isfinite(v)]) for i, run in enumerate(runs)
    ]
    series = [entry for entry in finite if entry[2]]
    if not series:
        return f'<p class="note">{esc(key)}: no finite values</p>'
    steps, values = [s for *_, pts in series for s, _ in pts], [v for *_, pts in series for _, v in pts]
    xt, yt = _ticks(min(steps), max(steps)), _ticks(min(values), max(values))

    def px(step: float) -> float:
        return _ML + (step - xt[0]) / (xt[-1] - xt[0]) * (_SVG_W - _ML - _MR)

    def py(value: float) -> float:
        return _SVG_H - _MB - (value - yt[0]) / (yt[-1] - yt[0]) * (_SVG_H - _MT - _MB)

    bottom, right = _SVG_H - _MB, _SVG_W - _MR
    parts = [
        f'<svg class="chart" data-metric="{esc(key)}" viewBox="0 0 {_SVG_W} {_SVG_H}" width="{_SVG_W}" '
        f'height="{_SVG_H}" role="img" aria-label="{esc(key)}">',
        f'<text class="title" x="{_ML}" y="17">{esc(key)}</text>',
        f'<text class="label" x="{(_ML + right) / 2}" y="{_SVG_H - 6}" text-anchor="middle">step</text>',
    ]
    for t in xt:
        x = px(t)
        parts.append(f'<line class="grid" x1="{x:.1f}" y1="{_MT}" x2="{x:.1f}" y2="{bottom}"/>')
        parts.append(f'<text class="tick" x="{x:.1f}" y="{bottom + 15}" text-anchor="middle">{_fmt(t)}</text>')
    for t in yt:
        y = py(t)
        parts.append(f'<line class="grid" x1="{_ML}" y1="{y:.1f}" x2="{right}" y2="{y:.1f}"/>')
        parts.append(f'<text class="tick" x="{_ML - 5}" y="{y + 4:.1f}" text-anchor="end">{_fmt(t)}</text>')
    parts.append(f'<polyline class="axis" points="{_ML},{_MT} {_ML},{bottom} {right},{bottom}"/>')
    for i, name, points in series:
        coords = " ".join(f"{px(s):.1f},{py(v):.1f}" for s, v in points)
        parts.append(
            f'<polyline class="series" data-run="{esc(name)}" stroke="{_color(i)}" points="{coords}">'
            f"<title>{esc(name)}</title></polyline>"
        )
        if len(points) <= 40:  # dots make sparse curves (eval every few hundred steps, or only at the end) visible
            dots = "".join(f'<circle cx="{px(s):.1f}" cy="{py(v):.1f}" r="2.5"/>' for s, v in points)
            parts.append(f'<g class="dots" fill="{_color(i)}">{dots}</g>')
    parts.append("</svg>")
    return "\n".join(parts)


_CSS = """body{font:14px system-ui,sans-serif;margin:1.5em;color:#222}
.charts{display:flex;flex-wrap:wrap;gap:12px}.chart{border:1px solid #ddd;background:#fff}
.chart .title{font-weight:600;font-size:13px}.chart .tick,.chart .label{font-size:11px;fill:#555}
.chart .grid{stroke:#eee}.chart .axis{stroke:#888;fill:none}
.series{fill:none;stroke-width:1.8;stroke-linejoin:round;stroke-linecap:round}.series:hover{stroke-width:4}
.legend span{display:inline-block;margin:0 1em .3em 0}.legend i{display:inline-block;width:14px;height:4px;
margin-right:4px;vertical-align:middle}table{border-collapse:collapse;margin-top:1em}
td,th{border:1px solid #ddd;padding:3px 8px;text-align:right}td:first-child,th:first-child{text-align:left}
tr.best{background:#fff4c2;font-weight:600}.note{color:#666}"""


def _html(runs: list[_Run], keys: list[str], title: str, metric: str) -> str:
    esc = html.escape
    key, minimise = parse_metric(metric)
    best = _best(runs, key, minimise)
    # Config keys whose values differ between runs: the hyperparameters a sweep varied.
    config_keys = sorted({k for run in runs for k in run.config} - _IDENTITY_KEYS)
    varied = [k for k in config_keys if len({repr(run.config.get(k)) for run in runs}) > 1][:8] if len(runs) > 1 else []
    metric_cols = [k for k in keys if k != "train/loss"]
    head = ["run", *varied, "last step", "train/loss", *metric_cols, "best"]
    rows = []
    for run in runs:
        is_best = run is best
        cells = [esc(run.name), *(esc(str(run.config.get(k, "—"))) for k in varied)]
        cells.append(NO_METRICS if run.last_step() is None else str(run.last_step()))
        cells += [_fmt(run.final(k)) for k in ("train/loss", *metric_cols)]
        cells.append('<span class="best-marker">★ best</span>' if is_best else "")
        attrs = ' class="best"' if is_best else ""
        rows.append(f"<tr{attrs}>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    how = "min" if minimise else "max"
    summary = (
        f"best by {esc(key)} ({how}, final value): <b>{esc(best.name)}</b> = {_fmt(best.final(key))}"
        if best
        else f"no run has a value for {esc(key)} yet"
    )
    legend = "".join(
        f'<span><i style="background:{_color(i)}"></i>{esc(run.name)}</span>' for i, run in enumerate(runs)
    )
    charts = "\n".join(_svg_chart(k, runs) for k in keys) if keys else f'<p class="note">{NO_METRICS}</p>'
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{esc(title)}</title><style>{_CSS}</style></head>
<body><h1>{esc(title)}</h1>
<p>{len(runs)} run(s). {summary}</p>
<div class="legend">{legend}</div>
<div class="charts">
{charts}
</div>
<table><thead><tr>{"".join(f"<th>{esc(h)}</th>" for h in head)}</tr></thead>
<tbody>
{chr(10).join(rows)}
</tbody></table>
</body></html>
"""


def write_report(path: Path, out_dir: Optional[Path] = None, metric: str = "eval/accuracy") -> tuple[Path, Path]:
    """Write ``report.png`` and ``report.html`` for the run or sweep at ``path`` into ``out_dir`` (default
    ``path``) and return their paths. ``metric`` picks the best run: ``eval/accuracy``, ``min:eval/loss``, ..."""
    path = Path(path)
    parse_metric(metric)  # a typo fails before anything is written
    run_dirs = find_runs(path)
    if not run_dirs:
        raise DdpJobError(f"no run directories in '{path}' (no {CONFIG_FILE} in it or below it)", "pass a run or sweep")
    base = path if run_dirs != [path] else path.parent  # names relative to the sweep: nested trial ids stay unique
    runs = [_Run(d.relative_to(base).as_posix(), _curves(RunDir(d).metrics()), _read_config(d)) for d in run_dirs]
    keys = _chart_keys(runs)
    out = Path(out_dir) if out_dir is not None else path
    out.mkdir(parents=True, exist_ok=True)
    png, page = out / "report.png", out / "report.html"
    title = f"ddpjob report: {path.resolve().name}"
    _write_png(runs, keys, title, png)
    text = _html(runs, keys, title, metric)
    from jobs import search  # an adaptive sweep adds Optuna's history and importances (search.png, a section)

    if search.is_search(path):
        text = text.replace("</body>", search.report_section(path, out) + "\n</body>", 1)
    page.write_text(text, encoding="utf-8")
    return png, page


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jobs.report", description=__doc__.splitlines()[0])
    parser.add_argument("path", type=Path, help="a run directory or a sweep folder of run directories")
    parser.add_argument("--out", type=Path, default=None, help="output folder (default: PATH)")
    parser.add_argument("--metric", default="eval/accuracy", help="picks the best run; prefix min: to minimise")
    args = parser.parse_args(argv)
    try:
        for written in write_report(args.path, args.out, args.metric):
            print(written)
    except DdpJobError as err:
        print(f"report: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
