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
    is. Evaluation (no gradients) spreads nothing."""

    def __init__(self, width: int = 1 << 16, heavy: tuple[int, ...] = (), heavy_factor: int = 2, **kwargs: Any):
        super().__init__(**kwargs)
        self.width, self.heavy, self.heavy_factor = width, frozenset(heavy), heavy_factor

    def build_datasets(self) -> tuple[Dataset, Dataset]:
        train, evals = super().build_datasets()
        assert isinstance(train, TensorDataset)
        x, y = train.tensors
        factor = torch.tensor([self.heavy_factor if i in self.heavy else 1 for i in range(len(y))])
        return TensorDataset(x, y, factor), evals

    def compute(self, model: nn.Module, batch: Any) -> Output:
        x, y, *rest = batch
        logits = model(x)
        if not torch.is_grad_enabled() or not rest:
            return self.score(logits, y)
        columns = self.width * int(rest[0].max())
        scale = torch.linspace(0.5, 1.5, columns, device=logits.device)
        spread = (logits.unsqueeze(-1) * scale).relu().mean(-1)
        return Output(loss=F.cross_entropy(logits.float() + 1e-3 * spread, y), count=len(y))
