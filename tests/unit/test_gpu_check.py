"""scripts/gpu-check: on a machine without CUDA it says so and runs nothing; its CPU rehearsal
(DDPJOB_GPU_CHECK_CPU=1) runs the whole flow (every strategy, the hand-written DDP loop, the exact-resume check) on
gloo with a tiny model. No Slurm: the check starts its ranks itself."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.gpu_check import STRATEGIES, steady_window
from tests.support.helpers import ROOT

SCRIPT = ROOT / "scripts" / "gpu-check"
NUMBER = re.compile(r"^[\d,]+(\.\d+)?$")


def gpu_check(*args: str, cwd: Path, timeout: float, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if k != "DDPJOB_GPU_CHECK_CPU" and not k.startswith("SLURM_")}
    return subprocess.run(
        [str(SCRIPT), *args], cwd=cwd, env=clean | {"PYTHON": sys.executable} | env,
        capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def table_rows(output: str) -> dict[str, list[str]]:
    """The printed table's body: strategy -> its other cells."""
    rows = {}
    for line in output.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and cells[0] not in ("strategy",) and not set(line) <= {"|", "-", ":"}:
            rows[cells[0]] = cells[1:]
    return rows


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU: gpu-check would run")
def test_without_cuda_it_says_so_and_runs_nothing(tmp_path):
    before = sorted((ROOT / "runs").glob("gpu-check-*"))
    proc = gpu_check("--out", str(tmp_path / "out"), "--work-dir", str(tmp_path / "work"), cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, proc.stdout
    assert "no CUDA GPU" in lines[0] and "nothing was run" in lines[0]
    assert f"torch {torch.__version__}" in lines[0] and "torch.cuda.is_available() = False" in lines[0]
    assert list(tmp_path.iterdir()) == []  # neither --out nor --work-dir, nor anything else, was created
    assert sorted((ROOT / "runs").glob("gpu-check-*")) == before


def test_steady_window_skips_warmup_and_the_checkpoint_interval():
    # Logged every 5 steps; a checkpoint after step 20 makes (20, 25] slow; warm-up before step 10.
    points = [(5, 10.0), (10, 10.5), (15, 10.6), (20, 10.7), (25, 13.7), (30, 13.8)]
    steps, seconds = steady_window(points, start=10, busy={20})
    assert steps == 15
    assert seconds == pytest.approx(0.3)


def test_cpu_rehearsal_runs_the_whole_flow_and_resumes_exactly(tmp_path):
    # Two strategies (each strategy's training is tested elsewhere): what only this proves is the check's own
    # flow: launching ranks, the baseline loop, the table, the JSON, and the signal-and-resume digest check.
    assert {"ddp", "pipeline"} < set(STRATEGIES)
    out = tmp_path / "out"
    proc = gpu_check("--out", str(out), "--work-dir", str(tmp_path / "work"), "--strategies", "ddp,pipeline",
                     cwd=tmp_path, timeout=600, DDPJOB_GPU_CHECK_CPU="1", OMP_NUM_THREADS="1")  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "CPU rehearsal, not a GPU check" in proc.stdout
    rows = table_rows(proc.stdout)
    assert set(rows) == {"hand-written DDP", "ddp", "pipeline"}, proc.stdout
    for name, (_where, samples, ms, ratio, _mem, save) in rows.items():
        for value in (samples, ms, ratio):
            assert NUMBER.match(value) and float(value.replace(",", "")) > 0, f"{name}: {rows[name]}"
        if name != "hand-written DDP":  # every trainer run saves one checkpoint inside it
            assert NUMBER.match(save), f"{name}: {rows[name]}"
    assert re.search(r"exact resume: OK \(digest [0-9a-f]{64}", proc.stdout), proc.stdout
    raw = json.loads((out / "results.json").read_text())
    assert raw["failures"] == [] and raw["resume"]["ok"]
    assert all(r["status"] == "ok" and r["ms_per_step"] > 0 for r in raw["rows"])
    assert "| ddp " in (out / "results.md").read_text()
