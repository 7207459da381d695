"""Sweep submission cost on the login node: ``ddpjob sweep`` of 1,000 trials against one ``ddpjob submit`` of the same
config (the baseline, measured in this script), each a fresh ``python -m jobs`` process.

What is measured is ddpjob's own work, not slurmctld's: every trial validated, 1,000 run directories initialised with
their configs, one code snapshot shared by the sweep, one pickled task per trial, and the arrays' sbatch calls.
``sbatch``, ``squeue`` and ``scontrol`` are small stand-ins first on PATH (``sbatch`` answers at once with a new id
and counts its calls; ``MaxArraySize`` is 301, so 1,000 trials are 4 arrays), so the figures do not depend on a
cluster's load and the bench runs anywhere. Runs alternate, medians of ``--repeats``.

    .venv/bin/python bench/sweep_submit.py [--trials 1000] [--repeats 3]

``rows()`` returns the table's rows as dicts; ``summary()`` the ratio lines for ``bench/run``.
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
from typing import Any, Optional, Sequence

ROOT = Path(__file__).resolve().parent.parent
DIGITS = ROOT / "configs" / "digits.yaml"
MAX_ARRAY_SIZE = 301

FAKES = {
    # submitit parses "Submitted batch job N"; each call appends a line, so the bench counts them.
    "sbatch": 'echo call >> "$FAKE_SLURM/sbatch.calls"\n'
    'n=$(wc -l < "$FAKE_SLURM/sbatch.calls")\necho "Submitted batch job $((1000 + n))"\n',
    "squeue": "exit 0\n",  # nothing queued
    "scontrol": f'[ "$1 $2" = "show config" ] && echo "MaxArraySize            = {MAX_ARRAY_SIZE}"\nexit 0\n',
}


def fake_slurm(folder: Path) -> dict[str, str]:
    """The stand-ins in ``folder``, and an environment with them first on PATH."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, body in FAKES.items():
        path = folder / name
        path.write_text("#!/bin/sh\n" + body)
        path.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SUBMITIT_"))}
    return env | {"PATH": f"{folder}:{env['PATH']}", "FAKE_SLURM": str(folder), "PYTHONPATH": str(ROOT),
                  "OMP_NUM_THREADS": "1"}  # fmt: skip


def timed(args: list[str], env: dict[str, str], cwd: Path) -> float:
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "jobs", *args], env=env, cwd=cwd, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"ddpjob {' '.join(args[:2])} failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    return time.perf_counter() - started


def rows(trials: int = 1000, repeats: int = 3) -> list[dict[str, Any]]:
    times: dict[str, list[float]] = {"submit": [], "sweep": []}
    calls = []
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        env = fake_slurm(tmp / "bin")
        for i in range(repeats):
            root = tmp / f"runs{i}"
            times["submit"].append(timed(["submit", str(DIGITS), "--no-cluster-check", f"run.root={root}"], env, tmp))
            (tmp / "bin" / "sbatch.calls").unlink()
            sweep = ["sweep", str(DIGITS), f"train.seed=range(0,{trials})", "--name", "bench", "--no-cluster-check"]
            times["sweep"].append(timed([*sweep, f"run.root={root}"], env, tmp))
            calls.append(len((tmp / "bin" / "sbatch.calls").read_text().splitlines()))
            (tmp / "bin" / "sbatch.calls").unlink()
    submit_s, sweep_s = statistics.median(times["submit"]), statistics.median(times["sweep"])
    return [{
        "bench": "sweep_submit", "trials": trials, "repeats": repeats, "submit_s": submit_s, "sweep_s": sweep_s,
        "per_trial_ms": 1000 * sweep_s / trials, "ratio": sweep_s / submit_s, "sbatch_calls": max(calls),
        "max_array_size": MAX_ARRAY_SIZE,
    }]  # fmt: skip


def summary(quick: bool = False) -> list[dict[str, Any]]:
    """The ratio lines of ``bench/run``."""
    (r,) = rows(trials=1000, repeats=1 if quick else 3)
    return [{
        "case": f"{r['trials']}-trial sweep ({r['sbatch_calls']} sbatch calls) vs one submit",
        "baseline": f"{r['submit_s']:.2f} s", "ddpjob": f"{r['sweep_s']:.2f} s ({r['per_trial_ms']:.1f} ms/trial)",
        "ratio": r["ratio"], "target": f"< {r['trials'] / 10:.0f}x (a tenth of submitting each trial alone)",
        "met": r["ratio"] < r["trials"] / 10,
    }]  # fmt: skip


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args(argv)
    results = rows(args.trials, args.repeats)
    print(f"login-node cost, fresh process each, median of {args.repeats} alternated runs (stand-in sbatch)")
    print("| trials | one submit | sweep | per trial | sweep / submit | sbatch calls |\n|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['trials']} | {r['submit_s']:.2f} s | {r['sweep_s']:.2f} s | {r['per_trial_ms']:.1f} ms "
              f"| {r['ratio']:.1f}x | {r['sbatch_calls']} |")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
