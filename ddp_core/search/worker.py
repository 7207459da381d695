"""One worker of an adaptive sweep: an array task's batch step, one process on the job's first node.

It asks the study for a trial (``search_study.ask``: under the ask-lock, within the budget), materialises it as a
normal run directory ``SWEEP/tNNNN`` (the base config plus the sampled values plus the ``trial:`` binding, validated by
``load_config``), trains it as its own ``srun`` job step running the normal trainer (the srun command the login node
rendered once, ``search.json``'s ``step``), tells the study how it ended, and asks again until the budget is spent.

An invalid suggestion is told FAIL with the reason and the worker goes on. A step that ends because its rank 0
requeued the job (the trainer's preemption path; inside a container image without scontrol, this worker makes the
requeue its rank 0 decided: ``search.step``) is told nothing: the requeued worker (same generation and array
index) finds the RUNNING trial still bound to it and resumes it in the same run directory, from its checkpoint.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Optional

from ddp_core.config import escape_interpolations, load_config
from ddp_core.errors import DdpJobError
from ddp_core.run.rundir import CODE_RECORD, RunDir
from ddp_core.search import step
from ddp_core.search.pruning import bound_trial, final_value
from ddp_core.search.study import BASE_CONFIG, FAIL_ATTR, JOURNAL_FILE, ask, bound_running, open_study, read_spec

if TYPE_CHECKING:
    import optuna

log = logging.getLogger("ddp_core")
# Set when Slurm sends this batch step SIGTERM (scancel, the time limit, a preemption): the job is ending, so a step
# that ended with it is told nothing and nothing new is asked; the trial stays RUNNING, bound to this worker, and a
# rerun of the sweep hands it to the next generation, which resumes it from its checkpoint.
ENDING = threading.Event()
# A trial's last event when the job was requeued, by its rank 0 or (``requeue_deferred``) by this worker for it.
HANDED_ON = frozenset({"requeued", "requeued_by_batch"})
REQUEUE_WAIT_S = 300  # Slurm ends a requeued job's batch step within seconds; past this the requeue did not happen


def override(key: str, value: Any) -> str:
    """``key=value`` that ``load_config`` reads back as ``value`` (JSON is YAML's flow syntax; ``${`` escaped)."""
    if isinstance(value, float):
        return f"{key}={value!r}"  # repr round-trips; JSON would write inf/nan in a form YAML does not read
    return f"{key}={json.dumps(escape_interpolations(value))}"


def trial_overrides(sweep: Path, spec: Mapping[str, Any], number: int, params: Mapping[str, Any]) -> list[str]:
    """What makes the base config trial ``number``: its sampled values, its name, and its binding to the study."""
    name = f"{spec['name']}-t{number:04d}"
    return [
        *(override(k, v) for k, v in params.items()),
        override("run.name", name),
        override("trial.storage", str(sweep / JOURNAL_FILE)),
        override("trial.number", number),
        override("trial.metric", spec["metric"].partition("/")[2]),
    ]


def materialise(sweep: Path, spec: Mapping[str, Any], trial: optuna.Trial) -> RunDir:
    """The trial's run directory, created once (a resumed trial keeps its own). Raises DdpJobError for a sampled
    config that does not validate."""
    run = RunDir(sweep / f"t{trial.number:04d}")
    if run.exists():
        return run
    cfg = load_config(sweep / BASE_CONFIG, trial_overrides(sweep, spec, trial.number, trial.params))
    if not cfg.wandb.group:
        cfg.wandb.group = spec["name"]
    run.initialize(cfg)
    # The sweep's one snapshot, as jobs.sweeps.arrays records it.
    if cfg.snapshot.enabled and (sweep / CODE_RECORD).exists():
        shutil.copyfile(sweep / CODE_RECORD, run.code_record)
    return run


def step_command(spec: Mapping[str, Any], run: RunDir) -> list[str]:
    """The login node's rendered srun line, plus where this trial's rank logs go: ``RUN/slurm/<job>_<rank>_log.*``,
    appended across attempts, as ``ddpjob logs`` reads them."""
    logs = [f"--output={run.slurm}/%j_%t_log.out", f"--error={run.slurm}/%j_%t_log.err", "--open-mode=append"]
    return [*spec["step"]["srun"], *logs, *spec["step"]["command"], str(run.path)]


def ended(run: RunDir) -> Optional[dict[str, Any]]:
    """The run's last event when it says the trial is over or handed to a requeue, else None."""
    events = run.events() if run.exists() else []
    last = events[-1] if events else None
    return last if last is not None and last["event"] in ("completed", "pruned", *HANDED_ON) else None


def settle(study: optuna.Study, trial: optuna.Trial, run: RunDir, metric: str, code: int) -> str:
    """Tell the study how the trial's step ended; returns the outcome (``requeued``: told nothing)."""
    import optuna

    last = ended(run)
    event = last["event"] if last else None
    if event in HANDED_ON and code == 0:
        return "requeued"
    if event == "completed":
        value = final_value(last.get("final"), metric) if last else None
        if value is not None and math.isfinite(value):
            study.tell(trial, value)
            return "complete"
        reason = f"the final eval has no finite '{metric}'"
    elif event == "pruned":
        study.tell(trial, state=optuna.trial.TrialState.PRUNED)
        return "pruned"
    else:
        why = step.last_failure(run) or f"last event: {event or 'none'}"
        reason = f"the trainer's step exited {code} ({why}); see {run.slurm}"
    trial.set_user_attr(FAIL_ATTR, reason)
    study.tell(trial, state=optuna.trial.TrialState.FAIL)
    return "fail"


def refuse(study: optuna.Study, trial: optuna.Trial, err: DdpJobError) -> None:
    """A sampled config that does not validate: the trial told FAIL with the reason (the worker then asks again)."""
    import optuna

    log.warning("trial %d: sampled config is invalid: %s", trial.number, err)
    trial.set_user_attr(FAIL_ATTR, f"invalid config: {err}")
    study.tell(trial, state=optuna.trial.TrialState.FAIL)


def run_trial(sweep: Path, spec: Mapping[str, Any], study: optuna.Study, trial: optuna.Trial) -> str:
    try:
        run = materialise(sweep, spec, trial)
    except DdpJobError as err:
        refuse(study, trial, err)
        return "fail"
    job = os.environ.get("SLURM_JOB_ID")
    if job and job not in {str(j["job_id"]) for j in run.jobs()}:
        run.record_job(job, "search", log_dir=str(run.slurm), worker=trial.user_attrs.get("worker"))
    code = 0
    last = ended(run)
    if last is None or last["event"] in HANDED_ON:  # a trial that finished before its worker died: tell
        log.info("trial %d: %s", trial.number, " ".join(step_command(spec, run)))
        code = step.run(step_command(spec, run), run, ENDING)  # an infrastructure failure: again (search.step)
    if ENDING.is_set() and (ended(run) or {}).get("event") not in HANDED_ON:  # a requeue's SIGTERM: see run()
        return "ending"
    outcome = settle(study, trial, run, spec["metric"].partition("/")[2], code)
    log.info("trial %d: %s", trial.number, outcome)
    return outcome


def run(sweep_dir: str, generation: int) -> dict[str, int]:
    """What submitit calls in each array task's batch step (``use_srun=False``): work until the budget is spent."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s worker %(message)s")
    sweep = Path(sweep_dir)
    task = int(os.environ.get("SLURM_ARRAY_TASK_ID", "0"))
    worker = f"{generation}:{task}"
    spec = read_spec(sweep)
    storage, study = open_study(sweep, seed_offset=generation * 10_007 + task)
    signal.signal(signal.SIGTERM, lambda *_: ENDING.set())  # replaces submitit's, which only logs it
    done: dict[str, int] = {}
    while not ENDING.is_set():
        resumed = bound_running(study, worker)
        trial = bound_trial(storage, study, resumed[0]) if resumed else ask(sweep, study, worker)
        if trial is None:
            log.info("worker %s: budget spent (%s)", worker, done)
            break
        outcome = run_trial(sweep, spec, study, trial)
        if outcome == "requeued":
            log.info("trial %d: the job is being requeued; its next attempt resumes the trial", trial.number)
            time.sleep(REQUEUE_WAIT_S)  # Slurm ends this step; the requeued task starts the worker again
            raise RuntimeError(f"trial {trial.number} requeued the job, but the job was not requeued")
        if outcome == "ending":
            log.info(
                "trial %d: the job is ending (SIGTERM); the trial stays bound to worker %s: rerun the sweep "
                "to continue it",
                trial.number,
                worker,
            )
            break
        done[outcome] = done.get(outcome, 0) + 1
    return done
