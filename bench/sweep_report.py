"""Reading a big sweep on the login node: ``ddpjob report`` and ``ddpjob status`` of a 1,000-trial grid sweep against
the same commands on a 100-trial one (the baseline, measured in this script), each a fresh ``python -m jobs`` process.

The sweeps are fabricated as ``ddpjob sweep`` and the trainer leave them (sweep.json with every trial's overrides,
loaded values and scales; per trial the whole config.yaml, run.json, attempts.jsonl and metrics.jsonl: train lines
every 5 steps and an eval at steps 10, 20 and 30; a tenth of the trials failed or pruned): no cluster needed.
``sacct`` is a stand-in first on PATH that answers nothing, as on a cluster whose accounting forgot the jobs: what is
timed is ddpjob's own reading and drawing. Runs alternate 100 / 1,000, medians of ``--repeats``. Targets (issue 33):
a 1,000-trial report under 10 s, its status under 2 s.

    .venv/bin/python bench/sweep_report.py [--trials 100 1000] [--repeats 3]

``rows()`` returns the table's rows as dicts; ``summary()`` the ratio lines for ``bench/run``.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional, Sequence

ROOT = Path(__file__).resolve().parent.parent
TARGETS = {"report": 10.0, "status": 2.0}  # seconds, at 1,000 trials


def fabricate(root: Path, trials: int, seed: int = 0) -> Path:
    """A finished grid-like sweep of ``trials`` trials over optim.lr (log), task.model.hidden and optim.name."""
    import yaml

    from ddp_core.config import load_config, to_yaml

    rng = random.Random(seed)
    # Each trial's config.yaml as ddpjob writes it (the whole resolved config, ~120 lines), not a stub.
    template = yaml.safe_load(to_yaml(load_config(ROOT / "configs" / "digits.yaml", ["train.max_steps=30"])))
    dumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)
    scales = {"optim.lr": "log", "task.model.hidden": "linear", "optim.name": "choice"}
    base = str(ROOT / "configs" / "digits.yaml")
    record: dict[str, Any] = {"name": root.name, "base_config": base, "trials": {}, "params": {}, "scales": scales}
    for i in range(trials):
        tid = f"{i:010x}"
        lr, hidden, name = 10 ** rng.uniform(-4, -2), rng.choice([32, 64, 128]), rng.choice(["adamw", "sgd"])
        run = root / tid
        run.mkdir(parents=True)
        config = copy.deepcopy(template)
        config["run"]["name"] = f"{root.name}-{tid}"
        config["optim"] |= {"lr": lr, "name": name}
        config["task"]["model"]["hidden"] = hidden
        (run / "config.yaml").write_text(yaml.dump(config, Dumper=dumper, sort_keys=False))
        (run / "run.json").write_text(json.dumps({"run_id": tid, "name": config["run"]["name"]}))
        record["trials"][tid] = ["train.max_steps=30", f"optim.lr={lr!r}", f"task.model.hidden={hidden}",
                                 f"optim.name={name}"]  # fmt: skip
        record["params"][tid] = {"optim.lr": lr, "task.model.hidden": hidden, "optim.name": name}
        acc = 0.95 - 0.1 * (math.log10(lr) + 3) ** 2 + hidden / 5000 + rng.gauss(0, 0.01)
        lines = [{"step": s, "time": 0, "split": "train", "loss": 2 / s + rng.random() / 100} for s in range(5, 35, 5)]
        lines += [{"step": s, "time": 0, "split": "eval", "accuracy": acc * s / 30, "loss": 1 - acc * s / 30}
                  for s in (10, 20, 30)]  # fmt: skip
        (run / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
        ended = "completed" if i % 10 else ("failed" if i % 20 else "pruned")
        (run / "attempts.jsonl").write_text(json.dumps({"event": "start", "t": 0}) + "\n"
                                            + json.dumps({"event": ended, "t": 1}) + "\n")  # fmt: skip
    (root / "sweep.json").write_text(json.dumps(record))
    return root


def timed(args: list[str], env: dict[str, str], cwd: Path) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of ``python -m jobs ARGS``: the CPU time does not move with the machine's load,
    which on a shared 2-core login node can double the wall time."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "jobs", *args], env=env, cwd=cwd, capture_output=True, text=True)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode:
        raise RuntimeError(f"ddpjob {' '.join(args[:2])} failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def rows(trials: Sequence[int] = (100, 1000), repeats: int = 3) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="ddpjob-bench-report-") as tmp:
        work = Path(tmp)
        fake = work / "bin"
        fake.mkdir()
        (fake / "sacct").write_text("#!/bin/sh\nexit 0\n")
        (fake / "sacct").chmod(0o755)
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        env |= {"PATH": f"{fake}:{env['PATH']}", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        sweeps = {n: fabricate(work / f"sweep-{n}", n) for n in trials}
        times: dict[tuple[str, int], list[tuple[float, float]]] = {}
        for _ in range(repeats):
            for command in ("report", "status"):
                for n, path in sweeps.items():
                    times.setdefault((command, n), []).append(timed([command, str(path)], env, work))
    return [
        {"command": command, "trials": n, "seconds": statistics.median(w for w, _ in ts),
         "cpu_seconds": statistics.median(c for _, c in ts), "runs": len(ts), "load": os.getloadavg()[0]}
        for (command, n), ts in times.items()
    ]  # fmt: skip


def summary(quick: bool = False) -> list[dict[str, Any]]:
    """The ratio lines of ``bench/run``: 1,000 trials against 100, with the issue's absolute targets."""
    found = {(r["command"], r["trials"]): r for r in rows((100, 1000), 1 if quick else 3)}
    out = []
    for command, target in TARGETS.items():
        small, big = found[(command, 100)], found[(command, 1000)]
        out.append({
            "case": f"ddpjob {command} of a 1000-trial sweep vs a 100-trial one (wall; CPU in brackets)",
            "baseline": f"{small['seconds']:.2f} s ({small['cpu_seconds']:.2f} s)",
            "ddpjob": f"{big['seconds']:.2f} s ({big['cpu_seconds']:.2f} s)",
            "ratio": big["seconds"] / small["seconds"], "target": f"< {target:g} s", "met": big["seconds"] < target,
        })  # fmt: skip
    return out


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--trials", type=int, nargs="+", default=[100, 1000])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args(argv)
    results = rows(args.trials, args.repeats)
    print(f"login-node cost, fresh process each, median of {args.repeats} alternated runs (stand-in sacct)")
    print("| command | trials | wall | CPU | load average |\n|---|---|---|---|---|")
    for r in results:
        print(f"| ddpjob {r['command']} | {r['trials']} | {r['seconds']:.2f} s | {r['cpu_seconds']:.2f} s "
              f"| {r['load']:.1f} |")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
