"""The attempts of a run's Slurm jobs, for ``ddpjob status``: from accounting where it answers, else from the
controller, with the one line that says what the controller cannot tell.

Accounting (``sacct -D``) lists every attempt of a job, also long after it ended: one call for every job of every
row. Where it does not answer (no ``sacct`` client here, slurmdbd down, ``AccountingStorageType=none``: the gateway's
``accounting_failure`` decides), ``squeue -t all`` says each job's state now, one row per job, for as long as the
controller holds it (``MinJobAge`` seconds past its end); past that the run's own ``attempts.jsonl`` is all there is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from ddp_core.cluster.slurm import Runner, gateway_for

SACCT_FIELDS = "JobID,JobIDRaw,State,ExitCode,Start,End"


@dataclass(frozen=True)
class Attempt:
    """One line of ``sacct -D``: one attempt of a job (a requeued job has one line per attempt). Without accounting:
    the job's one line from the controller, its current attempt."""

    job_id: str
    raw_id: str
    state: str
    exit_code: str = "0:0"
    start: str = ""
    end: str = ""


def without_accounting(error: str) -> str:
    """The line ``ddpjob status`` prints when accounting does not answer: why, and what it cannot know then."""
    return (
        f"no accounting ({error}): states come from the controller while it holds a job, then from the run's "
        "attempts.jsonl; not known without accounting: each earlier attempt's state and exit code, and how a job "
        "ended once the controller forgot it (MinJobAge)"
    )


def job_attempts(job_ids: Sequence[str], runner: Optional[Runner] = None) -> tuple[list[Attempt], Optional[str]]:
    """(every attempt of the jobs, oldest first per job; None) from accounting, else (each job's state from the
    controller, the ``without_accounting`` line)."""
    gateway = gateway_for(runner)
    answer = gateway.sacct(job_ids, SACCT_FIELDS, attempts=True)
    if answer.error is None:
        rows = []
        for parts in answer.rows:
            if len(parts) >= 3:
                job_id, raw, state, *rest = parts
                rows.append(Attempt(job_id, raw, (state.split() or ["?"])[0], *rest[:3]))  # "CANCELLED by 0"
        return rows, None
    held = [Attempt(q.job_id, q.raw_id, q.state, q.exit_code) for q in gateway.queue_states(job_ids)]
    return held, without_accounting(answer.error)


def in_array_range(spec: str, index: int) -> bool:
    """Whether ``index`` is in a pending-array spec like ``[1-3,7%2]``."""
    for part in spec.strip("[]").split("%")[0].split(","):
        lo, _, hi = part.partition("-")
        if lo.isdigit() and int(lo) <= index <= int(hi if hi.isdigit() else lo):
            return True
    return False
