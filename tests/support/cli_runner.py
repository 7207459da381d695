"""``ddpjob ARGS`` for the tests, the way a user runs it: as ``python -m jobs``, or, for the commands that import
torch on the login node, ddpjob's ``main`` in the test's own process, set up as that process would be.

Why in this process: ``submit``, ``sweep``, ``resume``, ``prepare`` and ``export`` import the user's task and
torch (to check the task and the strategy's cut of a meta-device model, or to read a checkpoint). As a process
each costs ~3 CPU-s of torch import on this 2-core machine, and the suite runs them ~150 times, in every pass: a
test process has torch imported already. Everything a process of its own would give the command is given here:
the working directory and the test's PYTHONPATH first on ``sys.path``, the environment with the test's additions, fresh
standard streams, logging as ``main`` configures it, an exit status, and a time limit. The modules the command
imported from outside the project and the venv (a test's own task module, say) are forgotten afterwards, so the
next test's module of the same name is imported afresh. A test about the process itself (its imports, its
signals) passes ``process=True``; ``--local`` runs always get a process (they train in it)."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import io
import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

from jobs import cli

IN_PROCESS = frozenset({"submit", "sweep", "resume", "prepare", "export", "pipeline"})
# Where the modules a command may import and this process keeps come from: the venv, Python's own, the project. The
# venv's site-packages by where torch is: a user's Debian python has it on PYTHONPATH, outside sys.prefix (as alice,
# tests/support/as_user.py), and a torch forgotten and imported again crashed her pytest in its garbage collection.
_TORCH = importlib.util.find_spec("torch")
_SITE = Path(_TORCH.origin).parents[1] if _TORCH and _TORCH.origin else Path(sys.prefix)
KEEP = tuple(str(Path(p).resolve()) for p in (sys.prefix, sys.base_prefix, _SITE, Path(__file__).parents[2]))


def run(
    args: Sequence[str], cwd: Path, timeout: float, env: dict[str, str], process: bool
) -> subprocess.CompletedProcess[str]:
    """What ``subprocess.run`` of ``python -m jobs ARGS`` would return (``process`` forces that)."""
    if process or not args or args[0] not in IN_PROCESS or "--local" in args:
        return subprocess.run(
            [sys.executable, "-m", "jobs", *args],
            cwd=cwd, capture_output=True, text=True, timeout=timeout, env={**os.environ, **env},
        )  # fmt: skip
    out, err = io.StringIO(), io.StringIO()
    with as_a_process(cwd, env), time_limit(args, timeout):
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = cli.main(list(args))
            except SystemExit as exit_:  # argparse's errors (2), as the process would exit
                code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    return subprocess.CompletedProcess(["ddpjob", *args], code, out.getvalue(), err.getvalue())


@contextlib.contextmanager
def as_a_process(cwd: Path, env: dict[str, str]) -> Iterator[None]:
    """The working directory, ``sys.path``, environment and root logger a ``python -m jobs`` run in ``cwd`` would
    start with, restored afterwards; modules imported from elsewhere than the venv and the project forgotten."""
    saved_env, saved_path, saved_dir = dict(os.environ), list(sys.path), os.getcwd()
    root = logging.getLogger()
    saved_handlers, saved_level = list(root.handlers), root.level
    modules = set(sys.modules)
    os.environ.update(env)
    os.chdir(cwd)
    # `python -m` puts the working directory first on sys.path, then the environment's PYTHONPATH
    sys.path[0:0] = [str(Path(cwd).resolve()), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    importlib.invalidate_caches()  # folders and modules the test just wrote
    root.handlers = []  # main's logging.basicConfig then writes to this command's stderr, as in its own process
    try:
        yield
    finally:
        os.chdir(saved_dir)
        os.environ.clear()
        os.environ.update(saved_env)
        sys.path[:] = saved_path
        root.handlers, root.level = saved_handlers, saved_level
        for name in set(sys.modules) - modules:
            module = sys.modules[name]  # a namespace package has no __file__, only its folders
            origin = getattr(module, "__file__", None) or next(iter(getattr(module, "__path__", None) or []), None)
            if origin and not str(Path(origin).resolve()).startswith(KEEP):
                del sys.modules[name]


@contextlib.contextmanager
def time_limit(args: Sequence[str], timeout: float) -> Iterator[None]:
    """``subprocess.run``'s timeout for a command in this process: SIGALRM raises in the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum: int, frame: object) -> None:
        raise subprocess.TimeoutExpired(["ddpjob", *args], timeout)

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def run_cli(
    *args: str, cwd: Path, timeout: float = 300, env: dict[str, str] | None = None, process: bool = False
) -> subprocess.CompletedProcess[str]:
    """Run ``ddpjob ARGS`` the way a user would, from ``cwd`` (``env`` adds to the environment): the commands that
    import torch in this test's process, set up as their own would be, others (and ``process=True``) as
    ``python -m jobs`` (see ``run`` above)."""
    return run(args, cwd, timeout, env or {}, process)


def field(output: str, name: str) -> str:
    """The value of a ``name: value`` line the CLI printed."""
    for line in output.splitlines():
        if line.startswith(f"{name}:"):
            return line.split(":", 1)[1].strip()
    raise AssertionError(f"no '{name}:' line in output:\n{output}")
