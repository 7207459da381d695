"""Tasks used only by tests: they run inside real Slurm jobs (the repo root is on PYTHONPATH there)."""

from __future__ import annotations

import builtins
import json
import os
import re
import shutil
import signal
import socket
import time
from pathlib import Path
from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn

from ddp_core.run import private
from ddp_core.task import Output
from ddp_core.tasks.charlm import CharLMTask
from ddp_core.tasks.digits import DigitsTask


class CrashingTask(DigitsTask):
    """Digits, but rank ``crash_rank`` (or, with ``crash_host``, every rank on that host: a bad node) fails at its
    ``crash_at``-th training batch of every attempt: ``error`` names the builtin exception it raises, or
    ``SIGKILL``, which it sends itself (what the OOM killer or a segfault in a library look like from outside), or
    ``HALT``: it writes ``halt_file`` (its pid in ``halt_file.pid``) and waits there for the test to take its whole node
    down from outside (``scripts/slurm-local kill-node``), or to drain the node and kill the rank
    (``tests.support.bad_node``), at a chosen step rather than at a raced moment.
    ``crash_launch``: only in that job step of the job's first attempt (``DDPJOB_LAUNCH``; -1: every one).
    ``crash_rank_by_launch``: in the job's first attempt, job step ``i``'s crashing rank is its ``i``-th item, and
    the later steps crash nowhere (it replaces ``crash_rank`` and ``crash_launch``)."""

    def __init__(
        self,
        crash_rank: int = 1,
        crash_at: int = 20,
        error: str = "RuntimeError",
        crash_host: str = "",
        halt_file: str = "",
        crash_launch: int = -1,
        crash_rank_by_launch: Sequence[int] = (),
        **kwargs: object,
    ) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.crash_rank, self.crash_at, self.error, self.batches = crash_rank, crash_at, error, 0
        self.crash_host, self.halt_file = crash_host, halt_file
        launch = (os.environ.get("SLURM_RESTART_COUNT", "0") or "0", os.environ.get("DDPJOB_LAUNCH", "0"))
        self.armed = crash_launch < 0 or launch == ("0", str(crash_launch))
        if crash_rank_by_launch:
            step = int(launch[1])
            self.armed = launch[0] == "0" and step < len(crash_rank_by_launch)
            self.crash_rank = crash_rank_by_launch[step] if self.armed else -1

    def compute(self, model: nn.Module, batch: tuple) -> Output:
        if model.training:
            self.batches += 1
            rank = dist.get_rank() if dist.is_initialized() else 0
            chosen = socket.gethostname() == self.crash_host if self.crash_host else rank == self.crash_rank
            if chosen and self.armed and self.batches == self.crash_at:
                if self.error == "SIGKILL":
                    if self.halt_file:  # when the kill came, for a benchmark's clock (bench/restart.py)
                        Path(self.halt_file).write_text(f"{time.time():.3f}\n")
                    os.kill(os.getpid(), signal.SIGKILL)
                if self.error == "HALT":  # its pid beside, first: for a test that kills this rank alone
                    Path(self.halt_file + ".pid").write_text(f"{os.getpid()}\n")
                    Path(self.halt_file).write_text(f"{socket.gethostname()} rank {rank} at batch {self.batches}\n")
                    while True:
                        time.sleep(1)
                raise getattr(builtins, self.error)(f"injected failure at batch {self.batches}")
        return super().compute(model, batch)


class KilledThenSignalledTask(CrashingTask):
    """``CrashingTask`` (rank ``crash_rank`` SIGKILLed at its ``crash_at``-th batch of the first job step, with
    ``crash_launch=0``) whose next job step of that attempt, the restart in the allocation, sends rank 0 the warning
    signal at its ``signal_at``-th batch: two interruptions, the first resumed from a checkpoint older than the last
    logged step, the second requeued. Numerics unchanged."""

    def __init__(self, signal_at: int = 0, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        launch = (os.environ.get("SLURM_RESTART_COUNT", "0") or "0", os.environ.get("DDPJOB_LAUNCH", "0"))
        self.signal_at, self.splits = (signal_at if launch == ("0", "1") else 0), 0

    def split(self, batch: tuple) -> tuple:
        self.splits += 1
        if self.signal_at and self.splits == self.signal_at and dist.get_rank() == 0:
            os.kill(os.getpid(), signal.SIGUSR2)
        return super().split(batch)


class NodeLossDigitsTask(DigitsTask):
    """Digits where rank ``crash_rank`` loses its node's memory at its ``crash_at``-th training batch of every attempt
    (split(), which every strategy calls): it removes its node's node-local copies (``local_path``/ddpjob-USER-JOB/HOST,
    the tier's folder of this job and host) and SIGKILLs itself, as a node that died and came back empty would leave
    it. Numerics unchanged."""

    def __init__(self, crash_rank: int = 1, crash_at: int = 30, local_path: str = "/dev/shm", **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.crash_rank, self.crash_at, self.local_path, self.batches = crash_rank, crash_at, local_path, 0

    def split(self, batch: tuple) -> tuple:
        self.batches += 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        if rank == self.crash_rank and self.batches == self.crash_at:
            folder = Path(self.local_path) / private.per_user_name(os.environ["SLURM_JOB_ID"]) / socket.gethostname()
            shutil.rmtree(folder)
            os.kill(os.getpid(), signal.SIGKILL)
        return super().split(batch)


class SlowDigitsTask(DigitsTask):
    """Digits with a pause per batch, so signals can land at chosen steps. Numerics unchanged. The pause is
    in split(), which every strategy calls on every rank (a pipeline never calls compute())."""

    def __init__(self, pause_s: float = 0.0, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.pause_s = pause_s

    def split(self, batch: tuple) -> tuple:
        if self.pause_s:
            time.sleep(self.pause_s)
        return super().split(batch)


class SlowFirstAttemptDigitsTask(SlowDigitsTask):
    """Digits with ``pause_s`` per batch in a job's first attempt only (``SLURM_RESTART_COUNT`` unset or 0): a run too
    slow to finish within its time limit there, and quick once requeued. Numerics unchanged."""

    def split(self, batch: tuple) -> tuple:
        if os.environ.get("SLURM_RESTART_COUNT", "0") == "0":
            return super().split(batch)
        return DigitsTask.split(self, batch)


class SignalsItself:
    """A task mixin: one rank sends itself the warning signal at a chosen batch of the attempt, as Slurm would
    mid-step. ``DDPJOB_TEST_SIGNAL_AT=RANK:BATCH`` (this process's environment: each attempt picks its own)
    names the rank and the 1-based count of split() calls (every strategy calls it once per batch on every
    rank); ``RANK:BATCH@N``: only in the Slurm job's attempt N (``SLURM_RESTART_COUNT``), so the job's next attempts
    run on. Numerics unchanged."""

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[call-arg]
        where, _, attempt = os.environ.get("DDPJOB_TEST_SIGNAL_AT", "-1:0").partition("@")
        rank, _, batch = where.partition(":")
        if attempt and int(attempt) != int(os.environ.get("SLURM_RESTART_COUNT", "0")):
            rank = "-1"
        self.signal_rank, self.signal_batch, self.batches = int(rank), int(batch), 0

    def split(self, batch: tuple) -> tuple:
        self.batches += 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        if rank == self.signal_rank and self.batches == self.signal_batch:
            os.kill(os.getpid(), signal.SIGUSR2)
        return super().split(batch)  # type: ignore[misc]


class SignalledDigitsTask(SignalsItself, DigitsTask):
    """Digits that signal themselves (``SignalsItself``)."""


class SignalledCharLMTask(SignalsItself, CharLMTask):
    """The char LM that signals itself (``SignalsItself``)."""


class ContainedDigitsTask(SignalledDigitsTask):
    """``SignalledDigitsTask`` that records where each rank of each attempt runs, in ``where_dir``: apptainer's
    ``APPTAINER_CONTAINER``, the test image's ``/etc/ddpjob-image`` and whether a ``scontrol`` is on PATH."""

    def __init__(self, where_dir: str = "", **kwargs: object) -> None:
        super().__init__(**kwargs)
        marker = Path("/etc/ddpjob-image")
        where = {
            "container": os.environ.get("APPTAINER_CONTAINER"),
            "image": marker.read_text().strip() if marker.exists() else None,
            "scontrol": shutil.which("scontrol"),
        }
        name = f"rank{os.environ.get('SLURM_PROCID')}-attempt{os.environ.get('SLURM_RESTART_COUNT', '0')}.json"
        (Path(where_dir) / name).write_text(json.dumps(where))


class StragglerDigitsTask(DigitsTask):
    """Digits where rank 1 pauses at every batch: rank 0 spends most of its time waiting in the gradient all-reduce,
    where a suspension catches it (with equal ranks it rarely does). Numerics unchanged."""

    def __init__(self, pause_s: float = 0.0, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.pause_s = pause_s

    def split(self, batch: tuple) -> tuple:
        if self.pause_s and dist.is_initialized() and dist.get_rank() == 1:
            time.sleep(self.pause_s)
        return super().split(batch)


class UnrecordableTask(DigitsTask):
    """Digits that, at training batch ``break_at``, puts a directory where the run's event log is (as a failing
    file system might): the attempt trains to its end, then cannot record that it completed."""

    def __init__(self, events_file: str = "", break_at: int = 0, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.events_file, self.break_at, self.batches = events_file, break_at, 0

    def split(self, batch: tuple) -> tuple:
        self.batches += 1
        if self.batches == self.break_at:
            os.unlink(self.events_file)
            os.mkdir(self.events_file)
        return super().split(batch)


class HangingTask(DigitsTask):
    """Digits where rank ``hang_rank`` stops the job's progress once per run: only while ``once_file`` does not exist
    (the hanging rank creates it), so the requeued or resumed attempt runs normally, with unchanged numerics.
    ``hang_in``: "step" (the rank sleeps in split() at batch ``hang_at``; the others then wait in the all-reduce),
    "collective" (the other ranks enter a collective at batch ``hang_at`` that this rank skips; it goes on into the
    gradient all-reduce, so every rank waits inside a collective), "datasets" (the rank sleeps while building
    the datasets, before the first step), "gil" (the rank runs a C call that never releases the GIL) or "stopped" (the
    rank SIGSTOPs itself: its process, watchdog thread included, stands still until someone continues or kills it)."""

    def __init__(self, once_file: str, hang_rank: int = 1, hang_at: int = 5, hang_in: str = "step",
                 **kwargs: object) -> None:  # fmt: skip
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.once_file, self.hang_rank, self.hang_at, self.hang_in = once_file, hang_rank, hang_at, hang_in
        self.batches, self.armed = 0, not os.path.exists(once_file)  # decided once, before any rank creates it
        self.side: object = None

    def _rank(self) -> int:
        return dist.get_rank() if dist.is_initialized() else 0

    def _hang_here(self) -> None:
        open(self.once_file, "w").close()
        while True:
            time.sleep(3600)

    def build_datasets(self) -> tuple:
        if self.hang_in == "datasets" and self.armed and self._rank() == self.hang_rank:
            self._hang_here()
        return super().build_datasets()

    def split(self, batch: tuple) -> tuple:
        self.batches += 1
        if self.hang_in == "collective" and self.side is None and dist.is_initialized():
            self.side = dist.new_group(backend="gloo")  # every rank, at its first batch: a group for the trap
        if self.batches == self.hang_at and self.armed:
            if self.hang_in == "step" and self._rank() == self.hang_rank:
                self._hang_here()
            if self.hang_in == "stopped" and self._rank() == self.hang_rank:
                open(self.once_file, "w").close()
                os.kill(os.getpid(), signal.SIGSTOP)
            if self.hang_in == "gil" and self._rank() == self.hang_rank:
                open(self.once_file, "w").close()
                re.fullmatch(r"(a|aa)+b", "a" * 64)  # years of backtracking in C, holding the GIL throughout
            if self.hang_in == "collective":
                if self._rank() != self.hang_rank:
                    dist.all_reduce(torch.zeros(1), group=self.side)  # never completes: hang_rank skips it
                open(self.once_file, "w").close()
        return super().split(batch)
