"""Packed sweeps against arrays on the local cluster (issue 57): the same sweep of ``--trials`` small trials (a script
that sleeps ``--seconds``: the scheduler's cost, not the trial's work, is what packing saves) submitted as today's
arrays (the baseline, one Slurm job per trial) and packed (``--pack``), one after the other in this invocation.

Measured for each: the time from ``ddpjob sweep`` to the last trial's result, the Slurm jobs submitted (sacct's
records of the sweep's arrays), the controller's RPCs meanwhile (``sdiag``'s counts by message type, before and
after) and, packed, the slots' idle share (1 - the trials' step time over slots x the pack's wall time). Run it on the
cluster alone; as a plain user on the site profile for the per-user limits a real site has.

    .venv/bin/python bench/pack.py [--trials 200] [--seconds 10] [--allocations 2]
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
TRIAL = "import sys, time\ntime.sleep(float(sys.argv[sys.argv.index('--seconds') + 1]))\n"


def rpcs() -> int:
    """The controller's RPCs so far: the sum of sdiag's counts by message type."""
    text = subprocess.run(["sdiag"], capture_output=True, text=True, check=True).stdout
    part = text.split("Remote Procedure Call statistics by message type", 1)[-1].split("Remote Procedure Call", 1)[0]
    return sum(int(m) for m in re.findall(r"count:(\d+)", part))


def ended(run: Path) -> float | None:
    """When the trial's run recorded its completion (epoch seconds), else None."""
    path = run / "attempts.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    done = [json.loads(line) for line in lines if '"completed"' in line]
    return float(done[-1]["t"]) if done else None


def started(run: Path) -> float:
    return float(next(json.loads(line) for line in (run / "attempts.jsonl").read_text().splitlines())["t"])


def sweep(folder: Path, trials: int, seconds: float, pack: list[str]) -> dict[str, Any]:
    folder.mkdir(parents=True)
    (folder / "trial.py").write_text(TRIAL)
    before, t0 = rpcs(), time.time()
    ids, done, root = [], 0, folder / "runs" / "bench"
    while done < trials:  # a site's submit limit refuses the whole sweep: then it trickles in, as a user's loop would
        size = trials - done
        proc = submit(folder, done, done + size, seconds, pack)
        while proc.returncode and (room := re.search(r": (\d+) more fit", proc.stderr)):
            size = int(room[1])
            if size:
                proc = submit(folder, done, done + size, seconds, pack)
            else:
                time.sleep(5)
                proc = submit(folder, done, done + 1, seconds, pack)
                size = 1
        if proc.returncode:
            raise RuntimeError(f"ddpjob sweep failed:\n{proc.stdout}{proc.stderr}")
        ids += (re.search(r"^arrays:\s+(.*)$", proc.stdout, re.M) or ["", ""])[1].split()
        done += size
    runs = [p for p in root.iterdir() if (p / "config.yaml").exists()]
    while not all(ended(r) for r in runs):
        time.sleep(2)
    last = max(ended(r) or 0 for r in runs)
    sacct = subprocess.run(["sacct", "-n", "-X", "-P", "-o", "JobID", "-j", ",".join(ids)], capture_output=True,
                           text=True).stdout  # fmt: skip
    busy = sum((ended(r) or 0) - started(r) for r in runs)
    slots = json.loads((root / "pack.json").read_text())["per_node"] * int(pack[-1]) if pack else 0
    jobs = len({line.strip() for line in sacct.splitlines() if line.strip()})
    return {"slots": slots, "wall_s": last - t0, "jobs": jobs, "rpcs": rpcs() - before, "busy_s": busy,
            "first": min(started(r) for r in runs), "last": last}  # fmt: skip


def submit(folder: Path, first: int, end: int, seconds: float, pack: list[str]) -> subprocess.CompletedProcess[str]:
    """``ddpjob sweep`` of trials ``first`` to ``end`` - 1 of the bench's sweep (one sweep directory, by name)."""
    keys = [f"script.args.seed=range({first},{end})", "slurm.tasks_per_node=1", "wandb.mode=disabled"]
    args = ["sweep", "--script", "trial.py", *keys, "--no-snapshot", "--name", "bench", *pack, "--", "--seconds",
            str(seconds)]  # fmt: skip
    return subprocess.run([sys.executable, "-m", "jobs", *args], cwd=folder, capture_output=True, text=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=200)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--allocations", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-pack-") as tmp:
        arrays = sweep(Path(tmp) / "arrays", args.trials, args.seconds, [])
        packed = sweep(Path(tmp) / "packed", args.trials, args.seconds, ["--pack", str(args.allocations)])
    print(f"{args.trials} trials of {args.seconds:g} s")
    for name, r in (("arrays", arrays), ("packed", packed)):
        print(f"  {name:7s} last result after {r['wall_s']:7.1f} s, {r['jobs']:4d} Slurm jobs, {r['rpcs']:6d} RPCs")
    print(f"  packed: results {arrays['wall_s'] / packed['wall_s']:.2f}x sooner, {packed['jobs'] / arrays['jobs']:.1%} "
          f"of the jobs, {packed['rpcs'] / max(1, arrays['rpcs']):.1%} of the RPCs")  # fmt: skip
    idle = 1 - packed["busy_s"] / (packed["slots"] * (packed["last"] - packed["first"]))
    print(f"  packed: {packed['slots']} slots, idle {idle:.1%} (launch to each trial's start counts as idle)")
    print(json.dumps({"arrays": arrays, "packed": packed}))


if __name__ == "__main__":
    main()
