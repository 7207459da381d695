"""What an out-of-memory costs where the strategy's steps communicate (issue 58, fsdp under ``data.batch_size=auto``):
no rank can stop in the step, so the attempt ends and the allocation runs it again at half the micro-batch
(``trainer.redo``, ``cluster.policy.run_smaller``). On the local cluster, alone, in this invocation, 2 fsdp ranks of
one CPU on one node, the memory a real ``ulimit -v`` (tests/cluster/test_memory_fit.py's task and limit: a fixed
micro-batch of 4's peak address space plus 128 MiB, so 16 and 8 run out in the probe, 4 fits, and rank 1's longer
samples of the heavy step run out at 4):

- the start: from the job's first attempt to its first step, the probe's two restarts included, against the same job
  at a fixed micro-batch of 4 (the baseline);
- each restart: from the watcher's ``failure`` event to the next attempt's probe (its ``micro_batch_shrunk``);
- the out-of-memory at the heavy step: from it to the run's first step after it, and the steps done again (from the
  newest checkpoint), against the run's normal steps.

    eval "$(scripts/slurm-local env)" && PYTHONPATH=. .venv/bin/python bench/memory_restart.py [--steps 12]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.memory_fit import SPACE, train

ROOT = Path(__file__).resolve().parent.parent
GLOBAL, HEAVY_STEP, EVERY = 32, 6, 4
HEAVY = list(range(HEAVY_STEP * GLOBAL + 1, (HEAVY_STEP + 1) * GLOBAL, 2))  # rank 1's samples of the heavy step
FSDP = [
    "task.target=tests.support.memory_tasks:WideDigitsTask", "task.data.width=400000", f"task.data.heavy={HEAVY}",
    f"data.global_batch_size={GLOBAL}", "data.shuffle=false", "optim.schedule=constant", "optim.warmup_steps=0",
    "train.eval_every=0", "train.log_every=1", "wandb.mode=disabled", "slurm.nodes=1", "slurm.tasks_per_node=2",
    "strategy.name=fsdp", f"checkpoint.every_steps={EVERY}",
]  # fmt: skip
MALLOC = "'export MALLOC_MMAP_THRESHOLD_=65536', 'export MALLOC_ARENA_MAX=1'"


def records(run: Path, name: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run / name).read_text().splitlines()]


def job(folder: Path, limit_kib: int, steps: int, *args: str) -> tuple[list[dict[str, Any]], dict[int, float]]:
    """``ddpjob submit --wait`` of the bench's run under the limit (it must complete): its events, and when each step
    ended (its newest record: a step done again counts once it is done again)."""
    folder.mkdir(parents=True)
    setup = f"slurm.setup=['ulimit -v {limit_kib}', {MALLOC}]"
    cmd = [sys.executable, "-m", "jobs", "submit", str(ROOT / "configs" / "digits.yaml"), *FSDP, *args, setup,
           f"train.max_steps={steps}", "--no-snapshot", "--wait"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # the task's module (tests.support), here and on the nodes
    proc = subprocess.run(cmd, cwd=folder, capture_output=True, text=True, env=env)
    run = re.search(r"^run dir:\s+(\S+)$", proc.stdout, re.M)
    assert proc.returncode == 0 and run, proc.stdout + proc.stderr
    rows = [r for r in records(Path(run[1]), "metrics.jsonl") if r.get("split") == "train"]
    return records(Path(run[1]), "attempts.jsonl"), {r["step"]: r["time"] for r in rows}


def first_step_s(found: list[dict[str, Any]], steps: dict[int, float]) -> float:
    """From the job's first attempt (its first rank's process) to its first step's end."""
    began = min(
        e["launched"] if e["event"] == "start" else e["t"] for e in found if e["event"] in ("start", "rank_failed")
    )
    return steps[1] - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-memory-restart-") as tmp:
        log = train(Path(tmp) / "reference", [*FSDP, "data.batch_size=4", f"train.max_steps={EVERY}"])
        limit_kib = (max(int(n) for n in SPACE.findall(log)) + 128) * 1024
        fixed = job(Path(tmp) / "fixed", limit_kib, HEAVY_STEP, "data.batch_size=4")  # stops before the heavy step
        auto = job(Path(tmp) / "auto", limit_kib, args.steps, "data.batch_size=auto")
    (found, steps), (fixed_found, fixed_steps) = auto, fixed
    failures = [e for e in found if e["event"] == "failure"]
    shrunk = [e for e in found if e["event"] == "micro_batch_shrunk"]
    restarts = [s["t"] - f["t"] for f, s in zip(failures, shrunk, strict=True)]
    last = [e for e in found if e["event"] == "start"][-1]
    oom = failures[-1]
    normal = sorted(steps[i] - steps[i - 1] for i in range(2, last["step"] + 1))  # the first attempt's
    again = steps[oom["step"] + 1] - oom["t"]  # from the out-of-memory to the heavy step done
    print(f"fsdp, 2 ranks, ulimit -v {limit_kib // 1024} MiB; micro-batches: "
          f"{' -> '.join(str(e['micro_batch']) for e in failures)} -> {last['micro_batch']}")  # fmt: skip
    print(f"  first attempt to first step: fixed 4 {first_step_s(fixed_found, fixed_steps):.2f} s, auto "
          f"{first_step_s(found, steps):.2f} s (its two restarts in the probe)")  # fmt: skip
    print(f"  each restart, failure to the next probe: {', '.join(f'{s:.2f}' for s in restarts)} s")
    median = normal[len(normal) // 2]
    print(f"  out of memory at step {oom['step']}: the next attempt from step {last['step']}; from the failure to "
          f"step {oom['step']} done {again:.2f} s, against a normal step of {median:.2f} s")  # fmt: skip
    print(json.dumps({"limit_mib": limit_kib // 1024, "restarts_s": restarts, "again_s": again, "normal_s": normal}))


if __name__ == "__main__":
    main()
