"""A task that stops at chosen batches until the test lets it go on: the test changes the world from outside (fills
a filesystem, frees it) at exactly those points, then says go. No sleeps racing the job.

``GatedDigitsTask(gate_dir=D, gates=[12, 25])``: rank 0, in the job's first attempt, at its 12th and 25th training
batch (split() calls, which every strategy makes once per batch; a DDP attempt's first is its priming batch) writes
``D/at-12`` and waits for ``D/go-12`` (at most ``wait_s``). The other ranks wait at the next collective. Numerics
unchanged."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Sequence

import torch.distributed as dist

from ddp_core.tasks.digits import DigitsTask


class GatedDigitsTask(DigitsTask):
    def __init__(self, gate_dir: str = "", gates: Sequence[int] = (), wait_s: float = 120.0, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.gate_dir, self.gates, self.wait_s, self.batches = Path(gate_dir), set(gates), wait_s, 0

    def split(self, batch: tuple) -> tuple:
        self.batches += 1
        first = os.environ.get("SLURM_RESTART_COUNT", "0") == "0"
        if first and self.batches in self.gates and (not dist.is_initialized() or dist.get_rank() == 0):
            wait_at(self.gate_dir, self.batches, self.wait_s, "gate", poll_s=0.05)
        return super().split(batch)


def wait_at(gate_dir: Path, name: object, wait_s: float, label: str, poll_s: float) -> None:
    """Rank 0 at gate ``name``: write ``at-NAME``, then wait for the test's ``go-NAME`` (at most ``wait_s``)."""
    (gate_dir / f"at-{name}").touch()
    deadline = time.monotonic() + wait_s
    while not (gate_dir / f"go-{name}").exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{label} {name}: no go from the test within {wait_s:g} s")
        time.sleep(poll_s)


SLOW_S = 1.0  # the storm task's pause a batch while a fault is held


class StormDigitsTask(DigitsTask):
    """The fault storm's task (tests/support/storm.py): rank 0 counts its training batches across the whole run, every
    attempt and launch, in ``D/batches`` (replaced whole: a rank killed while writing leaves the old count). Gate I is
    the first batch whose count reaches ``gates[I]`` once the test has armed it (``D/arm-I``: it arms a gate once the
    run has recovered from the fault before, which a run stopping a few steps after a signal may not have at that
    count); there rank 0 writes ``D/at-I`` and waits for ``D/go-I``. ``pause_s``: a pause every batch, on every rank,
    ``SLOW_S`` while ``D/slow`` exists. Numerics unchanged."""

    def __init__(
        self,
        gate_dir: str = "",
        gates: Sequence[int] = (),
        wait_s: float = 120.0,
        pause_s: float = 0.0,
        **kwargs: object,
    ) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.gate_dir, self.gates, self.wait_s, self.pause_s = Path(gate_dir), list(gates), wait_s, pause_s

    def split(self, batch: tuple) -> tuple:
        # While the test holds a fault (``D/slow``: a controller down for seconds, a node dying) the run trains on,
        # slowly, so it is still training when the fault ends and the next gate comes.
        time.sleep(SLOW_S if (self.gate_dir / "slow").exists() else self.pause_s)
        if not dist.is_initialized() or dist.get_rank() == 0:
            counter = self.gate_dir / "batches"
            count = int(counter.read_text()) + 1 if counter.exists() else 1
            (self.gate_dir / "batches.new").write_text(str(count))
            os.replace(self.gate_dir / "batches.new", counter)
            index = next((i for i in range(len(self.gates)) if not (self.gate_dir / f"go-{i}").exists()), None)
            if index is not None and count >= self.gates[index] and (self.gate_dir / f"arm-{index}").exists():
                wait_at(self.gate_dir, index, self.wait_s, "storm gate", poll_s=0.02)
        return super().split(batch)
