"""What an adaptive sweep's study costs per trial: the worker's ask (under the ask-lock, the budget re-read from
search.json) plus the trainer's reports plus the tell, on the journal file (``ddp_core.search.study``), for N trials
in one process, and the same without the journal (Optuna's in-memory storage) as the floor.

    .venv/bin/python bench/search_overhead.py [--trials 1000] [--sampler tpe] [--evals 3]

``rows()`` returns the table's rows as dicts (for an aggregator); ``main()`` prints them as markdown.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from ddp_core.search.study import JOURNAL_FILE, ask, create_study, distributions, open_storage, write_spec

PARAMS = {"optim.lr": {"dist": "loguniform", "low": 1e-5, "high": 1e-1},
          "task.model.hidden": {"dist": "randint", "low": 16, "high": 513, "step": 16}}  # fmt: skip


def objective(params: dict[str, Any]) -> float:
    return (math.log10(params["optim.lr"]) + 3) ** 2 + params["task.model.hidden"] / 512


def one(trials: int, sampler: str, evals: int, journal: bool) -> dict[str, Any]:
    import optuna

    with tempfile.TemporaryDirectory() as name:
        folder = Path(name)
        spec = {"name": "bench", "sampler": sampler, "pruner": "median", "seed": 0, "direction": "minimize",
                "metric": "eval/loss", "budget": trials, "parallelism": 1, "params": PARAMS}  # fmt: skip
        write_spec(folder, spec)
        storage = open_storage(str(folder / JOURNAL_FILE)) if journal else optuna.storages.InMemoryStorage()
        study = create_study(storage, spec)
        dists = distributions(PARAMS)
        started = time.perf_counter()
        for _ in range(trials):
            trial = ask(folder, study, "1:0") if journal else study.ask(dists)
            assert trial is not None
            value = objective(trial.params)
            for step in range(evals):
                trial.report(value * (evals - step), step)
                trial.should_prune()
            study.tell(trial, value)
        elapsed = time.perf_counter() - started
        size = (folder / JOURNAL_FILE).stat().st_size if journal else 0
    return {"storage": "journal file" if journal else "in memory", "sampler": sampler, "trials": trials,
            "evals_per_trial": evals, "ms_per_trial": round(1000 * elapsed / trials, 2),
            "total_s": round(elapsed, 1), "journal_kb": size // 1024}  # fmt: skip


def rows(trials: int = 1000, sampler: str = "tpe", evals: int = 3) -> list[dict[str, Any]]:
    return [one(trials, sampler, evals, journal=True), one(trials, sampler, evals, journal=False)]


def summary(quick: bool = False) -> list[dict[str, Any]]:
    """The ratio line of ``bench/run``: per trial on the journal file against Optuna's in-memory storage."""
    journal, memory = rows(trials=300 if quick else 1000, sampler="random")
    return [{
        "case": f"adaptive sweep study, {journal['trials']} trials (random sampler, ask + 3 reports + tell): "
                "journal file vs in memory",
        "baseline": f"{memory['ms_per_trial']:.1f} ms/trial", "ddpjob": f"{journal['ms_per_trial']:.1f} ms/trial",
        "ratio": journal["ms_per_trial"] / memory["ms_per_trial"], "target": "", "met": None,
    }]  # fmt: skip


def table(results: list[dict[str, Any]]) -> str:
    head = list(results[0])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join([*lines, *("| " + " | ".join(str(r[k]) for k in head) + " |" for r in results)])


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=1000)
    parser.add_argument("--sampler", default="tpe", choices=("tpe", "random"))
    parser.add_argument("--evals", type=int, default=3, help="intermediate reports (+ should_prune) per trial")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args(argv)
    results = rows(args.trials, args.sampler, args.evals)
    print(f"study overhead per trial (ask under the ask-lock + {args.evals} reports + tell), one process")
    print(table(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
