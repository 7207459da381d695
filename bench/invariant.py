"""The cost of world-size-invariant training (``train.invariant``): ms per step against plain ddp at the same global
batch and micro-batch (the same accumulation), at 1 and 2 ranks, for the digits MLP and the char LM (dropout on),
and the gradient bytes each rank receives per step (the trainer's start line: this mode's all-gather of subtree sums
against a ring all-reduce of the same gradients).

Runs come in ABBA pairs (plain then invariant, then invariant then plain); a case's ratio is the median of its
pairs' ratios, so the VM's drift cancels inside each pair. A step's time is the mean between the first and the last
progress line of ``metrics.jsonl`` (the first step, with its warm-up, is left out).

    .venv/bin/python bench/invariant.py [--pairs 2] [--steps 60] [--ranks 1 2] [--tasks "char LM"] [--override K=V ...]

On a machine with CUDA the trainer trains on the GPUs (a rank per GPU: ``--ranks`` at most the GPU count);
``--override`` applies to every run of both modes, after the task's own settings (a GPU-sized char LM, say).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the other benchmarks, also when run from elsewhere
from strategies import train

ROOT = Path(__file__).resolve().parent.parent
COMMON = ["train.eval_every=0", "train.log_every=1", "checkpoint.every_steps=0", "wandb.mode=disabled",
          "optim.warmup_steps=0", "task.model.dropout=0.1", "train.stop_check_ms=100"]  # fmt: skip
TASKS = {  # 4 micro-batch shards per step: 4 per rank at 1 rank, 2 at 2 ranks
    "digits MLP": ("digits.yaml", ["data.batch_size=16", "data.global_batch_size=64"]),
    "char LM": ("charlm.yaml", ["data.batch_size=8", "data.global_batch_size=32", "task.data.max_chars=200000"]),
}
EXCHANGE = re.compile(r"gradient exchange (\d+) bytes per rank per step \(a ring all-reduce: (\d+)\)")


def run(
    task: str, ranks: int, invariant: bool, steps: int, tmp: Path, more: Sequence[str] = ()
) -> tuple[float, tuple[int, int] | None]:
    """Seconds per step, and (this mode's, a ring all-reduce's) gradient bytes per rank per step if invariant."""
    config, extra = TASKS[task]
    run_dir = tmp / f"run{len(list(tmp.iterdir()))}"
    overrides = [*COMMON, *extra, *more, f"train.max_steps={steps}", f"train.invariant={str(invariant).lower()}"]
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))  # a GPU box's own packages kept
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path)
    seconds, stderr = train(ranks, str(ROOT / "configs" / config), overrides, run_dir, env)
    found = EXCHANGE.search(stderr)
    return seconds, (int(found[1]), int(found[2])) if found else None


def rows(
    pairs: int = 2,
    steps: int = 60,
    ranks_list: Sequence[int] = (1, 2),
    tasks: Sequence[str] = tuple(TASKS),
    more: Sequence[str] = (),
) -> list[dict[str, Any]]:
    """Per task and rank count: both modes' median ms per step, the median of the pairs' ratios, the bytes."""
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for task in tasks:
            task_steps = steps if task == "digits MLP" else steps // 2
            for ranks in ranks_list:
                times: dict[bool, list[float]] = {False: [], True: []}
                ratios, exchange = [], None
                for pair in range(pairs):
                    order = (False, True) if pair % 2 == 0 else (True, False)
                    got = {}
                    for invariant in order:
                        got[invariant], found = run(task, ranks, invariant, task_steps, Path(tmp), more)
                        exchange = found or exchange
                        times[invariant].append(got[invariant])
                    ratios.append(got[True] / got[False])
                out.append({"bench": "invariant", "task": task, "ranks": ranks, "steps": task_steps,
                            "plain_ms": 1000 * statistics.median(times[False]),
                            "invariant_ms": 1000 * statistics.median(times[True]),
                            "ratio": statistics.median(ratios), "ratios": ratios,
                            "exchange_bytes": exchange[0] if exchange else 0,
                            "ring_bytes": exchange[1] if exchange else 0})  # fmt: skip
    return out


def summary(quick: bool = False) -> list[dict[str, Any]]:
    """The lines of ``bench/run``: each case's step time against plain ddp (target 1.10x), and at 2 ranks the
    gradient bytes per rank per step against a ring all-reduce's."""
    lines = []
    for r in rows(pairs=1 if quick else 2, steps=40 if quick else 60):
        lines.append({
            "case": f"{r['task']} step, {r['ranks']} rank{'s' if r['ranks'] > 1 else ''}: train.invariant vs plain "
                    "ddp, same global batch", "baseline": f"{r['plain_ms']:.1f} ms",
            "ddpjob": f"{r['invariant_ms']:.1f} ms", "ratio": r["ratio"], "target": "<= 1.10x",
            "met": r["ratio"] <= 1.10,
        })  # fmt: skip
        if r["ranks"] > 1:
            lines.append({
                "case": f"{r['task']}, {r['ranks']} ranks: gradient bytes received per rank per step, all-gather of "
                        "subtree sums vs ring all-reduce", "baseline": f"{r['ring_bytes']} B",
                "ddpjob": f"{r['exchange_bytes']} B", "ratio": r["exchange_bytes"] / max(1, r["ring_bytes"]),
                "target": "", "met": None,
            })  # fmt: skip
    return lines


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--tasks", nargs="+", choices=list(TASKS), default=list(TASKS))
    parser.add_argument("--override", nargs="*", default=[], metavar="K=V", help="for every run, after the task's")
    args = parser.parse_args()
    for r in rows(args.pairs, args.steps, args.ranks, args.tasks, args.override):
        pairs = ", ".join(f"{x:.3f}" for x in r["ratios"])
        print(f"{r['task']:>10}, {r['ranks']} rank(s): plain {r['plain_ms']:6.1f} ms/step, invariant "
              f"{r['invariant_ms']:6.1f} ms/step, {r['ratio']:.3f}x (pairs {pairs}); gradient bytes per rank per "
              f"step {r['exchange_bytes']} (ring all-reduce {r['ring_bytes']})")  # fmt: skip


if __name__ == "__main__":
    main()
