"""Training-step metrics: the loss (``RunningLoss``), the task's ``Output.sums`` of each micro-batch, and the gradient
norm (``TrainSums``).

Nothing is computed per step: the tensors the step produced are kept (on the device)
and read back once, when a progress line is due; then the ranks' sums and counts travel with the line's own
gather (no collective of their own) and are added (float64) and divided, exactly as evaluation averages. Logged
as ``train/<name>`` and ``train/grad_norm`` (the mean over the steps since the last line) beside ``train/loss``.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from ddp_core.distributed import collectives
from ddp_core.tasks.base import Output


class TrainSums:
    def __init__(self) -> None:
        self.pending: dict[str, list[torch.Tensor]] = {}  # this rank's per-micro-batch sums, not read back yet
        self.totals: dict[str, float] = {}  # folded sums (float64 on the host)
        self.count = 0  # samples behind the sums
        self.norms: list[torch.Tensor] = []  # one gradient norm per step (the same on every rank), not read back
        self.norm_sum, self.norm_max, self.norm_steps = 0.0, 0.0, 0  # folded norms
        self.keys: Optional[list[str]] = None  # the metric names, agreed by all ranks at the first progress line

    def add(self, out: Output) -> None:
        """One training micro-batch's output (called by the strategy after its forward)."""
        if out.sums:
            self.count += out.count
            for key, value in out.sums.items():
                self.pending.setdefault(key, []).append(value.detach())

    def mark(self) -> tuple[int, dict[str, int]]:
        """Where the sums are now, for ``rollback``: a step done again (``trainer.memory``) counts once."""
        return self.count, {key: len(values) for key, values in self.pending.items()}

    def rollback(self, mark: tuple[int, dict[str, int]]) -> None:
        self.count, lengths = mark
        for key in list(self.pending):
            del self.pending[key][lengths.get(key, 0) :]

    def add_grad_norm(self, norm: torch.Tensor) -> None:
        self.norms.append(norm.detach())

    def _fold(self) -> None:
        for key, values in self.pending.items():
            total = torch.stack([v.double() for v in values]).sum().item()  # the read-back of this key
            self.totals[key] = self.totals.get(key, 0.0) + total
        self.pending.clear()
        if self.norms:
            norms = torch.stack([_replicated(n).double() for n in self.norms]).tolist()  # the norms' read-back
            self.norm_sum += sum(norms)
            self.norm_max = max(self.norm_max, *norms)
            self.norm_steps += len(norms)
            self.norms.clear()

    def take(self) -> list[float]:
        """This rank's part of a progress line: ``[samples, *sums in key order, norm sum, norm max, norm steps]``
        since the last line; then start anew. Every rank's list has the same length (the trainer gathers them with
        the line's other values); collective at the first call, where the ranks agree on the names (a pipeline's
        first stages have no sums and learn them from the others)."""
        self._fold()
        if self.keys is None:
            self.keys = collectives.union_keys(sorted(self.totals))
        taken = [float(self.count), *(self.totals.get(k, 0.0) for k in self.keys)]
        taken += [self.norm_sum, self.norm_max, float(self.norm_steps)]
        self.totals, self.count = {}, 0
        self.norm_sum, self.norm_max, self.norm_steps = 0.0, 0.0, 0
        return taken

    def combine(self, rows: list[list[float]]) -> dict[str, float]:
        """The line's metrics from every rank's ``take()``: each sum over all ranks' samples, and the mean and
        largest gradient norm (the same on every rank: the first row's)."""
        assert self.keys is not None, "take() agrees on the names first"
        count = max(1.0, sum(row[0] for row in rows))
        metrics = {k: sum(row[i + 1] for row in rows) / count for i, k in enumerate(self.keys)}
        norm_sum, norm_max, norm_steps = rows[0][-3:]
        if norm_steps:
            metrics |= {"grad_norm": norm_sum / norm_steps, "grad_norm_max": norm_max}
        return metrics

    def state_dict(self) -> dict[str, Any]:
        """This rank's partial sums (the checkpoint holds every rank's): the next line's average is the same after
        a resume."""
        self._fold()
        norms = [self.norm_sum, self.norm_max, float(self.norm_steps)]
        return {"totals": dict(self.totals), "count": self.count, "norms": norms}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.totals, self.count, self.pending = dict(state["totals"]), int(state["count"]), {}
        self.norm_sum, self.norm_max, steps = state["norms"]
        self.norm_steps, self.norms = int(steps), []


def _replicated(norm: torch.Tensor) -> torch.Tensor:
    """A norm over sharded gradients (fsdp) is a DTensor: its full value (the same on every rank)."""
    full = getattr(norm, "full_tensor", None)
    return full() if full is not None else norm


class RunningLoss:
    """The step losses since the last progress line, kept as the device tensors ``forward_backward`` returned: no
    arithmetic per micro-batch (an in-place add costs a kernel launch, ~4 us on a CPU, each time), and the host
    reads them back in one transfer when a line is due (``log_every``) or a checkpoint is written.

    The sum is taken in float64, one loss after the other in the order they came, onto the total of earlier read-backs:
    the same value whether or not a checkpoint (which folds the pending ones) fell inside the interval."""

    def __init__(self) -> None:
        self.total = 0.0  # float64 sum of the losses already read back
        self.pending: list[torch.Tensor] = []  # losses not read back yet (on the training device)
        self.steps = 0  # steps whose loss this rank saw (a pipeline's last stage only)

    def add(self, step_loss: torch.Tensor, counts: bool) -> None:
        self.pending.append(step_loss)
        self.steps += counts

    def _fold(self) -> None:
        if self.pending:
            for value in torch.stack(self.pending).tolist():  # the one read-back (a host-device sync)
                self.total += value
            self.pending.clear()

    def totals(self) -> list[float]:
        """[sum, steps] since the last reset: what a progress line reads."""
        self._fold()
        return [self.total, float(self.steps)]

    def state(self) -> torch.Tensor:
        """(sum, steps) as a CPU float64 tensor: the form checkpoints hold."""
        return torch.tensor(self.totals(), dtype=torch.float64)

    def load(self, state: torch.Tensor) -> None:
        self.total, self.steps, self.pending = float(state[0]), int(state[1]), []

    def reset(self) -> None:
        self.total, self.steps, self.pending = 0.0, 0, []
