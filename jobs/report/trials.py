"""What a report is drawn from: the trials of a sweep (or the runs of a folder, or one run), each with its swept
values, its state, its curves and its value of the metric that ranks them.

Read from the run directories alone (``metrics.jsonl``, ``attempts.jsonl``, ``config.yaml``) and from what the sweep
recorded at submit: ``sweep.json`` (a grid or random sweep: every trial's overrides, loaded values and each key's
scale) or ``search.json`` with its Optuna study (an adaptive sweep). No torch, no plotting library, no Slurm: it
works on a laptop, and ``ddpjob report --table`` needs nothing more.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from ddp_core.run.rundir import CONFIG_FILE, RunDir
from jobs.sweeps.record import SWEEP_FILE, infer_scale

if TYPE_CHECKING:
    pass

NO_METRICS = "no metrics yet"
RECORD_KEYS = {"step", "time", "split"}  # bookkeeping fields of a metrics line, not metrics
IDENTITY_KEYS = {"run.name", "run.root", "slurm.job_name", "wandb.group"}  # differ per run, repeat the trial column
# The last event an attempt wrote -> the trial's state. A run with events but none of these is still running
# (or was stopped between attempts); one with no event at all has not started.
EVENT_STATES = {
    "completed": "complete",
    "pruned": "pruned",
    "failed": "fail",
    "hang": "fail",
    "budget_exhausted": "fail",
}
STATES = ("complete", "running", "pruned", "fail", "pending")

Points = list[tuple[int, float]]


@dataclass(eq=False)  # compared by identity: a report ranks and looks up a thousand of them
class Trial:
    name: str  # the run directory relative to the sweep (the trial id), or the run's own name
    path: Path
    curves: dict[str, Points]  # "train/loss", "eval/accuracy", ... -> (step, value) sorted by step
    params: dict[str, Any] = field(default_factory=dict)  # swept key -> this trial's value
    state: str = "pending"  # one of STATES
    overrides: tuple[str, ...] = ()  # key=value as the sweep submitted it (fixed + swept): reruns it
    config: dict[str, Any] = field(default_factory=dict)  # flattened config.yaml (read only where needed)
    value: Optional[float] = None  # the ranking metric: final, or the best so far when it is checkpoint.monitor

    def final(self, key: str) -> Optional[float]:
        points = self.curves.get(key)
        return points[-1][1] if points else None

    def last_step(self) -> Optional[int]:
        return max((pts[-1][0] for pts in self.curves.values()), default=None)

    @property
    def is_script(self) -> bool:
        return bool(self.config.get("script.path") or self.config.get("script.module"))


@dataclass
class Sweep:
    """A report's subject: ``kind`` is ``run`` (one run), ``runs`` (a folder of runs), ``sweep`` (grid/random) or
    ``search`` (adaptive)."""

    root: Path
    kind: str
    trials: list[Trial]
    keys: list[str]  # the swept keys, in the sweep's order
    scales: dict[str, str]  # key -> log | linear | choice
    metric: str  # e.g. "eval/accuracy"
    minimise: bool
    monitored: bool = False  # values are the best per checkpoint.monitor, not the final ones
    base_config: Optional[str] = None  # what the rerun command submits (None: the trial's own config.yaml)
    study: Any = None  # the adaptive sweep's Optuna study (jobs.sweeps.search.summary), else None

    @property
    def best(self) -> Optional[Trial]:
        """The best finite value among complete trials; among all when none is complete (first in order on ties)."""
        scored = [t for t in self.trials if t.value is not None and math.isfinite(t.value)]
        done = [t for t in scored if t.state == "complete"] or scored
        if not done:
            return None
        return (min if self.minimise else max)(done, key=lambda t: t.value if t.value is not None else 0.0)

    def ranked(self) -> list[Trial]:
        """Best first; trials without a finite value last, in directory order."""
        scored = [t for t in self.trials if t.value is not None and math.isfinite(t.value)]
        scored.sort(key=lambda t: (t.value or 0.0) * (1 if self.minimise else -1))
        best = self.best
        if best is not None:  # a complete best outranks a running trial that is ahead for now
            scored.remove(best)
            scored.insert(0, best)
        kept = {id(t) for t in scored}
        return scored + [t for t in self.trials if id(t) not in kept]

    def counts(self) -> dict[str, int]:
        return {s: sum(1 for t in self.trials if t.state == s) for s in STATES}


def curves(records: list[dict[str, Any]]) -> dict[str, Points]:
    out: dict[str, Points] = {}
    for record in records:
        for key, value in record.items():
            # NaN/inf are kept (a diverged run must show "nan" in the table); the plots skip them.
            if key not in RECORD_KEYS and isinstance(value, (int, float)) and not isinstance(value, bool):
                out.setdefault(f"{record['split']}/{key}", []).append((record["step"], float(value)))
    return {key: sorted(points) for key, points in out.items()}


def read_config(run_dir: Path) -> dict[str, Any]:
    """config.yaml flattened to dotted keys, read as plain YAML (libyaml when present); {} when unreadable."""
    import yaml  # lazily: keeps ``import jobs.report`` cheap

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    try:
        data = yaml.load((run_dir / CONFIG_FILE).read_bytes(), Loader=loader)
    except (OSError, ValueError, RecursionError, yaml.YAMLError):  # ValueError: not UTF-8
        return {}  # the table just shows no config columns for it; the curves still count

    from ddp_core.config.tree import flatten  # lazily, as yaml: the config package is not for importing a report

    return flatten(data) if isinstance(data, dict) else {}


def state_of(run: RunDir, has_metrics: bool) -> str:
    decided = [e["event"] for e in run.events() if e["event"] not in ("rank_failed", "failure", "excluded")]
    if decided:
        return EVENT_STATES.get(decided[-1], "running")
    return "running" if has_metrics else "pending"


def override_value(text: str) -> Any:
    """An override's text as the value it loads to, for sweeps recorded before sweep.json kept loaded values."""
    import yaml

    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def sweep_record(path: Path) -> Optional[dict[str, Any]]:
    try:
        data = json.loads((path / SWEEP_FILE).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("trials"), dict) else None


def scales_of(keys: list[str], trials: list[Trial], recorded: dict[str, str]) -> dict[str, str]:
    return {k: recorded.get(k) or infer_scale([t.params[k] for t in trials if k in t.params]) for k in keys}
