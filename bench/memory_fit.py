"""What ``data.batch_size=auto`` costs (issue 58): the probe at start-up, against the launch-to-first-step time of
the same run at a fixed micro-batch, and one survived out-of-memory (the step done again), against the same step at
the halved micro-batch in a run that never ran out. All in this invocation, 2 ranks under torchrun on this machine's
CPUs, the memory a real ``ulimit -v`` (tests/cluster/test_memory_fit.py's task and limit: ``WideDigitsTask``, a
fixed micro-batch of 4's peak address space plus 128 MiB).

    .venv/bin/python bench/memory_fit.py [--steps 12] [--heavy-step 6]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
GLOBAL = 32
SPACE = re.compile(r"address space (\d+) MiB")


def train(run: Path, overrides: list[str], limit_kib: int = 0) -> str:
    """One 2-rank run (torchrun, outside Slurm), under ``ulimit -v limit_kib`` when given; returns its log."""

    def limited() -> None:
        if limit_kib:
            resource.setrlimit(resource.RLIMIT_AS, (limit_kib * 1024, limit_kib * 1024))

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "ddp_core",
           str(ROOT / "configs" / "digits.yaml"), "--run-dir", str(run), *overrides]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env |= {"OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, preexec_fn=limited, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stderr


def first(run: Path, event: str) -> dict[str, Any]:
    return next(e for e in map(json.loads, (run / "attempts.jsonl").read_text().splitlines()) if e["event"] == event)


def step_seconds(run: Path) -> dict[int, float]:
    """Each step's wall time in seconds, from the per-step progress records (train.log_every=1: ``step_ms``)."""
    rows = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r.get("split") == "train"]
    return {r["step"]: r["step_ms"] / 1000 for r in rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--heavy-step", type=int, default=6)
    args = parser.parse_args()
    share = list(range(args.heavy_step * GLOBAL + 1, (args.heavy_step + 1) * GLOBAL, 2))  # rank 1's samples
    # Where in rank 1's share the longer samples are: all of it (it runs out in its first micro-batch of 4), or its
    # last micro-batch only (after 3 of 4 micro-batches: the most a step can lose).
    cases = {"first": share, "last": share[-4:]}
    common = [
        "task.target=tests.support.memory_tasks:WideDigitsTask", "task.data.width=400000",
        f"data.global_batch_size={GLOBAL}", "data.shuffle=false", "optim.schedule=constant", "optim.warmup_steps=0",
        "train.eval_every=0", f"train.max_steps={args.steps}", "train.log_every=1", "wandb.mode=disabled",
        "slurm.tasks_per_node=2", "checkpoint.every_steps=0",
    ]  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        log = train(Path(tmp) / "fixed4", [*common, "data.batch_size=4"])
        limit = (max(int(n) for n in SPACE.findall(log)) + 128) * 1024
        train(Path(tmp) / "auto", [*common, "data.batch_size=auto"], limit)
        fixed, auto = first(Path(tmp) / "fixed4", "start"), first(Path(tmp) / "auto", "start")
        normal = sorted(steps := step_seconds(Path(tmp) / "fixed4").values())[len(steps) // 2]
        survived = {}
        for case, heavy in cases.items():
            oom, plain = Path(tmp) / f"oom-{case}", Path(tmp) / f"fixed2-{case}"
            train(oom, [*common, "data.batch_size=auto", f"task.data.heavy={heavy}"], limit)
            train(plain, [*common, "data.batch_size=2", f"task.data.heavy={heavy}"])
            at = args.heavy_step + 1  # the record after the step
            survived[case] = (first(oom, "micro_batch_shrunk"), step_seconds(oom)[at], step_seconds(plain)[at])
    startup = {name: e["t"] - e["launched"] for name, e in (("fixed", fixed), ("auto", auto))}
    print(f"limit: ulimit -v {limit // 1024} MiB; probe tried {auto['probed']}, chose {auto['micro_batch']}")
    print(f"launch to first step: fixed micro-batch {startup['fixed']:.2f} s, auto {startup['auto']:.2f} s "
          f"(probe {auto['probe_s']:.2f} s, {100 * auto['probe_s'] / startup['auto']:.0f}% of it)")  # fmt: skip
    for case, (shrunk, redone, plain) in survived.items():
        print(f"out of memory in rank 1's {case} micro-batch of step {shrunk['step']} ({shrunk['was']} -> "
              f"{shrunk['micro_batch']}, ranks {shrunk['ranks']}): that step {redone:.2f} s, the same step at "
              f"{shrunk['micro_batch']} in a run that never ran out {plain:.2f} s: {redone - plain:+.2f} s "
              f"({redone / plain:.2f}x; a normal step at 4: {normal:.2f} s)")  # fmt: skip


if __name__ == "__main__":
    main()
