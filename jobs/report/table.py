"""The trial table: one row per trial, best first (swept values, the ranking metric, state, steps, every final metric,
the run directory), as ``ddpjob report SWEEP --table csv|json`` writes it for pandas, and the commands that rerun a
trial as a single run or resume it.
"""

from __future__ import annotations

import csv
import json
import math
import shlex
from pathlib import Path
from typing import Any, Optional

from ddp_core.errors import DdpJobError
from ddp_core.run.rundir import CONFIG_FILE
from jobs.report.trials import Sweep, Trial

TABLE_FORMATS = ("csv", "json")


# A single run's throughput, MFU and memory (ddp_core.trainer.telemetry), drawn beside its loss where its lines have
# them; a sweep's trials compare by their metric, and these would only crowd its charts.
PERFORMANCE = ("train/samples_per_s", "train/tokens_per_s", "train/mfu", "train/peak_mem_gb", "train/peak_rss_gb")


def metric_keys(sweep: Sweep) -> list[str]:
    """train/loss and eval/* (what the trainer's runs have), a single run's performance beside its loss, plus
    everything a script run logged."""
    keys = {key for t in sweep.trials for key in t.curves}
    performance = [k for k in PERFORMANCE if k in keys] if sweep.kind == "run" else []
    first = [k for k in ("train/loss",) if k in keys] + performance + sorted(k for k in keys if k.startswith("eval/"))
    chosen = {key for t in sweep.trials if t.is_script for key in t.curves}
    return first + sorted(chosen - set(first))


def rerun_command(sweep: Sweep, trial: Trial) -> str:
    """``ddpjob submit`` of the trial as a single run: the sweep's base config and the trial's overrides, or, where
    the sweep recorded none (a folder of runs, a script's sweep without a base), the trial's own config.yaml."""
    if sweep.base_config and trial.overrides:
        return shlex.join(["ddpjob", "submit", sweep.base_config, *trial.overrides])
    return shlex.join(["ddpjob", "submit", str(trial.path / CONFIG_FILE)])


def resume_command(trial: Trial) -> str:
    return shlex.join(["ddpjob", "resume", str(trial.path)])


def rows(sweep: Sweep) -> list[dict[str, Any]]:
    """Every trial, best first; never one left out (a failed or pending trial has empty metric cells)."""
    keys = metric_keys(sweep)
    out = []
    for rank, t in enumerate(sweep.ranked(), 1):
        row: dict[str, Any] = {"rank": rank, "trial": t.name, "state": t.state}
        row |= {k: t.params.get(k) for k in sweep.keys}
        row |= {sweep.metric + (" (best)" if sweep.monitored else ""): t.value, "last_step": t.last_step()}
        row |= {f"final {k}": t.final(k) for k in keys}
        row["run_dir"] = str(t.path)
        out.append(row)
    return out


def _json_value(value: Any) -> Any:
    # Strict JSON has no NaN: a diverged metric becomes null (the CSV keeps nan, which pandas reads as a float).
    return None if isinstance(value, float) and not math.isfinite(value) else value


def write_table(sweep: Sweep, fmt: str, out_dir: Path) -> Path:
    if fmt not in TABLE_FORMATS:
        raise DdpJobError(f"--table {fmt} is not a table format", f"use one of {', '.join(TABLE_FORMATS)}")
    table = rows(sweep)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"trials.{fmt}"
    if fmt == "json":
        records = [{k: _json_value(v) for k, v in row.items()} for row in table]
        path.write_text(json.dumps(records, indent=1, default=str) + "\n", encoding="utf-8")
        return path
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(table[0]) if table else ["trial"])
        writer.writeheader()
        writer.writerows({k: _csv_value(v) for k, v in row.items()} for row in table)
    return path


def _csv_value(value: Any) -> Any:
    if value is None:
        return ""
    return json.dumps(value) if isinstance(value, (list, dict)) else value


def fmt(value: Optional[float]) -> str:
    return "—" if value is None else f"{value:.6g}"


def label(trial: Trial, keys: list[str]) -> str:
    """A trial as a reader knows it: its swept values (``lr=0.001 hidden=64``), else its directory name."""
    if not trial.params:
        return trial.name
    short = {k: k.rsplit(".", 1)[-1] for k in keys}
    if len(set(short.values())) < len(short):  # two keys end alike (optim.lr, sched.lr): keep them whole
        short = {k: k for k in keys}
    return " ".join(f"{short[k]}={value_text(trial.params[k])}" for k in keys if k in trial.params)


def value_text(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)
