"""Process-group lifecycle and per-rank RNG state, from an explicit ``DistEnv`` (no env:// magic)."""

from __future__ import annotations

import logging
import random
import socket
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ddp_core.dist_env import DistEnv

log = logging.getLogger(__name__)


def setup(env: DistEnv, timeout_s: float = 600.0) -> torch.device:
    """Pick the device, cap threads, and join the process group when there is more than one process."""
    torch.set_num_threads(env.cpus_per_rank)
    if torch.cuda.is_available():
        device = torch.device("cuda", env.local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    if env.source != "single":
        dist.init_process_group(
            backend,
            init_method=f"tcp://{env.master_addr}:{env.master_port}",
            rank=env.rank,
            world_size=env.world_size,
            timeout=timedelta(seconds=timeout_s),
        )
    log.info(
        "%s on %s: rank %d/%d local %d/%d node %d/%d master %s:%d backend %s device %s threads %d",
        env.source, socket.gethostname(), env.rank, env.world_size, env.local_rank, env.local_world_size, env.node_rank,
        env.num_nodes, env.master_addr, env.master_port, backend if env.source != "single" else "none",
        device, env.cpus_per_rank,
    )  # fmt: skip
    return device


def teardown() -> None:
    """Barrier, then destroy: exiting gloo without both aborted at shutdown in 6 of 12 runs here."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def all_reduce_sum(values: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized():
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
    return values


def union_keys(keys: list[str]) -> list[str]:
    """The sorted union of every rank's ``keys``: the same list everywhere, for collectives over dicts."""
    if not dist.is_initialized():
        return sorted(keys)
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, keys)
    return sorted(set().union(*everyone))


def gather_to_main(obj: Any, env: DistEnv) -> list[Any]:
    """Every rank's ``obj`` on rank 0 (others get an empty list)."""
    if not dist.is_initialized():
        return [obj]
    out: list[Any] = [None] * env.world_size if env.is_main else []
    dist.gather_object(obj, out if env.is_main else None, dst=0)
    return out


def seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rng_state() -> dict[str, Any]:
    """This rank's RNG states in a form ``torch.load(weights_only=True)`` accepts."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
