"""Private places: every folder ddpjob makes outside a run directory is this user's alone.

Why: those folders are on machines other users share (``/dev/shm`` and ``$TMPDIR`` on the compute nodes, the
laptop's temporary folder), under names others can predict (a job id is in ``squeue``, a pid in ``ps``). A folder
another user made first, or a symlink in its place, let them read what ddpjob wrote there (weights, optimizer
state) or swap in a forged copy that a later attempt restored; one made first with mode 0755 made the job fail.

The rule, in one place: such a folder has a per-user name (``per_user_name``, ``temp_folder``), is made by this user
with mode 0700 and is checked with ``lstat`` before use (``check``): owned by this user, a real folder (not a
symlink), no access for group or others. A place that fails is refused with a ``DdpJobError`` naming the path and
its owner or mode. Folders inside one are made 0700 too (``makedirs``) and files in them 0600, whatever the umask
(``opener``; ``seal`` for files a library wrote). A run directory's own files never go through here: who may read
them is the project's choice, and no one else may write them (``ddp_core.run.permissions``).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import pwd
import re
import shutil
import stat
import tempfile
from pathlib import Path
from typing import Iterator, Optional

from ddp_core.errors import DdpJobError

DIR_MODE, FILE_MODE = 0o700, 0o600
_SAFE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
HINT = "remove it (or ask its owner or the admins to: another user may have made it first) and run again"


def user_tag() -> str:
    """This user in a file name: the account name, or ``uid<N>`` without a usable passwd entry (a container)."""
    uid = os.geteuid()
    try:
        name = pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid{uid}"
    return name if _SAFE.fullmatch(name) else f"uid{uid}"


def per_user_name(key: str) -> str:
    """``ddpjob-<user>-<key>``: a folder's name of this user's, ``key`` (a job id) hashed if it is not file-safe."""
    safe = key if _SAFE.fullmatch(key) else hashlib.sha256(key.encode()).hexdigest()[:16]
    return f"ddpjob-{user_tag()}-{safe}"


def owner(uid: int) -> str:
    """A uid as an error line names it: ``alice (uid 2000)``, or ``uid N`` without a passwd entry."""
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def problem(path: Path) -> Optional[str]:
    """What makes ``path`` no private folder of this user's (``lstat``: a symlink is not followed); None if it is."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return "does not exist"
    if stat.S_ISLNK(st.st_mode):
        return f"is a symlink (to {os.readlink(path)})"
    if not stat.S_ISDIR(st.st_mode):
        return "is not a folder"
    if st.st_uid != os.geteuid():
        return f"is owned by {owner(st.st_uid)}, not {owner(os.geteuid())}"
    if st.st_mode & 0o077:
        return f"has mode {stat.S_IMODE(st.st_mode):04o} (group or others have access; it must be 0700)"
    return None


def check(path: Path, what: str = "folder", hint: str = HINT) -> Path:
    """``path`` if it is a private folder of this user's; else ``DdpJobError``: '<what> <path> <problem>: refused'."""
    found = problem(path)
    if found is not None:
        raise DdpJobError(f"{what} {path} {found}: refused", hint)
    return path


def folder(path: Path, what: str = "folder", hint: str = HINT) -> Path:
    """``path`` made by this user with mode 0700 if missing (its parent must exist), then checked (``check``)."""
    try:
        os.mkdir(path, DIR_MODE)
    except FileExistsError:
        pass  # ours from before (another rank, an earlier attempt), or someone else's: the check says which
    return check(path, what, hint)


def makedirs(path: Path) -> None:
    """``path`` and its missing parents, each 0700 (``Path.mkdir(parents=True)`` makes the parents 0777 - umask)."""
    missing = []
    while not path.exists():
        missing.append(path)
        path = path.parent
    for each in reversed(missing):
        each.mkdir(mode=DIR_MODE, exist_ok=True)


def temp_folder(kind: str, parent: Optional[Path] = None, prefix: str = "ddpjob") -> Path:
    """A new private folder ``<prefix>-<user>-<kind>-<random>`` in ``parent`` (the temporary folder by default):
    created exclusively (``mkdtemp``: a name another user made first is never reused), 0700, checked."""
    made = Path(tempfile.mkdtemp(prefix=f"{prefix}-{user_tag()}-{kind}-", dir=parent))
    return check(made, f"temporary {kind} folder")


@contextlib.contextmanager
def temporary(kind: str, parent: Optional[Path] = None) -> Iterator[Path]:
    """``temp_folder``, removed on leaving."""
    made = temp_folder(kind, parent)
    try:
        yield made
    finally:
        shutil.rmtree(made, ignore_errors=True)


def opener(path: str, flags: int) -> int:
    """For ``open(..., opener=opener)``: the file is 0600, whatever the umask, and a symlink in its place refused."""
    fd = os.open(path, flags | os.O_NOFOLLOW, FILE_MODE)
    try:
        os.fchmod(fd, FILE_MODE)
    except BaseException:
        os.close(fd)
        raise
    return fd


def seal(top: Path) -> None:
    """Files a library wrote in a private folder (DCP's shards, a download) made 0600, folders 0700; symlinks
    are left as they are (never followed)."""
    for parent, folders, files in os.walk(top):
        for name in folders + files:
            path = os.path.join(parent, name)
            st = os.lstat(path)
            if stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode):
                os.chmod(path, DIR_MODE if stat.S_ISDIR(st.st_mode) else FILE_MODE)
