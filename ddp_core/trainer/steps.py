"""The pieces of a training step the loop (``trainer.loop.Trainer``) calls: a batch to the device, the autocast
context, micro-batch groups, evaluation averaged exactly over ranks, the run's result (``Outcome``), and the weights
digest every rank logs at the end (bitwise-equal weights, equal digests).
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import logging
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Optional

import torch
from torch import nn

from ddp_core.config import Config, Precision
from ddp_core.distributed import collectives
from ddp_core.errors import DdpJobError
from ddp_core.strategies import Strategy
from ddp_core.tasks.base import Task

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Outcome:
    step: int
    final: Optional[dict[str, float]]  # eval metrics when the run finished
    signum: int = 0  # the signal the ranks agreed to stop on; 0 when finished
    pruned: bool = False  # a trial of an adaptive sweep that its study's pruner stopped early (final is None)
    early_stopped: bool = False  # finished before max_steps: checkpoint.monitor stopped improving


def map_tensors(batch: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``fn`` applied to every tensor of a batch (in tuples, lists and dicts), anything else kept."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, (list, tuple)):
        return type(batch)(map_tensors(b, fn) for b in batch)
    if isinstance(batch, dict):
        return {k: map_tensors(v, fn) for k, v in batch.items()}
    return batch


def to_device(batch: Any, device: torch.device) -> Any:
    if device.type == "cpu":
        return batch  # the loader's batches are on the CPU already: .to() would return each tensor itself
    return map_tensors(batch, lambda t: t.to(device, non_blocking=True))


def autocast(cfg: Config, device: torch.device) -> contextlib.AbstractContextManager[Any]:
    if cfg.train.precision is Precision.bf16:
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    if cfg.train.precision is Precision.fp16:
        return torch.autocast(device_type=device.type, dtype=torch.float16)
    return contextlib.nullcontext()


def evaluate(task: Task, model: nn.Module, loader: Any, cfg: Config, strategy: Strategy) -> dict[str, float]:
    sums: dict[str, torch.Tensor] = {}  # on the device: read back once, after the last batch
    count = 0
    model.eval()
    with torch.no_grad(), autocast(cfg, strategy.device):
        for batch in itertools.islice(loader, cfg.train.eval_batches or None):  # train.eval_batches: a cap per rank
            out = strategy.eval_step(task, model, to_device(batch, strategy.device))
            count += out.count
            for key, value in out.sums.items():
                value = value.detach().double()
                sums[key] = sums[key] + value if key in sums else value
    model.train()
    # Ranks without outputs (a pipeline's first stages) have no metric names yet: agree on them first.
    keys = collectives.union_keys(sorted(sums))
    zero = torch.zeros((), dtype=torch.float64, device=strategy.device)
    local = torch.stack([zero + count] + [sums.get(k, zero) for k in keys]).cpu()  # the one read-back
    totals = collectives.all_reduce_sum(local)  # host totals: gloo
    return {k: (totals[i + 1] / totals[0]).item() for i, k in enumerate(keys)}


def micro_batches(loader: Any, grad_accum: int) -> Iterator[list[Any]]:
    """Groups of ``grad_accum`` micro-batches; a short tail at the epoch's end is dropped."""
    group: list[Any] = []
    for batch in loader:
        group.append(batch)
        if len(group) == grad_accum:
            yield group
            group = []


def weights_digest(state: Mapping[str, torch.Tensor]) -> str:
    """sha256 over a full state dict in its order (``Strategy.full_model_state``): equal digests mean bitwise-equal
    weights."""
    h = hashlib.sha256()
    for name, tensor in state.items():
        h.update(name.encode())
        h.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def apply_determinism(cfg: Config, device: torch.device) -> None:
    """``train.deterministic`` for this process's kernels."""
    if cfg.train.deterministic and device.type == "cuda" and not os.environ.get("CUBLAS_WORKSPACE_CONFIG"):
        # use_deterministic_algorithms raises at the first cuBLAS call otherwise, after the queue wait.
        raise DdpJobError(
            "train.deterministic=true on a GPU needs CUBLAS_WORKSPACE_CONFIG in the environment",
            "submit through ddpjob (it exports it), or export CUBLAS_WORKSPACE_CONFIG=:4096:8",
        )
    if torch.are_deterministic_algorithms_enabled() != cfg.train.deterministic:
        # Only on a change: the call imports torch._inductor.config, i.e. all of dynamo (1.5-2 s here), which a run
        # without DDP, FSDP or compile never needs.
        torch.use_deterministic_algorithms(cfg.train.deterministic)
