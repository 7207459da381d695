"""A rank killed by SIGKILL -> the first step trained again, on the local Slurm cluster: today's requeue path
(``slurm.max_restarts=0``: the watcher requeues the job through the queue) against the restart inside the allocation
(``slurm.max_restarts`` > 0), with the queue idle and with a competing top-priority job pending for the same nodes, all
in one invocation. The ratio is the requeue path's recovery time over the restart's.

The digits job on two nodes of partition "wide" (n1 and n2; n3 free), one rank each, a checkpoint every 20 steps, a
step logged each step. Rank 1 kills itself at its 25th batch of the job's first step, after writing the time of the
kill (``tests.support.tasks:CrashingTask``, ``halt_file``): no polling, the kill lands at the same step every time. The
recovery time is that time to the first logged step of the next job step (``metrics.jsonl``). The competitor is
``sbatch -p wide -N 2 --exclusive --priority=TOP --wrap 'sleep 30'``, submitted once the run trains: it waits for two
whole nodes, so it gets the run's the moment they are freed.

    scripts/slurm-local up && flock /tmp/ddpjob-cluster.lock .venv/bin/python bench/restart.py [--repeats 2]
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
DIGITS = str(ROOT / "configs" / "digits.yaml")
RUN = ["train.max_steps=80", "checkpoint.every_steps=20", "train.eval_every=0", "train.log_every=1",
       "wandb.mode=disabled", "slurm.nodes=2", "slurm.tasks_per_node=1", "slurm.partition=wide",
       "task.target=tests.support.tasks:CrashingTask", "task.data.crash_rank=1", "task.data.crash_at=25",
       "task.data.error=SIGKILL", "task.data.crash_launch=0"]  # fmt: skip
COMPETITOR_S = 30


def submit(tmp: Path, *overrides: str) -> tuple[Path, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")  # the job imports tests.support.tasks
    out = subprocess.run([sys.executable, "-m", "jobs", "submit", DIGITS, *RUN, *overrides], cwd=tmp, env=env,
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    fields = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in out.splitlines())}
    return Path(fields["run dir"]), fields["job"]


def rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def gone(job: str) -> bool:
    return not subprocess.run(["squeue", "-h", "-j", job], capture_output=True, text=True).stdout.strip()


def wait(condition, timeout: float, what: str):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not (found := condition()):
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.05)
    return found


def recovery(restarts: int, competing: bool, tmp: Path) -> float:
    """Seconds from the kill to the first step logged after it, for one run."""
    killed = tmp / "killed"
    run_dir, job = submit(tmp, f"slurm.max_restarts={restarts}", f"task.data.halt_file={killed}")
    competitor = None
    if competing:
        wait(lambda: any(r["split"] == "train" for r in rows(run_dir)), 120, "the run to train")
        competitor = subprocess.run(
            ["sbatch", "--parsable", "-p", "wide", "-N", "2", "--exclusive", "--priority=TOP", "-o", "/dev/null",
             "--wrap", f"sleep {COMPETITOR_S}"], capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
    at = float(wait(lambda: killed.exists() and killed.read_text().strip(), 120, "the kill"))
    first = wait(lambda: next((r for r in rows(run_dir) if r["split"] == "train" and r["time"] > at), None),
                 300, "the first step after the kill")  # fmt: skip
    wait(lambda: gone(job) and (competitor is None or gone(competitor)), 300, "the jobs to end")
    return first["time"] - at


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    print("| queue | requeue path (s) | restart in the allocation (s) | ratio | target |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for competing in (False, True):
            figures = {r: [] for r in (0, 3)}  # type: dict[int, list[float]]
            for i in range(args.repeats):
                for restarts in (0, 3) if i % 2 == 0 else (3, 0):  # ABBA: the machine's drift cancels
                    where = Path(tmp) / f"{competing}-{restarts}-{i}"
                    where.mkdir()
                    figures[restarts].append(recovery(restarts, competing, where))
            requeue, restart = statistics.median(figures[0]), statistics.median(figures[3])
            queue = f"a job pending for the nodes ({COMPETITOR_S} s)" if competing else "idle"
            met = "met" if restart <= 10 else "NOT met"
            print(f"| {queue} | {requeue:.1f} | {restart:.1f} | {requeue / restart:.1f}x | <= 10 s: {met} |")


if __name__ == "__main__":
    main()
