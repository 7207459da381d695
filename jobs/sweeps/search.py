"""Adaptive sweeps on the login node: create the study, submit one job array of workers, continue or extend it, and
say where it stands (``ddpjob status`` on a search's sweep directory; ``ddpjob report`` reads its study too).

``ddpjob sweep`` validates the spec (``jobs.sweeps.search_spec``) and checks the base config as ``submit`` checks a run
(``check``), then writes the sweep directory (``ddp_core.search.study`` documents its layout), creates the Optuna study
on its journal and submits ONE array of ``parallelism`` tasks, each running ``ddp_core.search.worker.run`` in its batch
step (``render.Layout.workers``: no srun): the worker launches each trial as an srun step, with the srun line of the
search's one request (``step``). Running the same sweep again, or ``--more N``, continues the study: the RUNNING trials
of workers that are gone (squeue, one call) are bound to the new generation's task indices before its array is
submitted, so no trial is lost or run twice.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Optional, cast

from ddp_core.cluster.slurm import GATEWAY
from ddp_core.config import Config, to_yaml
from ddp_core.errors import DdpJobError
from ddp_core.search import pack as pack_worker
from ddp_core.search.slots import SlotSize
from ddp_core.search.study import (
    BASE_CONFIG,
    FAIL_ATTR,
    JOURNAL_FILE,
    RUN_DIR_ATTR,
    SEARCH_FILE,
    STATES,
    WORKER_ATTR,
    ask_lock,
    create_study,
    open_study,
    read_spec,
    reassign,
    state_name,
    write_spec,
)
from jobs.submission import checks, snapshot
from jobs.submission.render import Layout
from jobs.submission.request import SlurmRequest
from jobs.submission.submit import queue, submitted_or_withdrawn
from jobs.sweeps.pack import allocation, step
from jobs.sweeps.search_spec import SearchSpec


def is_search(path: Optional[str | Path]) -> bool:
    return path is not None and (Path(path) / SEARCH_FILE).is_file()


def sweep_root(spec: SearchSpec) -> Path:
    assert spec.base_config is not None, "build() validated the base config"
    return (Path(spec.base_config.run.root) / spec.name).resolve()


def check(spec: SearchSpec, local_check: bool = True) -> tuple[Config, SlurmRequest]:
    """Steps 1 and 2 of the submission pipeline (``jobs.submission.checks``) on the base config, once: every trial
    shares the task, and the workers' one request."""
    cfg = spec.base_config
    assert cfg is not None
    checks.check_code(cfg)
    return cfg, checks.resolve(cfg, checks.check_place(cfg, cluster=local_check))


def recorded(root: Path) -> tuple[Config, SlurmRequest]:
    """A search's base config as its start recorded it (checked then), and its request resolved for this submission."""
    from ddp_core.config import load_config

    cfg = load_config(root / BASE_CONFIG)
    return cfg, checks.resolve(cfg)


def start(
    spec: SearchSpec, cfg: Config, request: SlurmRequest, pack: Optional[dict[str, Any]] = None
) -> tuple[Path, Optional[str]]:
    """Create the search (or continue the same one) and submit its workers: (sweep dir, array id or None). ``pack``:
    its workers are the slots of packed allocations (``jobs.sweeps.pack.pack_spec``)."""
    root = sweep_root(spec)
    wanted = spec.study_spec()
    if is_search(root):
        known = read_spec(root)
        differs = [k for k, v in wanted.items() if k not in ("budget", "parallelism") and known.get(k) != v]
        if differs or wanted["budget"] > known["budget"]:  # --more may have raised it since: that is the same one
            what = differs[0] if differs else "trials"
            raise DdpJobError(
                f"sweep '{spec.name}' exists in {root} with another search ({what} differs)",
                f"rerun it as it was, extend it: `ddpjob sweep {root} --more N`, or pass --name",
            )
        return root, submit_workers(root, cfg, request)
    root.mkdir(parents=True, exist_ok=True)
    (root / BASE_CONFIG).write_text(to_yaml(cfg))
    snapshot.take_shared(snapshot.plan_sweep([cfg]), root)
    base = str(spec.base.resolve())
    packed = {"pack": {k: v for k, v in pack.items() if k != "step"}} if pack else {}
    write_spec(
        root, wanted | {"step": step(request), "generations": [], "base_config": base, "fixed": spec.fixed} | packed
    )
    from ddp_core.search.study import open_storage

    create_study(open_storage(str(root / JOURNAL_FILE)), wanted)
    return root, submit_workers(root, cfg, request)


def extend(root: Path, more: int, parallelism: Optional[int] = None) -> Optional[str]:
    """``--more N``: raise the budget by N (a finished study goes on), then submit workers as a rerun would."""
    if more < 1:
        raise DdpJobError(f"--more {more} is invalid", "give the number of trials to add, e.g. --more 32")
    with ask_lock(root):  # a live worker re-reads the budget under this lock
        spec = read_spec(root)
        wider = {"parallelism": parallelism} if parallelism else {}
        write_spec(root, spec | {"budget": spec["budget"] + more} | wider)
    return submit_workers(root, *recorded(root))


def alive_workers(spec: dict[str, Any]) -> set[str]:
    """Workers (``gen:index``) still queued or running: one squeue call over every generation's array."""
    arrays = {str(g["job_id"]): g["generation"] for g in spec["generations"]}
    pairs = GATEWAY.squeue_ids(sorted(arrays)) if arrays else []
    out = set()
    for job_id, _ in pairs:
        base, _, index = job_id.partition("_")
        if base in arrays and index.isdigit():
            out.add(f"{arrays[base]}:{index}")
    return out


def submit_workers(root: Path, cfg: Config, request: SlurmRequest) -> Optional[str]:
    """Re-bind orphaned RUNNING trials to a new generation and submit it: as many tasks as the study still needs,
    at most ``parallelism`` minus the workers still alive. Returns the array id, or None when nothing was needed."""
    import dataclasses

    import optuna
    from submitit.core.utils import DelayedSubmission

    from ddp_core.search import worker as search_worker

    with ask_lock(root):  # no worker asks (or binds) while trials change hands
        spec = read_spec(root)
        alive = alive_workers(spec)
        storage, study = open_study(root)
        trials = study.get_trials(deepcopy=False)
        running = {
            t.number: str(t.user_attrs.get(WORKER_ATTR))
            for t in trials
            if t.state in (optuna.trial.TrialState.RUNNING, optuna.trial.TrialState.WAITING)
        }
        packed = spec.get("pack")  # a packed search's workers are the slots of its allocations: gen:task/slot
        per = int(packed["per_node"]) if packed else 1
        orphans = sum(1 for worker in running.values() if worker.split("/")[0] not in alive)
        unasked = max(0, spec["budget"] - len(trials))
        workers = min(max(0, spec["parallelism"] - len(alive) * per), orphans + unasked)
        workers = max(workers, 1 if orphans else 0)
        if workers == 0:
            return None
        tasks = -(-workers // per)  # allocations of ``per`` slots each
        generation = len(spec["generations"]) + 1
        moved = reassign(running, lambda w: w.split("/")[0] in alive, generation, tasks * per)
        if packed:  # worker k of the generation is slot k % per of its allocation k // per
            moved = {
                n: f"{generation}:{int(w.split(':')[1]) // per}/{int(w.split(':')[1]) % per}" for n, w in moved.items()
            }
        study_id = storage.get_study_id_from_name(study.study_name)
        for number, worker in moved.items():
            trial_id = storage.get_trial_id_from_study_id_trial_number(study_id, number)
            storage.set_trial_user_attr(trial_id, WORKER_ATTR, worker)
        folder = root / "slurm"
        folder.mkdir(parents=True, exist_ok=True)
        # Each trial's srun line is search.json's step: the worker runs it, inside its own batch step.
        request = dataclasses.replace(request, job_name=cfg.slurm.job_name or spec["name"])
        run = search_worker.run
        if packed:  # whole nodes of slots, each allocation a pool of the search's workers
            request = allocation(request, SlotSize.of(packed["slot"]), per, cfg.slurm.mem_gb)
            run = pack_worker.run_search
        hint = "fix the cause and rerun the same command: the study continues"
        with submitted_or_withdrawn(folder, "search submission", hint, unit="array"):
            calls = [DelayedSubmission(run, str(root), generation) for _ in range(tasks)]
            jobs = queue(request, Layout.workers(folder, tasks), calls)
        array = str(jobs[0].job_id).split("_")[0]
        entry = {
            "generation": generation,
            "job_id": array,
            "tasks": tasks,
            "rebound": sorted(moved),
            "submitted": time.strftime("%Y-%m-%dT%H:%M:%S"),
        }
        write_spec(root, spec | {"generations": [*spec["generations"], entry]})
    return array


def own_metric(spec: dict[str, Any]) -> str:
    """A search's metric with its direction said (``min:eval/loss``), from its recorded spec: what status and report
    rank its trials by."""
    from ddp_core.config.metric import Metric

    return Metric(spec["metric"], spec["direction"] == "minimize").spec


def summary(root: Path) -> dict[str, Any]:
    """Counts by state, the best trial (value, params, run dir), and every trial's state by run directory name."""
    spec = read_spec(root)
    _, study = open_study(root)
    trials = study.get_trials(deepcopy=False)
    counts = dict.fromkeys(STATES, 0)
    states = {}
    for t in trials:
        name = state_name(t.state)
        counts[name] = counts.get(name, 0) + 1
        if RUN_DIR_ATTR in t.user_attrs:
            states[Path(t.user_attrs[RUN_DIR_ATTR]).name] = name.upper()
    done = [t for t in trials if state_name(t.state) == "complete" and t.value is not None]
    pick = min if spec["direction"] == "minimize" else max
    best = pick(done, key=lambda t: cast(float, t.value)) if done else None  # done: trials with a value
    fails = [f"t{t.number:04d}: {t.user_attrs[FAIL_ATTR]}" for t in trials if FAIL_ATTR in t.user_attrs]
    return {"spec": spec, "counts": counts, "best": best, "states": states, "trials": trials, "fails": fails}


def status_lines(info: dict[str, Any]) -> list[str]:
    spec, counts, best = info["spec"], info["counts"], info["best"]
    how = "min" if spec["direction"] == "minimize" else "max"
    lines = [
        f"search:  {spec['sampler']} on {how}:{spec['metric']}, pruner {spec['pruner']}, "
        f"{len(info['trials'])}/{spec['budget']} trials asked",
        "trials:  " + ", ".join(f"{counts.get(s, 0)} {s}" for s in STATES),
    ]
    if best is not None:
        params = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in best.params.items())
        lines.append(
            f"best:    trial {best.number} ({best.user_attrs.get(RUN_DIR_ATTR, '-')}) = {best.value:.6g}: {params}"
        )
    lines += [f"failed:  {line}" for line in info["fails"][-3:]]
    return lines


def start_lines(root: Path, array: Optional[str]) -> list[str]:
    info = summary(root)
    lines = [f"sweep:   {info['spec']['name']}", f"dir:     {root}", *status_lines(info)]
    gens = info["spec"]["generations"]
    if array is None:
        lines.append("arrays:  none submitted (enough workers are queued or running, or the budget is spent)")
    else:
        rebound = gens[-1]["rebound"]
        lines.append(f"arrays:  {array}")
        lines.append(
            f"workers: {gens[-1]['tasks']} (generation {gens[-1]['generation']}"
            + (f"; resumes trials {', '.join(map(str, rebound))})" if rebound else ")")
        )
    return lines
