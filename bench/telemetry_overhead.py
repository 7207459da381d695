"""The framework tax at one rank, and what the telemetry costs (issue: "no framework tax"), in one invocation: ms/step
of ddpjob's trainer against the hand-written DDP loop of ``bench/step_overhead.py`` at the tiny MLP (width 64) and the
width-1024 one, and the trainer's step with the telemetry on against off, in one run.

* **Against the hand-written loop**: pairs of runs in ABBA order, the ratio the median of the pairs' own ratios (as
  ``step_overhead``: the same model, data, optimizer and timed window, steps 50..N on rank 0, fresh processes bound to
  a CPU each). ddpjob's figure is its steps with the telemetry on (the default).
* **Telemetry on against off, in one run**: each ddpjob run switches its telemetry (``Telemetry.on``) every
  ``--block`` steps (a multiple of ``train.log_every``, so each block holds the same number of progress lines), on,
  off, on, ... Each pair of neighbouring blocks gives a ratio of their mean step times; the figure is the median
  over every pair of every run. Neighbouring blocks are a fraction of a second apart in the same process: the drift
  that moves separate runs of one loop by 2x within minutes on a shared 2-core VM cancels, which pairs of runs
  cannot do at 1%.
* ``telemetry_work_us``: the telemetry's own work timed in this process, exactly: the per-step clock read
  (``Telemetry.tick``) and, once per progress line, this rank's fields and the line's figures (``local``,
  ``combine``), per step at ``train.log_every`` 25 (digits.yaml's).

    .venv/bin/python bench/telemetry_overhead.py [--pairs 4] [--widths 64 1024] [--block 50] [--override K=V ...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the other benchmarks, also when run from elsewhere
from step_overhead import WINDOW_START, Options, finish, start

TAX_TARGET = 1.05  # the trainer's step at one rank against the hand-written loop's
TELEMETRY_TARGET = 1.01  # the telemetry on against off
BLOCK = 50  # steps per block of the in-run A/B: two progress lines at log_every 25
BLOCK_ENV = "DDPJOB_BENCH_AB_BLOCK"
SETUP = "telemetry_overhead:ab_switch"
AB_STEPS = {64: 2050, 1024: 450}  # per ddpjob run: the window (steps 50..N) in whole blocks


def run_ab(width: int, tmp: Path, block: int, extra: Sequence[str]) -> dict[str, Any]:
    """One ddpjob run switching its telemetry every ``block`` steps; its on/off step times, rank 0's."""
    steps = AB_STEPS.get(width, WINDOW_START + 8 * block)
    os.environ[BLOCK_ENV] = str(block)  # the workers' environment is this process's
    run = start("ddpjob", 1, width, steps, WINDOW_START, tmp, Options(overrides=tuple(extra), setup=SETUP))
    result = finish(run, steps, WINDOW_START)
    ends = result["ends"]  # perf_counter after steps WINDOW_START..steps
    blocks = []
    for first in range(WINDOW_START, steps - block + 1, block):  # block k: steps first+1 .. first+block
        i = first - WINDOW_START
        blocks.append(1000 * (ends[i + block] - ends[i]) / block)
    on, off = blocks[0::2], blocks[1::2]  # the telemetry is on in the first block (see ab_worker)
    pairs = [a / b for a, b in zip(on, off, strict=False)]  # an odd last block has no pair
    return {"on_ms": statistics.median(on), "off_ms": statistics.median(off), "pair_ratios": pairs}


def measure(widths: Sequence[int], pairs: int, block: int, extra: Sequence[str] = ()) -> list[dict[str, Any]]:
    out = []
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        finish(start("raw", 1, 64, 60, 10, tmp), 60, 10)  # warm the page cache
        for width in widths:
            raw_steps = AB_STEPS.get(width, WINDOW_START + 8 * block)  # ddpjob's: the same schedule over the window
            raw: list[float] = []
            ab: list[dict[str, Any]] = []
            for i in range(2 * pairs):
                for kind in ("raw", "ddpjob") if i % 2 == 0 else ("ddpjob", "raw"):
                    if kind == "raw":
                        raw.append(finish(start("raw", 1, width, raw_steps, WINDOW_START, tmp), raw_steps,
                                          WINDOW_START)["ms_per_step"])  # fmt: skip
                    else:
                        ab.append(run_ab(width, tmp, block, extra))
            ratios = [r["pair_ratios"] for r in ab]
            out.append({
                "bench": "telemetry_overhead", "width": width, "ranks": 1, "pairs": 2 * pairs, "block": block,
                "raw_ms": statistics.median(raw), "on_ms": statistics.median(r["on_ms"] for r in ab),
                "off_ms": statistics.median(r["off_ms"] for r in ab),
                "on_vs_raw": statistics.median(a["on_ms"] / r for a, r in zip(ab, raw, strict=True)),
                "off_vs_raw": statistics.median(a["off_ms"] / r for a, r in zip(ab, raw, strict=True)),
                "on_vs_off": statistics.median(x for run in ratios for x in run),
                "block_pairs": sum(len(run) for run in ratios),
                "runs_on_vs_off": [round(statistics.median(run), 4) for run in ratios],
                "raw_runs_ms": [round(r, 3) for r in raw], "on_runs_ms": [round(a["on_ms"], 3) for a in ab],
            })  # fmt: skip
    return out


def telemetry_work_us(log_every: int = 25, lines: int = 2000) -> float:
    """The telemetry's own work per step (microseconds): ``log_every`` ticks and one line's fields and figures."""
    import torch

    from ddp_core.cluster.env import DistEnv
    from ddp_core.config import load_config
    from ddp_core.distributed.straggler import WorkTimer
    from ddp_core.tasks.digits import DigitsTask
    from ddp_core.trainer.telemetry import Telemetry

    cfg = load_config(Path(__file__).resolve().parent.parent / "configs" / "digits.yaml", ["train.peak_tflops=1"])
    task = DigitsTask()
    telemetry = Telemetry(cfg, DistEnv.from_env({}), torch.device("cpu"), task, task.build_model(**cfg.task.model))
    work = WorkTimer(torch.device("cpu"))
    started = time.perf_counter()
    for _ in range(lines):
        for _ in range(log_every):
            telemetry.tick()
        telemetry.combine([telemetry.local(log_every, work)], 1.5, 32)
    return 1e6 * (time.perf_counter() - started) / (lines * log_every)


def table(rows: Sequence[dict[str, Any]], work_us: Optional[float]) -> str:
    lines = [
        "| width | hand-written ms/step | ddpjob, telemetry on | ddpjob / hand-written | in one run: telemetry on "
        "| off | on / off (block pairs) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['width']} | {r['raw_ms']:.3f} | {r['on_ms']:.3f} | {r['on_vs_raw']:.3f}x | {r['on_ms']:.3f} "
            f"| {r['off_ms']:.3f} | {r['on_vs_off']:.4f}x ({r['block_pairs']}) |"
        )
    if work_us is not None and rows:
        tiny = min(rows, key=lambda r: r["width"])
        share = work_us / (1000 * tiny["on_ms"])
        lines.append(f"\ntelemetry's own work: {work_us:.2f} us per step at train.log_every 25, {100 * share:.3f}% of "
                     f"the width-{tiny['width']} step ({tiny['on_ms']:.3f} ms)")  # fmt: skip
    return "\n".join(lines)


def summary(quick: bool = False) -> list[dict[str, Any]]:
    rows = measure([64, 1024], 2 if quick else 4, BLOCK)
    out = []
    for r in rows:
        for case, key, baseline, target in (
            ("ddpjob (telemetry on) vs hand-written DDP loop", "on_vs_raw", "raw", TAX_TARGET),
            ("telemetry on vs off, in one run", "on_vs_off", "off", TELEMETRY_TARGET),
        ):
            out.append({
                "case": f"step time, MLP width {r['width']}, 1 rank, {case}",
                "baseline": f"{r[baseline + '_ms']:.2f} ms",
                "ddpjob": f"{r['on_ms']:.2f} ms", "ratio": r[key], "target": f"<= {target:.2f}x",
                "met": r[key] <= target,
            })  # fmt: skip
    return out


def ab_switch() -> Any:
    """In a ddpjob worker of step_overhead, before it trains: the callback after each step's stamp that switches the
    telemetry every ``BLOCK_ENV`` steps of the window, on in its first block, off in the next, and so on. The switch
    comes after the step's optimizer update, before its progress line (if it has one): each block holds the same
    lines."""
    from ddp_core.trainer import telemetry

    made: list[Any] = []
    original = telemetry.Telemetry.__init__

    def keep(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        made.append(self)

    telemetry.Telemetry.__init__ = keep  # type: ignore[method-assign]
    block = int(os.environ[BLOCK_ENV])

    def switch(n: int) -> None:
        if made and n >= WINDOW_START and (n - WINDOW_START) % block == 0:
            made[0].on = (n - WINDOW_START) // block % 2 == 0

    return switch


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=4, help="ABBA pairs per width: 4 gives 8 runs of each kind")
    parser.add_argument("--widths", type=int, nargs="+", default=[64, 1024])
    parser.add_argument("--block", type=int, default=BLOCK, help="steps per telemetry block (a multiple of 25)")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override for ddpjob's runs, e.g. optim.implementation=for_loop")  # fmt: skip
    args = parser.parse_args(argv)
    rows = measure(args.widths, args.pairs, args.block, args.override)
    print(f"1 rank; ddpjob vs hand-written: {2 * args.pairs} runs each in ABBA pairs, the median of the pairs' ratios; "
          f"telemetry on/off: switched every {args.block} steps within each ddpjob run, the median of neighbouring "
          "blocks' ratios")  # fmt: skip
    print(table(rows, telemetry_work_us()))
    for r in rows:
        print(f"width {r['width']}: hand-written runs {r['raw_runs_ms']} ms, ddpjob (on) {r['on_runs_ms']} ms, "
              f"on/off per run {r['runs_on_vs_off']}")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
