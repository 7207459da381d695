"""The CSV tracker (log.trackers: csv): ``RUN/metrics.csv``, a flat table for a spreadsheet.

One row per logged call: ``step``, ``time`` (Unix seconds), then one column per metric (``train/loss``,
``eval/accuracy``, ...), in the order they first appeared; a step with train and eval metrics has two rows, each
with its own columns filled. A resumed attempt appends (the fan-out skips the steps an earlier attempt wrote); a
metric never seen before rewrites the file once with the wider header. Each row is flushed as it is written, as
``RUN/metrics.jsonl`` is.
"""

from __future__ import annotations

import csv
import io
import time
from pathlib import Path
from typing import Any

from ddp_core.config import Config
from ddp_core.run.rundir import RunDir, atomic_write_text
from ddp_core.trackers.base import Outcome

FIXED = ["step", "time"]


def path(run_dir: RunDir) -> Path:
    return run_dir.path / "metrics.csv"


def open_tracker(cfg: Config, run_dir: RunDir, run_id: str) -> CsvFile:
    return CsvFile(path(run_dir))


class CsvFile:
    name = "CSV"

    def __init__(self, file: Path) -> None:
        self.file = file
        self.columns = list(FIXED)
        if file.exists():
            text = file.read_text()
            if not text.endswith("\n"):  # a torn last row of a killed writer: dropped
                text = text[: text.rfind("\n") + 1]
                atomic_write_text(file, text)
            self.columns = next(csv.reader(io.StringIO(text)), []) or list(FIXED)

    def params(self, values: dict[str, Any]) -> None:
        """Nothing: the table holds metrics only (the hyperparameters are RUN/config.yaml)."""

    def metrics(self, values: dict[str, float], step: int) -> None:
        new = [k for k in values if k not in self.columns]
        if new or not self.file.exists() or not self.file.stat().st_size:
            self._widen(new)
        row = {"step": step, "time": round(time.time(), 3), **values}
        with open(self.file, "a", newline="") as f:
            csv.DictWriter(f, self.columns, lineterminator="\n").writerow(row)

    def _widen(self, new: list[str]) -> None:
        """The header with ``new`` columns added, the rows written so far kept (their new cells empty)."""
        rows: list[dict[str, str]] = []
        if self.file.exists():
            with open(self.file, newline="") as f:
                rows = list(csv.DictReader(f))
        self.columns += new
        out = io.StringIO()
        writer = csv.DictWriter(out, self.columns, lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
        atomic_write_text(self.file, out.getvalue())

    def finish(self, outcome: Outcome) -> None:
        """Nothing to close: each row was written whole."""
