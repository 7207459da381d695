"""Whether the filesystem of the runs takes the locks ddpjob relies on: ``flock`` on the run directory's trainer,
submit and meta locks (``rundir``), held across the cluster's nodes.

Parallel filesystems differ. Lustre refuses ``flock`` unless mounted ``-o flock`` (``noflock``, its default, answers
ENOSYS), and with ``-o localflock`` grants it on each node alone: two trainers on two nodes would both hold "the"
lock. NFS mounted ``nolock``, or ``local_lock=flock|all``, also keeps locks on the node. ``problem`` reads the mount
options (``/proc/self/mountinfo``) and then takes a real lock in the folder: one line naming the path, the filesystem
and the option, which submit refuses before anything is created (``jobs.submission.checks``), and which a lock that
fails on the compute node raises too (``held_problem``). Stdlib only.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
from pathlib import Path
from typing import IO, Any, Optional

from ddp_core.errors import DdpJobError
from ddp_core.run.diskfull import mount_point

__all__ = ["HINT", "flock", "mount_options", "mount_point", "problem"]

MOUNTINFO = Path("/proc/self/mountinfo")
HINT = (
    "put run.root on a filesystem whose flock holds across nodes (Lustre mounted -o flock; NFS without nolock or "
    "local_lock), or ask your site which one that is"
)


def mount_options(path: Path, mountinfo: Optional[str] = None) -> tuple[str, str, set[str]]:
    """(mount point, filesystem type, mount and superblock options) of the filesystem holding ``path``."""
    point = str(mount_point(path))
    text = mountinfo if mountinfo is not None else MOUNTINFO.read_text()
    found = ("", set[str]())
    for line in text.splitlines():
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) >= 6 and len(tail) >= 3 and fields[4].replace("\\040", " ") == point:
            found = (tail[0], set(fields[5].split(",")) | set(tail[2].split(",")))  # the last mount there wins
    return point, found[0], found[1]


def local_only(fstype: str, options: set[str]) -> Optional[str]:
    """The mount option that keeps ``flock`` from holding across nodes, or that refuses it; None if none does."""
    if fstype == "lustre":
        if "localflock" in options:
            return "localflock (a lock holds on its own node only)"
        if "flock" not in options:
            return "no flock option (Lustre refuses flock: noflock is its default)"
    if fstype.startswith("nfs"):
        if "nolock" in options:
            return "nolock (locks held on each node only)"
        if {"local_lock=flock", "local_lock=all"} & options:
            return "local_lock (flock held on each node only)"
    return None


def problem(folder: Path, mountinfo: Optional[str] = None) -> Optional[str]:
    """Why the runs under ``folder`` could not be locked across nodes, in one line; None when they can."""
    point, fstype, options = mount_options(folder, mountinfo)
    if (why := local_only(fstype, options)) is not None:
        return f"run.root {folder} is on {fstype} at {point}, mounted with {why}"
    here = Path(folder)
    while not here.exists() and here != here.parent:
        here = here.parent
    if not os.access(here, os.W_OK):
        return None  # not this check's to say: the run directory's creation names it
    try:
        with tempfile.NamedTemporaryFile(dir=here, prefix=".ddpjob-flock-") as f:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        return held_problem(here, err)
    return None


def held_problem(path: Path, err: OSError) -> str:
    """A ``flock`` in ``path`` that failed with ``err`` (not a lock another holds), in one line."""
    point, fstype, _ = mount_options(path)
    return f"flock on {path} failed ({err.strerror or err}): {fstype or 'the filesystem'} at {point} takes no flock"


def flock(f: IO[Any], flags: int) -> None:
    """``fcntl.flock`` of the run directory's locks: a filesystem that takes no flock is one line naming it (a lock
    another process holds is ``BlockingIOError``, raised as it is)."""
    try:
        fcntl.flock(f, flags)
    except BlockingIOError:
        raise
    except OSError as err:
        raise DdpJobError(held_problem(Path(f.name).parent, err), HINT) from err
