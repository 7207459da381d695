"""Per-step cost of ddpjob's trainer against the hand-written DDP loop, free of the machine's drift: both run at once.

``step_overhead.py`` runs the two loops one after the other. On a shared VM the speed of the same run drifts by
+-20% over minutes (3.5 to 5.1 ms per step for the same loop here, minutes apart), so its pairs' ratios scatter by
+-10% and it takes many pairs to resolve a few percent. Here a raw run and a ddpjob run start together, with the
same ranks and steps, and rank r of both is bound to CPU r: the two kinds share every CPU for the whole time, so
whatever the machine does hits both alike. Each kind's step time is its mean over the steps both ran at the same
time (rank 0's step ends, in the span where both were inside their timed windows).

This is a contention regime, not a job alone on its node: each CPU runs one rank of each kind, so a step's time is
set by the CPU the kind uses per step (the other kind takes the rest). It answers "does ddpjob's step cost more CPU
than the hand-written one's", with a spread of about 1% between repeats. The kind started first lags a little at
the start, so the start order alternates between repeats; ``--control`` also runs raw against raw, the method's own
bias and noise floor in the same invocation.

    .venv/bin/python bench/step_concurrent.py [--repeats 4] [--width 64] [--ranks 2] [--control] [--override K=V]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path
from typing import Any, Optional, Sequence

import step_overhead as so


def overlapped_ms(a: list[float], b: list[float]) -> tuple[float, float]:
    """Mean step (ms) of each of two runs over the span where both were stepping: each run's steps that ended
    inside it, from the step ends (perf_counter, one clock for every process)."""
    lo, hi = max(a[0], b[0]), min(a[-1], b[-1])
    if hi <= lo:
        raise RuntimeError("the two runs did not overlap: lengthen them with --steps")

    def mean(ends: list[float]) -> float:
        inside = [t for t in ends if lo <= t <= hi]
        return 1000 * (inside[-1] - inside[0]) / max(1, len(inside) - 1)

    return mean(a), mean(b)


def measure(
    kinds: tuple[str, str], width: int, ranks: int, repeats: int, steps: int, opts: so.Options
) -> list[dict[str, Any]]:
    """``repeats`` runs of the two kinds at once; the first kind starts first in even repeats, second in odd."""
    rows = []
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        so.launch("raw", 1, 64, 60, 10, tmp)  # warm the page cache
        for i in range(repeats):
            order = kinds if i % 2 == 0 else kinds[::-1]
            started = [so.start(kind, ranks, width, steps, so.WINDOW_START, tmp, opts) for kind in order]
            done = [so.finish(run, steps, so.WINDOW_START) for run in started]
            a, b = done if i % 2 == 0 else done[::-1]
            a_ms, b_ms = overlapped_ms(a["ends"], b["ends"])
            rows.append({"kinds": kinds, "first": order[0], "a_ms": a_ms, "b_ms": b_ms, "ratio": b_ms / a_ms})
    return rows


def rows(repeats: int = 4) -> list[dict[str, Any]]:
    """The default comparison (width 64, 2 ranks, raw against ddpjob) as dicts, for an aggregator."""
    return measure(("raw", "ddpjob"), 64, 2, repeats, 2000, so.Options())


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2000, help="steps per run (both kinds)")
    parser.add_argument("--control", action="store_true", help="also raw against raw: the method's bias and noise")
    parser.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override for ddpjob's runs (repeatable)")  # fmt: skip
    args = parser.parse_args(argv)
    opts = so.Options(overrides=tuple(args.override))
    pairs: list[tuple[str, str]] = [("raw", "ddpjob")] + ([("raw", "raw")] if args.control else [])
    print(f"MLP width {args.width}, {args.ranks} ranks, {args.steps} steps; rank r of both runs on CPU r")
    print("| A | B | started first | A ms/step | B ms/step | B/A |")
    print("|---|---|---|---|---|---|")
    for kinds in pairs:
        results = measure(kinds, args.width, args.ranks, args.repeats, args.steps, opts)
        for r in results:
            print(f"| {kinds[0]} | {kinds[1]} | {r['first']} | {r['a_ms']:.3f} | {r['b_ms']:.3f} | {r['ratio']:.3f} |")
        ratios = [r["ratio"] for r in results]
        print(f"| {kinds[0]} | {kinds[1]} | median of {len(results)} | | | **{statistics.median(ratios):.3f}** "
              f"(min {min(ratios):.3f}, max {max(ratios):.3f}) |")  # fmt: skip


if __name__ == "__main__":
    main()
