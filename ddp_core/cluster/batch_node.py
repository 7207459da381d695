"""The batch node's death in a job that outlives its nodes (``--no-kill``: spare nodes, or an elastic node range):
the job goes back through the queue, where a fresh batch script watches again.

The batch script and its watcher (``cluster.supervise``) run on the batch node. When that node dies (power, a kernel
panic), nothing is left to restart ranks or requeue the job, and Slurm 22.05 keeps such a job RUNNING on the nodes
left until its time limit: the allocation idles, or the ranks train on unwatched. So one process on another node asks
Slurm about the batch node every ``INTERVAL_S`` (``watch``; one ``scontrol show node``, from a daemon thread). Once
Slurm says it is gone (``node_state.gone``: DOWN, NOT_RESPONDING or FAIL, the watcher's test of a node too):

- with spare nodes (the batch node is the last spare, running no rank), rank 0 records the warning signal as if it
  had come (``preemption.StopFlag``): every rank stops after the same step and checkpoints, and rank 0 records an
  infrastructure ``failure`` of that host and requeues the job within ``slurm.max_failures`` (``cluster.policy``),
  excluding the host at its second failure as for any node. Nothing is lost but the queue wait;
- in an elastic job without spares, rank 0 ran on the batch node and died with it: the first process of the second
  node records the failure and requeues the job at once (``orphaned``), from the last checkpoint.

Torch-free.
"""

from __future__ import annotations

import functools
import logging
import signal
import socket
import threading
from typing import Callable, Optional, Protocol

from ddp_core.cluster.env import DistEnv
from ddp_core.cluster.failures import Failure, Kind
from ddp_core.cluster.node_state import gone
from ddp_core.cluster.policy import decide_after
from ddp_core.cluster.slurm import NODE_GATEWAY, SlurmGateway
from ddp_core.config import SlurmConfig
from ddp_core.run.rundir import RunDir

log = logging.getLogger(__name__)

INTERVAL_S = 5.0  # between two questions to the controller: Slurm itself marks a node gone after SlurmdTimeout


class Stoppable(Protocol):
    """What the trainer's watch stops: its ``StopFlag`` (the warning signal recorded, and why)."""

    warning: signal.Signals
    lost_batch_node: Optional[str]

    def record(self, signum: int) -> None: ...


def stopping(flag: Stoppable) -> Callable[[str], None]:
    """The trainer's answer to a lost batch node: ``flag`` records the warning signal as if it had come, and why."""

    def stop(host: str) -> None:
        flag.lost_batch_node = host
        flag.record(flag.warning)

    return stop


def script_told(slurm: SlurmConfig, host: str) -> bool:
    """Script mode's answer to a lost batch node: whether the script can be sent the configured warning signal (its
    own handler, or ddpjob's with ``script.resume_args``, then checkpoints and requeues); with ``slurm.signal: none``
    nothing can tell it, which is logged."""
    if not slurm.sends_signal:
        log.warning("slurm.signal is none: nothing tells the script that batch node %s is gone, and it runs on "
                    "unwatched (ddpjob cancel, then ddpjob resume, to requeue it)", host)  # fmt: skip
    return slurm.sends_signal


class Watch:
    """Rank 0's daemon thread: asks Slurm about ``host`` every ``interval_s`` until it is gone (then calls
    ``on_gone(host)`` once) or ``stop`` is called. Started where the warning signal and SIGTERM are held, as
    ``deadline.at``'s timer, if ``on_gone`` sends one: the kernel then never delivers them to this thread."""

    def __init__(
        self,
        host: str,
        on_gone: Callable[[str], None],
        gateway: SlurmGateway = NODE_GATEWAY,
        interval_s: float = INTERVAL_S,
    ) -> None:
        self.host, self.on_gone, self.gateway, self.interval_s = host, on_gone, gateway, interval_s
        self.done = threading.Event()
        self.thread = threading.Thread(target=self.run, name="batch-node-watch", daemon=True)
        self.thread.start()

    def run(self) -> None:
        while not self.done.wait(self.interval_s):
            if gone(self.gateway.show_node(self.host)):
                log.warning(
                    "the batch node %s is gone (Slurm marks it down): its batch script and watcher died with it, so "
                    "the job goes back through the queue to get a new one",
                    self.host,
                )
                self.on_gone(self.host)
                return

    def stop(self) -> None:
        self.done.set()


def watch(
    slurm: SlurmConfig,
    env: DistEnv,
    run_dir: RunDir,
    on_gone: Callable[[str], None],
    gateway: SlurmGateway = NODE_GATEWAY,
    interval_s: float = INTERVAL_S,
) -> Optional[Watch]:
    """The ``Watch`` of the batch node, from the one process of a ``--no-kill`` job that outlives it; None elsewhere
    (without ``--no-kill`` Slurm ends and requeues the job itself, ``cluster.node_loss``), or when scontrol does not
    name the batch node.

    - With spare nodes the batch node is the last spare and runs no rank: rank 0 (script mode: its launcher, or node
      0's torchrun agent) watches, and ``on_gone`` stops every rank at a step boundary with a checkpoint.
    - An elastic job without spares (``slurm.nodes`` MIN-MAX) runs rank 0 on the batch node, which dies with it, and
      the ranks left cannot checkpoint without it: the first process of the job's second node watches, and requeues
      the job itself (``requeue_after``; the work since the last checkpoint is lost, as with any dead rank).
    """
    spares = slurm.spare_nodes > 0
    watcher = env.is_main if spares else slurm.elastic and env.node_rank == 1 and env.local_rank == 0
    if not watcher or not env.slurm_job_id:
        return None
    job = gateway.show_job(env.slurm_job_id)
    host = job.raw.get("BatchHost", "") if job is not None else ""
    if not host or host == socket.gethostname():  # a watcher on the batch node would die with it
        return None
    if not spares:
        on_gone = functools.partial(orphaned, slurm=slurm, run_dir=run_dir, env=env, gateway=gateway)
    return Watch(host, on_gone, gateway, interval_s)


def orphaned(host: str, *, slurm: SlurmConfig, run_dir: RunDir, env: DistEnv, gateway: SlurmGateway) -> None:
    """An elastic job's answer to its lost batch node, from its second node: rank 0 died with it, so no rank can
    checkpoint; an infrastructure failure of ``host``, and the job requeued (or ended) by the after-failure policy
    now, which ends the ranks left waiting on rank 0."""
    requeue_after(host, slurm, run_dir, env, None, gateway)


def requeue_after(
    host: str,
    slurm: SlurmConfig,
    run_dir: RunDir,
    env: DistEnv,
    step: Optional[int],
    gateway: SlurmGateway = NODE_GATEWAY,
) -> int:
    """Rank 0, once every rank stopped and checkpointed at ``step`` because the batch node ``host`` is gone: an
    infrastructure ``failure`` of that host, then what the after-failure policy makes of it (a requeue within
    ``slurm.max_failures``, the lost host excluded where the partition can do without it, or the job's end). Returns the
    exit code."""
    what = f"node failure: the batch node {host} stopped responding (the batch script and its watcher died with it)"
    failure = Failure(Kind.infrastructure, None, host, step, what, lost="the batch node, gone (Slurm marks it down)")
    job = gateway.show_job(env.slurm_job_id) if env.slurm_job_id else None
    return decide_after(failure, run_dir, env, gateway, slurm, job=job).code
