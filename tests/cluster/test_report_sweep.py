"""A real sweep on the local cluster, end to end: one job array for its trials, each trial's config, status, a rerun
that submits nothing, and the report opened in headless Chromium (no JavaScript error, every chart drawn, the PNG's
panels each holding a drawing; the screenshot is kept beside the report, report-shot.png)."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest

from ddp_core.run.rundir import RunDir
from tests.support import browser
from tests.support.cli_runner import field, run_cli
from tests.support.helpers import ROOT, events, wait_for, wait_out_of_queue
from tests.support.report_pages import figures, png_panels

# 1-CPU trials, two at a time (slurm.array_parallelism): at most 2 CPUs per node, see tests/support/cluster_guard.py.
pytestmark = [pytest.mark.cluster_shared("b")]
DIGITS = str(ROOT / "configs" / "digits.yaml")
SWEEP = ["optim.lr=1e-3,3e-3,1e-2,3e-2", "task.model.hidden=32,64", "train.max_steps=30", "train.eval_every=10",
         "train.log_every=5", "checkpoint.every_steps=0", "wandb.mode=disabled", "slurm.tasks_per_node=1",
         "slurm.array_parallelism=2"]  # fmt: skip


def test_report_of_a_real_sweep_in_headless_chromium(slurm_cluster, tmp_path):
    started = time.monotonic()
    proc = run_cli("sweep", DIGITS, *SWEEP, "--name", "report-check", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert time.monotonic() - started < 30  # returns once queued, without waiting for the trials
    (array,) = field(proc.stdout, "arrays").split()  # eight trials, one sbatch
    sweep_dir = Path(field(proc.stdout, "dir"))
    trials = sorted(p.parent for p in sweep_dir.glob("*/config.yaml"))
    assert len(trials) == 8
    done = lambda: all((e := events(t)) and e[-1]["event"] == "completed" for t in trials)  # noqa: E731
    wait_for(done, 400, "all eight trials to complete", poll=2)
    seen = set()
    for trial in trials:
        cfg = RunDir(trial).load_config()
        assert json.loads((trial / "run.json").read_text())["jobs"][0]["job_id"].startswith(f"{array}_")
        seen.add((cfg.optim.lr, cfg.task.model["hidden"]))
        assert cfg.train.max_steps == 30
    assert seen == {(lr, h) for lr in (1e-3, 3e-3, 1e-2, 3e-2) for h in (32, 64)}
    wait_out_of_queue(array, 60)
    status = run_cli("status", str(sweep_dir), cwd=tmp_path)
    rows = [line for line in status.stdout.splitlines() if f"{array}_" in line]
    assert status.returncode == 0 and len(rows) == 8 and all("COMPLETED" in r for r in rows), status.stdout
    again = run_cli("sweep", DIGITS, *SWEEP, "--name", "report-check", cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert "0 new, 0 resumed, 8 completed" in again.stdout and "arrays:" not in again.stdout

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
