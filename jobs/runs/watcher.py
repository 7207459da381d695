"""The login node's one watcher of jobs: the loop of ``status --watch`` (runs, sweeps, pipelines) and of ``submit
--wait`` / ``resume --wait``, and when it asks Slurm.

Every refresh reads the run's own files (metrics.jsonl, attempts.jsonl: a job is running, at which step, that it
ended), which cost the controller nothing; Slurm is asked only what the files cannot say (pending and why, Slurm's
start estimate, that the job left the queue, the states in accounting), one query for every job in view, on the
back-off schedule of ``ddp_core.cluster.backoff`` (2 s growing to 30 s). A rate-limited answer (``SlurmBusy``) keeps
the last answer and asks again after the longest delay: "later", never "gone" or a wrong state.
"""

from __future__ import annotations

import sys
import time
from typing import Any, Callable, Generic, Optional, TypeVar

from ddp_core.cluster.backoff import Backoff
from ddp_core.cluster.slurm import SlurmBusy

T = TypeVar("T")
PLAIN_EVERY_S = 5.0  # a live line printed as plain lines (stdout not a terminal): at most one this often
LINE_REFRESH_S = 1.0  # a live line re-reads the run's files this often (no Slurm query)


class Poll(Generic[T]):
    """When a watcher asks Slurm: ``ask(key, fetch)`` calls ``fetch`` (one query for everything ``key`` names)
    only when the back-off's delay since the last call has passed or ``key`` changed; else it gives the last answer.
    ``hurry`` asks at the next refresh after ``after_s``: the files said something Slurm should confirm."""

    def __init__(self, backoff: Optional[Backoff] = None, clock: Optional[Callable[[], float]] = None) -> None:
        self.backoff, self.clock = backoff or Backoff(), clock or time.monotonic
        self.next_at = 0.0
        self.key: object = None
        self.answer: Optional[T] = None
        self.queries = 0  # how many times it asked Slurm (the benchmark and the tests read it)
        self.busy: Optional[str] = None  # the rate limit's line while the last question was refused

    def ask(self, key: object, fetch: Callable[[], T]) -> T:
        now = self.clock()
        if self.answer is not None and key == self.key and now < self.next_at:
            return self.answer
        self.queries += 1
        try:
            self.answer, self.key, self.busy = fetch(), key, None
        except SlurmBusy as err:
            self.backoff.slowest()
            self.next_at, self.busy = now + self.backoff.next(), str(err)
            if self.answer is None:  # nothing known yet: the watch loop says so and comes back later
                raise
            return self.answer
        self.next_at = now + self.backoff.next()
        return self.answer

    def hurry(self, after_s: float = 2.0) -> None:
        self.backoff.reset()
        self.next_at = min(self.next_at, self.clock() + after_s)


class Line:
    """One live line: rewritten in place on a terminal (``\\r``), else printed as plain lines, a new one only when
    the state changes or ``PLAIN_EVERY_S`` passed."""

    def __init__(self, tty: Optional[bool] = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.tty = sys.stdout.isatty() if tty is None else tty
        self.clock, self.last, self.printed_at = clock, "", -PLAIN_EVERY_S

    def show(self, text: str) -> None:
        if text == self.last:
            return
        now = self.clock()
        if self.tty:
            sys.stdout.write(f"\r{text}\033[K")
        elif text.split(",")[0] != self.last.split(",")[0] or now - self.printed_at >= PLAIN_EVERY_S:
            sys.stdout.write(text + "\n")
            self.printed_at = now
        else:
            return
        sys.stdout.flush()
        self.last = text

    def end(self) -> None:
        if self.tty and self.last:
            sys.stdout.write("\n")
            sys.stdout.flush()


def watch(
    render: Callable[[Poll[Any]], tuple[str, bool]],
    interval: Optional[float],
    line: Optional[Line] = None,
    poll: Optional[Poll[Any]] = None,
    interrupted: int = 0,
) -> int:
    """Print ``render(poll)``'s text (and whether anything in it may still run) once, or with ``interval`` again every
    ``interval`` s until nothing may; ``render`` asks Slurm through ``poll``, whose delays grow from ``interval``
    to 30 s (or ``interval``, if longer). A table is redrawn under a header line; with ``line``, one live line.
    Ctrl-C ends it with ``interrupted`` (``--watch``: 0, the normal way out)."""
    if poll is None:
        poll = Poll(Backoff(first_s=interval or 2.0, max_s=max(interval or 0.0, 30.0)))
    try:
        while True:
            try:
                text, active = render(poll)
            except SlurmBusy as err:  # nothing known yet and the controller refused: later, not an error
                poll.backoff.slowest()
                poll.next_at = poll.clock() + poll.backoff.next()
                text, active = f"{err} (asking again in {poll.next_at - poll.clock():.0f} s)", interval is not None
            if line is not None:
                line.show(text)
            else:
                if interval is not None and sys.stdout.isatty():
                    sys.stdout.write("\033[H\033[2J")  # clear the screen: the table redraws in place
                if interval is not None:
                    print(f"{time.strftime('%H:%M:%S')}  every {interval:g} s until all rows end (Ctrl-C stops); "
                          f"Slurm asked {poll.queries} times")  # fmt: skip
                print(text, flush=True)
            if interval is None or not active:
                if line is not None:
                    line.end()
                return 0
            time.sleep(interval)
    except KeyboardInterrupt:
        if line is not None:
            line.end()
        return interrupted
