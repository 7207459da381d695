"""The throughput line of ``ddpjob status`` and the report (jobs/runs/throughput.py), from fabricated records;
a real job's: tests/cluster/test_status_real_jobs.py."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from jobs.report import write_report
from jobs.runs import status, throughput
from tests.support.report_pages import png_panels


def line(step: int, **extra: float) -> dict:
    return {"step": step, "time": 1.7e9 + step, "split": "train", "loss": 1.0, "step_ms": 50.0, **extra}


GPU_LINE = {"samples_per_s": 1280.0, "tokens_per_s": 655360.0, "mfu": 0.4123, "data_wait": 0.031,
            "step_ms_p50": 49.5, "step_ms_p95": 61.0, "peak_mem_gb": 8.42, "peak_rss_gb": 3.1, "gpu_util": 97.0,
            "power_w": 2800.0, "energy_j": 1.4e6}  # fmt: skip


def test_the_last_line_the_eta_and_the_energy():
    metrics = [line(100, **GPU_LINE), {"step": 100, "split": "eval", "accuracy": 0.5}, line(200, **GPU_LINE)]
    text = throughput.describe(metrics, 1000)
    assert text == (
        "throughput at step 200: 1,280 samples/s, 655,360 tokens/s, MFU 41.2%, data wait 3%, step p50 49.5 ms p95 "
        "61 ms, peak 8.42 GB GPU, 3.10 GB host, GPU util 97%, 2,800 W; ETA 0:00:40 to step 1000 (train.max_steps); "
        "GPU energy 2.8 MJ (0.778 kWh)"
    )  # ETA: 800 steps of the last line's 50 ms; energy: both windows'
    assert throughput.describe(metrics, 200).endswith("2,800 W; GPU energy 2.8 MJ (0.778 kWh)")  # done: no ETA
    assert throughput.describe([line(10)], 100) is None  # a line without throughput (train.telemetry=false)
    cpu = throughput.describe([line(10, samples_per_s=900.5)], None)
    assert cpu == "throughput at step 10: 900 samples/s"  # no MFU, no tokens, no GPU: nothing made up


def test_status_and_report_of_a_run_show_it(tmp_path: Path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump({"run": {"name": "run"}, "train": {"max_steps": 400}}))
    rows = [line(s, **GPU_LINE) for s in (100, 200)] + [{"step": 200, "time": 1.7e9, "split": "eval", "loss": 0.5}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    text, _ = status.status_text(str(run), None)
    assert "throughput at step 200: 1,280 samples/s" in text and "ETA 0:00:10 to step 400 (train.max_steps)" in text
    png, page = write_report(run)
    titles = [p["title"] for p in png_panels(png)]
    assert titles == ["train/loss", "train/samples_per_s", "train/tokens_per_s", "train/mfu", "train/peak_mem_gb",
                      "train/peak_rss_gb", "eval/loss"]  # fmt: skip
    assert '<p class="throughput">throughput at step 200: 1,280 samples/s' in page.read_text()
