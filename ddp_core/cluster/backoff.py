"""The one back-off schedule of every loop that asks Slurm the same question again: 2 s, then twice as long each
time, up to 30 s, as submitit's InfoWatcher does for sacct.

A few hundred users each waiting on a job is a controller under load, and a site's per-user RPC limit
(``SlurmctldParameters=rl_enable``) answers a client over it with an error: a loop that asks at a fixed short
interval is both. The gateway's retry of a rate-limited call (``cluster.slurm``) and the login node's watcher
(``jobs.runs.watcher``: ``submit --wait``, ``status --watch``) take their delays from here. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass, field

FIRST_S = 2.0
MAX_S = 30.0


@dataclass
class Backoff:
    """Delays between two questions: ``first_s``, then ``factor`` times the last, never above ``max_s``."""

    first_s: float = FIRST_S
    factor: float = 2.0
    max_s: float = MAX_S
    upcoming: float = field(init=False)

    def __post_init__(self) -> None:
        self.upcoming = min(self.first_s, self.max_s)

    def next(self) -> float:
        """The delay before the next question; the one after it grows."""
        delay = self.upcoming
        self.upcoming = min(delay * self.factor, self.max_s)
        return delay

    def reset(self) -> None:
        """Something changed (the job started, it ended as its files say): the next delays are short again."""
        self.upcoming = min(self.first_s, self.max_s)

    def slowest(self) -> None:
        """The controller asked the caller to slow down (its rate limit): the next delay is the longest."""
        self.upcoming = self.max_s
