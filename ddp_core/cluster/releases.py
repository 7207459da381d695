"""What each Slurm release does that matters to ddpjob: one table (data, read by ``ddpjob doctor``, the tests and the
docs), and the findings for a release.

The project is tested on the releases of ``TESTED``; one outside them and ``TESTED_RANGE`` is untested. ``FACTS`` lists
the known behaviours by the releases they apply to (a range of ``major.minor`` or an exact ``major.minor.patch``);
a fix in a later patch release is one more bound, not code. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

TESTED = ("22.05", "24.11", "26.05")  # the local cluster runs each: scripts/slurm-local up --slurm RELEASE
TESTED_RANGE = ((23, 2), (26, 5))  # releases between these are close to tested ones; outside (bar 22.05): untested


@dataclass(frozen=True)
class ReleaseFact:
    key: str  # a stable identifier (doctor's finding value)
    first: tuple[int, ...]  # the first release it applies to: (22, 5) or (24, 11, 0)
    last: Optional[tuple[int, ...]]  # the last one (None: every later release, as far as known)
    level: Literal["info", "warn"]  # how doctor reports it: "info" (handled, for the record) or "warn" (can cost work)
    text: str
    handled: str  # what ddpjob does about it ("" while nothing)


FACTS = (
    ReleaseFact(
        "srun_cpus",
        (22, 5),
        None,
        "info",
        "srun no longer inherits --cpus-per-task from the allocation (since 22.05)",
        "ddpjob's srun line passes --cpus-per-task itself (jobs/submission/request.py's srun_args)",
    ),
    ReleaseFact(
        "requeue",
        (24, 11),
        (24, 11),  # measured on 24.11.5; 22.05 and 26.05.5 do not do it
        "info",
        "after a PreemptMode=REQUEUE preemption slurmctld requeues the job once more when its next attempt exits",
        "the batch script ends such an attempt of a completed run before srun (ExitCode.ALREADY_COMPLETE): the job "
        "ends COMPLETED after one more short start",
    ),
)


def parse(version: str) -> Optional[tuple[int, ...]]:
    """ "24.11.5" (or "slurm-wlm 24.11.5") -> (24, 11, 5); None when it is no release number."""
    words = version.split()
    parts = words[-1].split(".") if words else []
    return tuple(int(p) for p in parts) if len(parts) >= 2 and all(p.isdigit() for p in parts) else None


def _covers(release: tuple[int, ...], bound: tuple[int, ...]) -> int:
    """-1, 0, 1 as ``release`` is below, within or above ``bound`` (compared on the bound's own precision)."""
    head = release[: len(bound)]
    return (head > bound) - (head < bound)


def facts_for(version: str) -> list[ReleaseFact]:
    """The facts of ``FACTS`` that apply to ``version``."""
    release = parse(version)
    if release is None:
        return []
    return [f for f in FACTS if _covers(release, f.first) >= 0 and (f.last is None or _covers(release, f.last) <= 0)]


def support(version: str) -> tuple[str, str]:
    """How far the project's tests cover ``version``: ("tested", ...) for a release of ``TESTED``, ("between", ...)
    for one inside ``TESTED_RANGE`` the tests do not run, else ("untested", ...); the text says what to do."""
    release = parse(version)
    drill = "run `ddpjob doctor --drill` on it"
    if release is None:
        return "untested", f"release {version or '?'} not recognised; {drill}"
    if f"{release[0]}.{release[1]:02d}" in TESTED:
        return "tested", f"Slurm {version}: a tested release ({', '.join(TESTED)})"
    low, high = TESTED_RANGE
    if _covers(release, low) >= 0 and _covers(release, high) <= 0:
        return "between", f"Slurm {version}: between the tested releases ({', '.join(TESTED)}); {drill}"
    return "untested", f"Slurm {version}: untested release (tested: {', '.join(TESTED)}); {drill}"
