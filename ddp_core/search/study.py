"""The Optuna side of an adaptive sweep, shared by the login node (``jobs.sweeps.search``) and its workers
(``ddp_core.search.worker``): the sweep directory's search files, the study, its sampler and pruner, the ask-lock and
the trial <-> run directory <-> worker binding.

Layout of a search's sweep directory (beside the trial run directories ``t0000/``, ``t0001/``, ...)::

    SWEEP/search.json      the spec (sampler, pruner, metric, params), budget, generations of workers (login node)
    SWEEP/study.journal    Optuna's journal storage (one study, ``STUDY_NAME``), O_EXCL-locked: NFS-safe
    SWEEP/ask.lock         held around "count the trials, then ask": the budget is never overshot
    SWEEP/base.yaml        the resolved base config every trial starts from (fixed overrides applied)

A trial's binding lives in its user attrs: ``run_dir`` (``SWEEP/tNNNN``) and ``worker`` (``<generation>:<array task
index>``). A requeued worker (same generation and index) resumes the RUNNING trials bound to it; the login node
re-binds the RUNNING trials of workers that are gone to the next generation before it submits it.
"""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Optional

from ddp_core.run.rundir import atomic_write_text

if TYPE_CHECKING:
    import optuna

log = logging.getLogger(__name__)
STUDY_NAME = "search"  # one study per journal: the journal file lies in its sweep's directory


def open_storage(path: str) -> optuna.storages.BaseStorage:
    """The study's journal on the shared filesystem, locked by O_EXCL lock files (works on NFS, unlike flock)."""
    import optuna  # heavy and optional: only a trial or a search's login-side command pays for it
    from optuna.storages.journal import JournalFileBackend, JournalFileOpenLock

    return optuna.storages.JournalStorage(JournalFileBackend(path, lock_obj=JournalFileOpenLock(path)))


SEARCH_FILE = "search.json"
JOURNAL_FILE = "study.journal"
ASK_LOCK = "ask.lock"
BASE_CONFIG = "base.yaml"
WORKER_ATTR = "worker"
RUN_DIR_ATTR = "run_dir"
FAIL_ATTR = "fail_reason"
SAMPLERS = ("tpe", "random", "grid", "cmaes")
PRUNERS = ("median", "asha", "hyperband", "none")
STATES = ("running", "complete", "pruned", "fail")


def read_spec(sweep: Path) -> dict[str, Any]:
    return dict(json.loads((Path(sweep) / SEARCH_FILE).read_text()))


def write_spec(sweep: Path, spec: Mapping[str, Any]) -> None:
    atomic_write_text(Path(sweep) / SEARCH_FILE, json.dumps(spec, indent=1, sort_keys=True) + "\n")


def trial_dir_name(number: int) -> str:
    return f"t{number:04d}"


def distributions(params: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """Optuna distributions of the spec's params (``random:``'s syntax plus ``log``/``step``; randint's high is
    exclusive, like range(), so its IntDistribution ends at high - 1)."""
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    out: dict[str, Any] = {}
    for key, p in params.items():
        dist, step, logged = p["dist"], p.get("step"), bool(p.get("log", False))
        if dist == "choice":
            out[key] = CategoricalDistribution(list(p["values"]))
        elif dist == "randint":
            out[key] = IntDistribution(int(p["low"]), int(p["high"]) - 1, log=logged, step=int(step or 1))
        else:
            logged = logged or dist == "loguniform"
            out[key] = FloatDistribution(float(p["low"]), float(p["high"]), log=logged, step=step)
    return out


def grid_space(params: Mapping[str, Mapping[str, Any]]) -> dict[str, list[Any]]:
    """The grid sampler's values per key: choices, randint's range, a float range by its step."""
    space: dict[str, list[Any]] = {}
    for key, p in params.items():
        if p["dist"] == "choice":
            space[key] = list(p["values"])
        elif p["dist"] == "randint":
            space[key] = list(range(int(p["low"]), int(p["high"]), int(p.get("step") or 1)))
        else:
            low, high, step = float(p["low"]), float(p["high"]), float(p["step"])
            space[key] = [low + i * step for i in range(round((high - low) / step) + 1)]
    return space


def make_sampler(spec: Mapping[str, Any], seed_offset: int = 0) -> optuna.samplers.BaseSampler:
    """``seed_offset``: each worker samples with its own seed (same seed everywhere would draw the same startup
    trials in every worker)."""
    import optuna

    seed = int(spec.get("seed", 0)) * 1_000_003 + seed_offset
    name, budget = spec["sampler"], int(spec["budget"])
    if name == "tpe":
        # A third of the budget (at most Optuna's 10) explores at random before TPE models the results.
        return optuna.samplers.TPESampler(seed=seed, n_startup_trials=max(1, min(10, budget // 3)))
    if name == "grid":
        return optuna.samplers.GridSampler(grid_space(spec["params"]), seed=seed)
    if name == "cmaes":
        return optuna.samplers.CmaEsSampler(seed=seed)
    return optuna.samplers.RandomSampler(seed=seed)


def make_pruner(spec: Mapping[str, Any]) -> optuna.pruners.BasePruner:
    import optuna

    name, budget = spec.get("pruner", "none"), int(spec["budget"])
    if name == "median":
        # A quarter of the budget (at most Optuna's 5) completes before anything is compared with the median.
        return optuna.pruners.MedianPruner(n_startup_trials=max(1, min(5, budget // 4)))
    if name == "asha":
        return optuna.pruners.SuccessiveHalvingPruner()
    if name == "hyperband":
        return optuna.pruners.HyperbandPruner()
    return optuna.pruners.NopPruner()


def create_study(storage: optuna.storages.BaseStorage, spec: Mapping[str, Any]) -> optuna.Study:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna.create_study(
        storage=storage,
        study_name=STUDY_NAME,
        direction=spec["direction"],
        sampler=make_sampler(spec),
        pruner=make_pruner(spec),
        load_if_exists=True,
    )


def load_study(storage: optuna.storages.BaseStorage, spec: Mapping[str, Any], seed_offset: int = 0) -> optuna.Study:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna.load_study(
        study_name=STUDY_NAME, storage=storage, sampler=make_sampler(spec, seed_offset), pruner=make_pruner(spec)
    )


def open_study(sweep: Path, seed_offset: int = 0) -> tuple[optuna.storages.BaseStorage, optuna.Study]:
    storage = open_storage(str(Path(sweep) / JOURNAL_FILE))
    return storage, load_study(storage, read_spec(sweep), seed_offset)


@contextlib.contextmanager
def ask_lock(sweep: Path) -> Iterator[None]:
    """Exclusive across processes and hosts: an O_EXCL lock file (Optuna's own NFS-safe journal lock), taken over
    after 30 s without release (a holder killed mid-ask)."""
    from optuna.storages.journal import JournalFileOpenLock

    lock = JournalFileOpenLock(str(Path(sweep) / ASK_LOCK))
    lock.acquire()
    try:
        yield
    finally:
        lock.release()


def ask(sweep: Path, study: optuna.Study, worker: str) -> Optional[optuna.Trial]:
    """A new trial bound to ``worker``, or None when the budget (re-read: ``--more`` raises it) is spent. Under the
    ask-lock, so two workers never overshoot the budget; Optuna numbers every trial once."""
    with ask_lock(sweep):
        budget = int(read_spec(sweep)["budget"])
        if len(study.get_trials(deepcopy=False)) >= budget:
            return None
        trial = study.ask(distributions(read_spec(sweep)["params"]))
        trial.set_user_attr(RUN_DIR_ATTR, str(Path(sweep) / trial_dir_name(trial.number)))
        trial.set_user_attr(WORKER_ATTR, worker)
        return trial


def bound_running(study: optuna.Study, worker: str) -> list[int]:
    """Numbers of the RUNNING trials bound to ``worker``, oldest first: what a requeued worker resumes."""
    import optuna

    running = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,))
    return sorted(t.number for t in running if t.user_attrs.get(WORKER_ATTR) == worker)


def reassign(running: Mapping[int, str], alive: Callable[[str], bool], generation: int, tasks: int) -> dict[int, str]:
    """New workers for the RUNNING trials whose worker is gone: round-robin over the next generation's ``tasks``
    array indices. ``running``: trial number -> worker id; ``alive(worker)``: whether that worker may still run."""
    orphans = sorted(n for n, worker in running.items() if not alive(worker))
    return {number: f"{generation}:{i % tasks}" for i, number in enumerate(orphans)}


def state_name(state: Any) -> str:
    """An Optuna TrialState as the word status shows: running, complete, pruned, fail (waiting: running)."""
    name = str(getattr(state, "name", state)).lower()
    return "running" if name == "waiting" else name
