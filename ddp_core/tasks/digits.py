"""Example task: an MLP classifier on scikit-learn's bundled 8x8 digits (1,797 images, no download)."""

from __future__ import annotations

import gzip
import importlib.util
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset, TensorDataset

from ddp_core.errors import DdpJobError
from ddp_core.tasks.base import Output, Task
from ddp_core.tasks.flops import dense_flops_per_sample

N_IMAGES = 1797  # scikit-learn's digits: fixed, so the split sizes are known without loading it


def load_digits_table() -> np.ndarray:
    """scikit-learn's digits as ``sklearn.datasets.load_digits`` reads them (its package data: no network on compute
    nodes): one row per image, 64 pixel values then the label, float64. Read from the file without importing
    scikit-learn, whose import (SciPy with it) cost each rank about 2 s of CPU, more than its import of torch."""
    spec = importlib.util.find_spec("sklearn")  # finds the package without running it
    if spec is None or not spec.submodule_search_locations:
        raise DdpJobError("the digits task needs scikit-learn's bundled data", "pip install scikit-learn")
    path = Path(spec.submodule_search_locations[0]) / "datasets" / "data" / "digits.csv.gz"
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return np.loadtxt(f, delimiter=",")


class DigitsTask(Task):
    @classmethod
    def check_args(cls, data: dict[str, Any], model: dict[str, Any]) -> None:
        # Only the keys present: a subclass may take other arguments and inherit this check.
        bounds = [
            ("data", "eval_fraction", lambda v: 0 < v < 1, "must be in (0, 1)"),
            ("data", "eval_fraction", lambda v: int(N_IMAGES * v) >= 1, f"leaves none of {N_IMAGES} images to eval"),
            ("data", "split_seed", lambda v: 0 <= v < 2**63, "must be in [0, 2**63)"),
            ("model", "hidden", lambda v: 1 <= v <= 1 << 16, "must be in [1, 65536]"),
            ("model", "depth", lambda v: 0 <= v <= 64, "must be in [0, 64]"),
            ("model", "dropout", lambda v: 0 <= v < 1, "must be in [0, 1)"),
        ]
        for section, name, ok, why in bounds:
            args = data if section == "data" else model
            if name in args and not ok(args[name]):
                raise DdpJobError(
                    f"config key 'task.{section}.{name}' = {args[name]!r} is invalid: {why}",
                    f"fix it in the YAML or with task.{section}.{name}=...",
                )

    def __init__(self, eval_fraction: float = 0.2, split_seed: int = 0) -> None:
        self.eval_fraction = eval_fraction
        self.split_seed = split_seed

    def build_model(self, hidden: int = 128, depth: int = 2, dropout: float = 0.1) -> nn.Module:
        layers: list[nn.Module] = []
        width = 64
        for _ in range(depth):
            layers += [nn.Linear(width, hidden), nn.ReLU(), nn.Dropout(dropout)]
            width = hidden
        layers.append(nn.Linear(width, 10))
        return nn.Sequential(*layers)

    def flops_per_sample(self, model: nn.Module) -> float:
        return dense_flops_per_sample(model)  # an MLP on one 64-pixel vector: 6 N

    def build_datasets(self) -> tuple[Dataset, Dataset]:
        table = load_digits_table()
        x = torch.tensor(table[:, :-1], dtype=torch.float32) / 16.0
        y = torch.tensor(table[:, -1].astype(int), dtype=torch.long)
        # A fixed split, independent of the training seed, so eval numbers compare across runs.
        order = torch.randperm(len(y), generator=torch.Generator().manual_seed(self.split_seed))
        n_eval = int(len(y) * self.eval_fraction)
        eval_idx, train_idx = order[:n_eval], order[n_eval:]
        return TensorDataset(x[train_idx], y[train_idx]), TensorDataset(x[eval_idx], y[eval_idx])

    def score(self, logits: torch.Tensor, y: torch.Tensor) -> Output:
        loss = F.cross_entropy(logits.float(), y)
        if torch.is_grad_enabled():  # a training step: the trainer reads only the loss (eval runs under no_grad)
            return Output(loss=loss, count=len(y))
        correct = (logits.argmax(dim=1) == y).sum()
        return Output(loss=loss, count=len(y), sums={"loss": loss.detach() * len(y), "accuracy": correct.float()})


class PacedDigitsTask(DigitsTask):
    """Digits whose every batch takes at least ``pause_s`` more (a sleep, not work): ``ddpjob doctor --drill``'s task.
    The drill interrupts its job three times mid-run; paced steps make "mid-run" a number of steps that holds on any
    hardware (a tiny model's steps on a GPU are far too fast to aim at) and cost the cluster no compute. Numerics
    are DigitsTask's: the drill's uninterrupted twin compares bitwise."""

    @classmethod
    def check_args(cls, data: dict[str, Any], model: dict[str, Any]) -> None:
        super().check_args(data, model)
        pause = data.get("pause_s", 0.0)
        if not isinstance(pause, (int, float)) or not 0 <= pause <= 10:
            raise DdpJobError(
                f"config key 'task.data.pause_s' = {pause!r} is invalid: must be in [0, 10] seconds",
                "fix it in the YAML or with task.data.pause_s=...",
            )

    def __init__(self, pause_s: float = 0.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.pause_s = pause_s

    def split(self, batch: Any) -> tuple[Any, Any]:
        time.sleep(self.pause_s)  # in split(): every strategy calls it on every rank, once per batch
        return super().split(batch)
