"""pytest itself as an unprivileged user (issue 54: the cluster tests run as a user, not root).

``.venv/bin/python -m tests.support.as_user [pytest args]``, as root, with the cluster's environment
(``eval "$(scripts/slurm-local env)"``): creates the user (``DDPJOB_TEST_USER``, default ``alice``:
``ddpjob-alice``) if missing and execs ``/usr/bin/python3 -m pytest ARGS`` under her real uid, gid and groups
(``users.command``), so every job the tests submit is hers and Slurm and the kernel refuse what she may not do. Root
is needed only to get there; nothing runs as root after the exec, and she gets no sudo.

What she needs, and why each piece is here: Debian's python with the venv's site-packages and the checkout on
``PYTHONPATH`` (``users.python_env``: the venv's own python lives under ``/root``); her own ``HOME``; pytest's
``--basetemp`` and cache in a folder she owns (``/var/tmp/ddpjob-pytest-<user>-<instance>``: tmp_path, the cached
reference runs); the cluster's ``SLURM_CONF``, ``DDPJOB_SLURM_HOME`` and ``PATH``; and the cluster guard's lock files
beside the cluster's state opened for writing (``tests/support/cluster_guard.py``: root creates them, mode 0666). The
faults the tests inject from outside (a killed or frozen node, a stopped slurmdbd) need root: before the exec a root
fault broker is forked for her (``tests/support/faults.py``: a fixed set of ``scripts/slurm-local`` subcommands on a
socket only she can reach), and its socket is in her environment.

On 24.11 and 26.05 her pytest runs here as on 22.05: the release's client wrappers (first on her ``PATH``) enter its
root filesystem in a user namespace of hers (scripts/slurm-enter), and her jobs' steps run there with Debian's python,
which the site profile binds into the tree (docs/local-cluster.md, "Running the tests as a user").
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from tests.support import cluster_guard, faults, users
from tests.support.helpers import ROOT

# What the tests read from the caller's environment (scripts/test's and the cluster's); everything else is dropped.
PASSED = ("SLURM_CONF", "DDPJOB_SLURM_HOME", "DDPJOB_REQUIRE_SLURM", "DDPJOB_FUZZ_SCALE", "PYTEST_ADDOPTS", "TERM")


def prepare(user: users.User) -> Path:
    """Her folder for pytest's temporary files and cache, one per cluster instance (scripts/test runs her passes of
    several releases at once, and pytest empties its --basetemp at start), and the cluster guard's files she must
    lock."""
    folder = Path(f"/var/tmp/ddpjob-pytest-{user.name}-{cluster_guard.HOME.name}")
    folder.mkdir(mode=0o700, exist_ok=True)
    os.chown(folder, user.uid, user.gid)
    cluster_guard.HOME.mkdir(parents=True, exist_ok=True)
    for name in cluster_guard.LOCK_FILES:
        path = cluster_guard.HOME / name
        path.touch()
        path.chmod(0o666)
    return folder


def environment(user: users.User, broker: Path) -> dict[str, str]:
    env = users.python_env({k: os.environ[k] for k in PASSED if k in os.environ})
    env[faults.BROKER_ENV] = str(broker)
    env["PATH"] = users.slurm_path(env["PATH"])
    return users.user_environ(user, env)


def main(argv: list[str]) -> None:
    if os.geteuid() != 0:
        sys.exit("tests.support.as_user: run it as root (it creates the user and drops to her)")
    if mismatch := cluster_guard.instance_mismatch(os.environ):
        sys.exit(f'tests.support.as_user: {mismatch}: eval "$(scripts/slurm-local env)" first')
    user = users.ensure(os.environ.get("DDPJOB_TEST_USER", "alice"))
    folder = prepare(user)
    pytest = [users.SYSTEM_PYTHON, "-m", "pytest", f"--basetemp={folder / 'basetemp'}",
              "-o", f"cache_dir={folder / 'cache'}", *argv]  # fmt: skip
    os.chdir(ROOT)
    cmd = users.command(user, pytest)
    broker, _ = faults.start_broker(user.uid, user.gid)  # root's, with the caller's cluster environment
    os.execvpe(cmd[0], cmd, environment(user, broker))


if __name__ == "__main__":
    main(sys.argv[1:])
