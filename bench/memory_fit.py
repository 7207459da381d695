"""What fitting to memory costs (issue 58), all in this invocation, 2 ranks under torchrun on this machine's CPUs, the
memory a real ``ulimit -v`` (tests/cluster/test_memory_fit.py's tasks and limits):

- ``data.batch_size=auto``: the probe at start-up, against the launch-to-first-step time of the same run at a fixed
  micro-batch; one survived out-of-memory (the step done again), against the same step at the halved micro-batch in
  a run that never ran out (``WideDigitsTask``, a fixed micro-batch of 4's peak address space plus 128 MiB);
- ``train.invariant``: the step that ran out and was done again recomputing activations, and the steps after it,
  against the same steps of the same run without a limit (the same bits; ``blocks``: units to recompute);
- the guard every such step pays (``trainer.redo``: its random streams and sums kept, one all-reduce of the ranks'
  out-of-memory flags), timed alone at 2 ranks.

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
    env |= {"OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_ARENA_MAX": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, preexec_fn=limited, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stderr


def first(run: Path, event: str) -> dict[str, Any]:
    return next(e for e in map(json.loads, (run / "attempts.jsonl").read_text().splitlines()) if e["event"] == event)


def step_seconds(run: Path) -> dict[int, float]:
    """Each step's wall time in seconds, from the per-step progress records (train.log_every=1: ``step_ms``)."""
    rows = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r.get("split") == "train"]
    return {r["step"]: r["step_ms"] / 1000 for r in rows}


def median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def invariant(tmp: Path, steps: int, heavy_step: int) -> dict[str, float]:
    """A train.invariant run whose rank 1 runs out at ``heavy_step`` under the limit (the plain steps' peak + 72 MiB)
    and goes on recomputing activations, against the same run without a limit: step times in seconds."""
    common = [
        "task.target=tests.support.memory_tasks:WideDigitsTask", "task.data.width=150000", "task.data.blocks=6",
        "train.invariant=true", "data.global_batch_size=16", "data.batch_size=4", "data.shuffle=false",
        "optim.schedule=constant", "optim.warmup_steps=0", "train.eval_every=0", f"train.max_steps={steps}",
        "train.log_every=1", "wandb.mode=disabled", "slurm.tasks_per_node=2", "checkpoint.every_steps=0",
    ]  # fmt: skip
    heavy = f"task.data.heavy={list(range(heavy_step * 16 + 8, (heavy_step + 1) * 16))}"
    log = train(tmp / "inv-plain", common)
    limit = (max(int(n) for n in SPACE.findall(log)) + 72) * 1024
    train(tmp / "inv-limited", [*common, heavy], limit)
    train(tmp / "inv-free", [*common, heavy])
    assert first(tmp / "inv-limited", "activations_recomputed")["step"] == heavy_step
    limited, free = step_seconds(tmp / "inv-limited"), step_seconds(tmp / "inv-free")
    at, after = heavy_step + 1, range(heavy_step + 2, steps + 1)
    return {
        "limit_mib": limit / 1024, "redone": limited[at], "free": free[at],
        "before": median([limited[s] for s in range(2, at)]), "before_free": median([free[s] for s in range(2, at)]),
        "after": median([limited[s] for s in after]), "after_free": median([free[s] for s in after]),
    }  # fmt: skip


def guard(rank: int, store: str, out: str) -> None:
    """One rank of the guard's timing: what ``RedoneStep`` adds to a step that does not run out."""
    import time

    import torch.distributed as dist

    from ddp_core.distributed import rng
    from ddp_core.trainer.memory import ranks_out
    from ddp_core.trainer.metrics import TrainSums

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    sums, n = TrainSums(), 2000
    for timed in (False, True):  # a warm-up pass, then the timed one
        started = time.perf_counter()
        for _ in range(n):
            rng.rng_state(), sums.mark()
            ranks_out(False)
        if timed and rank == 0:
            Path(out).write_text(str((time.perf_counter() - started) / n))
    dist.destroy_process_group()


def guard_seconds(tmp: Path) -> float:
    import torch.multiprocessing as mp

    os.environ["OMP_NUM_THREADS"] = "1"
    mp.spawn(guard, args=(str(tmp / "store"), str(tmp / "guard")), nprocs=2)
    return float((tmp / "guard").read_text())


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
        inv = invariant(Path(tmp), args.steps, args.heavy_step)
        each = guard_seconds(Path(tmp))
    startup = {name: e["t"] - e["launched"] for name, e in (("fixed", fixed), ("auto", auto))}
    print(f"limit: ulimit -v {limit // 1024} MiB; probe tried {auto['probed']}, chose {auto['micro_batch']}")
    print(f"launch to first step: fixed micro-batch {startup['fixed']:.2f} s, auto {startup['auto']:.2f} s "
          f"(probe {auto['probe_s']:.2f} s, {100 * auto['probe_s'] / startup['auto']:.0f}% of it)")  # fmt: skip
    for case, (shrunk, redone, plain) in survived.items():
        print(f"out of memory in rank 1's {case} micro-batch of step {shrunk['step']} ({shrunk['was']} -> "
              f"{shrunk['micro_batch']}, ranks {shrunk['ranks']}): that step {redone:.2f} s, the same step at "
              f"{shrunk['micro_batch']} in a run that never ran out {plain:.2f} s: {redone - plain:+.2f} s "
              f"({redone / plain:.2f}x; a normal step at 4: {normal:.2f} s)")  # fmt: skip
    print(f"train.invariant under ulimit -v {inv['limit_mib']:.0f} MiB: step {args.heavy_step} ran out and was done "
          f"again recomputing activations: {inv['redone']:.2f} s vs {inv['free']:.2f} s without a limit; steps "
          f"before {inv['before']:.2f} vs {inv['before_free']:.2f} s, after (recomputing) {inv['after']:.2f} vs "
          f"{inv['after_free']:.2f} s ({inv['after'] / inv['after_free']:.2f}x)")  # fmt: skip
    print(f"the guard of a step that does not run out (streams and sums kept, one all-reduce of the flags, 2 ranks): "
          f"{each * 1e3:.3f} ms a step ({100 * each / normal:.2f}% of a normal step above)")  # fmt: skip


if __name__ == "__main__":
    main()
