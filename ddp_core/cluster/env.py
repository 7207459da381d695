"""Who am I in the job: one immutable ``DistEnv`` built once from the launcher's environment variables.

Sources, first match wins: torchrun (RANK/WORLD_SIZE/...), an srun task (SLURM_PROCID + SLURM_STEP_ID),
submitit's local executor (SUBMITIT_LOCAL_*), else a single process. Reading never writes ``os.environ``:
the process group is initialised from the values here, explicitly.
"""

from __future__ import annotations

import itertools
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional

from ddp_core.errors import DdpJobError

PORT_BASE = 20000
# Below Linux's ephemeral range (32768+), so a derived port is rarely taken by an outgoing connection.
PORT_SPAN = 12000
# Prime and coprime to PORT_SPAN: consecutive job ids map to distinct ports for PORT_SPAN ids in a row.
_PORT_STRIDE = 1009
_TORCH_DEFAULT_PORT = 29500
LAUNCH_VAR = "DDPJOB_LAUNCH"  # the batch script's count of this attempt's job steps (see DistEnv.launch)
PACKED_VAR = "DDPJOB_PACK_SLOT"  # a packed sweep's slot (ddp_core.search.slots): its worker makes the requeues
# Slurm's own cap on the hosts one hostlist expression may name.
_MAX_HOSTS = 65536


@dataclass(frozen=True)
class DistEnv:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    node_rank: int = 0
    num_nodes: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = PORT_BASE
    job_id: Optional[str] = None  # the launcher's job identity (Slurm job, torchrun run, submitit-local pid)
    slurm_job_id: Optional[str] = None  # set only inside a Slurm job: what `scontrol requeue` needs
    restart_count: int = 0
    # Which job step of this attempt the ranks are: 0, then one more per in-allocation restart (DDPJOB_LAUNCH, exported
    # by the batch script's loop of steps, ``jobs.submission.request``).
    launch: int = 0
    # torchrun's restarts of its workers inside this attempt (TORCHELASTIC_RESTART_COUNT): each a new set of ranks.
    elastic_restart: int = 0
    cpus_per_rank: int = 1
    source: str = "single"  # torchrun | slurm | submitit-local | single
    # torchrun's agent already serves the rendezvous store on master_port: rank 0 joins it as a client.
    agent_store: bool = False
    # A trial of a packed sweep (PACKED_VAR): its slot's worker requeues the allocation once every slot has saved.
    packed: bool = False

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @classmethod
    def from_env(cls, environ: Optional[Mapping[str, str]] = None) -> DistEnv:
        env = os.environ if environ is None else environ
        if "TORCHELASTIC_RUN_ID" in env or all(k in env for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR")):
            return _from_torchrun(env)
        # The batch shell also has SLURM_PROCID=0 and SLURM_NTASKS=N; only srun tasks have a step id, so
        # a trainer started in the batch script without srun runs single instead of waiting for N-1 peers.
        if "SLURM_PROCID" in env and _in_srun_step(env):
            return _from_slurm(env)
        if "SUBMITIT_LOCAL_GLOBALID" in env:
            return _from_submitit_local(env)
        # One process, possibly a one-task sbatch job without srun: it keeps the job's identity so it can requeue.
        job_id = env.get("SLURM_JOB_ID") or None
        return cls(
            job_id=job_id,
            slurm_job_id=job_id,
            restart_count=_int(env, "SLURM_RESTART_COUNT", 0),
            launch=_int(env, LAUNCH_VAR, 0),
            cpus_per_rank=_cpus(env, 1),
            source="single",
            packed=PACKED_VAR in env,
        )


def _int(env: Mapping[str, str], key: str, default: Optional[int] = None) -> int:
    raw = env.get(key)
    if raw is None or raw == "":
        if default is None:
            raise DdpJobError(f"environment variable {key} is not set", "start the trainer with srun or torchrun")
        return default
    try:
        return int(raw)
    except ValueError:
        raise DdpJobError(f"environment variable {key}={raw!r} is not an integer") from None


def _cpus(env: Mapping[str, str], local_world_size: int) -> int:
    # Oversubscribing cores made 2-rank CPU training 3x slower here: give each rank its share, at least 1.
    if env.get("SLURM_CPUS_PER_TASK"):
        return max(1, _int(env, "SLURM_CPUS_PER_TASK"))
    if env.get("OMP_NUM_THREADS"):
        return max(1, _int(env, "OMP_NUM_THREADS"))
    return max(1, (os.cpu_count() or 1) // max(1, local_world_size))


def _torchrun_cpus(env: Mapping[str, str], local_world: int) -> int:
    # A torchrun worker inherits its agent's SLURM_CPUS_PER_TASK: the CPUs of the agent's one task, which all of the
    # node's LOCAL_WORLD_SIZE workers share. (RANK... exported by hand in an srun task: that task is this rank's own.)
    if "TORCHELASTIC_RUN_ID" in env and env.get("SLURM_CPUS_PER_TASK"):
        return max(1, _int(env, "SLURM_CPUS_PER_TASK") // max(1, local_world))
    return _cpus(env, local_world)


def _in_srun_step(env: Mapping[str, str]) -> bool:
    return "SLURM_STEP_ID" in env and env.get("SLURM_STEP_ID") != "batch"


def _tasks_on_node(env: Mapping[str, str], node: int) -> int:
    """Tasks of this step on node ``node`` (SLURM_STEP_TASKS_PER_NODE, e.g. ``2(x3),1``); 1 if unknown."""
    tasks = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    return expand_tasks_per_node(tasks)[node] if tasks else 1


def _from_torchrun(env: Mapping[str, str]) -> DistEnv:
    world = _int(env, "WORLD_SIZE")
    # RANK/WORLD_SIZE/MASTER_ADDR exported by hand in an srun step: the node-local parts come from Slurm's task.
    in_step = _in_srun_step(env)
    node = _int(env, "SLURM_NODEID", 0) if in_step else 0
    local_world = _int(env, "LOCAL_WORLD_SIZE", _tasks_on_node(env, node) if in_step else 1)
    return DistEnv(
        rank=_int(env, "RANK"),
        local_rank=_int(env, "LOCAL_RANK", _int(env, "SLURM_LOCALID", 0) if in_step else 0),
        world_size=world,
        local_world_size=local_world,
        node_rank=_int(env, "GROUP_RANK", node),
        num_nodes=max(1, world // max(1, local_world)),
        master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
        master_port=_int(env, "MASTER_PORT", 29500),
        job_id=env.get("SLURM_JOB_ID") or env.get("TORCHELASTIC_RUN_ID"),
        slurm_job_id=env.get("SLURM_JOB_ID"),  # torchrun inside an allocation can still requeue it
        restart_count=_int(env, "SLURM_RESTART_COUNT", 0),
        launch=_int(env, LAUNCH_VAR, 0),
        elastic_restart=_int(env, "TORCHELASTIC_RESTART_COUNT", 0),
        cpus_per_rank=_torchrun_cpus(env, local_world),
        source="torchrun",
        agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
    )


def _from_slurm(env: Mapping[str, str]) -> DistEnv:
    node_rank = _int(env, "SLURM_NODEID", 0)
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or "127.0.0.1"
    local_world = _tasks_on_node(env, node_rank)
    job_id = env.get("SLURM_JOB_ID")
    return DistEnv(
        rank=_int(env, "SLURM_PROCID"),
        local_rank=_int(env, "SLURM_LOCALID", 0),
        world_size=_int(env, "SLURM_STEP_NUM_TASKS", None)
        if "SLURM_STEP_NUM_TASKS" in env
        else _int(env, "SLURM_NTASKS"),
        local_world_size=local_world,
        node_rank=node_rank,
        num_nodes=_int(env, "SLURM_STEP_NUM_NODES", None)
        if "SLURM_STEP_NUM_NODES" in env
        else _int(env, "SLURM_JOB_NUM_NODES", 1),
        master_addr=expand_nodelist(nodelist)[0],
        master_port=_int(env, "MASTER_PORT", 0) or derive_master_port(int(job_id or 0), _int(env, LAUNCH_VAR, 0)),
        job_id=job_id,
        slurm_job_id=job_id,
        restart_count=_int(env, "SLURM_RESTART_COUNT", 0),
        launch=_int(env, LAUNCH_VAR, 0),
        cpus_per_rank=_cpus(env, local_world),
        source="slurm",
        packed=PACKED_VAR in env,
    )


def _from_submitit_local(env: Mapping[str, str]) -> DistEnv:
    world = _int(env, "SUBMITIT_LOCAL_NTASKS", 1)
    job_id = env.get("SUBMITIT_LOCAL_JOB_ID", "0")
    return DistEnv(
        rank=_int(env, "SUBMITIT_LOCAL_GLOBALID"),
        local_rank=_int(env, "SUBMITIT_LOCAL_LOCALID", 0),
        world_size=world,
        local_world_size=world,
        master_port=derive_master_port(int(job_id) if job_id.isdigit() else 0),
        job_id=job_id,
        cpus_per_rank=_cpus(env, world),
        source="submitit-local",
    )


def derive_master_port(job_id: int, launch: int = 0) -> int:
    """A rendezvous port that differs for jobs sharing a node. Each array task has its own SLURM_JOB_ID already:
    adding the task id made ports collide (two arrays' ids and task ids summing alike). torch's default port
    29500, which a hand-started torchrun on the node may hold, maps to the top of the range instead. Each job step of an
    attempt (``launch``) takes the next port: its predecessor's may still be held while its ranks' sockets close. A
    derived port may still be taken (two jobs' ids can map alike): rank 0 then listens on another one and tells the
    others through the run directory (``cluster.rendezvous``)."""
    port = PORT_BASE + (job_id * _PORT_STRIDE + launch) % PORT_SPAN
    return PORT_BASE + PORT_SPAN if port == _TORCH_DEFAULT_PORT else port


_RANGE_ITEM = re.compile(r"([0-9]{1,18})(?:-([0-9]{1,18}))?")  # ASCII digits: str.isdigit() takes "²"
_NODELIST_HINT = "Slurm's hostlist syntax, e.g. gpu[01-04,07],login1 (from SLURM_STEP_NODELIST / SLURM_JOB_NODELIST)"


def _nodelist_error(nodelist: str, why: str) -> DdpJobError:
    shown = repr(nodelist) if len(nodelist) <= 100 else repr(nodelist[:100]) + "..."
    return DdpJobError(f"cannot parse Slurm nodelist {shown}: {why}", _NODELIST_HINT)


def _split_top_level(nodelist: str, text: str) -> list[str]:
    """Comma-separated hostlist items, commas inside one bracket level kept; unbalanced or nested brackets refused."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
        if depth not in (0, 1):
            raise _nodelist_error(nodelist, "unbalanced or nested brackets")
    if depth:
        raise _nodelist_error(nodelist, "unbalanced brackets")
    parts.append(text[start:])
    return [p for p in parts if p]


def _parse_item(nodelist: str, item: str) -> list[Any]:
    """One hostlist item as literal strings and bracket groups, each group a list of (low, high, width)."""
    parts: list[Any] = []
    for i, piece in enumerate(re.split(r"\[([^\[\]]*)\]", item)):
        if i % 2 == 0:  # literal text between bracket groups
            if re.search(r"[\s\x00-\x1f\x7f\[\]]", piece):
                raise _nodelist_error(nodelist, f"bad host name part {piece[:40]!r}")
            if piece:
                parts.append(piece)
            continue
        ranges = []
        for spec in piece.split(","):
            match = _RANGE_ITEM.fullmatch(spec)
            if not match or (match[2] is not None and int(match[2]) < int(match[1])):
                raise _nodelist_error(nodelist, f"bad range {spec[:40]!r}")
            lo = int(match[1])
            ranges.append((lo, int(match[2]) if match[2] is not None else lo, len(match[1])))
        parts.append(ranges)
    return parts


def _numbers(ranges: list[tuple[int, int, int]]) -> list[str]:
    return [str(n).zfill(width) for lo, hi, width in ranges for n in range(lo, hi + 1)]


def expand_nodelist(nodelist: str) -> list[str]:
    """Slurm's compressed hostlist (``n[1-2]``, ``gpu[01-04,07],login1``, ``rack[1-2]-n[1-2]``) → hostnames, in
    order; numbers are zero-padded to the width of the range's low end. Counts before it expands: more than
    ``_MAX_HOSTS`` hosts (``n[0-99999999]``, or two ranges multiplied) is refused without building them."""
    items = [_parse_item(nodelist, item) for item in _split_top_level(nodelist, nodelist.strip())]
    total = 0
    for parts in items:
        count = 1
        for part in parts:
            if isinstance(part, list):
                count *= sum(hi - lo + 1 for lo, hi, _ in part)
                if count > _MAX_HOSTS:
                    break
        total += count
        if total > _MAX_HOSTS:
            raise _nodelist_error(nodelist, f"names more than {_MAX_HOSTS} hosts")
    if not total:
        raise _nodelist_error(nodelist, "names no host")
    hosts: list[str] = []
    for parts in items:
        choices = [[part] if isinstance(part, str) else _numbers(part) for part in parts]
        hosts.extend("".join(combo) for combo in itertools.product(*choices))
    return hosts


def expand_tasks_per_node(spec: str) -> list[int]:
    """``SLURM_TASKS_PER_NODE`` such as ``2(x3),1`` → ``[2, 2, 2, 1]``."""
    counts: list[int] = []
    for item in spec.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item.strip())
        if not match:
            raise DdpJobError(f"cannot parse Slurm tasks-per-node {spec!r}")
        counts.extend([int(match[1])] * int(match[2] or 1))
    return counts


def process_started() -> Optional[float]:
    """When this process started (epoch seconds, to ~10 ms), from Linux's /proc: the moment srun (or torchrun) launched
    this rank, before its imports. None where /proc cannot say. A rank's ``start`` event records it, so a run's
    goodput tells the launch's start-up apart from the queue before it (``jobs.runs.goodput``)."""
    try:
        stat = Path("/proc/self/stat").read_text()
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        # Field 22 (starttime, clock ticks after boot); the fields after the ")" of the command's name start at 3.
        ticks = int(stat.rpartition(")")[2].split()[19])
    except (OSError, ValueError, IndexError):
        return None
    return round(time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK")), 3)
