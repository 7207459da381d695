"""``ddpjob report``: offline ``report.png`` and a self-contained ``report.html`` of one run or a whole sweep, or the
sweep's trial table as CSV or JSON (``--table``).

Reads only what the runs and the sweep leave on disk (``jobs.report.trials``), so it works on a login node or a
laptop with no W&B, no network and no torch. A sweep's page answers what it was for (``jobs.report.page``): the
metric against each swept key, parallel coordinates and importances (Optuna's, ``jobs.report.study``), the best
trial with the commands that rerun or resume it, curves over steps, and every trial with its state. The plotting
libraries (Plotly, Optuna, matplotlib) are imported only when a report is drawn: ``import jobs.report`` stays cheap.

    python -m jobs.report runs/my-sweep [--metric min:eval/loss] [--out DIR] [--table csv|json]
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from ddp_core.errors import DdpJobError
from jobs.report.png import PNG_SIZE
from jobs.report.sources import load
from jobs.report.table import TABLE_FORMATS

__all__ = ["FILES", "PNG_SIZE", "write_report", "write_table"]

REPORT, PAGE = "report.png", "report.html"
FILES = (REPORT, PAGE, *(f"trials.{fmt}" for fmt in TABLE_FORMATS))  # all a report writes: ddpjob --host brings these


def write_report(path: Path, out_dir: Optional[Path] = None, metric: Optional[str] = None) -> tuple[Path, Path]:
    """Write ``report.png`` and ``report.html`` for the run or sweep at ``path`` into ``out_dir`` (default
    ``path``) and return their paths. ``metric`` ranks the trials (``eval/accuracy``, ``min:eval/loss``, ...); None:
    an adaptive sweep's own metric, else the trials' checkpoint.monitor, else eval/accuracy."""
    from jobs.report import page, png

    path = Path(path)
    sweep = load(path, metric)
    out = Path(out_dir) if out_dir is not None else path
    out.mkdir(parents=True, exist_ok=True)
    title = f"ddpjob report: {path.resolve().name}"
    png_path, html_path = out / REPORT, out / PAGE
    png.write_png(sweep, title, png_path)
    search_lines: list[str] = []
    if sweep.study is not None:
        from jobs.sweeps import search

        search_lines = search.status_lines(sweep.study)
    html_path.write_text(page.render(sweep, title, search_lines), encoding="utf-8")
    return png_path, html_path


def write_table(path: Path, fmt: str, out_dir: Optional[Path] = None, metric: Optional[str] = None) -> Path:
    """``trials.csv`` or ``trials.json`` of the sweep at ``path`` (one row per trial, best first), for pandas."""
    from jobs.report import table

    if fmt not in TABLE_FORMATS:  # before reading a thousand run directories
        raise DdpJobError(f"--table {fmt} is not a table format", f"use one of {', '.join(TABLE_FORMATS)}")
    path = Path(path)
    return table.write_table(load(path, metric), fmt, Path(out_dir) if out_dir is not None else path)
