"""The report of a real sweep on the local cluster, opened in headless Chromium: no JavaScript error, every chart
drawn, and the PNG's panels each holding a drawing. The screenshot is kept beside the report (report-shot.png)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests import browser
from tests.conftest import ROOT, field, run_cli
from tests.helpers import events, wait_for
from tests.test_report import figures, png_panels

# 1-CPU trials, two at a time (slurm.array_parallelism): at most 2 CPUs per node, see tests/cluster_guard.py.
pytestmark = [pytest.mark.slurm, pytest.mark.cluster_shared("b")]
DIGITS = str(ROOT / "configs" / "digits.yaml")
SWEEP = ["optim.lr=1e-3,3e-3,1e-2,3e-2", "task.model.hidden=32,64", "train.max_steps=30", "train.eval_every=10",
         "train.log_every=5", "checkpoint.every_steps=0", "wandb.mode=disabled", "slurm.tasks_per_node=1",
         "slurm.array_parallelism=2"]  # fmt: skip


def test_report_of_a_real_sweep_in_headless_chromium(slurm_cluster, tmp_path):
    proc = run_cli("sweep", DIGITS, *SWEEP, "--name", "report-check", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    sweep_dir = Path(field(proc.stdout, "dir"))
    trials = sorted(p.parent for p in sweep_dir.glob("*/config.yaml"))
    assert len(trials) == 8
    done = lambda: all((e := events(t)) and e[-1]["event"] == "completed" for t in trials)  # noqa: E731
    wait_for(done, 400, "all eight trials to complete", poll=2)

    report = run_cli("report", str(sweep_dir), cwd=tmp_path)
    assert report.returncode == 0, report.stderr
    page, png = Path(field(report.stdout, "html")), Path(field(report.stdout, "png"))
    charts = figures(page.read_text())
    curves = ["curve-eval/accuracy", "curve-eval/loss", "curve-train/loss"]  # eval every 10 steps: 3 points each
    assert sorted(charts) == [*curves, "importance", "parallel", "slice"]
    assert charts["slice"]["layout"]["xaxis"]["type"] == "log"  # optim.lr swept over decades
    assert [p["title"] for p in png_panels(png)] == [
        "eval/accuracy vs optim.lr", "eval/accuracy vs task.model.hidden", "train/loss", "eval/accuracy",
        "eval/loss"]  # fmt: skip

    rendered = browser.render(page, tmp_path / "browser")
    shutil.copy(rendered.screenshot, sweep_dir / "report-shot.png")
    assert rendered.errors == []
    sections = browser.chart_sections(rendered.dom)
    assert sorted(sections) == sorted(charts)
    blank = [name for name, body in sections.items() if browser.drawn_marks(body) == 0]
    assert blank == [], f"charts Chromium left blank: {blank}"
    assert browser.drawn_marks(sections["slice"]) >= 8 * 2  # a marker per trial in each key's panel
