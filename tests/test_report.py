"""jobs/report.py: offline curves for runs and sweeps, from fake run directories (no Slurm, no torch)."""

from __future__ import annotations

import json
import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ddp_core.errors import DdpJobError
from ddp_core.run.rundir import RunDir
from jobs.report import PNG_SIZE, find_runs, write_report

ROOT = Path(__file__).resolve().parent.parent


def make_run(path: Path, lr: float, accuracy: list[float] | None, eval_loss: float = 0.5, torn: bool = False) -> Path:
    """A run directory as the trainer leaves it: config.yaml, and metrics.jsonl unless ``accuracy`` is None."""
    path.mkdir(parents=True)
    (path / "config.yaml").write_text(yaml.safe_dump({"run": {"name": path.name}, "optim": {"lr": lr}}))
    if accuracy is None:
        return path  # submitted, not started: no metrics yet
    lines = []
    for step in range(25, 325, 25):
        lines.append({"step": step, "time": 1.7e9 + step, "split": "train", "loss": 2.0 * lr * 1000 / step, "lr": lr})
    for i, acc in enumerate(accuracy):
        lines.append({"step": 100 * (i + 1), "time": 1.7e9, "split": "eval", "accuracy": acc, "loss": eval_loss})
    text = "".join(json.dumps(line) + "\n" for line in lines)
    if torn:
        text += '{"step": 325, "time": 1.7e9, "split": "tr'  # the writer was killed mid-line
    (path / "metrics.jsonl").write_text(text)
    return path


@pytest.fixture
def sweep(tmp_path: Path) -> Path:
    root = tmp_path / "sweep"
    make_run(root / "lr-1e-3", 1e-3, [0.70, 0.85, 0.90], eval_loss=0.20)
    make_run(root / "lr-3e-3", 3e-3, [0.80, 0.93, 0.95], eval_loss=0.30, torn=True)
    make_run(root / "lr-1e-2", 1e-2, [0.60, 0.75, 0.80], eval_loss=0.60)
    make_run(root / "lr-3e-2", 3e-2, None)
    return root


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def charts(page: str) -> dict[str, str]:
    """metric name -> the text of its <svg> chart."""
    return dict(re.findall(r'<svg class="chart" data-metric="([^"]+)"(.*?)</svg>', page, re.S))


def best_rows(page: str) -> list[str]:
    return re.findall(r'<tr class="best">(.*?)</tr>', page, re.S)


def test_find_runs_sweep_single_and_nested(sweep: Path, tmp_path: Path):
    names = [p.name for p in find_runs(sweep)]
    assert names == ["lr-1e-2", "lr-1e-3", "lr-3e-2", "lr-3e-3"]
    assert find_runs(sweep / "lr-1e-3") == [sweep / "lr-1e-3"]
    # <sweep>/<group>/<trial>/config.yaml; a config.yaml inside a run's own subfolders is not a run.
    nested = tmp_path / "nested"
    make_run(nested / "a" / "0", 1e-3, [0.5])
    make_run(nested / "b" / "0", 1e-3, [0.6])
    make_run(nested / "c", 1e-3, [0.7])
    (nested / "c" / "wandb").mkdir()
    (nested / "c" / "wandb" / "config.yaml").write_text("wandb_version: 1\n")
    assert [p.relative_to(nested).as_posix() for p in find_runs(nested)] == ["a/0", "b/0", "c"]
    assert find_runs(tmp_path / "missing") == []


def test_read_metrics_skips_torn_last_line(sweep: Path):
    records = RunDir(sweep / "lr-3e-3").metrics()
    assert len(records) == 12 + 3 and records[-1]["split"] == "eval"
    assert RunDir(sweep / "lr-3e-2").metrics() == []  # no metrics.jsonl yet
    garbled = sweep / "lr-1e-2" / "metrics.jsonl"
    garbled.write_text('{"step": 1, "split": "train", "loss": 1.0}\n\nnot json\n[1, 2]\n{"split": "train"}\n')
    assert RunDir(sweep / "lr-1e-2").metrics() == [{"step": 1, "split": "train", "loss": 1.0}]


def test_sweep_report(sweep: Path):
    png, page_path = write_report(sweep)
    assert (png, page_path) == (sweep / "report.png", sweep / "report.html")
    assert png_size(png) == PNG_SIZE == (1200, 800)
    page = page_path.read_text()

    # One chart per metric; one series per run that has metrics (the empty run draws none).
    by_metric = charts(page)
    assert sorted(by_metric) == ["eval/accuracy", "eval/loss", "train/loss"]
    for svg in by_metric.values():
        assert svg.count('class="series"') == 3 and svg.count("data-run=") == 3
        assert re.findall(r'data-run="([^"]+)"', svg) == ["lr-1e-2", "lr-1e-3", "lr-3e-3"]
        assert 'class="tick"' in svg
    assert page.count('class="series"') == 9

    # Self-contained: nothing fetched from the network, no external scripts or styles.
    assert "http://" not in page and "https://" not in page
    assert "<script" not in page and "<link" not in page

    # The table: every run, the empty one noted, the best (max final eval/accuracy) marked once.
    assert [r for r in ("lr-1e-2", "lr-1e-3", "lr-3e-2", "lr-3e-3") if f"<td>{r}</td>" not in page] == []
    assert "no metrics yet" in page
    [best] = best_rows(page)
    assert "<td>lr-3e-3</td>" in best and "★ best" in best and "0.95" in best
    assert page.count("★ best") == 1
    assert "<th>optim.lr</th>" in page  # the hyperparameter the sweep varied


def test_best_by_minimised_metric(sweep: Path, tmp_path: Path):
    _, page = write_report(sweep, tmp_path / "out", metric="min:eval/loss")
    [best] = best_rows(page.read_text())
    assert "<td>lr-1e-3</td>" in best
    # Loss-like names are minimised without a prefix; max: forces maximisation.
    [best] = best_rows(write_report(sweep, tmp_path / "out", metric="eval/loss")[1].read_text())
    assert "<td>lr-1e-3</td>" in best
    [best] = best_rows(write_report(sweep, tmp_path / "out", metric="max:eval/loss")[1].read_text())
    assert "<td>lr-1e-2</td>" in best


def test_single_run_report_and_out_dir(sweep: Path, tmp_path: Path):
    run = sweep / "lr-1e-3"
    png, page_path = write_report(run, out_dir=tmp_path / "reports")
    assert png.parent == page_path.parent == tmp_path / "reports"
    assert png_size(png) == PNG_SIZE
    page = page_path.read_text()
    assert all(svg.count('data-run="lr-1e-3"') == 1 for svg in charts(page).values())
    assert "<td>lr-1e-3</td>" in best_rows(page)[0]
    assert not (sweep / "report.html").exists()


def test_empty_run_still_reports(sweep: Path):
    png, page_path = write_report(sweep / "lr-3e-2")
    assert png_size(png) == PNG_SIZE
    page = page_path.read_text()
    assert "no metrics yet" in page and 'class="series"' not in page and best_rows(page) == []


def test_names_escaped_diverged_run_and_many_runs(tmp_path: Path):
    sweep = tmp_path / "big"
    make_run(sweep / "a<b>&c", 1e-3, [0.5, 0.6])
    diverged = make_run(sweep / "diverged", 1e-3, [0.4])
    with open(diverged / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 400, "time": 1.7e9, "split": "train", "loss": float("nan")}) + "\n")
    for i in range(12):  # 14 runs: past the PNG's legend limit
        make_run(sweep / f"trial-{i:02d}", 1e-3 * (i + 1), [0.1 * (i % 9)])
    png, page_path = write_report(sweep)
    assert png_size(png) == PNG_SIZE
    page = page_path.read_text()
    assert "a<b>" not in page and 'data-run="a&lt;b&gt;&amp;c"' in page
    assert charts(page)["train/loss"].count('class="series"') == 14
    assert "<td>nan</td>" in page  # the diverged run's final train loss is shown, not hidden


def test_errors_before_writing(tmp_path: Path, sweep: Path):
    with pytest.raises(DdpJobError, match="no run directories"):
        write_report(tmp_path / "nothing-here")
    with pytest.raises(DdpJobError, match="bad metric"):
        write_report(sweep, metric="median:eval/accuracy")
    assert not (sweep / "report.png").exists()


def test_import_is_light_and_cli(sweep: Path):
    code = "import sys, jobs.report; print(sorted(m for m in ('matplotlib', 'torch', 'yaml') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
    cli = [sys.executable, "-m", "jobs.report", str(sweep), "--metric", "min:eval/loss"]
    out = subprocess.run(cli, cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.split() == [str(sweep / "report.png"), str(sweep / "report.html")]
