"""The controller's RPCs that waiting on jobs costs, from ``sdiag``'s per-user counts (counters reset first): ``submit
--wait`` of one 2-node digits job (the client and the job's own watchers together, both as root here), ``status
--watch`` of a real sweep of 1,000 trials, its array held (per minute), and an adaptive search's 32 workers running
short trials as job steps (per minute, every worker's own asking and srun's step RPCs together), against the baseline
of the same minutes with nothing asking (the daemons' own RPCs, which run as root too) and against the old loop's
cost (one ``squeue -j`` every 0.5 s).

    cd REPO && eval "$(scripts/slurm-local env)" && PYTHONPATH=. .venv/bin/python bench/rpc_budget.py [--trials 1000]

Needs the local cluster, alone (it resets the controller's counters). Targets: each at most 30 RPCs a minute.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DIGITS = str(ROOT / "configs" / "digits.yaml")
TWO = ["train.max_steps=2000", "checkpoint.every_steps=500", "train.eval_every=0", "train.log_every=20",
       "wandb.mode=disabled", "slurm.nodes=2", "slurm.tasks_per_node=1", "slurm.partition=wide"]  # fmt: skip


def root_rpcs() -> int:
    """root's RPC count since the last reset, less sdiag's own calls (REQUEST_STATS_INFO)."""
    text = subprocess.run(["sdiag"], capture_output=True, text=True, check=True).stdout
    user = re.search(r"^\s*root\s+\(\s*0\)\s+count:(\d+)", text, re.M)
    stats = re.search(r"REQUEST_STATS_INFO\s+\(\s*\d+\)\s+count:(\d+)", text)
    return (int(user[1]) if user else 0) - (int(stats[1]) if stats else 0)


def measured(cmd: list[str], cwd: Path) -> tuple[int, float, str]:
    """(root's RPCs, seconds, stdout) of ``cmd`` from a counter reset."""
    subprocess.run(["sdiag", "-r"], capture_output=True, check=True)
    started = time.monotonic()
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    out = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    kinds = subprocess.run(["sdiag"], capture_output=True, text=True).stdout.split("by message type")[-1]
    print(" ".join(cmd[3:6]), kinds.split("by user")[0], flush=True)
    return root_rpcs(), time.monotonic() - started, out.stdout + out.stderr


def idle(seconds: float) -> int:
    """root's RPCs over ``seconds`` with nothing running: the daemons' own."""
    subprocess.run(["sdiag", "-r"], capture_output=True, check=True)
    time.sleep(seconds)
    return root_rpcs()


def per_minute(rpcs: float, seconds: float) -> float:
    return 60 * rpcs / seconds


def search_workers(ddpjob: list[str], cwd: Path, workers: int, seconds: int, base_rate: float) -> tuple:
    """An adaptive search of ``workers`` workers (one array task each, one CPU: those the cluster cannot hold wait in
    the queue), each running short trials one after another as srun steps, measured for ``seconds`` once the first
    trial trains; then cancelled. The old loop's figure: one ``squeue -j`` a worker every 0.5 s."""
    search = [*ddpjob, "sweep", DIGITS, "optim.lr=loguniform(1e-3,1e-2)", "--search", "random", "--trials",
              str(4 * workers), "--parallel", str(workers), "--name", "rpc-search", "train.max_steps=40",
              "train.eval_every=0", "checkpoint.every_steps=20", "wandb.mode=disabled", "slurm.nodes=1",
              "slurm.tasks_per_node=1"]  # fmt: skip
    proc = subprocess.run(search, cwd=cwd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    arrays = next(line.split()[1:] for line in proc.stdout.splitlines() if line.startswith("arrays:"))
    sweep = Path(next(line.split(None, 1)[1] for line in proc.stdout.splitlines() if line.startswith("dir:")).strip())
    try:
        deadline = time.monotonic() + 600
        while not list(sweep.glob("t*/metrics.jsonl")) and time.monotonic() < deadline:
            time.sleep(2)
        subprocess.run(["sdiag", "-r"], capture_output=True, check=True)
        started = time.monotonic()
        time.sleep(seconds)
        rpcs, took = root_rpcs(), time.monotonic() - started
        kinds = subprocess.run(["sdiag"], capture_output=True, text=True).stdout.split("by message type")[-1]
        print("search workers", kinds.split("by user")[0], flush=True)
        running = subprocess.run(["squeue", "-h", "-t", "R", "-o", "%i"], capture_output=True, text=True).stdout.split()
        trials = len(list(sweep.glob("t*/metrics.jsonl")))
    finally:
        subprocess.run(["scancel", *arrays], capture_output=True)
        while subprocess.run(["squeue", "-h", "-j", ",".join(arrays)], capture_output=True, text=True).stdout.strip():
            time.sleep(1)  # its workers gone before the folder is removed
    print(f"search: {len(running)} of {workers} workers running, {trials} trials started", flush=True)
    return (f"{workers} search workers ({len(running)} running)", rpcs, took, per_minute(rpcs, took) - base_rate,
            workers * 3 * 60 / 0.5)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=1000, help="trials of the watched sweep")
    parser.add_argument("--watch-s", type=int, default=60, help="how long the sweep is watched")
    parser.add_argument("--workers", type=int, default=32, help="an adaptive search's workers (0: not measured)")
    parser.add_argument("--only-workers", action="store_true", help="measure the search's workers alone")
    args = parser.parse_args()
    ddpjob = [sys.executable, "-m", "jobs"]
    with tempfile.TemporaryDirectory(dir=ROOT / ".." if os.access(ROOT.parent, os.W_OK) else None) as tmp:
        cwd = Path(tmp)
        if args.only_workers:
            base_rate = per_minute(idle(30), 30)
            print_rows([search_workers(ddpjob, cwd, args.workers, args.watch_s, base_rate)], base_rate)
            return
        waited, wait_s, out = measured([*ddpjob, "submit", DIGITS, "--wait", *TWO], cwd)
        assert "COMPLETED after" in out, out[-3000:]
        base = idle(min(wait_s, 60))
        base_rate = per_minute(base, min(wait_s, 60))
        old_rate = 3 * 60 / 0.5  # one squeue -j (3 RPCs) every 0.5 s
        rows = [("submit --wait, 2-node job", waited, wait_s, per_minute(waited, wait_s) - base_rate, old_rate)]
        # A real sweep of --trials trials, its array held (sbatch --hold: every task pending, so the watch keeps
        # refreshing), watched for a minute; then cancelled.
        sweep = subprocess.run([*ddpjob, "sweep", DIGITS, f"train.seed=range(0,{args.trials})", "wandb.mode=disabled",
                                "slurm.additional={hold: true}"], cwd=cwd, capture_output=True, text=True)  # fmt: skip
        assert sweep.returncode == 0, sweep.stdout + sweep.stderr
        arrays = next(line.split()[1:] for line in sweep.stdout.splitlines() if line.startswith("arrays:"))
        try:
            watched, watch_s, out = measured(
                ["timeout", "-s", "INT", str(args.watch_s), *ddpjob, "status", "digits-sweep", "--watch", "2"], cwd
            )
        finally:
            subprocess.run(["scancel", *arrays], capture_output=True)
        queries = out.count("every 2 s")
        rows.append((f"status --watch, {args.trials}-trial sweep", watched, watch_s,
                     per_minute(watched, watch_s) - base_rate, 3 * 60 / 2))  # fmt: skip
        if args.workers:
            rows.append(search_workers(ddpjob, cwd, args.workers, args.watch_s, base_rate))
    print_rows(rows, base_rate)
    print(f"\nstatus --watch refreshed {queries} times in {watch_s:.0f} s")


def print_rows(rows: list[tuple], base_rate: float) -> None:
    print(f"baseline (nothing asking): {base_rate:.1f} RPCs/min\n")
    print("| case | RPCs | seconds | RPCs/min above baseline | target | old loop RPCs/min |")
    print("|---|---|---|---|---|---|")
    for case, rpcs, secs, rate, old in rows:
        print(f"| {case} | {rpcs} | {secs:.0f} | {rate:.1f} | 30 | {old:.0f} |")


if __name__ == "__main__":
    main()
