"""Process-group lifecycle and the device each rank trains on, from an explicit ``DistEnv``: the rendezvous, joining
and leaving the group, the health check's collective, the GPU binding line.

**Which backend serves which tensor.** On a CUDA node the process group is ``cpu:gloo,cuda:nccl``: one group
with two backends, picked per collective by the tensor's device.

- Data-path tensors live on the GPU and go through NCCL: DDP's gradient buckets, FSDP2's all-gathers and
  reduce-scatters, pipeline activations and the pipeline's dp gradient average and clip norm.
- Coordination stays on the host and goes through gloo: the per-step stop flag (``preemption.StopFlag``),
  the logged-loss and eval totals, and the object collectives (RNG states to rank 0, metric names, the
  agreed checkpoint: ``collectives``). torch sends object collectives through the CPU backend when the group has one.
  A CPU collective never enters a CUDA stream, so the stop flag does not stall the GPU's queue of kernels;
  the loss is read back from the GPU only when a progress line is due.
- Groups made from the default one inherit both backends: ``new_group()``, and the device meshes of fsdp
  and pipeline. The async-checkpoint group (``sharded_checkpoint``) is gloo alone, because it carries only
  objects.

On a CPU node the whole group is ``gloo``. ``cfg.dist.guard`` rehearses a GPU node's groups on a CPU
machine: ``ddp_core.distributed.guard`` builds them with the same device→backend table, with gloo in place
of nccl, so a collective that the GPU node would not serve fails here first.

**Failing loudly.** Collectives time out after ``dist.timeout_s``; joining the group (the TCP store
rendezvous: every rank must arrive) has the longer ``dist.init_timeout_s``, for slow node start-up and
imports from a cold shared filesystem. NCCL's async error handling is on by default in torch >= 2.2
(``TORCH_NCCL_ASYNC_ERROR_HANDLING=3``); the batch script sets it explicitly (``jobs.submission.submit``). After a
timeout or a NCCL error, the ranks' communicators are aborted, and the rank's error line names its rank
and host (``launch``). A Slurm suspension (SIGTSTP, SIGSTOP, later SIGCONT) must not count as a stuck collective:
``ddp_core.distributed.suspend`` lifts the timeouts for its length.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from datetime import timedelta
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from ddp_core.cluster import rendezvous
from ddp_core.cluster.env import DistEnv
from ddp_core.cluster.health import HealthCheckFailed
from ddp_core.config import DistConfig
from ddp_core.distributed import flight_recorder, suspend
from ddp_core.distributed import guard as collective_guard
from ddp_core.distributed.guard import CPU_BACKEND, GPU_BACKEND
from ddp_core.errors import DdpJobError

log = logging.getLogger(__name__)


def backend_spec(cuda: bool) -> str:
    return GPU_BACKEND if cuda else CPU_BACKEND


def visible_gpus(environ: Optional[dict[str, str]] = None) -> Optional[list[str]]:
    """The GPUs Slurm (or the user) made visible to this process, from ``CUDA_VISIBLE_DEVICES``; None if unset."""
    raw = (os.environ if environ is None else environ).get("CUDA_VISIBLE_DEVICES")
    if raw is None:
        return None
    return [item for item in raw.split(",") if item.strip()]


def device_index(env: DistEnv, gpu_count: int) -> int:
    """Which of the visible GPUs this rank drives.

    Slurm makes GPUs visible in one of two ways, and ``local_rank % visible`` is right in both:
    - every task sees all the node's GPUs (``--gpus-per-node``): local rank r takes GPU r;
    - each task sees only its own GPU (``--gpus-per-task=1`` or ``--gpu-bind``): every rank takes GPU 0.
    """
    if gpu_count < 1:
        raise DdpJobError(
            f"rank {env.rank} has no visible GPU (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})",
            "request GPUs with slurm.gpus_per_node",
        )
    if env.local_world_size > gpu_count and gpu_count > 1:
        # Two ranks on one GPU: NCCL refuses ("Duplicate GPU detected"), better to say why here.
        raise DdpJobError(
            f"{env.local_world_size} ranks on node {env.node_rank} but only {gpu_count} GPUs are visible",
            "make slurm.gpus_per_node match the ranks per node",
        )
    return env.local_rank % gpu_count


def setup(env: DistEnv, cfg: Optional[DistConfig] = None, meeting: Optional[Path] = None) -> torch.device:
    """Pick the device, cap threads, and join the process group when there is more than one process. ``meeting``:
    where the job step's rendezvous port is agreed (``cluster.rendezvous.meeting_file``), if anywhere."""
    cfg = cfg or DistConfig()
    torch.set_num_threads(env.cpus_per_rank)
    cuda = torch.cuda.is_available()
    if cuda:
        device = torch.device("cuda", device_index(env, torch.cuda.device_count()))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    backend = backend_spec(cuda)
    if cfg.guard:
        backend = collective_guard.install(cfg.guard, cuda, env)
    if env.source != "single":
        store = _rendezvous_store(env, cfg, meeting)
        flight_recorder.enable(cuda)  # a hang's dump then holds the NCCL collectives in flight
        dist.init_process_group(
            backend,
            store=store,
            rank=env.rank,
            world_size=env.world_size,
            timeout=timedelta(seconds=cfg.timeout_s),
            # Binds NCCL's communicator to this GPU and creates it now, not at the first collective. CPU: omitted
            # (every form raises there).
            device_id=device if cuda else None,
        )
        if env.slurm_job_id:
            # Only in Slurm jobs: outside, SIGTSTP is a Ctrl-Z and must still stop the process.
            suspend.install()
    log.info(
        "%s on %s: rank %d/%d local %d/%d node %d/%d master %s:%d backend %s device %s threads %d",
        env.source, socket.gethostname(), env.rank, env.world_size, env.local_rank, env.local_world_size, env.node_rank,
        env.num_nodes, env.master_addr, env.master_port, backend if env.source != "single" else "none",
        device, env.cpus_per_rank,
    )  # fmt: skip
    log.info("gpu binding: %s", describe_binding(env, cuda))
    return device


def check_health(device: torch.device, env: DistEnv, min_free: float = 0.05) -> None:
    """The device part of an attempt's health check (``cluster.health``): on a GPU, free memory (at least
    ``min_free`` of it) and a small matrix product with an exact answer; then a one-element all-reduce on the
    training device over every rank (on GPUs, NCCL's path, the gradients'). Raises ``HealthCheckFailed`` naming
    the host."""
    host = socket.gethostname()
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        if free < min_free * total:
            raise HealthCheckFailed(
                f"health check on {host}: {device} has {free / 2**30:.1f} GiB free of {total / 2**30:.1f} GiB "
                "(another process holds it?)"
            )
        a = (torch.arange(64 * 64, dtype=torch.float32) % 7).reshape(64, 64)  # small integers: exact in TF32 too
        if not torch.equal((a.to(device) @ a.to(device)).cpu(), a @ a):
            raise HealthCheckFailed(f"health check on {host}: a matrix product on {device} gave a wrong answer")
    # A guard rehearsal on a CPU machine stands the CPU in for the GPU, and its table may serve no CPU tensor: the
    # GPU node would run this collective on its GPU, so the rehearsal has nothing true to say about it.
    rehearsing_gpu = device.type == "cpu" and collective_guard.active_spec() is not None
    if dist.is_initialized() and not rehearsing_gpu:
        total_ranks = torch.ones(1, device=device)
        dist.all_reduce(total_ranks)
        if int(total_ranks.item()) != env.world_size:
            raise HealthCheckFailed(
                f"health check on {host}: an all-reduce over {env.world_size} ranks gave a wrong sum"
            )


def _rendezvous_store(env: DistEnv, cfg: DistConfig, meeting: Optional[Path]) -> dist.TCPStore:
    """Our own store: its timeout bounds the rendezvous (every rank joins), the group's bounds each collective.
    Each rank signs in; rank 0 waits for all of them, so a rank that never arrives (a wrong address or port, a
    node that cannot reach the master) ends the attempt within ``dist.init_timeout_s`` naming who is missing.
    ``meeting``: where rank 0 publishes the port it listens on, the derived one or, when that is taken, another the
    kernel gives it; the others read it there (``cluster.rendezvous``). None: every rank uses ``env.master_port``."""
    hosting = env.rank == 0 and not env.agent_store
    port = env.master_port
    if meeting is not None and not hosting:
        port = rendezvous.await_port(meeting, cfg.init_timeout_s, env.rank)
    where = f"{env.master_addr}:{port}"

    def unreachable(err: str) -> DdpJobError:
        return DdpJobError(
            f"rank {env.rank} on {socket.gethostname()} could not reach the rendezvous at {where} within "
            f"dist.init_timeout_s ({cfg.init_timeout_s:g} s): {err}",
            "check that every rank gets the same MASTER_ADDR/MASTER_PORT and that this node can reach that host "
            "and port (firewall, the interface the name resolves to)",
        )

    if not hosting:
        failed = _await_listener(env.master_addr, port, cfg.init_timeout_s)
        if failed is not None:
            raise unreachable(failed)
    try:
        store = _tcp_store(env, port, hosting, cfg.init_timeout_s)
    except dist.DistNetworkError as err:
        if not (hosting and "in use" in str(err)):
            raise unreachable(str(err).splitlines()[0]) from None
        if meeting is None and env.world_size > 1:  # alone, nobody else needs to know where it listens
            raise DdpJobError(
                f"rank 0 on {socket.gethostname()} cannot listen on the rendezvous port {port}: in use",
                "another process on this node holds it (a job sharing the node, a stray torchrun): export a free "
                "MASTER_PORT in slurm.setup, or resubmit",
            ) from None
        store = _tcp_store(env, 0, hosting, cfg.init_timeout_s)  # the kernel's pick: free by construction
        log.warning("rendezvous port %d is in use on %s: listening on %d instead", port, socket.gethostname(),
                    store.port)  # fmt: skip
        where = f"{env.master_addr}:{store.port}"
    if meeting is not None and hosting:
        rendezvous.publish(meeting, store.port)  # once it listens: a rank that reads the port connects at once
    prefix = f"ddpjob/{env.restart_count}/{env.launch}/arrived/"  # torchrun's store outlives a restart of its workers
    store.set(f"{prefix}{env.rank}", socket.gethostname())
    if env.rank == 0:
        _await_ranks(store, [f"{prefix}{r}" for r in range(env.world_size)], cfg.init_timeout_s, where)
    return store


def _tcp_store(env: DistEnv, port: int, hosting: bool, timeout_s: float) -> dist.TCPStore:
    return dist.TCPStore(
        env.master_addr,
        port,
        env.world_size,
        is_master=hosting,
        timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False,  # rank 0 waits in _rendezvous_store, where it can say which ranks are missing
    )


def _await_listener(host: str, port: int, timeout_s: float) -> Optional[str]:
    """Wait until rank 0's store accepts connections; None then, else the last connection error at the deadline.

    All ranks of an srun step start together, and rank 0 often opens its store last. A TCPStore client that finds
    no listener retries with a growing back-off: it joined 0.1 to 1.7 s after the store came up here. Probing with
    plain connections (a few ms apart, at most 50 ms) lets this rank's client connect as soon as the store is up."""
    deadline = time.monotonic() + timeout_s
    pause = 0.005
    while True:
        try:
            socket.create_connection((host, port), timeout=max(0.1, min(5.0, deadline - time.monotonic()))).close()
            return None
        except OSError as err:
            if time.monotonic() + pause >= deadline:
                return str(err) or type(err).__name__
        time.sleep(pause)
        pause = min(0.05, pause * 1.5)


def _await_ranks(store: dist.Store, keys: list[str], timeout_s: float, where: str) -> None:
    try:
        store.wait(keys, timedelta(seconds=timeout_s))  # returns as the last rank signs in (no polling interval)
    except dist.DistStoreError:
        if not store.check(keys):
            missing = [r for r, key in enumerate(keys) if not store.check([key])]
            arrived = [f"{r} on {store.get(key).decode()}" for r, key in enumerate(keys) if r not in missing]
            shown = ", ".join(map(str, missing[:20])) + (f" and {len(missing) - 20} more" if len(missing) > 20 else "")
            raise DdpJobError(
                f"rank{'s' if len(missing) > 1 else ''} {shown} never arrived at the rendezvous at {where} within "
                f"dist.init_timeout_s ({timeout_s:g} s); arrived: {', '.join(arrived[:20])}",
                "read the missing ranks' logs: a rank that cannot reach this host and port says so there",
            ) from None


def describe_binding(env: DistEnv, cuda: bool) -> str:
    """One line: what Slurm made visible to this rank and which GPU it takes (also on a node without CUDA, where
    it says which one it would take: the local cluster's GRES GPUs are placeholders)."""
    visible = visible_gpus()
    shown = "unset" if visible is None else ",".join(visible) or "empty"
    count = torch.cuda.device_count() if cuda else len(visible or [])
    if count == 0:
        return f"CUDA_VISIBLE_DEVICES={shown} local_rank {env.local_rank} -> cpu"
    index = env.local_rank % count
    physical = visible[index] if visible and index < len(visible) else str(index)
    where = "" if cuda else " (no CUDA in this process: training on cpu)"
    return f"CUDA_VISIBLE_DEVICES={shown} local_rank {env.local_rank} -> cuda:{index} (GPU {physical}){where}"


def teardown() -> None:
    """Barrier, then destroy: exiting gloo without both aborted at shutdown in 6 of 12 runs here."""
    if dist.is_initialized():
        dist.barrier()
        collective_guard.report()
        dist.destroy_process_group()


def ensure_single_process_group(device: torch.device) -> None:
    """A one-rank group for a process started alone (FSDP needs one for its device mesh); an in-memory store,
    no port. Same device→backend table as a multi-rank job."""
    if not dist.is_initialized():
        spec = collective_guard.active_spec() or backend_spec(device.type == "cuda")
        dist.init_process_group(spec, store=dist.HashStore(), rank=0, world_size=1)


def peak_memory_gb(device: torch.device) -> Optional[float]:
    """This rank's peak GPU memory allocated by tensors since the start (GB); None on the CPU."""
    if device.type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(device) / 1e9
