"""Where a packed allocation's slots get their trials (``search.pack``): a grid or random sweep's queue, or an
adaptive search's study.

- ``QueueSource``: the next trial of the sweep's queue (``search.queue``); its end is marked there.
- ``StudySource``: each slot is one of the search's workers (``<generation>:<array task>/<slot>``): it resumes the
  RUNNING trials bound to it, else asks the study for a new one within the budget (``study.ask``, under the
  ask-lock), materialises it as a run directory and tells the study how it ended (``search.worker``'s ``settle``), so
  the budget, pruning and the re-binding of a dead worker's trials work as they do for a search's array of workers.

Torch-free.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Protocol

from ddp_core.errors import DdpJobError
from ddp_core.run.rundir import RunDir
from ddp_core.search import queue
from ddp_core.search.slots import Slot

log = logging.getLogger("ddp_core")


@dataclass(frozen=True)
class Trial:
    key: str  # the queue's entry (a run directory's path), or the study's trial number
    run: RunDir
    asked: Any = None  # the study's live optuna.Trial (StudySource)


class Source(Protocol):
    def take(self, slot: Slot, held: set[str]) -> Optional[Trial]: ...

    def settle(self, slot: Slot, trial: Trial, ended: str, code: int) -> None: ...

    def pending(self, job: str) -> bool: ...


class QueueSource:
    def __init__(self, sweep: Path, job: str) -> None:
        self.sweep, self.job = sweep, job

    def take(self, slot: Slot, held: set[str]) -> Optional[Trial]:
        path = queue.claim(self.sweep, self.job, held)
        return None if path is None else Trial(path, RunDir(Path(path)))

    def settle(self, slot: Slot, trial: Trial, ended: str, code: int) -> None:
        queue.finish(self.sweep, trial.key, "completed" if ended == "completed" else "failed")

    def pending(self, job: str) -> bool:
        """Whether the queue holds trials for allocation ``job`` still: unclaimed, or its own and unfinished."""
        trials, claims = queue.read_pack(self.sweep)["trials"], queue.read_claims(self.sweep)
        return any(t not in claims or (claims[t]["job"] == job and claims[t]["state"] == "running") for t in trials)


class StudySource:
    def __init__(self, sweep: Path, generation: int, task: int) -> None:
        self.sweep, self.generation, self.task = sweep, generation, task
        self.studies: dict[int, Any] = {}  # each slot's own (storage, study): Optuna's objects stay on one thread
        self.lock = threading.Lock()

    def worker(self, slot: Slot) -> str:
        return f"{self.generation}:{self.task}/{slot.index}"

    def study(self, slot: Slot) -> tuple[Any, Any]:
        from ddp_core.search.study import open_study

        with self.lock:
            if slot.index not in self.studies:
                offset = (self.generation * 10_007 + self.task) * 101 + slot.index  # each worker samples its own seed
                self.studies[slot.index] = open_study(self.sweep, seed_offset=offset)
            return self.studies[slot.index]

    def take(self, slot: Slot, held: set[str]) -> Optional[Trial]:
        from ddp_core.search.pruning import bound_trial
        from ddp_core.search.study import ask, bound_running, read_spec
        from ddp_core.search.worker import materialise, refuse

        storage, study = self.study(slot)
        while True:
            resumed = [n for n in bound_running(study, self.worker(slot)) if str(n) not in held]
            asked = bound_trial(storage, study, resumed[0]) if resumed else ask(self.sweep, study, self.worker(slot))
            if asked is None:
                return None
            try:
                return Trial(str(asked.number), materialise(self.sweep, read_spec(self.sweep), asked), asked)
            except DdpJobError as err:  # an invalid sample: told FAIL, and the slot asks again
                refuse(study, asked, err)

    def pending(self, job: str) -> bool:
        """Whether the study's budget has trials left to ask."""
        from ddp_core.search.study import open_study, read_spec

        return len(open_study(self.sweep)[1].get_trials(deepcopy=False)) < int(read_spec(self.sweep)["budget"])

    def settle(self, slot: Slot, trial: Trial, ended: str, code: int) -> None:
        from ddp_core.search.study import read_spec
        from ddp_core.search.worker import settle

        _, study = self.study(slot)
        metric = read_spec(self.sweep)["metric"].partition("/")[2]
        log.info("trial %s: %s", trial.key, settle(study, trial.asked, trial.run, metric, code))
