"""The TensorBoard tracker (log.trackers: tensorboard): event files in ``RUN/tensorboard``, or in a subfolder named
after the run directory of ``log.tensorboard.dir`` (a folder or a URL TensorBoard's file systems write, s3://...).

Each attempt writes a new event file of its own (TensorBoard reads a folder's files in order, as one run). Records
are written synchronously and flushed at each call, never queued: what a killed attempt logged is in its file, the
fan-out's skip (``fanout.Trackers``) then keeps the next attempt from writing a step again, and TensorBoard never
sees a step go back (which would make it discard the later points as orphaned). The hyperparameters go to the
HParams dashboard once, in the run's first event file. Uses TensorBoard's own writer and protobufs, not torch's
``SummaryWriter``: script mode's ``runtime.log`` must not import torch.
"""

from __future__ import annotations

import itertools
import os
import socket
import time
from typing import Any

from ddp_core.config import Config
from ddp_core.run.rundir import RunDir
from ddp_core.trackers.base import Outcome, numbers, scalar_params

EVENT_FILE = "events.out.tfevents"  # the prefix TensorBoard looks for
_FILES = itertools.count()  # a second writer in one process and second gets a name of its own (as TensorBoard's)


def log_dir(cfg: Config, run_dir: RunDir) -> str:
    """Where this run's event files go."""
    base = cfg.log.tensorboard.dir
    if base is None:
        return str(run_dir.path / "tensorboard")
    return f"{base.rstrip('/')}/{run_dir.name}"


def open_tracker(cfg: Config, run_dir: RunDir, run_id: str) -> TensorBoardRun:
    return TensorBoardRun(log_dir(cfg, run_dir))


class TensorBoardRun:
    """One attempt's event file."""

    name = "TensorBoard"

    def __init__(self, folder: str) -> None:
        from tensorboard.compat import tf
        from tensorboard.compat.proto import event_pb2, summary_pb2
        from tensorboard.summary.writer.record_writer import RecordWriter

        self.event_pb2, self.summary_pb2 = event_pb2, summary_pb2
        gfile = tf.io.gfile
        gfile.makedirs(folder)
        self.new = not any(EVENT_FILE in name for name in gfile.listdir(folder))
        stamp = f"{time.time():010.0f}.{socket.gethostname()}.{os.getpid()}.{next(_FILES)}"
        self.path = f"{folder}/{EVENT_FILE}.{stamp}"
        self.writer = RecordWriter(gfile.GFile(self.path, "wb"))
        self._write(self.event_pb2.Event(wall_time=time.time(), file_version="brain.Event:2"))

    def params(self, values: dict[str, Any]) -> None:
        if not self.new:
            return
        from tensorboard.plugins.hparams import summary_v2

        self._write(self.event_pb2.Event(wall_time=time.time(), summary=summary_v2.hparams_pb(scalar_params(values))))

    def metrics(self, values: dict[str, float], step: int) -> None:
        summary = self.summary_pb2.Summary(
            value=[self.summary_pb2.Summary.Value(tag=k, simple_value=v) for k, v in numbers(values).items()]
        )
        self._write(self.event_pb2.Event(wall_time=time.time(), step=step, summary=summary))

    def finish(self, outcome: Outcome) -> None:
        if not self.writer.closed:
            self.writer.close()

    def _write(self, event: Any) -> None:
        self.writer.write(event.SerializeToString())
        self.writer.flush()
