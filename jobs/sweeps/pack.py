"""Submit a grid or random sweep packed (``ddpjob sweep --pack [N]``): a few allocations of whole nodes, each a pool of
slots that run the trials side by side (``ddp_core.search.pack``), instead of one array task per trial.

Each trial is still a normal run directory (``jobs.sweeps.arrays`` plans and creates them). The trials go into the
sweep's queue (``ddp_core.search.queue``); one array of N allocation tasks is submitted, each running the pool in its
batch step (``render.Layout.workers``, as a search's workers). A slot is one trial's size on one node (its tasks,
CPUs, GPUs, memory); an allocation holds ``per_node`` of them on each of its nodes: as many as the partition's nodes
take. N: given, or enough allocations for ``slurm.array_parallelism`` trials at once (never more than the trials).
Submitting the same sweep again frees the claims of allocations that are gone, so their trials run in the next ones.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, Optional

from ddp_core.errors import DdpJobError
from ddp_core.search import pack as pack_worker
from ddp_core.search import queue
from ddp_core.search.slots import SlotSize
from jobs.submission import partitions
from jobs.submission.render import Layout, render
from jobs.submission.request import SlurmRequest, mem_option
from jobs.submission.submit import queue as submit_queue
from jobs.submission.submit import submitted_or_withdrawn
from jobs.sweeps.arrays import TrialPlan, initialise, record_jobs, sweep_dir
from jobs.sweeps.spec import Sweep


@dataclasses.dataclass(frozen=True)
class Packing:
    """How the sweep is packed: the slot, slots per node, and the allocations' request and count."""

    size: SlotSize
    per_node: int
    allocations: int
    request: SlurmRequest


def step(request: SlurmRequest) -> dict[str, list[str]]:
    """The srun line each trial runs as a job step of a worker's or a pack's allocation (a search's, with the
    search's one request; a pack's slot adds its own options: ``search.slots``)."""
    return {"srun": ["srun", *request.srun_args], "command": request.task_command()}


def slot_of(request: SlurmRequest, mem_gb: Optional[float]) -> SlotSize:
    """One trial's share of a node, from its request: it must fit on one node."""
    if request.max_nodes != 1 or request.spare_nodes:
        raise DdpJobError(
            f"config key 'slurm.nodes' = {request.ranked_nodes}: a packed trial runs on one node",
            "set slurm.nodes=1 (and slurm.spare_nodes=0), or sweep without --pack",
        )
    mem_mb = math.ceil(float(mem_gb) * 1024) if mem_gb else 0
    return SlotSize(request.tasks_per_node, request.cpus_per_task, request.gpus_per_node, mem_mb)


def plan_pack(
    request: SlurmRequest, mem_gb: Optional[float], part: partitions.Partition, trials: int, parallelism: int,
    allocations: int = 0,
) -> Packing:  # fmt: skip
    """The pack for ``trials`` trials of ``request`` on nodes of ``part``; ``allocations`` 0: derived."""
    size = slot_of(request, mem_gb)
    per_node = size.fits(part.cpus_per_node, part.gpus_per_node)
    if per_node < 1:
        gpus = f" and {size.gpus} GPUs" if size.gpus else ""
        raise DdpJobError(
            f"a trial needs {size.tasks * size.cpus} CPUs{gpus} of one node (slurm.tasks_per_node x "
            f"slurm.cpus_per_task), and partition '{part.name}' has nodes of {part.cpus_per_node} CPUs"
            + (f" and {part.gpus_per_node} GPUs" if size.gpus else ""),
            "make the trial smaller, pick a partition with bigger nodes, or sweep without --pack",
        )
    if allocations < 0:
        raise DdpJobError(f"--pack {allocations} is invalid", "give the number of allocations, e.g. --pack 4")
    wanted = allocations or math.ceil(min(trials, parallelism or trials) / per_node)
    return Packing(size, per_node, max(1, min(wanted, trials)), allocation(request, size, per_node, mem_gb))


def allocation(request: SlurmRequest, size: SlotSize, per_node: int, mem_gb: Optional[float]) -> SlurmRequest:
    """The request of one allocation of the pack: a whole node of ``per_node`` slots of ``size``."""
    return dataclasses.replace(
        request,
        tasks_per_node=per_node * size.tasks,
        gpus={"gpus_per_node": per_node * size.gpus} if size.gpus else {},
        where={**request.where, **({"mem": str(mem_option(mem_gb * per_node))} if mem_gb else {})},
        additional={**request.additional, "exclusive": True},
    )


def pack_spec(packing: Packing, warning: str) -> dict[str, Any]:
    """What the queue file (or a search's spec) holds of the pack: each slot's srun line and size, the slots a node,
    and the warning signal."""
    slot = dataclasses.asdict(packing.size)
    return {"step": step(packing.request), "slot": slot, "per_node": packing.per_node, "warning": warning}


def render_pack_script(sweep: Sweep, packing: Packing) -> str:
    """What ``sweep --pack --dry-run`` prints: the batch script of the pack's allocations."""
    return render(packing.request, Layout.workers(sweep_dir(sweep) / "slurm", packing.allocations))


def submit_pack(sweep: Sweep, plans: list[TrialPlan], packing: Packing) -> Optional[str]:
    """Create the trials to run, queue them, and submit the allocations; returns the array's job id (None: nothing to
    run)."""
    from submitit.core.utils import DelayedSubmission

    from ddp_core.cluster.slurm import GATEWAY

    todo = initialise(sweep, plans)
    if not todo:
        return None
    root = sweep_dir(sweep)
    folder = root / "slurm"
    packs = recorded_packs(root)
    # An allocation still queued or running keeps its trials (by its own job id, as its claims name it); squeue
    # failing refuses the submission: a trial must never run twice.
    alive = {job for pair in GATEWAY.squeue_ids(packs, strict=True) for job in pair} if packs else set()
    queue.release(root, lambda job: job in alive, {str(p.run_dir.path) for p in todo})
    queue.add_trials(root, [str(p.run_dir.path) for p in todo], pack_spec(packing, sweep.configs[0].slurm.warning))
    hint = "fix the cause and rerun the same `ddpjob sweep --pack` command: it queues only the trials not yet done"
    with submitted_or_withdrawn(folder, "packed sweep submission", hint, unit="array"):
        calls = [DelayedSubmission(pack_worker.run, str(root), len(packs) + 1) for _ in range(packing.allocations)]
        jobs = submit_queue(packing.request, Layout.workers(folder, packing.allocations), calls)
    array = str(jobs[0].job_id).split("_")[0]
    entry = {"job_id": array, "allocations": packing.allocations, "slots": packing.per_node}
    record_jobs(root, sweep, "packs", entry | {"trials": [p.trial.trial_id for p in todo]})
    return array


def recorded_packs(root: Path) -> list[str]:
    """The job ids of the pack arrays this sweep submitted (sweep.json)."""
    import json

    from jobs.sweeps.record import SWEEP_FILE

    path = root / SWEEP_FILE
    return [str(p["job_id"]) for p in json.loads(path.read_text()).get("packs", [])] if path.exists() else []


def summary(root: Path) -> Optional[dict[str, Any]]:
    """A packed sweep's queue as ``ddpjob status`` shows it (None: the sweep is not packed): each trial's state by
    run directory name (PENDING until a slot takes it, then as its run records, COMPLETED or FAILED once ended),
    the counts, the allocations and the trials completed per hour."""
    import time

    if not (root / queue.PACK_FILE).exists():
        return None
    spec, claims = queue.read_pack(root), queue.read_claims(root)
    states = {Path(t).name: "PENDING" for t in spec["trials"] if t not in claims}
    states |= {Path(t).name: c["state"].upper() for t, c in claims.items() if c["state"] in queue.ENDED}
    counts = {
        "pending": sum(1 for t in spec["trials"] if t not in claims),
        "running": sum(1 for c in claims.values() if c["state"] == "running"),
        **{s: sum(1 for c in claims.values() if c["state"] == s) for s in queue.ENDED},
    }
    ended = [(Path(t) / "attempts.jsonl").stat().st_mtime for t, c in claims.items() if c["state"] == "completed"]
    started = min(((Path(t) / "run.json").stat().st_mtime for t in claims), default=time.time())
    hours = (max(ended, default=started) - started) / 3600
    per_hour = len(ended) / hours if hours > 0 else 0.0
    return {"spec": spec, "states": states, "counts": counts, "packs": recorded_packs(root), "per_hour": per_hour}


def status_lines(info: dict[str, Any]) -> list[str]:
    spec, counts = info["spec"], info["counts"]
    packs = ", ".join(info["packs"]) or "none"
    return [
        f"pack:    arrays {packs}, {spec['per_node']} slots a node; {counts['running']} slots busy",
        "trials:  " + ", ".join(f"{n} {s}" for s, n in counts.items()) + f"; {info['per_hour']:.0f} completed an hour",
    ]
