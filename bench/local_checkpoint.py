"""The cost of the node-local checkpoint tier (``checkpoint.local_every_steps``) per training step: with a copy every
step, every 10 and every 50 steps, and at the interval docs/failures.md recommends (copies 0.5 s of training apart:
``RECOMMENDED``), against the tier off, for the CPU models (the digits MLP and the char LM), 2 ranks under ddp
(torchrun), copies in /dev/shm (``checkpoint.local_path``'s default). No durable checkpoint is written before the end.
A setting of 0 is the control: the tier off against itself, the method's noise in the same invocation. The CPU a
copy takes (both ranks, every thread) is the difference against off times the interval: the copy every step gives
it best, the other settings' ratios follow from it.

The figure is CPU time per step: the user and system time of both ranks' processes, every thread (the copies'
writer and gloo's threads included), sampled from ``/proc`` while they train and divided by the steps done in
between (the first 15% of the run and its end left out). On a machine shared with other work (this VM's load
average moves between 1 and 7 within minutes) wall-clock step times of the same run scatter by 20% or more, while
CPU time per step does not move with the load; on 2 CPUs fully used by 2 ranks, CPU the tier takes is wall time
training loses. Wall-clock ms per step (between the same samples) is printed beside it. Each repeat runs the
settings in a rotated order; a setting's ratio is the median of the repeats' ratios against the same repeat's run
without the tier.

    .venv/bin/python bench/local_checkpoint.py [--repeats 3] [--tasks "char LM"] [--every 0 1 10 50] [--override K=V]
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
from typing import Any, Sequence

ROOT = Path(__file__).resolve().parent.parent
COMMON = ["train.eval_every=0", "train.log_every=5", "checkpoint.every_steps=0", "wandb.mode=disabled",
          "optim.warmup_steps=0", "task.model.dropout=0.1"]  # fmt: skip
TASKS = {  # (config, overrides, steps: 5 to 10 s of training here)
    "digits MLP": ("digits.yaml", ["data.batch_size=32"], 2000),
    "char LM": ("charlm.yaml", ["data.batch_size=16", "task.data.max_chars=200000"], 200),
}
# docs/failures.md: copies at least 0.5 s of training apart (3.3 and 35 ms per step here).
RECOMMENDED = {"digits MLP": 150, "char LM": 20}
TICK = os.sysconf("SC_CLK_TCK")
WINDOW = (0.15, 0.95)  # the part of the run's steps measured


def _cpu_s(pid: int) -> float:
    """A process's user + system CPU seconds, all its threads."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICK  # utime, stime: fields 14 and 15 of stat


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return found


def _last_step(metrics: Path) -> int:
    try:
        with open(metrics, "rb") as f:
            f.seek(max(0, f.seek(0, 2) - 4096))
            tail = f.read().decode(errors="replace").splitlines()
    except OSError:
        return 0
    for line in reversed(tail):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError):
            continue
    return 0


def run(task: str, every: int, steps: int, run_dir: Path, more: Sequence[str]) -> tuple[float, float]:
    """(CPU ms per step of both ranks together, wall ms per step) of ``task`` with a copy every ``every`` steps."""
    config, extra, _ = TASKS[task]
    overrides = [*COMMON, *extra, *more, f"train.max_steps={steps}", f"checkpoint.local_every_steps={every}"]
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "ddp_core",
           str(ROOT / "configs" / config), "--run-dir", str(run_dir), *overrides]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    lo, hi = int(steps * WINDOW[0]), int(steps * WINDOW[1])
    samples: list[tuple[int, float, float]] = []  # (step, CPU s of the ranks, time)
    while proc.poll() is None:
        time.sleep(0.05)
        step = _last_step(run_dir / "metrics.jsonl")
        if lo <= step <= hi and (not samples or step > samples[-1][0]):
            samples.append((step, sum(_cpu_s(pid) for pid in _children(proc.pid)), time.perf_counter()))
    _, err = proc.communicate()
    if proc.returncode != 0 or len(samples) < 2:
        why = f"exited {proc.returncode} ({len(samples)} samples)"
        raise RuntimeError(f"{' '.join(cmd)} {why}:\n{err.decode()[-3000:]}")
    (s0, c0, t0), (s1, c1, t1) = samples[0], samples[-1]
    return 1000 * (c1 - c0) / (s1 - s0), 1000 * (t1 - t0) / (s1 - s0)


def rows(
    repeats: int = 3,
    tasks: Sequence[str] = tuple(TASKS),
    settings: Sequence[int] = (1, 10, 50),
    more: Sequence[str] = (),
    scale: float = 1.0,
) -> list[dict[str, Any]]:
    """Per task and setting: the median CPU and wall ms per step, and the median of the repeats' CPU ratios. A
    setting of 0 is the control: another run without the tier, against the first."""
    out = []
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        for task in tasks:
            everys = sorted(set(settings) | ({RECOMMENDED[task]} if settings else set()))
            runs = [("off", 0), *((f"every {every}", every) for every in everys)]
            steps = max(60, int(TASKS[task][2] * scale))
            got: dict[str, list[tuple[float, float]]] = {key: [] for key, _ in runs}
            for i in range(repeats):
                for key, every in runs[i % len(runs) :] + runs[: i % len(runs)]:
                    got[key].append(run(task, every, steps, tmp / f"run{len(list(tmp.iterdir()))}", more))
            for key, every in runs[1:]:
                pairs = list(zip(got[key], got["off"], strict=True))
                ratios = [on[0] / off[0] for on, off in pairs]
                per_copy = statistics.median((on[0] - off[0]) * every for on, off in pairs)
                out.append({"bench": "local_checkpoint", "task": task, "ranks": 2, "steps": steps, "every": every,
                            "off_cpu_ms": statistics.median(c for c, _ in got["off"]),
                            "on_cpu_ms": statistics.median(c for c, _ in got[key]),
                            "off_wall_ms": statistics.median(w for _, w in got["off"]),
                            "on_wall_ms": statistics.median(w for _, w in got[key]),
                            "ratio": statistics.median(ratios), "ratios": ratios,
                            "copy_cpu_ms": per_copy})  # fmt: skip
    return out


def summary(quick: bool = False) -> list[dict[str, Any]]:
    """The lines of ``bench/run``: each task's CPU per step with copies every step, 10 and 50 steps and at the
    interval docs/failures.md recommends for the model's step time (target 1.03x) against the tier off."""
    out = []
    for r in rows(repeats=2 if quick else 3, settings=(0, 1, 10, 50), scale=0.5 if quick else 1.0):
        target = RECOMMENDED[r["task"]] == r["every"]
        what = "0 (control: off again)" if r["every"] == 0 else str(r["every"])
        out.append({
            "case": f"{r['task']}, 2 ranks: CPU per step, checkpoint.local_every_steps={what} vs off",
            "baseline": f"{r['off_cpu_ms']:.2f} ms", "ddpjob": f"{r['on_cpu_ms']:.2f} ms", "ratio": r["ratio"],
            "target": "<= 1.03x" if target else "", "met": r["ratio"] <= 1.03 if target else None,
        })  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tasks", nargs="+", choices=list(TASKS), default=list(TASKS))
    parser.add_argument("--every", type=int, nargs="+", default=[0, 1, 10, 50], help="0: the control, off again")
    parser.add_argument("--scale", type=float, default=1.0, help="steps per run, times each task's default")
    parser.add_argument("--override", nargs="*", default=[], metavar="K=V", help="for every run, after the task's")
    args = parser.parse_args()
    print("| task | local_every_steps | CPU ms/step off | CPU ms/step on | CPU on/off (median) | repeats | "
          "CPU ms per copy | wall ms/step off | on |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows(args.repeats, args.tasks, args.every, args.override, args.scale):
        each = ", ".join(f"{x:.3f}" for x in r["ratios"])
        print(f"| {r['task']} | {r['every']} | {r['off_cpu_ms']:.2f} | {r['on_cpu_ms']:.2f} | **{r['ratio']:.3f}** | "
              f"{each} | {r['copy_cpu_ms']:.1f} | {r['off_wall_ms']:.2f} | {r['on_wall_ms']:.2f} |")  # fmt: skip


if __name__ == "__main__":
    main()
