"""A task whose training step's memory is large, and larger for chosen samples: the memory-fit tests'
(tests/cluster/test_memory_fit.py). The memory is real (the CPU allocator's, under a real ``ulimit -v``), never an
exception raised in its place."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset, TensorDataset

from ddp_core.task import Output
from ddp_core.tasks.digits import DigitsTask


class WideDigitsTask(DigitsTask):
    """Digits whose training forward also spreads each sample's logits over ``width`` columns (a ReLU's output, kept
    for the backward): about ``40 x width`` bytes a sample, three times that during the backward. A training sample
    listed in ``heavy`` spreads over ``heavy_factor x width``: a data-dependent larger batch, as a longer sequence
    is. Evaluation (no gradients) spreads nothing.

    With ``blocks``, the spreading is done by the model instead, in that many ``Spread`` units one after another:
    each keeps its own product for the backward, so activation checkpointing (which recomputes a unit's in the
    backward) holds about one unit's at a time instead of every unit's. A sample's factor then travels as the last
    column of its input."""

    def __init__(
        self, width: int = 1 << 16, heavy: tuple[int, ...] = (), heavy_factor: int = 2, blocks: int = 0, **kwargs: Any
    ):
        super().__init__(**kwargs)
        self.width, self.heavy, self.heavy_factor, self.blocks = width, frozenset(heavy), heavy_factor, blocks

    def build_model(self, **kwargs: Any) -> nn.Module:
        base = super().build_model(**kwargs)
        return SpreadNet(base, self.width, self.blocks) if self.blocks else base

    def build_datasets(self) -> tuple[Dataset, Dataset]:
        train, evals = super().build_datasets()
        assert isinstance(train, TensorDataset) and isinstance(evals, TensorDataset)
        x, y = train.tensors
        factor = torch.tensor([self.heavy_factor if i in self.heavy else 1 for i in range(len(y))])
        if self.blocks:
            ones = torch.ones(len(evals.tensors[1]), 1)
            return TensorDataset(torch.cat([x, factor[:, None].float()], 1), y), TensorDataset(
                torch.cat([evals.tensors[0], ones], 1), evals.tensors[1]
            )
        return TensorDataset(x, y, factor), evals

    def compute(self, model: nn.Module, batch: Any) -> Output:
        x, y, *rest = batch
        logits = model(x)
        if not torch.is_grad_enabled() or not rest:
            return self.score(logits, y)
        spreads = spread(logits, self.width * int(rest[0].max()))
        return Output(loss=F.cross_entropy(logits.float() + 1e-3 * spreads, y), count=len(y))


def spread(logits: torch.Tensor, columns: int) -> torch.Tensor:
    """The logits spread over ``columns`` (a ReLU's output of ``40 x columns`` bytes a sample, kept for its
    backward), averaged back."""
    scale = torch.linspace(0.5, 1.5, columns, device=logits.device)
    return (logits.unsqueeze(-1) * scale).relu().mean(-1)


class Spread(nn.Module):
    """A unit: ``h + spread(linear(h))`` over ``width x factor`` columns."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear, self.width = nn.Linear(10, 10), width

    def forward(self, h: torch.Tensor, factor: int) -> torch.Tensor:
        return h + spread(self.linear(h), self.width * factor)


class SpreadNet(nn.Module):
    """The digits MLP, then ``blocks`` spreading units (only while gradients are taken); the input's last column is
    the sample's factor."""

    _no_split_modules = ["Spread"]  # the units activation checkpointing recomputes

    def __init__(self, base: nn.Module, width: int, blocks: int) -> None:
        super().__init__()
        self.base, self.spreads = base, nn.ModuleList(Spread(width) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, factor = self.base(x[:, :-1]), int(x[:, -1].max())
        if torch.is_grad_enabled():
            for unit in self.spreads:
                h = unit(h, factor)
        return h
