"""Who may write and who may read a run directory: one policy, the same on the login node and the compute nodes.

Runs often live in a project folder shared with a group (setgid, ``umask 002``). What a job executes or unpickles
(submitit's ``*_submitted.pkl`` and ``*_result.pkl``, ``config.yaml`` whose ``task.target`` is imported,
``code.json`` and the code snapshot first on ``sys.path``, the ``profile-now`` trigger) would then be writable by
every member of the group: any of them could run code as the run's owner. So:

- Writing, whatever the user's umask: ``tighten`` adds ``022`` to the umask of every ddpjob process (the CLI, each
  rank, submitit's job entry; sbatch passes it on to the job), so nothing ddpjob, submitit or Slurm writes for a
  run is writable by anyone but its owner.
- Before any of it is used, ``check_trusted`` refuses, in one line, such a file that another user owns or can write
  (its group or everyone), or whose folder, up to the run directory (or a sweep's folder), they can write (a file
  could be swapped in): on the compute node before submitit unpickles the call (``ddp_core.cluster.entry``) and before
  the trainer or script imports anything (``ddp_core.run.snapshot.activate``); on the login node before ``--wait``
  unpickles a result (``jobs.submission.follow``). Folders above the run directory are the user's to share.
- Reading is one choice: by default the umask decides (``umask 022``: the group and everyone may read a run's
  configs, code, checkpoints and logs); a private run (``run.private: true``, or ``DDPJOB_PRIVATE=1`` in the
  environment) gets umask ``077``: folders 0700, files 0600, the run directory closed to every other user.

Folders ddpjob makes outside a run directory (node-local copies, staging) follow ``ddp_core.run.private`` instead:
always this user's alone. No torch, no submitit: the job entry runs it before submitit loads anything. The users'
view: docs/how-it-works.md.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Iterable

from ddp_core.errors import DdpJobError
from ddp_core.run.private import owner

PRIVATE_ENV = "DDPJOB_PRIVATE"


def is_private(configured: bool = False) -> bool:
    """Whether the run is private: ``run.private`` (``configured``), or ``DDPJOB_PRIVATE`` set to anything but 0."""
    return configured or os.environ.get(PRIVATE_ENV, "0").strip() not in ("", "0")


def tighten(private: bool = False) -> int:
    """Add ``022`` to this process's umask (``077`` for a private run); returns the umask now in force. A private
    run's ``DDPJOB_PRIVATE=1`` is exported too, so the jobs this process submits, and their ranks, keep it."""
    old = os.umask(0o077)
    new = old | (0o077 if private else 0o022)
    os.umask(new)
    if private:
        os.environ[PRIVATE_ENV] = "1"
    return new


def restrict(path: Path) -> None:
    """Take from ``path``'s mode what the umask would have: a copy that kept its source's mode (``shutil.copy2``,
    rsync -a) is then no more open than a file written here."""
    mask = os.umask(0o077)
    os.umask(mask)
    os.chmod(path, stat.S_IMODE(os.stat(path).st_mode) & ~mask)


def untrusted(path: Path) -> str:
    """Why ``path`` (followed through links: what would be read) could have been changed by another user, or ''."""
    info = os.stat(path)
    if info.st_uid != os.getuid():
        return f"is owned by {owner(info.st_uid)}, not by you"
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        who = {stat.S_IWGRP: "its group", stat.S_IWOTH: "everyone"}.get(
            info.st_mode & (stat.S_IWGRP | stat.S_IWOTH), "its group and everyone"
        )
        return f"is writable by {who} (mode {stat.S_IMODE(info.st_mode):04o})"
    return ""


def check_trusted(paths: Iterable[Path], top: Path) -> None:
    """Refuse, in one ``DdpJobError``, any of ``paths`` (files or folders that exist), or any folder between one and
    ``top`` (inclusive), that another user owns or can write."""
    seen: set[Path] = set()
    top = Path(os.path.abspath(top))
    for path in paths:
        path = Path(os.path.abspath(path))
        chain = [path, *(p for p in path.parents if p.is_relative_to(top))]
        for item in chain:
            if item in seen:
                continue
            seen.add(item)
            why = untrusted(item)
            if why:
                kind = "folder" if item.is_dir() else "file"
                raise DdpJobError(
                    f"{item} {why}: another user could change what this job runs, so it is refused before use",
                    f"if you did not change that {kind}, ask who did; else chmod go-w {item} (ddpjob writes run files "
                    "writable by you only, whatever the umask)",
                )


def tree(folder: Path) -> list[Path]:
    """``folder`` and everything in it (the code snapshot): each one is imported or decides what is."""
    found = [folder]
    for here, dirs, names in os.walk(folder):
        found += [Path(here) / n for n in (*dirs, *names)]
    return found
