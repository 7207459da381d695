"""Fault-storm soak: longer storms on the fault storm's harness (tests/support/storm.py, issue 56), one run per seed,
many faults of every kind, each injected from outside at a gate the run reaches. Prints, per seed, the setting, the
faults, how the run ended and why (a budget spent, a problem found), whether its final weights are bitwise those of
an uninterrupted run, its goodput and the steps it trained again; then the faults survived per kind over all seeds.
A fault counts as survived when the run recorded what it must (tests/support/storm.py's ``check_recorded``) and the
run went on to complete bitwise.

Needs the local cluster on the preempt profile, alone, and an interpreter that imports this checkout:

    PYTHONPATH=. .venv/bin/python bench/storm.py [--seeds 1 2 3] [--faults 10] [--steps 150] [--keep DIR]
"""

from __future__ import annotations

import argparse
import collections
import os
import secrets
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

from ddp_core.run.rundir import RunDir
from jobs.runs import goodput
from tests.support import s3, storm
from tests.support.helpers import (
    digests,
    events,
    final_digests,
    rank_logs,
    run_trainer,
    stop_server,
    wait_idle,
)

ROOT = Path(__file__).resolve().parent.parent
DIGITS = str(ROOT / "configs" / "digits.yaml")


def submit(schedule: storm.Schedule, cwd: Path, extra: list[str]) -> tuple[str, Path]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    task = [f"task.data.gate_dir={cwd / 'gate'}"]
    out = subprocess.run([sys.executable, "-m", "jobs", "submit", DIGITS, *schedule.overrides(), *task, *extra],
                         cwd=cwd, env=env, capture_output=True, text=True)  # fmt: skip
    if out.returncode:
        raise SystemExit(f"ddpjob submit failed ({out.returncode}):\n{out.stdout}{out.stderr}")
    fields = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in out.stdout.splitlines())}
    return fields["job"], (cwd / fields["run dir"]).resolve()


def one_storm(schedule: storm.Schedule, cwd: Path, reference: str) -> dict[str, Any]:
    """One run through ``schedule``: what it survived, how it ended, its goodput."""
    (cwd / "gate").mkdir(parents=True)
    server, extra, pid = None, [f"run.root={storm.SMALL_FS / f'storm-{uuid.uuid4().hex[:8]}'}"], None
    if schedule.setting == "s3":
        server, endpoint = s3.start_server(cwd / "moto.log")
        bucket = s3.S3(endpoint, f"ddpjob-{secrets.token_hex(4)}")
        os.environ.update(bucket.env())
        import s3fs

        s3fs.S3FileSystem.clear_instance_cache()
        s3fs.S3FileSystem().mkdir(bucket.bucket)
        extra, pid = [f"run.root={cwd / 'runs'}", f"checkpoint.dir={bucket.url('ckpt')}"], server.pid
    wait_idle(300)
    job_id, run_dir = submit(schedule, cwd, extra)
    world, checked, problems = storm.Storm(job_id, run_dir, cwd / "gate", pid), [], []
    try:
        for fault in schedule.faults:
            found = storm.check_recorded(world.inject(fault))
            checked.append((fault.kind, not found))
            problems += found
            print(f"  {fault.index}: {fault.kind} {'ok' if not found else found}", flush=True)
    except AssertionError as err:  # a gate never reached: the run ended early (a budget, a failure)
        problems.append(f"stopped at fault {len(checked)}: {err}")
    finally:
        world.repair()
    state = storm.final_state(job_id, 600)
    if server is not None:
        stop_server(server)
    ended = [e for e in events(run_dir) if e["event"] in ("completed", "failed", "budget_exhausted")]
    bitwise = state == "COMPLETED" and set(digests(rank_logs(run_dir, job_id)).values()) == {reference}
    problems += storm.lost_steps(run_dir) if state == "COMPLETED" else []
    measured = goodput.of_run(RunDir(run_dir))
    return {"state": state, "bitwise": bitwise, "checked": checked, "problems": problems, "run_dir": run_dir,
            "ended": ended[-1] if ended else None, "goodput": measured}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--faults", type=int, default=10)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--keep", type=Path, help="keep the runs here (default: a temporary folder, removed)")
    args = parser.parse_args()
    work = args.keep or Path(tempfile.mkdtemp(prefix="ddpjob-storm-"))
    schedules = [storm.plan(seed, args.faults, steps=args.steps) for seed in args.seeds]
    uninterrupted = [*storm.RUN, f"train.max_steps={args.steps}"]
    ref = final_digests(run_trainer(DIGITS, work / "reference", uninterrupted, nproc=2))[0]
    survived: collections.Counter[str] = collections.Counter()
    injected: collections.Counter[str] = collections.Counter()
    for schedule in schedules:
        print(schedule.describe(), flush=True)
        out = one_storm(schedule, work / f"seed-{schedule.seed}", ref)
        for kind, ok in out["checked"]:
            injected[kind] += 1
            survived[kind] += ok and out["bitwise"]
        g = out["goodput"]
        print(
            f"  ended {out['state']} ({out['ended'] and out['ended']['event']}), bitwise {out['bitwise']}, "
            f"{g.line() if g else 'no goodput'}, steps trained again {g.retrained_steps if g else '-'}",
            flush=True,
        )
        for problem in out["problems"]:
            print(f"  problem: {problem}", flush=True)
    print("faults survived per kind:", ", ".join(f"{k} {survived[k]}/{injected[k]}" for k in sorted(injected)))
    if not args.keep:
        subprocess.run(["rm", "-rf", str(work)], check=False)


if __name__ == "__main__":
    main()
