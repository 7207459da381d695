"""Slurm suspension (PreemptMode=SUSPEND or GANG, ``scontrol suspend``/``resume``): the job pauses and continues
where it stopped, without a collective timing out while it was stopped.

Slurm suspends a job by sending every task SIGTSTP, then SIGSTOP ``suspend_grace_time`` later
(PreemptParameters, default 2 s); resuming sends SIGCONT. A collective's timeout (``dist.timeout_s``) runs on a
steady clock, which keeps running while the process is stopped. A rank stopped while it waits for a peer finds its
deadline past when it continues, and unless the peer's data has already arrived (the peer was stopped too, maybe
before it sent; nodes resume one after the other) gloo raises "Timed out waiting ... for recv operation" and
closes the group's connections: no retry can save the attempt. On the local cluster a rank waiting in DDP's
gradient all-reduce when a 15 s suspension began failed the job with ``dist.timeout_s=5``.

So the timeouts are lifted for the length of the suspension:

- SIGTSTP (the warning): every process group's backends get an unbounded timeout for the collectives started
  from then on. The handler replaces SIGTSTP's default action (stop the process), so the ranks keep running
  during the grace: the collectives already in flight finish, and the ones in flight at SIGSTOP have no
  deadline to miss.
- SIGCONT: every backend gets its own timeout back, for the collectives started after it.

Limits: a collective still waiting at SIGSTOP that began before SIGTSTP keeps its deadline (one that waited
longer than the grace), as does every collective when ``suspend_grace_time=0`` or when a process is stopped
without SIGTSTP (``kill -STOP``). Python runs the handler on the main thread between two bytecodes, so a C++ call
longer than the grace (a long backward) delays it. A SIGTSTP that no SIGSTOP follows leaves the timeouts lifted
until a SIGCONT.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from datetime import timedelta
from types import FrameType
from typing import Any, Callable, Optional

import torch.distributed as dist

log = logging.getLogger(__name__)

# Longer than any suspension, short enough for gloo's and NCCL's deadline arithmetic (now + timeout, in ns).
UNBOUNDED = timedelta(days=365)

_owner = 0  # the pid that installed the handlers: forked children (DataLoader workers) inherit them, leave them be
_saved: dict[int, tuple[Any, timedelta]] = {}  # id(backend) -> (backend, its own timeout) while suspended
_warned_at = 0.0
_listeners: list[Callable[[bool], None]] = []  # told True at the suspend warning, False at resume (the watchdog)


def install() -> None:
    """Handle Slurm's suspend (SIGTSTP, then SIGSTOP) and resume (SIGCONT) in this process. Main thread only; after
    submitit's handlers (its SIGCONT handler only logs)."""
    global _owner
    _owner = os.getpid()
    signal.signal(signal.SIGTSTP, _on_suspend)
    signal.signal(signal.SIGCONT, _on_resume)


def on_change(listener: Callable[[bool], None]) -> None:
    """Call ``listener(True)`` when a suspension is announced and ``listener(False)`` when the job resumes: a stopped
    job makes no progress, and that is not a hang (``ddp_core.trainer.watchdog``)."""
    _listeners.append(listener)


def _backends() -> list[Any]:
    """Every backend of every process group of this process: the default group's and those made after it (the
    async checkpoint's gloo group, device meshes); a ``cpu:gloo,cuda:nccl`` group has two."""
    # torch has no public way to list a live group's backends or change their timeout (``_set_pg_timeout`` is
    # private too): the group map and ``_get_backend`` are the narrowest internals that do it.
    found: dict[int, Any] = {}
    if dist.is_initialized():
        for group in list(dist.distributed_c10d._world.pg_map):
            for device in group._device_types:
                backend = group._get_backend(device)
                found[id(backend)] = backend
    return list(found.values())


def _on_suspend(signum: int, frame: Optional[FrameType]) -> None:
    global _warned_at
    if os.getpid() != _owner or _saved:  # a second SIGTSTP must not save the unbounded timeouts as the backends' own
        return
    for backend in _backends():
        _saved[id(backend)] = (backend, backend.options._timeout)
        backend.set_timeout(UNBOUNDED)
    _warned_at = time.monotonic()
    for listener in _listeners:
        listener(True)
    log.warning("suspend warning (SIGTSTP): collective timeouts lifted until the job resumes (SIGCONT)")


def _on_resume(signum: int, frame: Optional[FrameType]) -> None:
    if os.getpid() != _owner or not _saved:
        return
    for backend, timeout in _saved.values():
        backend.set_timeout(timeout)
    _saved.clear()
    for listener in _listeners:
        listener(False)
    log.warning("resumed %.1f s after the suspend warning: collective timeouts restored", time.monotonic() - _warned_at)
