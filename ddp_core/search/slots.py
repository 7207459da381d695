"""The slots of a packed sweep's allocation: each runs one trial at a time, as a job step of its own size.

A slot is a share of one node: ``tasks`` Slurm tasks of ``cpus`` CPUs each (the trial's ranks), ``gpus`` GPUs and
``mem_mb`` of memory. Its job steps are ``srun --nodes=1 --nodelist=NODE --ntasks=T --exact ...``: ``--exact`` gives
each step only its own CPUs (bound to them by the trial's ``--cpu-bind``), ``--gres=gpu:G`` its own GPUs (Slurm sets
``CUDA_VISIBLE_DEVICES``), and ``--mem`` its share of the node's memory, so steps of several slots run side by side
instead of waiting for the first one's. Every step of the allocation gets a rendezvous port of its own
(``MASTER_PORT``, counted over the allocation's steps), and ``PACKED_VAR``: the trial's rank 0 then defers a requeue to
the pack (``cluster.exits.requeue_within``), which requeues the allocation once every slot has saved.

Torch-free.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping, Optional

from ddp_core.cluster.env import PACKED_VAR, derive_master_port, expand_nodelist


@dataclass(frozen=True)
class SlotSize:
    tasks: int  # the trial's ranks (Slurm tasks) on its one node
    cpus: int  # CPUs per task
    gpus: int = 0  # GPUs of the slot
    mem_mb: int = 0  # memory of the slot (0: Slurm's default)

    @classmethod
    def of(cls, spec: Mapping[str, Any]) -> SlotSize:
        return cls(int(spec["tasks"]), int(spec["cpus"]), int(spec.get("gpus", 0)), int(spec.get("mem_mb", 0)))

    def fits(self, cpus: int, gpus: int) -> int:
        """How many slots of this size a node of ``cpus`` CPUs and ``gpus`` GPUs holds."""
        by_cpu = cpus // (self.tasks * self.cpus)
        return min(by_cpu, gpus // self.gpus) if self.gpus else by_cpu


class Ports:
    """One rendezvous port per job step of the allocation, thread-safe."""

    def __init__(self, job_id: int) -> None:
        self.job_id, self.count, self.lock = job_id, itertools.count(), threading.Lock()

    def next(self) -> int:
        with self.lock:
            return derive_master_port(self.job_id, next(self.count))


@dataclass(frozen=True)
class Slot:
    index: int
    node: str
    size: SlotSize
    ports: Optional[Ports] = field(default=None, compare=False)

    @property
    def name(self) -> str:
        return f"slot {self.index} ({self.node})"

    def srun(self, base: list[str]) -> list[str]:
        """``base`` (``srun`` and the trial's own options) as a step of this slot."""
        own = ["--nodes=1", f"--nodelist={self.node}", f"--ntasks={self.size.tasks}", "--exact"]
        own += [f"--gres=gpu:{self.size.gpus}"] if self.size.gpus else []
        own += [f"--mem={self.size.mem_mb}M"] if self.size.mem_mb else []
        return [base[0], *own, *base[1:]]

    def environment(self) -> dict[str, str]:
        """What each of the slot's steps adds to the worker's environment: a port of its own, and the pack's mark."""
        port = {"MASTER_PORT": str(self.ports.next())} if self.ports is not None else {}
        return {**port, PACKED_VAR: str(self.index)}


def slots_here(size: SlotSize, per_node: int, environ: Mapping[str, str]) -> list[Slot]:
    """The allocation's slots: ``per_node`` on each of its nodes (the login node sized it to whole nodes), numbered
    node by node. Memory: the node's (``SLURM_MEM_PER_NODE``) shared out, unless the trial set its own."""
    nodes = expand_nodelist(environ.get("SLURM_JOB_NODELIST", "localhost"))
    node_mem = int(environ.get("SLURM_MEM_PER_NODE", "0") or 0)
    if not size.mem_mb and node_mem:
        size = SlotSize(size.tasks, size.cpus, size.gpus, node_mem // per_node)
    ports = Ports(int(environ.get("SLURM_JOB_ID", "0") or 0))
    numbered: Iterator[int] = itertools.count()
    return [Slot(next(numbered), node, size, ports) for node in nodes for _ in range(per_node)]
