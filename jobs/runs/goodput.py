"""A run's goodput: the share of its time spent on training steps that count, and where the rest went, from the run's
own records alone (``attempts.jsonl``'s events and ``metrics.jsonl``'s rows): ``ddpjob status RUN``, the run's report
and ``bench/soak.py`` read it from here.

A *launch* is one start of the ranks, which rank 0's ``start`` event marks just before the launch's first step: a Slurm
job's attempt has one, and one more after each restart of its ranks in the same allocation (the batch script's
``restarted`` event). The run's time goes from its first launch's begin to its end (its last record, or ``end``),
less the gaps between its jobs (a ``ddpjob resume`` after the run had ended waits on a person, not on the run).
Every second of it falls in exactly one term, so the terms sum to the total:

- **training**: from a launch's first step to its last record that counts (a metrics row, train, eval or checkpoint,
  whose step no later launch took back), less the checkpoint blocking in between: the steps that count, with the
  evaluations and progress lines among them.
- **checkpoint**: what training blocked for in those saves (the checkpoint rows' ``save_s``: a synchronous save
  whole, an asynchronous one's copy to host memory).
- **retrained**: steps trained again. A launch that reached step F (its rows, and the steps its failure, requeue or
  restart events name), followed by one that resumed from checkpoint step C < F, trained F - C steps for nothing;
  each counts at its measured step time: the median ``step_ms`` of the launch that trained it again (of the whole
  run, if that launch logged none).
- **startup**: a launch's begin to its first step: imports, rendezvous, loading the checkpoint. The begin is the
  ``restarted`` event for a launch restarted in its allocation, else rank 0's process start (the ``start`` event's
  ``launched``), else its first step (no start-up measured).
- **restarts**: the end of a launch that another launch of its job follows: from its last record that counts, past
  its steps trained again, to the next launch's begin in the same allocation (the ``restarted`` event), or to the
  requeue (the ``requeued`` event, else the launch's last record): the failure, its detection and the decision.
- **queue**: from a requeue to the next attempt's begin: Slurm's requeue, the wait for nodes, the batch script.
- **other**: each job's last launch after its last record that counts (past its steps trained again, where a later
  job resumed the run): a completed run's exit, the steps past the last checkpoint of a run that ended failed, or
  those since the last progress line at ``end``.

goodput = training / total. Records without a time (``t`` in events, ``time`` in rows) are left out.
"""

from __future__ import annotations

import bisect
import statistics
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    from ddp_core.run.rundir import RunDir

Record = dict[str, Any]
# (term, label, what it is): in the order status and the report show them; the keys of Goodput.seconds.
TERMS = (
    ("training", "training", "steps that count, with the evaluations among them"),
    ("checkpoint", "checkpoint blocking", "training blocked by checkpoint saves"),
    ("retrained", "steps trained again", "steps past the restored checkpoint, trained before a failure"),
    ("startup", "start-up", "a launch's begin to its first step: imports, rendezvous, checkpoint load"),
    ("restarts", "restarts", "a launch's end to the next launch in the allocation, or to the requeue"),
    ("queue", "queue waits", "a requeue to the next attempt's begin"),
    ("other", "other", "each job's last launch after its last record that counts"),
)
REQUEUES = frozenset({"requeued", "requeued_by_batch"})
# Events a launch writes about its own end before a requeue: its last record where no requeue event is (Slurm's own).
OWN_END = frozenset({"rank_failed", "hang", "interrupted", "preempted", "requeue_deferred"})
# And the decisions that end a job: a resumed run's earlier job ended at the last of these.
JOB_END = OWN_END | {"failure", "failed", "budget_exhausted", "requeue_failed", "completed", "pruned", *REQUEUES}


@dataclass(frozen=True)
class Goodput:
    """A run's time split into ``TERMS`` (seconds, summing to ``total``), and the counts behind them."""

    seconds: dict[str, float]
    launches: int
    requeues: int  # launches that followed a requeue of the same job
    restarts: int  # launches restarted in the same allocation
    retrained_steps: int

    @property
    def total(self) -> float:
        return sum(self.seconds.values())

    @property
    def fraction(self) -> float:
        """Training over the total: 0 for a run without time yet."""
        return self.seconds["training"] / self.total if self.total > 0 else 0.0

    def share(self, term: str) -> float:
        return self.seconds[term] / self.total if self.total > 0 else 0.0

    def counts(self, term: str) -> str:
        """What a term counts, for its label: ``312 steps``, ``2 in the allocation``, ``1 requeue``; empty for none."""
        if term == "retrained" and self.retrained_steps:
            return f"{self.retrained_steps} step{'s' * (self.retrained_steps != 1)}"
        if term == "restarts" and self.restarts:
            return f"{self.restarts} in the allocation"
        if term == "queue" and self.requeues:
            return f"{self.requeues} requeue{'s' * (self.requeues != 1)}"
        return ""

    def line(self) -> str:
        """One line for ``ddpjob status``: the goodput, then each other term's share that is not zero."""
        parts = []
        for term, label, _ in TERMS[1:]:
            if self.seconds[term] > 0 or self.counts(term):
                counted = f" ({self.counts(term)})" if self.counts(term) else ""
                parts.append(f"{label} {100 * self.share(term):.1f}%{counted}")
        launches = f"{self.launches} launch{'es' * (self.launches != 1)}"
        head = f"goodput {100 * self.fraction:.1f}% of {duration(self.total)} ({launches})"
        return head + (": " + ", ".join(parts) if parts else "")


def duration(seconds: float) -> str:
    """``2h 5m``, ``10m 3s``, ``4.2s``."""
    if seconds < 60:
        return f"{seconds:.1f}s"
    whole = round(seconds)
    h, m, s = whole // 3600, whole % 3600 // 60, whole % 60
    return f"{h}h {m}m" if h else f"{m}m {s}s"


def of_run(run: RunDir, end: Optional[float] = None) -> Optional[Goodput]:
    """The goodput of the run at ``run`` (see ``measure``)."""
    return measure(run.events(), run.metrics(), end)


def _t(record: Record, key: str = "t") -> Optional[float]:
    value = record.get(key)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _step(record: Record) -> Optional[int]:
    step = record.get("step")
    return step if isinstance(step, int) and not isinstance(step, bool) else None


@dataclass
class _Launch:
    start: Record
    after: list[Record]  # the events between this start and the next one
    rows: list[Record]  # the metrics rows written during this launch
    begin: float
    first: float  # the start event's time: just before the first step
    ended_by: str = "last"  # "allocation" (restarted in it), "requeue" (same job, next attempt), "job" (a resume)
    end: float = 0.0
    counted: list[Record] = field(default_factory=list)  # its rows that no later launch took back
    counted_end: float = 0.0

    def reached(self) -> Optional[int]:
        """The furthest step this launch trained: its rows' and the steps its end's events name."""
        return max((s for r in [*self.rows, *self.after] if (s := _step(r)) is not None), default=None)


def _launches(events: list[Record], rows: list[Record]) -> list[_Launch]:
    """The launches, each with its begin, the events after it and its rows (by time), and how it ended."""
    starts = [i for i, e in enumerate(events) if e["event"] == "start"]
    launches: list[_Launch] = []
    for n, i in enumerate(starts):
        start, first = events[i], _t(events[i]) or 0.0
        before = events[starts[n - 1] + 1 : i] if n else []
        after = events[i + 1 : starts[n + 1]] if n + 1 < len(starts) else events[i + 1 :]
        attempt = (start.get("job_id"), start.get("restart_count"))
        restarted = [
            e for e in before if e["event"] == "restarted" and (e.get("job_id"), e.get("restart_count")) == attempt
        ]
        begin = _t(restarted[-1]) if restarted else _t(start, "launched")
        if launches:
            job = launches[-1].start.get("job_id") == start.get("job_id")
            launches[-1].ended_by = "allocation" if restarted else "requeue" if job else "job"
        launches.append(_Launch(start, after, [], min(first if begin is None else begin, first), first))
    rows = sorted(rows, key=lambda r: r["time"])
    times = [r["time"] for r in rows]
    for k, launch in enumerate(launches):
        until = bisect.bisect_left(times, launches[k + 1].first) if k + 1 < len(launches) else len(rows)
        launch.rows = rows[bisect.bisect_left(times, launch.first) : until]
    return launches


def _ends(launches: list[_Launch], stop: float) -> None:
    """Each launch's end and the end of what counts in it, clamped so that no two launches' times overlap."""
    for k, launch in enumerate(launches):
        nxt = launches[k + 1] if k + 1 < len(launches) else None
        requeued = [e for e in launch.after if e["event"] in REQUEUES]
        if nxt is None:
            launch.end = stop
        elif launch.ended_by == "allocation":
            launch.end = nxt.begin
        elif launch.ended_by == "requeue" and requeued:
            launch.end = _t(requeued[0]) or launch.first
        else:  # Slurm requeued it (no event), or a later job resumed the run: the launch's last own record
            ends = OWN_END if launch.ended_by == "requeue" else JOB_END
            times = [_t(e) or 0.0 for e in launch.after if e["event"] in ends] + [r["time"] for r in launch.rows]
            launch.end = max([launch.first, *(t for t in times if t <= nxt.begin)])
        if nxt is not None:
            launch.end = min(launch.end, nxt.begin)
            nxt.begin = max(nxt.begin, launch.end)
            nxt.first = max(nxt.first, nxt.begin)
        resumed = _step(nxt.start) if nxt is not None else None
        launch.counted = [r for r in launch.rows if resumed is None or (_step(r) or 0) <= resumed]
        launch.counted_end = min(max([launch.first, *(r["time"] for r in launch.counted)]), launch.end)


def _step_time(rows: list[Record]) -> float:
    """Seconds per step: the median ``step_ms`` of these train rows (0 without one)."""
    times = [
        float(r["step_ms"]) for r in rows if r.get("split") == "train" and isinstance(r.get("step_ms"), (int, float))
    ]
    return statistics.median(times) / 1000 if times else 0.0


def measure(events: list[Record], metrics: list[Record], end: Optional[float] = None) -> Optional[Goodput]:
    """The goodput of a run from its events (``RunDir.events()``) and metrics rows (``RunDir.metrics()``), up to
    ``end`` (epoch seconds; default: its last record). None before its first launch's ``start``."""
    timed = [e for e in events if _t(e) is not None and (end is None or (_t(e) or 0.0) <= end)]
    rows = [r for r in metrics if _t(r, "time") is not None and (end is None or (_t(r, "time") or 0.0) <= end)]
    if not any(e["event"] == "start" for e in timed):
        return None
    stop = end if end is not None else max([_t(e) or 0.0 for e in timed] + [_t(r, "time") or 0.0 for r in rows])
    launches = _launches(timed, rows)
    _ends(launches, stop)
    seconds = {term: 0.0 for term, _, _ in TERMS}
    retrained_steps = 0
    for k, launch in enumerate(launches):
        nxt = launches[k + 1] if k + 1 < len(launches) else None
        seconds["startup"] += launch.first - launch.begin
        span = launch.counted_end - launch.first
        saves = sum(float(r.get("save_s") or 0.0) for r in launch.counted if r.get("split") == "checkpoint")
        seconds["checkpoint"] += min(saves, span)
        seconds["training"] += span - min(saves, span)
        tail = launch.end - launch.counted_end
        if nxt is None:
            seconds["other"] += tail
            continue
        reached, resumed = launch.reached(), _step(nxt.start)
        lost = max(0, reached - resumed) if reached is not None and resumed is not None else 0
        retrained_steps += lost
        redone = min(tail, lost * (_step_time(nxt.counted) or _step_time(rows)))
        seconds["retrained"] += redone
        seconds["other" if launch.ended_by == "job" else "restarts"] += tail - redone
        if launch.ended_by == "requeue":
            seconds["queue"] += nxt.begin - launch.end
    return Goodput(
        seconds=seconds,
        launches=len(launches),
        requeues=sum(1 for launch in launches[:-1] if launch.ended_by == "requeue"),
        restarts=sum(1 for launch in launches[:-1] if launch.ended_by == "allocation"),
        retrained_steps=retrained_steps,
    )
