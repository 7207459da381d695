"""The node-local tier's folders on a node (``checkpoint.local_path``): the checks of the path, the job's and the
node's folders made this user's alone and claimed for the run, and what turns the tier off without ending the run.

Why a module of its own: these are the tier's decisions about a shared machine's folder (another user's folder in
the tier's predictable place, another job that filled ``/dev/shm``), apart from what the copies hold and how they
travel (``local``, ``local_replica``). The rule for the folders is ``ddp_core.run.private``'s.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
from pathlib import Path
from typing import Optional

from ddp_core.cluster.env import DistEnv
from ddp_core.errors import DdpJobError
from ddp_core.run import private
from ddp_core.run.rundir import RunDir, atomic_write_text

log = logging.getLogger(__name__)

OWNER = "run.txt"
PATH_HINT = "or set checkpoint.local_every_steps=0 to run without the node-local tier"
REFUSED_HINT = (
    "job ids are predictable, so another user may have made it first: remove it (or ask its owner or the admins "
    "to), or set checkpoint.local_path to a folder of your own; until then the node-local tier is off and the run "
    "goes on with its durable checkpoints"
)
# A copy that fails with one of these is skipped (the next interval's is tried): the node's room or disk, not a bug.
FALLBACK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EIO})


class TierOff(DdpJobError):
    """The node-local tier cannot be used in this attempt, on any rank (raised on every rank alike)."""


def check_folder(path: Path, host: str) -> None:
    """On the node: ``checkpoint.local_path`` exists, is a folder and this process may write there."""
    where = f"checkpoint.local_path {path} on {host}"
    if not path.exists():
        problem, fix = "does not exist", "name a node-local folder every node has (/dev/shm, /tmp)"
    elif not path.is_dir():
        problem, fix = "is not a folder", "name a node-local folder (/dev/shm, /tmp)"
    elif not os.access(path, os.W_OK | os.X_OK):
        problem, fix = "is not writable here", "name a folder the job may write (/dev/shm, /tmp)"
    else:
        return
    raise DdpJobError(f"{where} {problem}", f"{fix}, {PATH_HINT}")


def folder_bytes(folder: Path) -> int:
    total = 0
    for parent, _, names in os.walk(folder):
        for name in names:
            try:
                total += os.lstat(os.path.join(parent, name)).st_size
            except OSError:  # pruned meanwhile
                pass
    return total


def refusal(folder: Path, host: str) -> Optional[DdpJobError]:
    """Why ``folder`` (the job's or the node's) is no private folder of this user's; None if it is one."""
    found = private.problem(folder)
    if found is None:
        return None
    return DdpJobError(f"on {host}, the node-local tier's folder {folder} {found}: refused", REFUSED_HINT)


def claim(root: Path, node: Path, run_dir: Path, host: str) -> None:
    """The node's first rank: the job's folder ``root`` and ``node`` in it made private (``ddp_core.run.private``;
    ``DdpJobError`` if one is not), and ``node`` belongs to this run: a folder another run left under the same job id
    (a reused id, an adaptive sweep's worker on its next trial) or one without its owner file is emptied first."""
    what = f"on {host}, the node-local tier's folder"
    private.folder(root, what, REFUSED_HINT)
    private.folder(node, what, REFUSED_HINT)
    owner = node / OWNER
    try:
        ours = owner.read_text().strip() == str(run_dir)
    except OSError:
        ours = False
    if not ours:
        if any(node.iterdir()):
            log.warning("removing %s: local copies of another run (or of none)", node)
            shutil.rmtree(node, ignore_errors=True)
            private.folder(node, what, REFUSED_HINT)
        atomic_write_text(owner, f"{run_dir}\n", private=True)


def fallback_errno(err: BaseException) -> Optional[int]:
    """The errno of ``FALLBACK_ERRNOS`` behind ``err`` (torch.save reports a full disk as a RuntimeError whose
    context is the OSError), or None."""
    seen: set[int] = set()
    cause: Optional[BaseException] = err
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, OSError) and cause.errno in FALLBACK_ERRNOS:
            return cause.errno
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return None


def off_for_attempt(off: DdpJobError, env: DistEnv, run_dir: RunDir) -> None:
    log.warning("node-local tier off for this attempt, durable checkpoints only: %s", off)
    if env.is_main:
        record(run_dir, "local_tier_off", job_id=env.job_id, reason=off.message)


def record(run_dir: RunDir, event: str, **fields: object) -> None:
    """One of the tier's events in the run's ``attempts.jsonl``, never raising: the warning already says it."""
    try:
        run_dir.log_event(event, **fields)
    except OSError as err:
        log.warning("could not record the %s event in %s: %s", event, run_dir.path, err)
