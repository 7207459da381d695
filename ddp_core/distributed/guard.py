"""Rehearse a GPU node's process groups on a CPU machine: every collective the GPU node would not serve fails here.

NCCL serves only CUDA tensors. A collective on a CPU tensor sent to a group without a CPU backend fails only
on a GPU node, after the job has waited in the queue. ``dist.guard`` (config) turns that into a failure on
any CPU machine, in two layers:

1. **The process groups themselves.** The trainer builds its groups from the GPU node's device→backend table
   with every accelerator backend replaced by gloo. ``cpu:gloo,cuda:nccl`` becomes ``cpu:gloo,cuda:gloo``,
   and NCCL alone becomes ``cuda:gloo``. Those are real groups, and torch refuses a tensor whose device has
   no backend in the table ("No backend type associated with device type cpu"). That includes the
   collectives torch issues from C++ (DDP's reducer) and the groups derived from the default one (device
   meshes, ``new_group``).
2. **A wrapper around ``torch.distributed``'s public collectives.** It refuses the same calls before they
   reach torch, with a message that names the collective, the device, the group's backends on the GPU node
   and the calling line. It also counts (collective, device, GPU backend) per rank; ``report`` logs the
   counts at teardown, to show which backend each kind of traffic would use.

``dist.guard=gpu`` rehearses the trainer's own GPU table (``ddp_core.distributed.groups.GPU_BACKEND``). Any other
value is taken as a table to rehearse, e.g. ``nccl``, which is what the trainer used before it had a CPU
backend. On a CUDA machine the real table is kept, and only the wrapper's checks and counts are added.
"""

from __future__ import annotations

import collections
import functools
import inspect
import logging
import socket
import traceback
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from ddp_core.cluster.env import DistEnv
from ddp_core.errors import DdpJobError

log = logging.getLogger(__name__)

# The collectives the project, torch's object collectives, FSDP2 and pipelining call through torch.distributed.
# isend/irecv stay unwrapped: P2POp checks its op by identity (dist.isend), and pipelining's P2P goes through
# batch_isend_irecv, which is checked op by op.
_TENSOR_COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "broadcast",
    "reduce",
    "gather",
    "scatter",
    "all_to_all",
    "all_to_all_single",
    "send",
    "recv",
)
_OBJECT_COLLECTIVES = ("all_gather_object", "gather_object", "broadcast_object_list", "scatter_object_list")

_state: dict[str, Any] = {"gpu_spec": None, "sim_spec": None, "counts": None, "rank": 0}


class CollectiveRefused(DdpJobError):
    """A collective the GPU node's process group would not serve."""


# The process group's backends per device: what the trainer builds on GPUs, and on CPUs alone.
GPU_BACKEND = "cpu:gloo,cuda:nccl"
CPU_BACKEND = "gloo"


def served(spec: str) -> dict[str, str]:
    """A backend spec → {device type: backend}. A bare name serves what that backend serves."""
    if ":" not in spec:
        name = spec.strip().lower()
        return {"cuda": name} if name == "nccl" else {"cpu": name, "cuda": name}
    table = {}
    for item in spec.split(","):
        device, _, backend = item.partition(":")
        table[device.strip()] = backend.strip().lower()
    return table


def rehearsal_spec(gpu_spec: str) -> str:
    """The GPU table with gloo in place of every other backend: the same devices served, runnable on a CPU."""
    table = served(gpu_spec)
    return ",".join(f"{device}:gloo" for device in table)


def install(guard: str, cuda: bool, env: DistEnv) -> str:
    """Wrap torch.distributed's collectives; return the backend spec the process group is to be built with."""
    gpu_spec = GPU_BACKEND if guard == "gpu" else guard
    if _state["counts"] is None:
        for name in (*_TENSOR_COLLECTIVES, *_OBJECT_COLLECTIVES, "batch_isend_irecv"):
            original = getattr(dist, name, None)
            if original is not None:
                setattr(dist, name, _wrap(name, original))
    _state.update(
        gpu_spec=gpu_spec,
        sim_spec=gpu_spec if cuda else rehearsal_spec(gpu_spec),
        counts=collections.Counter(),
        rank=env.rank,
    )
    log.info("collective guard: GPU backends %s, rehearsed here as %s", gpu_spec, _state["sim_spec"])
    return _state["sim_spec"]


def active_spec() -> Optional[str]:
    return _state["sim_spec"]


def report() -> None:
    counts = _state["counts"]
    if counts:
        lines = ", ".join(f"{op} {dev}->{backend} x{n}" for (op, dev, backend), n in sorted(counts.items()))
        log.info("collective guard: %s", lines)


def _gpu_table(group: Any) -> dict[str, str]:
    """The group's device→backend table on the GPU node (its rehearsed backends mapped back)."""
    spec = dist.get_backend(group)
    table = served(spec)
    if spec == _state["sim_spec"]:  # built from the rehearsed GPU table: report the GPU node's backends
        return served(_state["gpu_spec"])
    return table


def _call_site() -> str:
    for frame in reversed(traceback.extract_stack()[:-3]):
        if "/torch/" not in frame.filename and "collective_guard" not in frame.filename:
            return f"{frame.filename}:{frame.lineno} ({frame.name})"
    return "?"


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors(item)]
    return []


def _check(name: str, group: Any, devices: set[str]) -> None:
    if group is None and not dist.is_initialized():
        return
    table = _gpu_table(group)
    for device in sorted(devices):
        backend = table.get(device)
        if backend is None:
            spec = ",".join(f"{d}:{b}" for d, b in table.items())
            raise CollectiveRefused(
                f"rank {_state['rank']} on {socket.gethostname()}: {name} on a {device} tensor, but on a GPU node "
                f"this group's backends are '{spec}', which serve no {device} tensors (called from {_call_site()})",
                "keep host-side values on the CPU of a group with a cpu backend, data on the training device",
            )
        _state["counts"][(name, device, backend)] += 1


def _wrap(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        if _state["counts"] is not None:
            bound = signature.bind_partial(*args, **kwargs).arguments
            if name == "batch_isend_irecv":
                for op in bound.get("p2p_op_list", []):
                    _check(name, op.group, {op.tensor.device.type})
            elif name in _OBJECT_COLLECTIVES:
                _check(name, bound.get("group"), {"cpu"})  # objects are pickled into CPU byte tensors
            else:
                devices = {t.device.type for value in bound.values() for t in _tensors(value)}
                _check(name, bound.get("group"), devices)
        return fn(*args, **kwargs)

    return guarded
