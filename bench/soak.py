"""Soak: the goodput of a run of about ``--minutes`` (default 10) on the local Slurm cluster whose rank is killed from
outside every ``--kill-every-s`` (default 120 s), over today's requeue path (``slurm.max_restarts=0``: each failure
goes through the queue) and over in-allocation restart (``slurm.max_restarts`` large: the ranks restart as a new job
step of the same allocation), in one invocation, each measured by ``jobs.runs.goodput`` from the run's own records.

Each half submits the digits job (2 ranks on one node, ``SlowDigitsTask``: a pause per batch makes a step ~50 ms,
a checkpoint every 100 steps), waits for its first step, then SIGKILLs rank ``--rank``'s process (found by its
``SLURM_JOB_ID`` and ``SLURM_PROCID`` in /proc: the local cluster's nodes are this machine) at the middle of each
interval, once the run trains again after the last kill; at ``--minutes`` after the first launch began it cancels
the job and measures the run up to then. The kills are not the node's fault, so after each one the bench takes the
host back (an ``included`` event, as ``ddpjob resume --include-node`` records): else ddpjob's rule, a host's second
infrastructure failure excludes it, would end the run on a 2-node cluster after three kills.

Needs the local cluster, alone (hold its lock), and an interpreter that imports this checkout:

    flock /tmp/ddpjob-cluster.lock env PYTHONPATH=. .venv/bin/python bench/soak.py [--minutes 10] \\
        [--kill-every-s 120] [--only requeue restart] [--keep DIR]

A checkout whose config has no ``slurm.max_restarts`` (before in-allocation restart) runs the requeue half without the
override (its only path) and skips the other.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

from ddp_core.config import SlurmConfig
from ddp_core.run.rundir import RunDir
from jobs.runs import goodput

ROOT = Path(__file__).resolve().parent.parent
DIGITS = str(ROOT / "configs" / "digits.yaml")
RUN = [
    "task.target=tests.support.tasks:SlowDigitsTask", "task.data.pause_s=0.05", "train.max_steps=10000000",
    "train.log_every=10", "train.eval_every=0", "checkpoint.every_steps=100", "wandb.mode=disabled",
    "slurm.max_failures=1000",
]  # fmt: skip
HALVES = {"requeue": ["slurm.max_restarts=0"], "restart": ["slurm.max_restarts=1000"]}
TRAINS_AGAIN_S = 300.0  # a kill's run that has not trained again by then has stopped: the half ends there


def restarts_exist() -> bool:
    """Whether this checkout's config has slurm.max_restarts (in-allocation restart)."""
    return any(f.name == "max_restarts" for f in dataclasses.fields(SlurmConfig))


def submit(overrides: list[str], minutes: float, cwd: Path) -> tuple[RunDir, str]:
    """``ddpjob submit`` of the digits job; its run directory and job id."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")  # the ranks import tests.support.tasks
    args = [*RUN, f"slurm.time_min={int(minutes) + 10}", *overrides]
    out = subprocess.run([sys.executable, "-m", "jobs", "submit", DIGITS, *args], cwd=cwd, env=env,
                         capture_output=True, text=True)  # fmt: skip
    if out.returncode:
        raise SystemExit(f"ddpjob submit failed ({out.returncode}):\n{out.stdout}{out.stderr}")
    fields = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in out.stdout.splitlines())}
    return RunDir((cwd / fields["run dir"]).resolve()), fields["job"]


def rank_pid(job_id: str, rank: int) -> Optional[int]:
    """The process of rank ``rank`` of the job's running step on this machine, from /proc: the lowest pid whose
    environment has the job's id, that rank and a step id (the batch shell has none of its own)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            env = dict(item.partition(b"=")[::2] for item in (proc / "environ").read_bytes().split(b"\0") if item)
            alive = (proc / "stat").read_text().rpartition(")")[2].split()[0] not in ("Z", "X")
        except OSError:
            continue
        step = env.get(b"SLURM_STEP_ID", b"batch")
        mine = env.get(b"SLURM_JOB_ID") == job_id.encode() and env.get(b"SLURM_PROCID") == str(rank).encode()
        if mine and alive and step != b"batch":
            found.append(int(proc.name))
    return min(found, default=None)


def wait_for(what: str, check: Any, timeout: float, pause: float = 0.2) -> Any:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if (value := check()) is not None:
            return value
        time.sleep(pause)
    raise TimeoutError(what)


def starts(run: RunDir) -> list[dict[str, Any]]:
    return [e for e in run.events() if e["event"] == "start"]


def soak(run: RunDir, job_id: str, minutes: float, every: float, rank: int) -> dict[str, Any]:
    """Kill rank ``rank`` every ``every`` seconds, in the middle of each interval, until ``minutes`` after the first
    launch began; then cancel the job. Returns what happened, with the run's goodput up to then."""
    first = wait_for("the first step", lambda: (starts(run) or [None])[0], 600)
    began = first.get("launched") or first["t"]
    deadline, kills, back = began + 60 * minutes, [], []
    for k in range(int(60 * minutes // every) + 1):
        at = began + every * (k + 0.5)
        if at >= deadline:
            break
        time.sleep(max(0.0, at - time.time()))
        try:
            launches = len(starts(run))
            pid = wait_for("a live rank", lambda: rank_pid(job_id, rank), max(1.0, deadline - time.time()))
        except TimeoutError:
            break
        os.kill(pid, signal.SIGKILL)
        kills.append(time.time())
        print(f"  killed rank {rank} (pid {pid}) at {kills[-1] - began:.0f} s", flush=True)
        try:
            failure = wait_for("the failure's record", lambda: _failure_after(run, kills[-1]), TRAINS_AGAIN_S)
            if failure.get("host"):
                run.log_event("included", host=failure["host"], by="bench/soak")
            wait_for("the next launch", lambda n=launches: starts(run)[n:] or None, TRAINS_AGAIN_S)
            back.append(starts(run)[launches]["t"] - kills[-1])
        except TimeoutError as err:
            print(f"  no {err} within {TRAINS_AGAIN_S:.0f} s: this half ends here ({run.path})", flush=True)
            break
    time.sleep(max(0.0, deadline - time.time()))
    subprocess.run(["scancel", job_id], check=False)
    wait_for("the job's end", lambda: None if _queued(job_id) else True, 120, pause=1.0)
    return {"kills": len(kills), "back_s": back, "goodput": goodput.of_run(run, end=min(deadline, time.time()))}


def _failure_after(run: RunDir, t: float) -> Optional[dict[str, Any]]:
    return next((e for e in run.events() if e["event"] == "failure" and e["t"] >= t), None)


def _queued(job_id: str) -> bool:
    out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True)
    return bool(out.stdout.strip())


def table(results: dict[str, dict[str, Any]]) -> str:
    terms = [label for _, label, _ in goodput.TERMS]
    head = ["path", "goodput", *terms[1:], "kills", "kill -> first step (median)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, r in results.items():
        g: Optional[goodput.Goodput] = r["goodput"]
        if g is None:
            lines.append(f"| {name} | no start | " + " | ".join("-" for _ in head[2:]) + " |")
            continue
        shares = [f"{100 * g.share(t):.1f}% ({g.counts(t)})" if g.counts(t) else f"{100 * g.share(t):.1f}%"
                  for t, _, _ in goodput.TERMS[1:]]  # fmt: skip
        back = f"{statistics.median(r['back_s']):.1f} s" if r["back_s"] else "-"
        lines.append(f"| {name} | {100 * g.fraction:.1f}% of {goodput.duration(g.total)} | "
                     + " | ".join(shares) + f" | {r['kills']} | {back} |")  # fmt: skip
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=10.0, help="each half's length, from its first launch's begin")
    p.add_argument("--kill-every-s", type=float, default=120.0, help="one kill in the middle of each such interval")
    p.add_argument("--rank", type=int, default=1, help="the rank killed (of 2)")
    p.add_argument("--only", nargs="+", choices=list(HALVES), default=list(HALVES))
    p.add_argument("--keep", type=Path, help="keep the runs' directories here (default: a temporary folder)")
    p.add_argument("--json", type=Path, help="also write the figures here")
    args = p.parse_args(argv)
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(dir="/var/tmp") as tmp:
        where = args.keep or Path(tmp)
        where.mkdir(parents=True, exist_ok=True)
        for name in args.only:
            overrides = HALVES[name] if restarts_exist() else [] if name == "requeue" else None
            if overrides is None:
                print(f"{name}: skipped (this checkout's config has no slurm.max_restarts)", flush=True)
                continue
            run, job = submit(overrides, args.minutes, where)
            print(f"{name}: job {job}, {run.path}", flush=True)
            results[name] = soak(run, job, args.minutes, args.kill_every_s, args.rank) | {"run": str(run.path)}
            g = results[name]["goodput"]
            print(f"  {g.line() if g else 'no start'}", flush=True)
    print(table(results))
    if "requeue" in results and "restart" in results and results["requeue"]["goodput"]:
        base, other = results["requeue"]["goodput"], results["restart"]["goodput"]
        print(f"in-allocation restart / requeue goodput: {other.fraction / base.fraction:.3f}x" if other else "")
    if args.json:
        args.json.write_text(json.dumps({k: _plain(v) for k, v in results.items()}, indent=2) + "\n")
    return 0


def _plain(r: dict[str, Any]) -> dict[str, Any]:
    g = r["goodput"]
    return r | {"goodput": None if g is None else dataclasses.asdict(g) | {"fraction": g.fraction}}


if __name__ == "__main__":
    sys.exit(main())
