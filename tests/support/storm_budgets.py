"""The fault storm with tight budgets (issue 56): a run that spends a budget ends with that reason, and only then.

``draw(seed, count)`` draws small budgets (``slurm.max_restarts``, ``max_failures``, ``max_preemptions``,
``max_hangs``, each 0 or 1) and a storm schedule (tests/support/storm.py) of the faults that spend them: killed ranks,
warning signals, Slurm's preemption and long stalls. ``spending`` is what ddpjob's budgets must make of that
schedule, worked out here from the documented rules alone (docs/preemption.md, ``cluster.policy``), not from the code
that keeps them:

- a killed rank is restarted inside the allocation while the attempt has restarts left, and each requeue is a new
  attempt with ``slurm.max_restarts`` of its own;
- else it is a failure, requeued within ``slurm.max_failures``;
- a warning signal or a preemption is a preemption, requeued within ``slurm.max_preemptions``;
- a long stall is a hang, requeued within ``slurm.max_hangs``;
- the fault that takes a budget past its limit ends the run: ``budget_exhausted``, whose reason names the budget.

The schedule is cut after that fault: the run survives every fault before it, and ends at it.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, replace
from typing import Optional

from tests.support import storm

BUDGETED = {"kill": "failure", "usr2": "preemption", "preempt": "preemption", "stall_long": "hang"}


@dataclass(frozen=True)
class Budgets:
    restarts: int
    failures: int
    preemptions: int
    hangs: int

    def limit(self, name: str) -> int:
        return int(getattr(self, f"{name}s"))

    def overrides(self) -> list[str]:
        return [f"slurm.max_{name}={getattr(self, name)}" for name in ("restarts", "failures", "preemptions", "hangs")]


@dataclass(frozen=True)
class Spent:
    index: int  # the fault that spends the budget
    name: str  # the budget: failure, preemption, hang
    count: int  # how many of it the run has had then: the limit and one

    def reason(self, budgets: Budgets) -> str:
        """The ``budget_exhausted`` event's reason."""
        plural = "" if self.count == 1 else "s"
        return f"after {self.count} {self.name}{plural} (slurm.max_{self.name}s={budgets.limit(self.name)})"


def spending(schedule: storm.Schedule, budgets: Budgets) -> Optional[Spent]:
    """The fault of ``schedule`` that spends a budget of ``budgets`` (the module docstring), or None."""
    restarts, used = 0, Counter[str]()
    for fault in schedule.faults:
        if fault.kind == "kill" and restarts < budgets.restarts:
            restarts += 1
            continue
        name = BUDGETED[fault.kind]
        used[name] += 1
        if used[name] > budgets.limit(name):
            return Spent(fault.index, name, used[name])
        restarts = 0  # requeued: the next attempt has restarts of its own
    return None


def draw(seed: int, count: int) -> tuple[storm.Schedule, Budgets, Optional[Spent]]:
    """``seed``'s budgets and schedule (in the preemptible partition), cut after the fault that spends a budget."""
    rng = random.Random(seed)
    budgets = Budgets(*(rng.randint(0, 1) for _ in range(4)))
    schedule = storm.plan(seed, count, kinds=set(BUDGETED), settings={"low"})
    spent = spending(schedule, budgets)
    if spent is not None:
        schedule = replace(schedule, faults=schedule.faults[: spent.index + 1])
    return schedule, budgets, spent


def overrides(schedule: storm.Schedule, budgets: Budgets) -> list[str]:
    """The run's overrides: the storm's, with ``budgets`` in place of its generous ones."""
    tight = budgets.overrides()
    keys = {o.split("=", 1)[0] for o in tight}
    return [o for o in schedule.overrides() if o.split("=", 1)[0] not in keys] + tight
