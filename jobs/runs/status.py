"""``ddpjob status``: where each run or sweep trial stands, one table row per run.

A row per run joins what the run directory says (run.json's job ids, attempts.jsonl, metrics.jsonl, checkpoint
manifests, and for script mode the script from config.yaml) with Slurm's accounting. A refresh asks ``sacct`` once for
every job of every row (``-D`` lists each requeued attempt of a job as its own line), never once per job: a sweep of a
thousand trials is one call. Which runs a command is about, and their jobs, is ``jobs.runs.listing``, shared with
``ddpjob logs`` and ``ddpjob cancel`` (``jobs.runs.logs``). Under one run's table: the code its attempts import and its
goodput, where its time went (``jobs.runs.goodput``).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import logging
import math
import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Sequence

from ddp_core.checkpoint import storage
from ddp_core.cluster import failures
from ddp_core.cluster.slurm import Runner
from ddp_core.errors import DdpJobError
from jobs.runs import goodput, notes, throughput
from jobs.runs.attempts import Attempt, in_array_range, job_attempts
from jobs.runs.listing import DEFAULT_ROOT, Job, query_ids, run_jobs, runs_to_show, shown_path
from jobs.runs.ranking import ranking_metric
from jobs.runs.watcher import Poll, watch

if TYPE_CHECKING:
    from ddp_core.run.rundir import RunDir

log = logging.getLogger(__name__)
# A job in one of these states may still produce output or run again; anything else is final.
ACTIVE_STATES = frozenset(
    {
        "PENDING",
        "RUNNING",
        "REQUEUED",
        "REQUEUE_HOLD",
        "REQUEUE_FED",
        "RESIZING",
        "SUSPENDED",
        "COMPLETING",
        "CONFIGURING",
        "SIGNALING",
        "STAGE_OUT",
        "STOPPED",
    }
)
EVENT_STATES = {
    "start": "STARTED",
    "interrupted": "INTERRUPTED",
    "requeued": "INTERRUPTED",
    "completed": "COMPLETED",
    "budget_exhausted": "BUDGET_EXHAUSTED",
    "preempted": "PREEMPTED",
    "hang": "HUNG",
    "pruned": "PRUNED",
    "failed": "FAILED",  # a user error (ddp_core.cluster.failures): not retried
}
ACCOUNTING_LAG_S = 120  # a job this young with no sacct record yet is queued, not lost
SCRIPT_WIDTH = 48  # characters of a script's command line in the table
# Every Slurm command goes through the gateway (cluster.slurm); ``runner=`` hands it fabricated output in tests.


@dataclass
class Row:
    run: RunDir
    jobs: list[Job]
    events: list[dict[str, Any]]
    attempts: list[Attempt] = field(default_factory=list)
    last_step: Optional[int] = None
    loss: Optional[float] = None
    metric: Optional[float] = None
    checkpoint_mtime: Optional[float] = None
    checkpoint_url: Optional[str] = None  # checkpoint.dir's folder of the run, in object storage
    straggler: Optional[dict[str, Any]] = None  # the last progress line, when it names a persistent straggler
    script: Optional[list[str]] = None  # script mode: what each rank runs (ddp_core.script), else None
    trial_state: Optional[str] = None  # a trial of an adaptive sweep: its state in the study (COMPLETE, PRUNED, ...)
    no_accounting: Optional[str] = None  # why accounting did not answer (attempts are then the controller's)

    @property
    def job_label(self) -> str:
        recorded = [j.job_id for j in self.jobs]
        return f"{recorded[-1]} +{len(recorded) - 1}" if len(recorded) > 1 else (recorded or ["-"])[0]

    def state(self, now: float) -> str:
        if self.trial_state is not None:  # its worker's job says nothing about the trial: the study does
            return self.trial_state
        # A rank's own failure record (rank_failed) may follow the attempt's end: the watcher's or the ranks' decision.
        decided = [e for e in self.events if e["event"] != "rank_failed"]
        last_event = decided[-1]["event"] if decided else ""
        if self.attempts:
            last = self.attempts[-1]
            if last_event in ("preempted", "budget_exhausted") and last.state not in ACTIVE_STATES:
                # PreemptMode=CANCEL, or a spent budget: the ranks left (inside a preemption's grace time), so
                # Slurm's record reads FAILED; the run's own record says why.
                return EVENT_STATES[last_event]
            if last.state == "FAILED" and last_event == "failed" and failures.last_kind(decided) == "memory":
                return "OUT_OF_MEMORY"  # a step's task over its limit; the batch script then ended FAILED
            return f"FAILED({last.exit_code.split(':')[0]})" if last.state == "FAILED" else last.state
        # No accounting (a --local run, or no sacct here): the trainer's own record says what happened last.
        if self.no_accounting and self.jobs and EVENT_STATES.get(last_event) in ("STARTED", "INTERRUPTED"):
            return "UNKNOWN"  # nor does the controller hold the job any more: it ended, no record says how
        if last_event in EVENT_STATES:
            return EVENT_STATES[last_event]
        newest = max((j.submitted for j in self.jobs if j.on_slurm), default="")
        if newest and now - time.mktime(time.strptime(newest, "%Y-%m-%dT%H:%M:%S")) < ACCOUNTING_LAG_S:
            return "PENDING"  # sbatch answered, slurmdbd has not written the record yet
        return "UNKNOWN" if self.jobs else "NOT_SUBMITTED"

    @property
    def early_stopped(self) -> bool:
        """The run completed through train.early_stop_patience (its monitored metric stopped improving)."""
        done = [e for e in self.events if e["event"] == "completed"]
        return bool(done and done[-1].get("early_stopped"))

    def active(self, now: float) -> bool:
        return self.state(now) in ACTIVE_STATES

    def history(self, now: float) -> str:
        """Each attempt's state, oldest first, repeats folded, jobs apart: ``REQUEUED x3 > COMPLETED | RUNNING``."""
        if not self.attempts:
            return self.state(now)
        states = [(a.job_id, a.state) for a in self.attempts[:-1]] + [(self.attempts[-1].job_id, self.state(now))]
        jobs = []
        for _, group in itertools.groupby(states, key=lambda pair: pair[0]):
            folded = ((state, len(list(same))) for state, same in itertools.groupby(state for _, state in group))
            jobs.append(" > ".join(state if n == 1 else f"{state} x{n}" for state, n in folded))
        return " | ".join(jobs)

    @property
    def ranks(self) -> str:
        """Each attempt's world size, from its start event, oldest first, repeats folded as in ``history``: an
        elastic job (slurm.nodes MIN-MAX) that ran on 2 ranks, then twice on 4, reads ``2 > 4 x2``."""
        sizes = [e["world_size"] for e in self.events if e["event"] == "start" and isinstance(e.get("world_size"), int)]
        folded = ((size, len(list(same))) for size, same in itertools.groupby(sizes))
        return " > ".join(str(size) if n == 1 else f"{size} x{n}" for size, n in folded) or "-"

    @property
    def restarts(self) -> int:
        """Requeues of the run's jobs (a resume is a new job, not a restart). A REQUEUED line counts before
        its next attempt's line exists; attempts.jsonl covers runs sacct does not know."""
        requeued = sum(1 for a in self.attempts if a.state.startswith("REQUEUE"))
        later = len(self.attempts) - len({a.job_id for a in self.attempts})
        by_events = sum(1 for e in self.events if e["event"] == "start" and e.get("restart_count", 0) > 0)
        return max(requeued, later, by_events)


def _read_row(run: RunDir, metric_key: str) -> Row:
    row = Row(run, run_jobs(run), run.events(), script=run.script_command())
    split, _, name = metric_key.partition("/")
    records = run.metrics()
    for record in records:
        if record["split"] == "train" and isinstance(record.get("loss"), (int, float)):
            row.loss = float(record["loss"])
            row.straggler = record if isinstance(record.get("straggler_rank"), int) else None
        if record["split"] == split and isinstance(record.get(name), (int, float)):
            row.metric = float(record[name])
    # attempts.jsonl knows steps metrics.jsonl may not (a stop between two log lines); a script's events may have
    # none (step null): its steps are the ones it gave ddp_core.runtime, if any.
    steps = [r["step"] for r in records] + [e["step"] for e in row.events if isinstance(e.get("step"), int)]
    row.last_step = max(steps, default=None)
    where = run.recorded_checkpoints()
    row.checkpoint_mtime = storage.newest_manifest_time(where)
    row.checkpoint_url = where if isinstance(where, str) else None
    return row


def collect(
    run_paths: Sequence[Path], metric_key: str, runner: Optional[Runner] = None, poll: Optional[Poll[Any]] = None
) -> list[Row]:
    """Read every run and attach its sacct attempts: one sacct call for all of them (with ``poll``, a watcher's:
    only when its back-off says so, else its last answer)."""
    from ddp_core.run.rundir import RunDir  # imports omegaconf: not at module level, `ddpjob --help` builds our parsers

    rows = []
    for path in run_paths:
        try:
            rows.append(_read_row(RunDir(Path(path)), metric_key))
        except DdpJobError as err:
            if len(run_paths) == 1:
                raise
            log.warning("skipping %s: %s", path, err)  # one damaged run must not hide a whole sweep's status
    owner: dict[str, Row] = {}  # any id a job goes by (as submitted, or raw) -> its row
    tasks: dict[str, list[tuple[int, Row]]] = {}  # array base id -> (task index, row)
    for row in rows:
        for job in row.jobs:
            owner.setdefault(job.job_id, row)
            base, _, task = job.job_id.partition("_")
            if task.isdigit():
                tasks.setdefault(base, []).append((int(task), row))
    ids = query_ids([j for row in rows for j in row.jobs])
    fetch = functools.partial(job_attempts, ids, runner)
    attempts, no_accounting = fetch() if poll is None else poll.ask(tuple(ids), fetch)
    for row in rows:
        row.no_accounting = no_accounting
    for attempt in attempts:
        base, _, spec = attempt.job_id.partition("_")
        # Array tasks not started yet share one line: 5301_[4-9%2], or a bare 5301 just after the submit.
        if spec.startswith("[") or (not spec and base in tasks):
            for index, row in tasks.get(base, []):
                if not spec or in_array_range(spec, index):
                    row.attempts.append(Attempt(f"{base}_{index}", attempt.raw_id, attempt.state))
        elif (owned := owner.get(attempt.job_id) or owner.get(attempt.raw_id)) is not None:
            owned.attempts.append(attempt)
    return rows


def sort_by_metric(rows: list[Row], metric: str) -> tuple[list[Row], Optional[Row]]:
    """Best first; rows without a finite value last, by name. Returns (rows, best row or None)."""
    minimise = ranking_metric(metric).minimize
    scored = [r for r in rows if r.metric is not None and math.isfinite(r.metric)]

    def score(row: Row) -> float:
        assert row.metric is not None  # scored holds only rows with a finite metric
        return row.metric if minimise else -row.metric

    scored.sort(key=score)
    kept = {id(r) for r in scored}  # by identity: Row's dataclass equality compares every field, a thousand squared
    rest = sorted((r for r in rows if id(r) not in kept), key=lambda r: r.run.name)
    return scored + rest, (scored[0] if scored else None)


def age(mtime: Optional[float], now: float) -> str:
    if mtime is None:
        return "-"
    seconds = max(0, int(now - mtime))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit} ago"
    return f"{seconds}s ago"


def script_label(command: Optional[list[str]], limit: int = SCRIPT_WIDTH) -> str:
    """A script run's command for the table: the file's name (not its path) and its arguments; past ``limit``, the
    last arguments that fit, where a sweep's own arguments are (``train.py … --lr=0.001``)."""
    if command is None:
        return "-"
    head = command[:2] if command[0] == "-m" else [Path(command[0]).name]
    name, args = shlex.join(head), [shlex.quote(a) for a in command[len(head) :]]
    if len(name) + sum(1 + len(a) for a in args) <= limit:
        return " ".join([name, *args])
    room = limit - len(name) - 2  # 2: " …"
    kept: list[str] = []
    while args and len(args[-1]) + sum(1 + len(a) for a in kept) <= room:
        kept.insert(0, args.pop())
    return f"{name} … {' '.join(kept)}" if kept else f"{name} …{args[-1][-max(8, room) :]}"


def render(rows: Sequence[Row], metric_key: str, best: Optional[Row], now: float) -> str:
    """A fixed-width table; numbers right-aligned, the run directory last (its width varies most). A SCRIPT column
    when any row is a script run."""
    fmt = lambda v: "-" if v is None else f"{v:.4g}"  # noqa: E731
    scripts = any(r.script is not None for r in rows)
    head = [
        "",
        "JOB",
        "STATE",
        "RESTARTS",
        "RANKS",
        "STEP",
        "LOSS",
        metric_key,
        "CHECKPOINT",
        *(["SCRIPT"] * scripts),
        "RUN DIR",
    ]
    right = {3, 4, 5, 6, 7}
    table = [head] + [
        [
            "*" if r is best else "",
            r.job_label,
            r.history(now) + " (early stop)" * r.early_stopped,
            str(r.restarts),
            r.ranks,
            "-" if r.last_step is None else str(r.last_step),
            fmt(r.loss),
            fmt(r.metric),
            age(r.checkpoint_mtime, now) + (f" {r.checkpoint_url}" if r.checkpoint_url else ""),
            *([script_label(r.script)] * scripts),
            shown_path(r.run.path),
        ]
        for r in rows
    ]
    widths = [max(len(line[i]) for line in table) for i in range(len(head))]
    lines = [
        "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(line, widths, strict=True)))
        for line in table
    ]
    return "\n".join(
        [
            *(line.rstrip() for line in lines),
            *(n for r in rows for n in notes.for_run(r.run.name, r.events, r.straggler)),
        ]
    )


def _code_line(run: RunDir) -> str:
    """What the run's attempts import: its code snapshot (ddp_core.run.snapshot), or the working tree."""
    from ddp_core.run import snapshot

    try:
        return snapshot.describe(snapshot.read_record(run))
    except DdpJobError as err:
        return str(err)


def status_text(
    path: Optional[str],
    metric: Optional[str],
    limit: int = 20,
    runner: Optional[Runner] = None,
    poll: Optional[Poll[Any]] = None,
) -> tuple[str, bool]:
    """One refresh: (the table, whether any row is still active). ``metric`` None: an adaptive sweep's own, else
    eval/accuracy. ``poll``: ``--watch``'s, which asks accounting only on its back-off."""
    from jobs.sweeps import pack, search

    # is_search is False for None; the check is spelled out for the type checker (Path(None) is an error)
    study = search.summary(Path(path)) if path is not None and search.is_search(path) else None
    if metric is None:
        own = study["spec"] if study else None
        metric = search.own_metric(own) if own else "eval/accuracy"
    metric_key = ranking_metric(metric).key
    paths, is_sweep = runs_to_show(path, limit)
    rows, now = collect(paths, metric_key, runner, poll), time.time()
    packed = pack.summary(Path(path)) if path is not None and not study else None
    for row in rows:  # a trial's state is its study's, or its queue's, not its worker's or allocation's job's
        row.trial_state = (study or packed or {}).get("states", {}).get(row.run.name)
    best = None
    if is_sweep:
        rows, best = sort_by_metric(rows, metric)
    text = render(rows, metric_key, best, now)
    if rows and rows[0].no_accounting:
        text += f"\n{rows[0].no_accounting}"
    if len(rows) == 1 and not is_sweep:
        text += f"\ncode: {_code_line(rows[0].run)}"
        if (speed := throughput.describe(rows[0].run.metrics(), throughput.max_steps_in(rows[0].run))) is not None:
            text += f"\n{speed}"
        if (measured := goodput.measure(rows[0].events, rows[0].run.metrics())) is not None:
            text += f"\n{measured.line()}"
    if best is not None:
        text += f"\n* best by {metric}: {shown_path(best.run.path)} = {best.metric:.6g}"
    if packed is not None:
        text = "\n".join([*pack.status_lines(packed), text])
        return text, packed["counts"]["pending"] + packed["counts"]["running"] > 0
    if study is not None:
        text = "\n".join([*search.status_lines(study), text])
        return text, study["counts"]["running"] > 0 or len(study["trials"]) < study["spec"]["budget"]
    return text, any(r.active(now) for r in rows)


def cmd_status(args: argparse.Namespace) -> int:
    return watch(lambda poll: status_text(args.path, args.metric, args.limit, poll=poll), args.watch)


def add_parser(sub: Any) -> None:
    """Register ``status`` on ``ddpjob``'s subparsers."""
    p = sub.add_parser("status", help="job state, restarts, step, loss/metric and checkpoint age per run or trial")
    p.add_argument(
        "path", nargs="?", help=f"a run directory or a sweep folder (default: newest runs in ./{DEFAULT_ROOT})"
    )
    p.add_argument(
        "--watch",
        nargs="?",
        type=float,
        const=10.0,
        metavar="SECONDS",
        help="refresh every SECONDS (default 10) until all rows end; put it after PATH",
    )
    p.add_argument(
        "--metric",
        help="sweeps: ranks trials (default eval/accuracy, a search's own metric); a loss or error is minimised, "
        "anything else maximised",
    )
    p.add_argument("--limit", type=int, default=20, help="without PATH: how many of the newest runs")


COMMANDS = {"status": cmd_status}
