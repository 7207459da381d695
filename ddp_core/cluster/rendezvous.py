"""Where the ranks of one job step meet: the rendezvous port, agreed through the run directory.

Every rank derives the same port from its job id and job step (``env.derive_master_port``), but the port may be
taken: by another job on the same node whose id maps to the same port (10 arrays of 1,000 tasks gave 13 such pairs),
or, after an in-allocation restart, by sockets of the step before. A rank that guessed differently from rank 0 would
wait on the wrong port until ``dist.init_timeout_s`` ends the attempt. So the port is decided once, by the process
that listens, and read by everyone else:

- the listener (the trainer's rank 0, the first rank of a script run with srun, node 0's torchrun agent) takes the
  derived port if it can listen there, else any free port the kernel gives it, and writes the port it listens on to
  ``RUN/slurm/rendezvous/JOB.ATTEMPT.STEP`` (atomically: a reader sees the whole number or nothing);
- every other rank waits for that file (up to ``dist.init_timeout_s``) and connects there. Nobody probes by
  connecting to candidate ports: a connection to a port another job holds would join that job's store.

Only Slurm steps publish (``meeting_file``); a single process, torchrun's own workers and submitit's local executor
have a launcher that already agreed on the port. Torch-free: script mode uses it before torch is loaded.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from pathlib import Path
from typing import Optional

from ddp_core.cluster.env import DistEnv
from ddp_core.errors import DdpJobError

log = logging.getLogger(__name__)

POLL_S = 0.05  # how often a waiting rank looks for the listener's file: a shared filesystem's round trip or so


def meeting_file(run_dir: Path, env: DistEnv) -> Optional[Path]:
    """Where this job step's port is published, or None when nothing is (not a multi-rank Slurm step)."""
    if env.source != "slurm" or not env.distributed or not env.slurm_job_id:
        return None
    return run_dir / "slurm" / "rendezvous" / f"{env.slurm_job_id}.{env.restart_count}.{env.launch}"


def can_listen(port: int) -> bool:
    """Whether this host can listen on ``port`` now (bound as a listener binds it, with ``SO_REUSEADDR``: a port
    whose last connections linger in TIME_WAIT is free)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A port the kernel says is free now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def pick(port: int) -> int:
    """``port`` if this host can listen there, else a free one (logged): for a listener that binds it a moment later
    (a user's script, torchrun's agent)."""
    if can_listen(port):
        return port
    other = free_port()
    log.warning("rendezvous port %d is in use on %s: listening on %d instead", port, socket.gethostname(), other)
    return other


def publish(path: Path, port: int) -> None:
    """The listener's port, for the others to read (``await_port``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(f"{port}\n")
    os.replace(tmp, path)


def await_port(path: Path, timeout_s: float, rank: int) -> int:
    """The port the listener published at ``path``; raises ``DdpJobError`` when none is within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            text = path.read_text().strip()
        except FileNotFoundError:
            text = ""
        if text.isdigit():
            return int(text)
        if time.monotonic() > deadline:
            raise DdpJobError(
                f"rank {rank} on {socket.gethostname()}: the rendezvous's listener published no port in {path} within "
                f"dist.init_timeout_s ({timeout_s:g} s)",
                "rank 0 did not start or cannot write the run directory: read rank 0's log",
            )
        time.sleep(POLL_S)


def agree(env: DistEnv, run_dir: Path, listener: bool, timeout_s: float) -> int:
    """The port this job step meets on, for a listener that binds it itself after this returns (script mode's
    ranks, torchrun's agents): ``listener`` picks and publishes it, the others read it. Outside a Slurm step, the
    derived port."""
    path = meeting_file(run_dir, env)
    if path is None:
        return env.master_port
    if listener:
        port = pick(env.master_port)
        publish(path, port)
        return port
    return await_port(path, timeout_s, env.rank)
