"""The interface a user implements to train their own model, and the loader that finds it by import path.

A task is a class named in the config as ``task.target = "package.module:ClassName"``. It is built as
``ClassName(**task.data)`` on every rank and provides ``build_model``, ``build_datasets`` and ``score``
(loss and metric sums from the model's output) — or overrides ``compute`` for a forward that does not
fit ``model(inputs)``. See the README section "Plugging in your own model".
"""

from __future__ import annotations

import importlib
import inspect
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from ddp_core.config import TaskConfig
from ddp_core.errors import DdpJobError


@dataclass
class Output:
    """What ``Task.compute`` returns for one batch.

    ``loss`` is the mean loss to backpropagate. ``sums`` are per-batch *sums* of metrics (e.g. summed
    loss, number correct); the trainer adds them over batches and ranks and divides by the summed
    ``count``, so evaluation is exact whatever the batch and world size.
    """

    loss: torch.Tensor
    count: int
    sums: dict[str, torch.Tensor] = field(default_factory=dict)


class Task(ABC):
    @abstractmethod
    def build_model(self, **model_args: Any) -> nn.Module:
        """The model, on the CPU; called after the trainer seeds torch so every rank builds the same one."""

    @abstractmethod
    def build_datasets(self) -> tuple[Dataset, Dataset]:
        """(train, eval) map-style datasets. No downloads on compute nodes: read local files or package data."""

    def split(self, batch: Any) -> tuple[Any, Any]:
        """(model inputs, targets) of a batch. The pipeline strategy feeds inputs to its first stage and
        targets to its last, so this is the only place a batch's layout is known."""
        inputs, targets = batch
        return inputs, targets

    def score(self, output: Any, targets: Any) -> Output:
        """Loss and metric sums from the model's output. Needed by strategies where no process holds the
        whole model (pipeline); the default ``compute`` uses it too."""
        raise NotImplementedError(f"{type(self).__name__} must implement score() (or compute())")

    def compute(self, model: nn.Module, batch: Any) -> Output:
        """Forward one batch (already on the model's device) and return loss and metric sums."""
        inputs, targets = self.split(batch)
        return self.score(model(inputs), targets)


def _resolve(target: str) -> type:
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise DdpJobError(
            f"task.target '{target}': cannot import module '{module_name}' ({err})",
            "check the module path and that it is importable on the compute nodes (installed or on PYTHONPATH)",
        ) from None
    obj = getattr(module, attr, None)
    if not (isinstance(obj, type) and issubclass(obj, Task)):
        raise DdpJobError(
            f"task.target '{target}': '{attr}' is not a ddp_core.task.Task subclass in {module_name}",
            "name a class that subclasses ddp_core.task.Task",
        )
    return obj


def _check_kwargs(fn: Any, given: dict[str, Any], key: str) -> None:
    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    accepted = {n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)} - {"self"}
    unknown = sorted(set(given) - accepted)
    if unknown:
        raise DdpJobError(
            f"unknown config key '{key}.{unknown[0]}' for {fn.__qualname__}",
            f"accepted keys: {', '.join(sorted(accepted)) or 'none'}",
        )
    missing = [n for n, p in params.items() if n in accepted and p.default is p.empty and n not in given]
    if missing:
        raise DdpJobError(
            f"config key '{key}.{missing[0]}' is required by {fn.__qualname__}", f"set {key}.{missing[0]}=..."
        )


def check_task(cfg: TaskConfig) -> None:
    """Login-node check: the task imports and accepts exactly the configured model/data keys."""
    cls = _resolve(cfg.target)
    _check_kwargs(cls.__init__, cfg.data, "task.data")
    _check_kwargs(cls.build_model, cfg.model, "task.model")


def load_task(cfg: TaskConfig) -> Task:
    check_task(cfg)
    return _resolve(cfg.target)(**cfg.data)
