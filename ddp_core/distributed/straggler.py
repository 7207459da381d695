"""Stragglers: each rank's own work per step, and the slowest rank, recorded with every progress line.

Step time is the same on every rank (they wait for each other in the gradient sync), so it cannot tell a slow
rank apart. What can is the work a rank does before it reaches that sync: waiting for its data and running its
forward. The fast ranks spend the difference waiting inside the collective. ``WorkTimer`` measures that work (host
time for the data; on CUDA, events for the forward, since the host only launches kernels); the trainer gathers
it with the progress line's existing all-gather (no extra collective) and records the spread in
``metrics.jsonl`` and W&B: ``work_ms_min``/``work_ms_median``/``work_ms_max`` per step, ``slowest_rank`` and its
host. When the same rank is the slowest by ``train.straggler_factor`` over the median in each of the last few
lines (``persistent``), the line also names it as ``straggler_rank``, rank 0 logs a warning, and ``ddpjob status``
shows it.
"""

from __future__ import annotations

import statistics
import time
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Optional, Sequence

if TYPE_CHECKING:
    import torch

LINES = 3  # progress lines in a row a straggler must lead before status names it


class WorkTimer:
    """This rank's data wait and forward time since the last ``take_ms``."""

    def __init__(self, device: torch.device) -> None:  # torch-free at import: ``ddpjob status`` reads this module
        self.cuda = device.type == "cuda"
        self.host_s = 0.0
        self.data_s = 0.0  # the data wait alone, since the last ``take_data_ms`` (the progress line's data_wait)
        self.events: list[tuple[Any, Any]] = []
        self._started = 0.0  # the forward in progress: its start (host time, or a CUDA event)
        self._start: Any = None

    def timed(self, items: Iterable[Any]) -> Iterator[Any]:
        """``items`` with the time spent waiting for each next one counted (the data loader)."""
        iterator = iter(items)
        while True:
            started = time.perf_counter()
            try:
                item = next(iterator)
            except StopIteration:
                return
            waited = time.perf_counter() - started
            self.host_s += waited
            self.data_s += waited
            yield item

    def forward(self) -> WorkTimer:
        """``with timer.forward():`` around a forward (one at a time: never nested)."""
        return self

    # A plain class's enter and exit, not a generator's: this runs every micro-batch.
    def __enter__(self) -> None:
        if not self.cuda:
            self._started = time.perf_counter()
            return
        import torch

        self._start = torch.cuda.Event(enable_timing=True)
        self._start.record()

    def __exit__(self, *exc: Any) -> None:
        if not self.cuda:
            self.host_s += time.perf_counter() - self._started
            return
        import torch

        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self.events.append((self._start, end))

    def take_ms(self) -> float:
        """Milliseconds of work since the last call; call it where the host has synchronised with the GPU anyway."""
        total = self.host_s * 1000 + sum(start.elapsed_time(end) for start, end in self.events)
        self.host_s, self.events = 0.0, []
        return total

    def take_data_ms(self) -> float:
        """Milliseconds spent waiting for data since the last call."""
        waited, self.data_s = self.data_s, 0.0
        return waited * 1000


def spread(work_ms: Sequence[float], hosts: Sequence[str]) -> dict[str, Any]:
    """The per-step work of every rank summarised for one progress line."""
    slowest = max(range(len(work_ms)), key=lambda r: work_ms[r])
    return {
        "work_ms_min": round(min(work_ms), 3),
        "work_ms_median": round(statistics.median(work_ms), 3),
        "work_ms_max": round(work_ms[slowest], 3),
        "slowest_rank": slowest,
        "slowest_host": hosts[slowest] if slowest < len(hosts) else "?",
    }


def persistent(lines: Sequence[dict[str, Any]], factor: float) -> Optional[int]:
    """The rank that was the slowest, by ``factor`` over the median and by at least a tenth of the step time
    (``step_ms``), in each of the last ``LINES`` spreads; None if there is none. One slow interval is noise, and
    so is a 3x spread of a millisecond in a 50 ms step: a rank slow line after line, at a cost, is a straggler."""
    last = lines[-LINES:]
    if len(last) < LINES or len({r.get("slowest_rank") for r in last}) != 1:
        return None
    slow = all(
        r["work_ms_max"] >= factor * r["work_ms_median"] and r["work_ms_max"] - r["work_ms_median"] >= r["step_ms"] / 10
        for r in last
    )
    return int(last[-1]["slowest_rank"]) if slow else None
