"""What ``ddpjob doctor`` reads from a run (else the config's defaults): its newest measured save time and the
settings that decide what a preemption or a time limit costs it, with its Slurm request as the submission pipeline
resolves it (``jobs.submission.request``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from ddp_core.errors import DdpJobError
from ddp_core.run.rundir import RunDir
from jobs.runs.lookup import find_runs, resolve

RECENT_SAVES = 5  # the newest saves say how long one takes now (the optimizer state may have grown)


@dataclass(frozen=True)
class RunInfo:
    """What a run says about its checkpoints; the config's defaults where there is no run."""

    path: Optional[Path]
    save_s: Optional[float]
    sigterm_budget_s: float
    signal_lead_s: int
    signal: str
    every_steps: int
    qos: Optional[str]
    nodes: tuple[Any, int, int] = (1, 1, 1)  # slurm.nodes as given, its MIN and its MAX
    image: Optional[str] = None  # slurm.container's apptainer image: the compute-node probe looks inside it
    deadline_margin_s: int = 30  # slurm.deadline_margin_s: the trainer's own stop before the time limit


def save_cost(record: dict[str, Any]) -> Optional[float]:
    """What a checkpoint record says a synchronous save (a signal's) costs: ``save_s``, the time training blocked,
    or ``write_s``, a background save's time from start to manifest, whichever is larger."""
    times = [float(t) for t in (record.get("save_s"), record.get("write_s")) if isinstance(t, (int, float))]
    return max(times) if times else None


def read_run(run: Optional[Path], root: Path = Path("runs")) -> RunInfo:
    """``run``'s largest recent save time and its settings; without ``run``, the newest run under ``root`` that
    measured a save."""
    run = resolve(str(run), root) if run is not None else None
    runs = [p for p in find_runs(root) if RunDir(p).metrics_file.is_file()] if run is None and root.is_dir() else []
    runs.sort(key=lambda p: RunDir(p).metrics_file.stat().st_mtime, reverse=True)
    for path in [run] if run is not None else runs:
        costs = [save_cost(r) for r in RunDir(path).metrics() if r["split"] == "checkpoint"]
        saves = [s for s in costs if s is not None]
        if saves:
            return settings(path, float(max(saves[-RECENT_SAVES:])))
    return settings(run, None)


def settings(path: Optional[Path], save_s: Optional[float]) -> RunInfo:
    """The run's config (else the defaults), and its Slurm request as the pipeline resolves it."""
    from ddp_core.config import load_config
    from jobs.submission.request import SlurmRequest

    cfg = None
    if path is not None:
        try:
            cfg = RunDir(path).load_config()
        except DdpJobError:
            pass  # an older or hand-edited config: the defaults still say what the trainer does
    cfg = cfg or load_config(None, ["run.name=doctor"])
    ckpt, slurm, request = cfg.checkpoint, cfg.slurm, SlurmRequest.resolve(cfg)
    sig = request.signal.partition("@")[0] if request.signal else "none"  # none: no warning signal
    nodes = (request.nodes, request.min_nodes, request.max_nodes)
    image = slurm.container.image if slurm.container.runtime == "apptainer" else None
    return RunInfo(
        path, save_s, ckpt.sigterm_budget_s, slurm.signal_lead_s, sig, ckpt.every_steps, slurm.qos, nodes, image,
        slurm.deadline_margin_s,
    )  # fmt: skip
