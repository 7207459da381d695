"""Several ranks in fresh processes, joined in one gloo group: for in-process checks of collective code."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist


def _entry(rank: int, fn: Callable[..., None], world: int, store: str, args: tuple[Any, ...]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def spawn(fn: Callable[..., None], world: int, tmp: Path, *args: Any) -> None:
    """``fn(rank, world, *args)`` in ``world`` fresh processes joined in one gloo group; ``fn`` must be a module's
    top-level function (the processes import it). A failing rank fails the call."""
    store = tmp / f"store-{fn.__name__}-{world}"
    torch.multiprocessing.spawn(_entry, args=(fn, world, str(store), args), nprocs=world)
