"""Per-step time of each strategy relative to single-process training of the same model and global batch
(the char LM, configs/charlm.yaml), measured in this script: single process, then dp and model_parallel
(one process), then ddp, fsdp and pipeline (2 ranks under torchrun, gloo, CPU).

    .venv/bin/python bench/strategies.py [--steps 60]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CHARLM = str(ROOT / "configs" / "charlm.yaml")
RUNS = {
    "single process": (1, []),
    "dp (1 process)": (1, ["strategy.name=dp"]),
    "model_parallel (1 process)": (1, ["strategy.name=model_parallel"]),
    "ddp (2 ranks)": (2, ["strategy.name=ddp"]),
    "fsdp (2 ranks)": (2, ["strategy.name=fsdp"]),
    "pipeline 2 stages, 1f1b (2 ranks)": (2, ["strategy.name=pipeline", "strategy.stages=2"]),
}


def train(nproc: int, config: str, overrides: list[str], run_dir: Path, env: dict[str, str]) -> tuple[float, str]:
    """The trainer on ``config`` (one process, or ``nproc`` ranks under torchrun) to its end: seconds per step
    between its first and last train record (the first step's warm-up left out), and its stderr."""
    launcher = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                     f"--nproc-per-node={nproc}"]  # fmt: skip
    cmd = [*launcher, "-m", "ddp_core", config, "--run-dir", str(run_dir), *overrides]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    records = [r for r in rows if r["split"] == "train"]
    return (records[-1]["time"] - records[0]["time"]) / (records[-1]["step"] - records[0]["step"]), proc.stderr


def step_time(nproc: int, overrides: list[str], steps: int, tmp: Path, global_batch: int) -> float:
    run_dir = tmp / f"run{len(list(tmp.iterdir()))}"
    # The same global batch everywhere: 2 data-parallel ranks take half each; pipeline stages share theirs.
    data_parallel = nproc if any(o in overrides for o in ("strategy.name=ddp", "strategy.name=fsdp")) else 1
    common = [f"train.max_steps={steps}", "train.log_every=10", "train.eval_every=0", "checkpoint.every_steps=0",
              "wandb.mode=disabled", f"data.batch_size={global_batch // data_parallel}",
              "optim.warmup_steps=0"]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS=str(max(1, 2 // nproc)))
    return train(nproc, CHARLM, [*common, *overrides], run_dir, env)[0]


def rows(steps: int = 60, global_batch: int = 32) -> list[dict[str, Any]]:
    """Each strategy's seconds per step and its ratio to single-process training, as dicts."""
    with tempfile.TemporaryDirectory() as tmp:
        times = {name: step_time(n, o, steps, Path(tmp), global_batch) for name, (n, o) in RUNS.items()}
    base = times["single process"]
    return [{"bench": "strategies", "strategy": name, "steps": steps, "global_batch": global_batch,
             "ms_per_step": 1000 * seconds, "ratio": seconds / base} for name, seconds in times.items()]  # fmt: skip


def summary(quick: bool = False) -> list[dict[str, Any]]:
    """The ratio lines of ``bench/run``: every strategy against one process on the same model and global batch."""
    results = rows(steps=40 if quick else 60)
    base = results[0]
    return [{
        "case": f"char LM step, {r['strategy']} vs single process", "baseline": f"{base['ms_per_step']:.1f} ms",
        "ddpjob": f"{r['ms_per_step']:.1f} ms", "ratio": r["ratio"], "target": "", "met": None,
    } for r in results[1:]]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--global-batch", type=int, default=32)
    args = parser.parse_args()
    for r in rows(args.steps, args.global_batch):
        print(f"{r['strategy']:>36}: {r['ms_per_step']:7.1f} ms/step  ({r['ratio']:4.2f}x single process)")


if __name__ == "__main__":
    main()
