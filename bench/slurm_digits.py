"""The digits job on the local Slurm cluster: submit → first training step, steps/s with 1 and 2 ranks
(ratio against 1 rank in the same script), and signal → first step of the requeued attempt.

    scripts/slurm-local up && .venv/bin/python bench/slurm_digits.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DIGITS = str(ROOT / "configs" / "digits.yaml")
COMMON = ["train.eval_every=0", "train.log_every=50", "checkpoint.every_steps=0", "wandb.mode=disabled"]


def ddpjob(*args: str, cwd: Path) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")  # jobs import tests.support.tasks from the repo
    out = subprocess.run(
        [sys.executable, "-m", "jobs", *args], cwd=cwd, env=env, capture_output=True, text=True, check=True
    )
    return {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in out.stdout.splitlines())}


def records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def events(run_dir: Path) -> list[dict]:
    path = run_dir / "attempts.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def throughput(ranks: int, tmp: Path) -> tuple[float, float]:
    """(seconds from submit to the first logged step, steady steps/s) for ``ranks`` ranks on one node."""
    submitted = time.time()
    out = ddpjob("submit", DIGITS, "--wait", *COMMON, "train.max_steps=3000", f"slurm.tasks_per_node={ranks}", cwd=tmp)
    rows = [r for r in records(Path(out["run dir"])) if r["split"] == "train"]
    first = rows[0]["time"] - submitted - rows[0]["step"] / rows[0]["samples_per_s"] * 32 * ranks
    steady = (rows[-1]["step"] - rows[0]["step"]) / (rows[-1]["time"] - rows[0]["time"])
    return first, steady


def requeue_latency(tmp: Path) -> tuple[float, int]:
    """(seconds from scancel --signal to the requeued attempt's first logged step, steps lost)."""
    slow = ["task.target=tests.support.tasks:SlowDigitsTask", "task.data.pause_s=0.02", "train.max_steps=400",
            "train.log_every=1", "train.eval_every=0", "checkpoint.every_steps=100", "wandb.mode=disabled"]  # fmt: skip
    out = ddpjob("submit", DIGITS, *slow, cwd=tmp)
    run_dir, job = Path(out["run dir"]), out["job"]
    while not any(r["step"] > 50 for r in records(run_dir)):
        time.sleep(0.1)
    signalled = time.time()
    subprocess.run(["scancel", "--signal=USR2", job], check=True)
    while sum(e["event"] == "start" for e in events(run_dir)) < 2:
        time.sleep(0.1)
    stopped = next(e["step"] for e in events(run_dir) if e["event"] == "interrupted")
    while not any(r["step"] > stopped and r["time"] > signalled for r in records(run_dir)):
        time.sleep(0.05)
    first = next(r for r in records(run_dir) if r["step"] > stopped and r["time"] > signalled)
    lost = stopped - max(e["step"] for e in events(run_dir) if e["event"] == "start")
    subprocess.run(["scancel", job], check=False)
    return first["time"] - signalled, abs(lost)


def main() -> None:
    with tempfile.TemporaryDirectory(dir="/var/tmp") as tmp:
        one_first, one = throughput(1, Path(tmp))
        two_first, two = throughput(2, Path(tmp))
        print(f"submit -> first step: {one_first:.1f} s (1 rank), {two_first:.1f} s (2 ranks)")
        print(f"steps/s: 1 rank {one:.0f}, 2 ranks {two:.0f} (ratio {two / one:.2f})")
        print(f"samples/s ratio 2 ranks / 1 rank: {2 * two / one:.2f} (each rank takes data.batch_size per step)")
        latency, lost = requeue_latency(Path(tmp))
        print(f"signal -> first step of the requeued attempt: {latency:.1f} s, steps lost {lost}")


if __name__ == "__main__":
    main()
