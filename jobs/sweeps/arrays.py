"""Submit a sweep as Slurm job arrays: one array per chunk of at most MaxArraySize trials, throttled with %N.

Each trial is a normal run in ``<run.root>/<sweep name>/<trial id>/`` (the id hashes its resolved overrides),
so preemption, exact resume, checkpoints and W&B (group = sweep name) work per trial. Submitting the same
sweep again skips completed and still-active trials and resumes the rest from their checkpoints. The
command returns as soon as the arrays are queued. Every task of the arrays runs what ``ddpjob submit`` would run
for its trial (``jobs.submission.submit.task_function``): the trainer, or the trial's script with its own arguments.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from ddp_core.cluster.failures import excluded_hosts
from ddp_core.cluster.slurm import GATEWAY
from ddp_core.config import Config
from ddp_core.errors import DdpJobError
from ddp_core.run.rundir import CODE_RECORD, RunDir, atomic_write_text
from jobs.submission import checks, snapshot
from jobs.submission.active import queued
from jobs.submission.render import Layout, render
from jobs.submission.request import SlurmRequest
from jobs.submission.submit import queue, submitted_or_withdrawn, task_function
from jobs.sweeps.record import SWEEP_FILE
from jobs.sweeps.spec import Sweep, Trial


@dataclass(frozen=True)
class TrialPlan:
    trial: Trial
    cfg: Config
    run_dir: RunDir
    action: str  # submit | resume | completed | active


def trial_config(sweep: Sweep, trial: Trial, cfg: Config) -> Config:
    """The trial's own run config: named after the trial, W&B-grouped under the sweep."""
    return dataclasses.replace(
        cfg,
        run=dataclasses.replace(cfg.run, name=f"{sweep.name}-{trial.trial_id}"),
        wandb=dataclasses.replace(cfg.wandb, group=cfg.wandb.group or sweep.name),
    )


def sweep_dir(sweep: Sweep) -> Path:
    return (Path(sweep.configs[0].run.root) / sweep.name).resolve()


def check_sweep(sweep: Sweep, local_check: bool = True) -> SlurmRequest:
    """Steps 1 and 2 of the submission pipeline (``jobs.submission.checks``), as ``submit`` takes them for one run:
    the code of every distinct script or task setting, and the place and the one request the array's tasks share,
    which it returns (named after the sweep)."""
    varying = {key for trial in sweep.trials for key in trial.params}
    # script.launcher too: it decides the request's tasks per node.
    shared = sorted(k for k in varying if k.startswith(("slurm.", "run.")) or k == "script.launcher")
    if shared:
        raise DdpJobError(
            f"sweep key '{shared[0]}' cannot vary: the trials of one array share its resources and run root",
            "set it once for the whole sweep (a plain key=value)",
        )
    if len({cfg.script.enabled for cfg in sweep.configs}) > 1:
        # One array pickles one task function for all of its tasks.
        raise DdpJobError(
            "sweep mixes trials that run a script with trials that run the built-in trainer",
            "sweep scripts and trainer settings separately",
        )
    checked: dict[str, Config] = {}
    for cfg in sweep.configs:  # submit's checks of the code, once per distinct script or task, model and strategy
        parts = [cfg.script.path, cfg.script.module, cfg.task.target, cfg.task.model, cfg.task.data, cfg.strategy]
        key = json.dumps(parts, sort_keys=True, default=str)
        if key not in checked:
            checks.check_code(cfg)
            checked[key] = cfg
        cfg.script.path, cfg.script.sha256 = checked[key].script.path, checked[key].script.sha256
    first, *others = sweep.configs
    for cfg in others:
        checks.check_place(cfg, cluster=False)  # the image's path made absolute in each trial's config
    request = checks.resolve(first, checks.check_place(first, cluster=local_check))
    for cfg in others:  # one array, one request: every trial records the resolved CPUs per rank
        cfg.slurm.cpus_per_task = request.cpus_per_rank
    return dataclasses.replace(request, job_name=first.slurm.job_name or sweep.name)


def plan(sweep: Sweep) -> list[TrialPlan]:
    root = sweep_dir(sweep)
    same_base(sweep, root)
    plans, recorded = [], {}
    for trial, cfg in zip(sweep.trials, sweep.configs, strict=True):
        run_dir = RunDir(root / trial.trial_id)
        events = run_dir.events() if run_dir.exists() else []
        recorded[trial.trial_id] = [str(j["job_id"]) for j in run_dir.jobs()] if events else []
        if events and events[-1]["event"] == "completed":
            action = "completed"
        else:
            action = "resume" if run_dir.exists() else "submit"
        plans.append(TrialPlan(trial, trial_config(sweep, trial, cfg), run_dir, action))
    active = queued([j for ids in recorded.values() for j in ids], GATEWAY)
    return [
        dataclasses.replace(p, action="active")
        if p.action == "resume" and any(j in active for j in recorded[p.trial.trial_id])
        else p
        for p in plans
    ]


def same_base(sweep: Sweep, root: Path) -> None:
    """A sweep run again under its name keeps its base config: its trial ids cover only their own keys, so a changed
    base would count the old base's completed trials as done and resume the others with the new one."""
    path = root / SWEEP_FILE
    recorded = json.loads(path.read_text()).get("base_digest") if path.exists() else None
    if recorded is not None and recorded != sweep.base_digest:
        raise DdpJobError(
            f"sweep '{sweep.name}' in {root} ran with another base config: its trials and these would mix",
            "name this sweep otherwise (name: in the sweep file, or --name), or move that folder away",
        )


def max_array_size() -> int:
    """The cluster's MaxArraySize: array indices must stay below it."""
    return GATEWAY.max_array_size()


def chunks(items: list[Any], size: int) -> list[list[Any]]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def render_array_script(sweep: Sweep, request: SlurmRequest, count: int, parallelism: int) -> str:
    """What ``sweep --dry-run`` prints: the script ``submit_sweep`` queues for an array of ``count`` trials."""
    folder = sweep_dir(sweep) / "slurm"
    return render(request, Layout.array(folder, folder / "runs-TIMESTAMP-0.txt", count, parallelism))


def excluded_by_trials(plans: list[TrialPlan]) -> dict[str, str]:
    """The hosts the sweep's trials excluded after failures (``ddp_core.cluster.failures``), with why."""
    hosts: dict[str, str] = {}
    for p in plans:
        hosts.update(excluded_hosts(p.run_dir.events()))
    return hosts


def to_run(plans: list[TrialPlan]) -> list[TrialPlan]:
    """The trials a submission runs: new ones and those to resume (neither completed nor queued or running)."""
    return [p for p in plans if p.action in ("submit", "resume")]


def initialise(sweep: Sweep, plans: list[TrialPlan]) -> list[TrialPlan]:
    """The run directory of every trial to run (``to_run``), which it returns, and the sweep's folder of Slurm files;
    new trials share the sweep's one code snapshot, resumed ones keep theirs."""
    todo = to_run(plans)
    if not todo:
        return []
    root = sweep_dir(sweep)
    # Sized before anything exists.
    code = None if (root / CODE_RECORD).exists() else snapshot.plan_sweep(sweep.configs)
    (root / "slurm").mkdir(parents=True, exist_ok=True)
    shared = snapshot.take_shared(code, root)
    for p in todo:
        p.run_dir.initialize(p.cfg)
        if shared is not None and p.action == "submit" and p.cfg.snapshot.enabled:
            snapshot.write_record(p.run_dir.path, shared)
    return todo


def submit_sweep(sweep: Sweep, plans: list[TrialPlan], parallelism: int, request: SlurmRequest) -> list[str]:
    """Initialise every trial to run and submit them as arrays of ``request`` (``check_sweep``'s); returns the array
    job ids."""
    from submitit.core.utils import DelayedSubmission

    todo = initialise(sweep, plans)
    if not todo:
        return []
    run = task_function(sweep.configs[0])  # one function for the whole array: check_sweep made sure it fits all
    root = sweep_dir(sweep)
    folder = root / "slurm"
    if excluded := excluded_by_trials(plans):
        # The nodes a trial excluded after its failures: the trials submitted now stay off them as well.
        for host, why in excluded.items():
            print(f"excluding {host}: {why} (a trial of this sweep excluded it)")
        own = [h for h in str(request.additional.get("exclude", "")).split(",") if h]
        hosts = ",".join(dict.fromkeys([*own, *excluded]))
        request = dataclasses.replace(request, additional={**request.additional, "exclude": hosts})
    arrays: list[str] = []
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for number, chunk in enumerate(chunks(todo, max_array_size())):
        runs = folder / f"runs-{stamp}-{number}.txt"  # each task's run directory: its batch script watches it
        runs.write_text("".join(f"{p.run_dir.path}\n" for p in chunk))
        done = f"; {len(arrays)} earlier arrays were submitted: {' '.join(arrays)}" if arrays else ""
        hint = "fix the cause and rerun the same `ddpjob sweep` command: it submits only the trials not yet queued"
        # Earlier arrays of this sweep may still be queued from the folder: only this one's are withdrawn.
        with submitted_or_withdrawn(folder, "sweep submission", hint, earlier=done, unit="array"):
            calls = [DelayedSubmission(run, str(p.run_dir.path)) for p in chunk]
            jobs = queue(request, Layout.array(folder, runs, len(chunk), parallelism), calls)  # one sbatch per chunk
        array_id = str(jobs[0].job_id).split("_")[0]
        arrays.append(array_id)
        for p, job in zip(chunk, jobs, strict=True):
            p.run_dir.record_job(str(job.job_id), "array", log_dir=str(folder))
        record_jobs(root, sweep, "arrays", {"job_id": array_id, "trials": [p.trial.trial_id for p in chunk]})
    return arrays


def record_jobs(root: Path, sweep: Sweep, kind: str, entry: dict[str, Any]) -> None:
    """``entry`` (a job's id and what it runs) appended to sweep.json's ``kind`` (``arrays``, ``packs``)."""
    path = root / SWEEP_FILE
    meta: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
    base = str(sweep.base_config.resolve()) if sweep.base_config is not None else None
    meta.update(name=sweep.name, sweep_id=sweep.sweep_id, base_config=base, base_digest=sweep.base_digest)
    meta.setdefault("trials", {t.trial_id: list(t.overrides) for t in sweep.trials})
    # What a report plots each trial at (the loaded values: 1e-3 and 0.001 alike) and each key's axis scale.
    meta.setdefault("params", {t.trial_id: t.params for t in sweep.trials})
    meta.setdefault("scales", sweep.scales)
    meta.setdefault(kind, []).append({**entry, "submitted": time.strftime("%Y-%m-%dT%H:%M:%S")})
    atomic_write_text(path, json.dumps(meta, indent=1) + "\n")


def summary(sweep: Sweep, plans: list[TrialPlan], arrays: list[str], max_size: Optional[int] = None) -> str:
    counts = {a: sum(1 for p in plans if p.action == a) for a in ("submit", "resume", "completed", "active")}
    lines = [
        f"sweep:   {sweep.name} (id {sweep.sweep_id}), {len(plans)} trials",
        f"dir:     {sweep_dir(sweep)}",
        f"trials:  {counts['submit']} new, {counts['resume']} resumed, {counts['completed']} completed (skipped), "
        f"{counts['active']} queued or running (skipped)",
    ]
    if arrays:
        lines.append(f"arrays:  {' '.join(arrays)}")
        if max_size:
            n = counts["submit"] + counts["resume"]
            lines.append(f"chunks:  {math.ceil(n / max_size)} sbatch calls (MaxArraySize {max_size})")
    return "\n".join(lines)
