"""Real unprivileged users for the tests of what one user can do to another on a shared cluster.

``ensure()`` creates them once per machine with Debian's ``useradd`` (it needs root, as the suite runs): ``alice``
(``ddpjob-alice``, whose runs are attacked) and ``mallory`` (``ddpjob-mallory``, who attacks), each with a home of
their own (mode 0700) and a private group, uid 1000 or above and no sudo, plus a shared project group
``ddpjob-proj`` both are members of (a setgid project folder's group). Nothing here fakes a uid: ``run`` starts the
command under the user's real uid, gid and groups (``setpriv``), so the kernel does the refusing.

``python_env`` lets such a user run the project's code: the venv's own ``python`` links to pyenv's under ``/root``,
which other users cannot enter, so their interpreter is Debian's ``/usr/bin/python3`` (the same CPython 3.11 ABI)
with the venv's site-packages and the checkout on ``PYTHONPATH``.
"""

from __future__ import annotations

import grp
import os
import pwd
import subprocess
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional, Sequence

from ddp_core.cluster.slurm import SlurmGateway
from tests.support.cluster_guard import HOME as CLUSTER_HOME
from tests.support.helpers import ROOT

PROJECT_GROUP = "ddpjob-proj"
SYSTEM_PYTHON = "/usr/bin/python3"


@dataclass(frozen=True)
class User:
    name: str
    uid: int
    gid: int
    home: Path


def require_root() -> None:
    import pytest

    if os.geteuid() != 0:
        pytest.skip("creating test users needs root (the suite runs as root here and in CI)")


def _user(name: str) -> User:
    entry = pwd.getpwnam(name)
    return User(name, entry.pw_uid, entry.pw_gid, Path(entry.pw_dir))


def ensure(short: str) -> User:
    """The test user ``ddpjob-<short>``, created on first use (idempotent; a member of ``ddpjob-proj``)."""
    require_root()
    name = f"ddpjob-{short}"
    try:
        grp.getgrnam(PROJECT_GROUP)
    except KeyError:
        subprocess.run(["groupadd", "-f", PROJECT_GROUP], check=True)
    try:
        user = _user(name)
    except KeyError:
        subprocess.run(
            ["useradd", "--create-home", "--user-group", "--shell", "/bin/bash", "-K", "UID_MIN=2000",
             "--groups", PROJECT_GROUP, name],
            check=True,
        )  # fmt: skip
        user = _user(name)
    assert user.uid >= 1000 and user.uid != 0, user
    if name not in grp.getgrnam(PROJECT_GROUP).gr_mem:
        subprocess.run(["usermod", "-a", "-G", PROJECT_GROUP, name], check=True)
    os.chmod(user.home, 0o700)
    reachable(ROOT)
    return user


def reachable(path: Path) -> None:
    """Let every user enter the folders above ``path`` (the checkout: the test users import its code and the venv's
    packages from it): a folder without search permission for others (a clone under ``/root``, 0700) gets ``o+x``,
    entering only, never listing. The folders here are 0755 already; a CI clone's parents may not be."""
    for folder in [path, *path.parents]:
        mode = folder.stat().st_mode
        if not mode & 0o001:
            os.chmod(folder, mode | 0o001)


def project_gid() -> int:
    return grp.getgrnam(PROJECT_GROUP).gr_gid


def python_env(extra: Optional[Mapping[str, str]] = None) -> dict[str, str]:
    """An environment in which a plain user's ``/usr/bin/python3`` imports the project and its dependencies."""
    site = sysconfig.get_paths()["purelib"]  # the venv's site-packages (readable by all: /work is 0755)
    env = {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "LANG": "C.UTF-8",
        "PYTHONPATH": os.pathsep.join([str(ROOT), site]),
        "OMP_NUM_THREADS": "1",
    }
    env.update(extra or {})
    return env


def run(
    user: User,
    argv: Sequence[str],
    *,
    cwd: Optional[Path] = None,
    env: Optional[Mapping[str, str]] = None,
    umask: int = 0o022,
    check: bool = False,
    timeout: float = 120,
) -> subprocess.CompletedProcess[str]:
    """``argv`` as ``user`` (real uid, gid and supplementary groups), with ``umask``, in ``cwd`` (default: the home)."""
    return subprocess.run(
        command(user, argv, umask=umask), cwd=cwd or user.home, env=user_environ(user, env),
        capture_output=True, text=True, check=check, timeout=timeout,
    )  # fmt: skip


def command(user: User, argv: Sequence[str], *, umask: int = 0o022) -> list[str]:
    """The command line that runs ``argv`` as ``user`` (see ``run``; ``tests.support.as_user`` execs it)."""
    return [
        "setpriv", f"--reuid={user.uid}", f"--regid={user.gid}", "--init-groups", "--inh-caps=-all",
        "sh", "-c", f'umask {umask:03o} && exec "$@"', "sh", *argv,
    ]  # fmt: skip


def user_environ(user: User, env: Optional[Mapping[str, str]] = None) -> dict[str, str]:
    """``env`` (default: ``python_env()``) with the user's own HOME, USER and LOGNAME."""
    return {"HOME": str(user.home), "USER": user.name, "LOGNAME": user.name, **(env or python_env())}


def shell(user: User, script: str, **kwargs: object) -> subprocess.CompletedProcess[str]:
    """A ``sh -c`` script as ``user`` (see ``run``)."""
    return run(user, ["sh", "-c", script], **kwargs)  # type: ignore[arg-type]


def slurm_path(path: str) -> str:
    """``path`` with the cluster's client commands first: a release's wrappers (``$DDPJOB_SLURM_HOME/bin``, which
    ``scripts/slurm-local env`` puts first) enter its root filesystem, a user in a user namespace of her own
    (scripts/slurm-enter); /usr/sbin for the entry's ``pivot_root``."""
    wrappers = CLUSTER_HOME / "bin"
    if not wrappers.is_dir():
        return path
    parts = path.split(":")
    return ":".join([str(wrappers), *parts, *(d for d in ("/usr/sbin", "/sbin") if d not in parts)])


def slurm_env() -> dict[str, str]:
    """``python_env`` with the cluster's ``SLURM_CONF`` and client commands (``slurm_path``)."""
    conf = os.environ.get("SLURM_CONF", "/etc/slurm/slurm.conf")
    return python_env({"SLURM_CONF": conf, "PATH": slurm_path("/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin")})


def gateway_as(user: User) -> SlurmGateway:
    """ddpjob's Slurm gateway, its commands run as ``user``."""
    return SlurmGateway(lambda cmd: run(user, cmd, env=slurm_env(), timeout=60))
