"""Health checks of a rank's node before an attempt's first step: the run directory is writable, the site's own
check passes (``slurm.health_check``, a shell command run by each node's first rank, its output in the log), and,
for the trainer, the GPU answers and a collective on the training device completes (``distributed.groups``). A
failed check raises ``HealthCheckFailed``: the batch script's watcher excludes the node from the job's later
attempts and requeues it within ``slurm.max_health_failures``, without spending ``slurm.max_failures``
(``cluster.failures``). A run directory that takes no write because its filesystem is full (ENOSPC, EDQUOT) is no
fault of the node: ``StorageFailing`` (kind ``storage``: requeued, no node excluded). Torch-free.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import socket
import subprocess
import time
from typing import Optional

from ddp_core.cluster.env import DistEnv
from ddp_core.run import diskfull
from ddp_core.run.diskfull import StorageFailing
from ddp_core.run.rundir import RunDir

log = logging.getLogger("ddp_core")
TIMEOUT_S = 60.0  # slurm.health_check's bound: a hung check fails the node


class HealthCheckFailed(RuntimeError):
    """This node failed a health check: not the user's code, and not worth another attempt on the same node."""


def check_node(run_dir: RunDir, env: DistEnv, command: Optional[str], timeout_s: float = TIMEOUT_S) -> None:
    """The node checks every rank runs (the site's command on each node's first rank only). Raises
    ``HealthCheckFailed`` naming the host and the check."""
    host = socket.gethostname()
    probe = run_dir.path / f".health-{host}-{env.rank}-{os.getpid()}"
    try:
        probe.write_text("ok")
        probe.unlink()
    except OSError as err:
        with contextlib.suppress(OSError):
            probe.unlink()
        if err.errno in (errno.ENOSPC, errno.EDQUOT):  # full for every node: the filesystem's, not this node's
            raise StorageFailing(f"health check on {host}: {diskfull.describe(err, run_dir.path)}") from None
        raise HealthCheckFailed(f"health check on {host}: the run directory is not writable ({err})") from None
    if not command or env.local_rank != 0:
        return
    started = time.monotonic()
    try:
        proc = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise HealthCheckFailed(
            f"health check on {host}: slurm.health_check did not finish within {timeout_s:g} s"
        ) from None
    output = (proc.stdout + proc.stderr).strip()
    took = time.monotonic() - started
    if proc.returncode != 0:
        log.error("slurm.health_check on %s failed (exit %d, %.1f s): %s", host, proc.returncode, took, output)
        last = output.splitlines()[-1] if output else f"exit {proc.returncode}"
        raise HealthCheckFailed(f"health check on {host}: slurm.health_check failed: {last}")
    log.info("slurm.health_check on %s passed in %.1f s%s", host, took, f": {output}" if output else "")
