"""What ``bench/run`` runs: every benchmark of bench/ through its ``summary(quick)``, then one markdown table of
ratios (each against a baseline measured in the same invocation: the hand-written loop, ``import torch``,
``torch.save``+fsync, the in-memory dataset, one submit, one process), with the machine and versions on top.

A benchmark lists itself in ``BENCHES`` (module name, title) and provides ``summary(quick: bool) -> list[dict]``
with keys ``case``, ``baseline``, ``ddpjob`` (display strings), ``ratio`` (float), ``target`` (display string, empty
when none) and ``met`` (bool, or None without a target). A benchmark that fails is reported in the table and
the exit status is 1; the others still run.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from importlib import metadata
from pathlib import Path
from typing import Any, Optional, Sequence

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent

BENCHES = [
    ("step_overhead", "step overhead"),
    ("startup", "start-up"),
    ("checkpoint_save", "checkpoints"),
    ("data_loading", "data loading"),
    ("sweep_submit", "sweep submission"),
    ("search_overhead", "adaptive sweeps"),
    ("sweep_report", "sweep reports"),
    ("strategies", "strategies"),
    ("invariant", "world-size-invariant training"),
    ("local_checkpoint", "node-local checkpoints"),
    ("telemetry_overhead", "framework tax and telemetry"),
]


def machine() -> list[str]:
    """The lines on top of the table: where and with what the figures were measured."""
    import torch

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())  # fmt: skip
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    versions = {name: _version(name) for name in ("torch", "submitit", "omegaconf", "optuna", "wandb")}
    load = os.getloadavg()[0]
    return [
        f"- machine: {platform.node()}, {os.cpu_count()} CPUs ({cpu}), {mem_gib:.0f} GiB, "
        f"GPUs: {', '.join(gpus) or 'none'}; load average {load:.2f} at start",
        f"- versions: Python {platform.python_version()}, "
        + ", ".join(f"{k} {v}" for k, v in versions.items() if v)
        + f"; ddpjob {rev.stdout.strip() or 'unknown'}",
        f"- date: {datetime.datetime.now().isoformat(timespec='seconds')}; "
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}",
    ]


def _version(name: str) -> Optional[str]:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def run(names: Sequence[str], quick: bool) -> tuple[list[dict[str, Any]], bool]:
    sys.path.insert(0, str(BENCH))
    lines, ok = [], True
    for name, title in BENCHES:
        if name not in names:
            continue
        started = time.perf_counter()
        print(f"bench/run: {title} ...", file=sys.stderr, flush=True)
        try:
            results = importlib.import_module(name).summary(quick=quick)
        except Exception as err:  # one broken benchmark must not hide the others' figures
            traceback.print_exc()
            ok = False
            results = [{"case": f"FAILED: {type(err).__name__}: {err}"[:200], "baseline": "", "ddpjob": "",
                        "ratio": float("nan"), "target": "", "met": False}]  # fmt: skip
        took = time.perf_counter() - started
        print(f"bench/run: {title} took {took:.0f} s", file=sys.stderr, flush=True)
        lines += [{"bench": title, **r, "bench_s": round(took, 1)} for r in results]
    return lines, ok


def table(lines: Sequence[dict[str, Any]]) -> str:
    marks = {True: "yes", False: "**no**", None: ""}
    out = ["| benchmark | case | baseline | ddpjob | ratio | target | met |", "|---|---|---|---|---|---|---|"]
    for r in lines:
        out.append(f"| {r['bench']} | {r['case']} | {r['baseline']} | {r['ddpjob']} | {r['ratio']:.3f}x "
                   f"| {r['target']} | {marks[r['met']]} |")  # fmt: skip
    return "\n".join(out)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description="every benchmark in bench/, one markdown table of ratios")
    names = [name for name, _ in BENCHES]
    parser.add_argument("--quick", action="store_true", help="fewer repeats (minutes, noisier)")
    parser.add_argument("--only", nargs="+", choices=names, default=names, metavar="NAME",
                        help=f"run only these: {', '.join(names)}")  # fmt: skip
    parser.add_argument("--json", type=Path, help="also write the lines as JSON here")
    parser.add_argument("--markdown", type=Path, help="also write the output (markdown) here")
    args = parser.parse_args(argv)
    head = machine()
    started = time.perf_counter()
    lines, ok = run(args.only, args.quick)
    text = "\n".join([
        "## ddpjob benchmarks (bench/run" + (" --quick)" if args.quick else ")"), "", *head,
        f"- took {time.perf_counter() - started:.0f} s", "", table(lines),
    ])  # fmt: skip
    print(text)
    if args.markdown:
        args.markdown.write_text(text + "\n")
    if args.json:
        args.json.write_text(json.dumps({"machine": head, "lines": lines}, indent=1) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
