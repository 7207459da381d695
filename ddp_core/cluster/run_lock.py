"""Rank 0's hold on its run directory for a whole attempt (``RunDir.hold_trainer_lock``), taken the same way by the
trainer and by script mode: no second trainer in one run directory.

The previous attempt of the same Slurm job may still be exiting when its requeued successor starts: the lock is
waited for, a minute. A previous attempt whose node died never releases it, though: a lock on a shared filesystem
outlives a dead client until the server's lease ends (NFSv4: 90 s by default; a frozen node's, never). So a holder
that is an earlier attempt of this very job, on another node that Slurm says is gone (``node_state.gone``), is
taken for dead and its lock is broken; any other holder is a trainer to wait for, or refuse. Only NOT_RESPONDING is
not gone for this (``node_state.down``): the holder may be alive behind a slow network. Torch-free.
"""

from __future__ import annotations

import functools
import os
import socket
from typing import IO

from ddp_core.cluster.env import DistEnv
from ddp_core.cluster.node_state import down
from ddp_core.cluster.slurm import NODE_GATEWAY, SlurmGateway
from ddp_core.run.rundir import RunDir

REQUEUED_WAIT_S = 60.0  # for the previous attempt of a requeued or restarted job to exit


def hold(run_dir: RunDir, env: DistEnv, gateway: SlurmGateway = NODE_GATEWAY) -> IO[str]:
    """Rank 0: the run directory's trainer lock, held while the returned file stays open."""
    holder = {"host": socket.gethostname(), "pid": os.getpid(), "job": env.job_id or "-"}
    wait_s = REQUEUED_WAIT_S if env.restart_count or env.launch else 0.0
    return run_dir.hold_trainer_lock(holder, wait_s, functools.partial(dead, env=env, gateway=gateway))


def dead(holder: dict[str, str], *, env: DistEnv, gateway: SlurmGateway) -> bool:
    """Whether the lock's recorded ``holder`` (host, pid, job) is an earlier attempt of this job on another node that
    Slurm has taken out (DOWN or FAIL)."""
    host = holder.get("host", "")
    if not env.slurm_job_id or holder.get("job") != env.job_id or not host or host == socket.gethostname():
        return False
    return down(gateway.show_node(host))
