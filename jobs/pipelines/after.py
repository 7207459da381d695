"""Dependencies between runs: ``ddpjob submit --after RUN|JOB[:ok|any|notok]`` and a pipeline step's ``after:``.

A dependency is Slurm's (``sbatch --dependency=afterok:ID``, in the job's one ``SlurmRequest``), so the later job
waits in the queue, not in a process of ddpjob's. A run's requeues (preemption, a timeout, the watcher's ``scontrol
requeue``) keep its job id, and Slurm counts a requeued job as not ended: a dependent waits for the run's final end,
not for its first attempt. A ``ddpjob resume`` submits a new job: ``--after RUN`` names the run's newest job. A run
that has ended already is decided here (``Upstream.decide``): its ``ok``/``any`` leaves nothing to wait for (Slurm
forgets ended jobs after MinJobAge, and sbatch then refuses the dependency), a condition it can no longer meet is
refused in one line. ``sbatch --kill-on-invalid-dep=yes`` cancels a dependent whose condition became impossible (the
earlier run failed) instead of leaving it pending for ever.
"""

from __future__ import annotations

import argparse
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from ddp_core.errors import DdpJobError
from jobs.runs import lookup, status
from jobs.runs.follow import follow
from jobs.submission import commands as submission

MODES = {"ok": "afterok", "any": "afterany", "notok": "afternotok"}
HELP = (
    "wait for an earlier run (its directory, name or a job id) or any Slurm job to end: ok (default: it completed), "
    "any, or notok (it failed); repeatable"
)
_JOB_ID = re.compile(r"\d+")


@dataclass(frozen=True)
class After:
    """``REF[:MODE]``: what to wait for and on which end."""

    ref: str
    mode: str = "ok"

    @classmethod
    def parse(cls, text: str, where: str = "--after") -> After:
        ref, sep, mode = text.rpartition(":")
        if not sep or mode not in MODES:
            if sep and re.fullmatch(r"[a-z]+", mode):  # a mode, misspelled (a path's ':' is not one)
                raise DdpJobError(f"{where} '{text}': unknown condition '{mode}'", "use REF:ok, REF:any or REF:notok")
            ref, mode = text, "ok"
        if not ref:
            raise DdpJobError(f"{where} '{text}' names nothing to wait for", "write RUN[:ok|any|notok]")
        return cls(ref, mode)

    def __str__(self) -> str:
        return f"{self.ref}:{self.mode}"


def satisfied(state: str, mode: str) -> Optional[bool]:
    """Whether a run that ended in ``state`` (``ddpjob status``'s) meets ``mode``; None while it may still run."""
    if state in status.ACTIVE_STATES or state in ("UNKNOWN", "NOT_SUBMITTED"):
        return None
    return {"ok": state == "COMPLETED", "notok": state != "COMPLETED", "any": True}[mode]


@dataclass(frozen=True)
class Upstream:
    """What a dependency names now: the job to wait for and, for a run of ddpjob's, the run's state."""

    name: str  # as the user named it (a run's directory name for a run)
    job_id: str
    state: Optional[str]  # None: a plain Slurm job (not a run ddpjob knows): Slurm alone decides

    def decide(self, mode: str, where: str) -> Optional[str]:
        """The ``--dependency`` item to add (``afterok:ID``), or None when the run ended and meets ``mode``; raises
        when it ended and never will."""
        met = satisfied(self.state, mode) if self.state is not None else None
        if met is None:
            return f"{MODES[mode]}:{self.job_id}"
        if met:
            return None
        raise DdpJobError(
            f"{where} {self.name}:{mode}: run {self.name} ended {self.state}, so this job could never start",
            f"resume or resubmit {self.name} first, or wait for another end (:any, :notok)",
        )


def upstream(ref: str, root: Path) -> Upstream:
    """The newest Slurm job of the run ``ref`` names (a directory, a name, or a job id of one of its attempts) and
    its state; a job id no run under ``root`` knows is taken as a plain Slurm job."""
    try:
        path = lookup.resolve(ref, root)
    except DdpJobError:
        if _JOB_ID.fullmatch(ref):
            return Upstream(ref, ref, None)
        raise
    (row,) = status.collect([path], "eval/accuracy")
    jobs = [j for j in row.jobs if j.on_slurm]
    if not jobs:
        raise DdpJobError(
            f"run {path.name} has no Slurm job to wait for (never submitted, or run with --local)",
            f"submit it first: ddpjob resume {path}",
        )
    return Upstream(path.name, jobs[-1].job_id, row.state(time.time()))


def dependency(items: Sequence[Optional[str]]) -> Optional[str]:
    """``--dependency``'s value: every item must hold (``,``); None when nothing is left to wait for."""
    kept = [item for item in items if item]
    return ",".join(kept) if kept else None


def cmd_submit(args: argparse.Namespace) -> int:
    """``ddpjob submit``, with ``--after``'s dependencies resolved first (each one line when refused)."""
    root = lookup.DEFAULT_ROOT
    afters = [After.parse(text) for text in args.after]
    items = [upstream(a.ref, root).decide(a.mode, "--after") for a in afters]
    return submission.cmd_submit(args, dependency=dependency(items), follow=follow)
