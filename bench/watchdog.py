"""Hang watchdog overhead: per-step time of the trainer with the watchdog off (the baseline, same invocation), at
its default (stall 300 s: a poll every 5 s) and at a short stall (10 s: a poll every second), plus the cost of
one ``beat()`` call. Runs are interleaved, so drift on a shared machine hits every setting alike.

    .venv/bin/python bench/watchdog.py [--steps 600] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SETTINGS = {
    "off": "watchdog.stall_s=0",
    "default (300 s)": "watchdog.stall_s=300",
    "short (10 s)": "watchdog.stall_s=10",
}


def step_ms(run_dir: Path) -> float:
    """Median of the logged step times, the first interval (start-up, first-step allowance) left out."""
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    times = [m["step_ms"] for m in lines if m.get("split") == "train"][1:]
    return statistics.median(times)


def run(steps: int, setting: str, tmp: Path) -> float:
    run_dir = Path(tempfile.mkdtemp(dir=tmp))
    cmd = [sys.executable, "-m", "ddp_core", str(ROOT / "configs" / "digits.yaml"), "--run-dir", str(run_dir),
           f"train.max_steps={steps}", "train.log_every=50", "train.eval_every=0", "checkpoint.every_steps=0",
           "wandb.mode=disabled", setting]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SUBMITIT_"))} | {"OMP_NUM_THREADS": "1"}
    subprocess.run(cmd, check=True, capture_output=True, env=env, cwd=ROOT)
    return step_ms(run_dir)


def beat_ns(calls: int = 1_000_000) -> float:
    sys.path.insert(0, str(ROOT))
    from ddp_core.config import WatchdogConfig
    from ddp_core.trainer.watchdog import Watchdog

    dog = Watchdog(WatchdogConfig(stall_s=300), Path(tempfile.gettempdir()), 0, 1, lambda *a: 0)
    dog.beat(0)  # past the first-step switch, as in training
    started = time.perf_counter()
    for step in range(calls):
        dog.beat(step)
    return (time.perf_counter() - started) / calls * 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    results: dict[str, list[float]] = {name: [] for name in SETTINGS}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.repeats):
            for name, setting in SETTINGS.items():
                results[name].append(run(args.steps, setting, Path(tmp)))
    base = statistics.median(results["off"])
    print(f"digits, 1 process, {args.steps} steps, median step time of {args.repeats} interleaved runs each")
    for name, values in results.items():
        ms = statistics.median(values)
        print(f"  watchdog {name:16s} {ms:7.3f} ms/step   x{ms / base:.3f} vs off")
    print(f"  beat(): {beat_ns():.0f} ns per call (once per step)")


if __name__ == "__main__":
    main()
