"""Data loading hidden behind compute: the trainer's step time with a dataset whose ``__getitem__`` waits ~1 ms (a
read from a slow filesystem or object store), without and with DataLoader workers, against the same run on the
in-memory dataset (the baseline, measured in this script). With ``data.num_workers=2`` the workers fetch the next
batches while the step computes, so the step time returns to the baseline's. The workers persist across epochs
(``persistent_workers``): the runs span several epochs, and the table counts the worker processes that served
training batches (2 for the whole run, not 2 per epoch). One process, runs alternated, medians of each run's
logged ``step_ms`` (its first interval, start-up, left out); each ratio is the median of per-round ratios.

    .venv/bin/python bench/data_loading.py [--repeats 4] [--delay-ms 1]

``rows()`` returns the table's rows as dicts (for an aggregator); ``main()`` prints them as markdown.
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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's ddp_core, as the trainer's

from torch.utils.data import Dataset

from ddp_core.tasks.digits import DigitsTask

ROOT = Path(__file__).resolve().parent.parent
DIGITS = ROOT / "configs" / "digits.yaml"
BATCH_SIZE = 8
WIDTH = 1024  # a step of a few ms: enough compute for two workers to hide 8 x 1 ms of loading
STEPS = 450  # 1437 training images / 8: 179 steps an epoch, so 2.5 epochs
SETTINGS = {
    "in-memory dataset (baseline)": (0.0, 0),
    "slow dataset, num_workers=0": (None, 0),
    "slow dataset, num_workers=2": (None, 2),
}


class SlowDataset(Dataset):
    """``inner``, each item ``delay_s`` late; the process serving it is recorded (one empty file per pid)."""

    def __init__(self, inner: Dataset, delay_s: float, pids: Optional[Path]) -> None:
        self.inner, self.delay_s, self.pids = inner, delay_s, pids

    def __len__(self) -> int:
        return len(self.inner)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> Any:
        if self.pids is not None:
            (self.pids / str(os.getpid())).touch()
        time.sleep(self.delay_s)
        return self.inner[index]


class SlowDigitsTask(DigitsTask):
    """Digits whose training set waits ``delay_ms`` per item and records its pids under ``pids_dir``."""

    def __init__(self, delay_ms: float = 1.0, pids_dir: str = "", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.delay_s, self.pids = delay_ms / 1000, Path(pids_dir) if pids_dir else None

    def build_datasets(self) -> tuple[Dataset, Dataset]:
        train, evals = super().build_datasets()
        return SlowDataset(train, self.delay_s, self.pids), evals


def run(delay_ms: float, workers: int, tmp: Path) -> dict[str, float]:
    run_dir = Path(tempfile.mkdtemp(dir=tmp))
    pids = run_dir / "pids"
    pids.mkdir()
    cmd = [sys.executable, "-m", "ddp_core", str(DIGITS), "--run-dir", str(run_dir / "run"),
           "task.target=bench.data_loading:SlowDigitsTask", f"task.data.delay_ms={delay_ms}",
           f"task.data.pids_dir={pids}", f"task.model.hidden={WIDTH}", f"data.batch_size={BATCH_SIZE}",
           f"data.num_workers={workers}", f"train.max_steps={STEPS}", "train.log_every=25", "train.eval_every=0",
           "checkpoint.every_steps=0", "wandb.mode=disabled"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SUBMITIT_", "TORCHELASTIC_"))}
    env |= {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    subprocess.run(cmd, check=True, capture_output=True, env=env, cwd=ROOT)
    lines = [json.loads(line) for line in (run_dir / "run" / "metrics.jsonl").read_text().splitlines()]
    step_ms = [m["step_ms"] for m in lines if m.get("split") == "train"][1:]
    served = [int(p.name) for p in pids.iterdir()]
    return {"step_ms": statistics.median(step_ms), "processes": len(served)}


def rows(repeats: int = 4, delay_ms: float = 1.0) -> list[dict[str, Any]]:
    """Each round runs the three settings, in an order rotated from round to round; a setting's ratio is the median
    of its rounds' ratios to the baseline of the same round: the VM's drift (single runs of the same step move by
    20% within minutes here) cancels inside a round, as in ``bench/step_overhead.py``'s pairs."""
    names = list(SETTINGS)
    results: dict[str, list[dict[str, float]]] = {name: [] for name in SETTINGS}
    with tempfile.TemporaryDirectory() as name:
        for i in range(repeats):
            for setting in names[i % len(names) :] + names[: i % len(names)]:
                delay, workers = SETTINGS[setting]
                results[setting].append(run(delay_ms if delay is None else delay, workers, Path(name)))
    base = [r["step_ms"] for r in results[names[0]]]
    out = []
    for setting, runs in results.items():
        out.append({"bench": "data_loading", "setting": setting, "delay_ms": delay_ms, "batch_size": BATCH_SIZE,
                    "step_ms": statistics.median(r["step_ms"] for r in runs),
                    "ratio": statistics.median(r["step_ms"] / b for r, b in zip(runs, base, strict=True)),
                    "processes": max(r["processes"] for r in runs)})  # fmt: skip
    return out


def table(results: Sequence[dict[str, Any]]) -> str:
    lines = ["| setting | ms/step | vs baseline | processes serving training items |", "|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['setting']} | {r['step_ms']:.2f} | {r['ratio']:.2f}x | {r['processes']} |")
    return "\n".join(lines)


def summary(quick: bool = False) -> list[dict[str, Any]]:
    """The ratio lines of ``bench/run``: the slow dataset's step time against the in-memory one's."""
    results = rows(repeats=2 if quick else 4)
    base = results[0]
    return [{
        "case": f"{r['setting'].removeprefix('slow dataset, ')}, {r['delay_ms']:g} ms per item vs in-memory data",
        "baseline": f"{base['step_ms']:.2f} ms", "ddpjob": f"{r['step_ms']:.2f} ms", "ratio": r["ratio"],
        "target": "<= 1.10x (hidden)" if r["processes"] > 1 else "",
        "met": r["ratio"] <= 1.1 if r["processes"] > 1 else None,
    } for r in results[1:]]  # fmt: skip


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--delay-ms", type=float, default=1.0, help="per item")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args(argv)
    results = rows(args.repeats, args.delay_ms)
    print(f"trainer step time, 1 process, batch {BATCH_SIZE}, MLP width {WIDTH}, {STEPS} steps (2.5 epochs), "
          f"{args.delay_ms:g} ms per item; medians of {args.repeats} rounds, ratios within a round")  # fmt: skip
    print(table(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
