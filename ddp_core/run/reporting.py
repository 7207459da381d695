"""Rank-0 progress and the run's local metrics log (JSON lines), both resume-aware."""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, BinaryIO, Optional

from ddp_core.run import diskfull
from ddp_core.run.rundir import atomic_write_text

log = logging.getLogger("ddp_core.progress")


class MetricsLog:
    """Appends ``{"step", "time", "split", ...}`` lines. On resume from step k, lines past k (written by an
    attempt that died after its last checkpoint) are dropped first, so the file never repeats a step."""

    def __init__(self, path: Path, resume_step: int) -> None:
        self.path = path
        self.previous_last_step = -1  # the last step any earlier attempt logged
        if path.exists():
            lines = path.read_text().splitlines()
            steps = [_step_of(line) for line in lines]
            self.previous_last_step = max((s for s in steps if s != sys.maxsize), default=-1)
            kept = [line for line, step in zip(lines, steps, strict=True) if step <= resume_step]
            text = "".join(f"{line}\n" for line in kept)
            diskfull.tolerant("the metrics log's rewind", path, lambda: atomic_write_text(path, text))
        # Open for the attempt: an open and a close per line cost the training loop more than the line's write.
        # Unbuffered: a line a full disk refuses is lost whole, never left in a buffer to be written later.
        self.file: Optional[BinaryIO] = None
        self.torn = False  # a line was cut short by a full disk: the next one starts on a line of its own

    def write(self, step: int, split: str, metrics: dict[str, float]) -> None:
        record = {"step": step, "time": round(time.time(), 3), "split": split, **metrics}
        line = ("\n" if self.torn else "") + json.dumps(record) + "\n"
        self.torn = not diskfull.tolerant(f"the metrics line of step {step}", self.path, lambda: self._append(line))

    def _append(self, line: str) -> None:
        if self.file is None:
            self.file = open(self.path, "ab", buffering=0)
        data = line.encode()
        while data:  # a whole line at a time, for ``ddpjob status`` and a rank 0 that dies next
            data = data[self.file.write(data) or 0 :]

    def sync(self) -> None:
        """Make every line written so far durable (called before each checkpoint: a checkpoint at step k then
        implies the metrics through step k survive a crash)."""
        if (f := self.file) is not None:
            diskfull.tolerant("the metrics log's sync", self.path, lambda: os.fsync(f.fileno()))

    def close(self) -> None:
        """Sync and close (idempotent)."""
        if self.file is not None:
            self.sync()
            self.file.close()
            self.file = None


def _step_of(line: str) -> int:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return sys.maxsize  # a torn last line from a killed writer: drop it


PERCENT = ("mfu", "data_wait")  # fractions the line shows as percentages (the records keep the fractions)


def _shown(key: str, value: float) -> str:
    if key in PERCENT:
        return f"{key} {100 * value:.3g}%"
    if key == "tokens_per_s":
        return f"tokens/s {value:.0f}"
    return f"{key} {value:.4g}"


class Progress:
    """A tqdm bar on a terminal; plain log lines (step, loss, samples/s, ETA) in SLURM log files."""

    def __init__(self, start_step: int, max_steps: int, samples_per_step: int, enabled: bool) -> None:
        self.start_step, self.max_steps, self.samples_per_step = start_step, max_steps, samples_per_step
        self.enabled = enabled
        self.started = time.perf_counter()
        self.bar: Optional[Any] = None
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=max_steps, initial=start_step, unit="step", dynamic_ncols=True)

    def rate(self, step: int) -> tuple[float, float]:
        """(steps/s, samples/s) since this attempt started."""
        elapsed = max(1e-9, time.perf_counter() - self.started)
        steps_per_s = (step - self.start_step) / elapsed
        return steps_per_s, steps_per_s * self.samples_per_step

    def update(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        steps_per_s, samples_per_s = self.rate(step)
        if self.bar is not None:
            self.bar.n = step
            self.bar.set_postfix(loss=f"{metrics.get('loss', float('nan')):.4f}", refresh=True)
            return
        eta = timedelta(seconds=int((self.max_steps - step) / steps_per_s)) if steps_per_s > 0 else "?"
        samples_per_s = metrics.get("samples_per_s", samples_per_s)  # the window's, where the line has it
        extras = " ".join(_shown(k, v) for k, v in metrics.items() if k != "samples_per_s")
        log.info("step %d/%d %s samples/s %.0f eta %s", step, self.max_steps, extras, samples_per_s, eta)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
