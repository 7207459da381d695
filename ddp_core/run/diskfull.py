"""A full or failing filesystem under the run directory: which errors are its, and where it is mounted.

A shared filesystem that fills up (ENOSPC), a quota that is reached (EDQUOT) or a server that fails a write (EIO)
is neither the run's fault nor the node's: the trainer keeps training through a checkpoint it could not write, and
a line of the metrics log or of the events that could not be appended is lost, never the run. Such an error often
arrives wrapped (torch.save raises a RuntimeError from the OSError of the file it streams into; a background save
a ``CheckpointWriteError``; DCP a ``CheckpointException`` holding each rank's error): ``disk_error`` finds it in
the chain. ``StorageFailing`` is what ends an attempt once saves failed ``MAX_FAILED_SAVES`` times in a row: the
failure table (``cluster.failures``) calls it the filesystem's (kind ``storage``: requeued, no node excluded).
Stdlib only: the login node's readers import the run package.
"""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path
from typing import Any, Callable, Optional

log = logging.getLogger(__name__)

# The errors of a filesystem that cannot take a write, as the warning names them.
WHY = {errno.ENOSPC: "no space left", errno.EDQUOT: "disk quota exceeded", errno.EIO: "I/O error"}
# Checkpoints that could not be written in a row before the attempt stops and is requeued (training on without
# one for longer would put more work at risk than a requeue costs).
MAX_FAILED_SAVES = 3


class StorageFailing(Exception):
    """Saves to the run directory failed ``MAX_FAILED_SAVES`` times in a row: the attempt ends, to be requeued."""


def disk_error(err: BaseException) -> Optional[OSError]:
    """The ENOSPC, EDQUOT or EIO ``OSError`` behind ``err`` (itself, its causes and contexts, a DCP exception's
    per-rank errors); None if there is none."""
    stack: list[Any] = [err]
    seen: set[int] = set()
    while stack:
        e = stack.pop()
        if isinstance(e, tuple):  # DCP's wrapped failure: (exception, traceback summary)
            stack.extend(e[:1])
            continue
        if not isinstance(e, BaseException) or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in WHY:
            return e
        stack += [e.__cause__, e.__context__]
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            stack += list(failures.values())
    return None


def mount_point(path: Path) -> Path:
    """The mount point of the filesystem holding ``path`` (or the nearest folder of it that exists)."""
    here = Path(os.path.abspath(path))
    while not here.exists() and here != here.parent:
        here = here.parent
    while not os.path.ismount(here) and here != here.parent:
        here = here.parent
    return here


def describe(err: OSError, path: Path) -> str:
    """``no space left on /shared``: what the filesystem of ``path`` refused, by its mount point."""
    return f"{WHY.get(err.errno or 0, err.strerror or 'error')} on {mount_point(path)}"


def tolerant(what: str, path: Path, write: Callable[[], None]) -> bool:
    """Run ``write`` (of a line: an event, a metrics record) into ``path``; on a full or failing filesystem the line
    is lost with a warning naming it, never raised. Whether it was written; any other error is raised."""
    try:
        write()
    except OSError as err:
        if err.errno not in WHY:
            raise
        log.warning("%s not written to %s: %s (%s)", what, path, describe(err, path), errno.errorcode[err.errno])
        return False
    return True
