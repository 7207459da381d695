"""DataParallel: one process per node drives all of its GPUs; each batch is split across them by threads."""

from __future__ import annotations

import torch
from torch import nn

from ddp_core.errors import DdpJobError
from ddp_core.strategies.base import SingleProcessStrategy


def local_devices(first: torch.device) -> list[torch.device]:
    """This node's devices, starting at ``first`` (where the loop puts batches and DataParallel gathers)."""
    if first.type != "cuda":
        return [first]
    count = torch.cuda.device_count()
    return [torch.device("cuda", (first.index or 0) + i) for i in range(count - (first.index or 0))]


def require_single_process(name: str, world_size: int) -> None:
    """dp and model_parallel have no gradient exchange between processes: a second one would train apart."""
    if world_size > 1:
        raise DdpJobError(
            f"strategy.name={name!r} runs in one process, but this job started {world_size}",
            "start it alone (python -m ddp_core, or one Slurm task per node), or use strategy.name=ddp",
        )


class DPStrategy(SingleProcessStrategy):
    def wrap(self, model: nn.Module) -> nn.Module:
        require_single_process("dp", self.env.world_size)
        model = model.to(self.device)
        if self.device.type != "cuda":
            # Without GPUs DataParallel only calls the module; and given device_ids=None on a machine that has
            # GPUs it would take them all, although this strategy was placed on the CPU (found on an H100).
            return model
        return nn.DataParallel(model, device_ids=local_devices(self.device))

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module if isinstance(model, nn.DataParallel) else model
