"""A task's signals from its first instruction: the warning signal and SIGTERM are held, never fatal, until a handler
takes them.

Slurm signals a job's tasks whenever its timer or a preemption says so, and that includes the first second of an
attempt, while the ranks are still starting Python, importing torch, or running submitit's bootstrap. Until a
handler is installed, the default action of USR1/USR2/TERM ends the process: both ranks died of USR2 1.1 s into a
requeued attempt, and the run was lost (``srun: error: n1: tasks 0-1: User defined signal 2``).

So every task starts behind ``task_prefix``: GNU env's ``--block-signal`` (coreutils 8.31 and later) blocks the two
signals and execs the interpreter, and a blocked signal stays pending across ``execve``. The window left is env's own
start before it blocks them (its whole run, fork to exit, took 4 ms on a loaded 2-core VM), against the seconds of
Python's. Where env lacks the option (RHEL 8's coreutils 8.30), a bare ``python -I -S -c`` does the same before the
real interpreter starts (a window of its start: 20 ms there, against 73 ms for a plain ``python -c pass``).

Who releases them, once a handler is up (a pending signal is then delivered at once, to that handler):

- the trainer and ``ddp_core.runtime``: ``preemption.StopFlag``, right after installing its handlers (``install``:
  ddpjob's own handlers, never taken for a script's);
- script mode: ``ddp_core.script.deferred``: a plain script keeps the warning signal held (instead of dying of an
  early warning it runs on to the time limit, or, if it resumes itself, ``when_held`` requeues it), and the handler
  a framework installs (Lightning's requeue on USR1, a submitit-style handler) is called at an optimizer step every
  rank agrees on. SIGTERM keeps its default for a plain script: released just before the script runs.

At the other end, ``ignore_from_now``: once an attempt's outcome is recorded, a signal is ignored until the process
exits (Python's teardown would otherwise restore the default action for its last milliseconds).

The signal mask is per thread and inherited by threads and children: a thread started while the signals are held
keeps them held (torchrun's agent thread, whose workers then start held too, ``ddp_core.script.torchrun``).
Torch-free.
"""

from __future__ import annotations

import functools
import shutil
import signal
import subprocess
import threading
import time
from typing import Any, Callable, Union

Handler = Union[Callable[[int, Any], Any], int, signal.Handlers, None]

# Blocks the held signals, then execs its arguments: the fallback for an env without --block-signal.
_BOOTSTRAP = "import os,signal,sys;signal.pthread_sigmask(signal.SIG_BLOCK,{%d,%d});os.execvp(sys.argv[1],sys.argv[1:])"


def warning_signal(name: str) -> signal.Signals:
    """``slurm.signal``'s value (``USR2``, ``SIGUSR1``, ``usr1``) as a signal."""
    return signal.Signals[f"SIG{name.upper().removeprefix('SIG')}"]


def held(warning: str) -> tuple[signal.Signals, signal.Signals]:
    """The signals a task holds until a handler takes them: the warning signal and SIGTERM."""
    return warning_signal(warning), signal.SIGTERM


@functools.cache
def env_blocks_signals() -> bool:
    """Whether this machine's ``env`` has ``--block-signal`` (GNU coreutils 8.31+). Asked on the login node, where
    the task command is rendered: compute nodes run the same OS image on the clusters we know of (``ddpjob doctor``
    reports which prefix jobs get, ``held_signals``)."""
    env = shutil.which("env")
    if env is None:
        return False
    try:
        return subprocess.run([env, "--block-signal=TERM", "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def task_prefix(warning: str, python: str) -> list[str]:
    """What goes in front of ``python ...`` in every task's command line, so that the task holds ``held(warning)``
    from its first instruction (module docstring)."""
    sigs = held(warning)
    if env_blocks_signals():
        return ["env", *(f"--block-signal={sig.name.removeprefix('SIG')}" for sig in sigs)]
    return [python, "-I", "-S", "-c", _BOOTSTRAP % (sigs[0].value, sigs[1].value)]


# The real ``signal.signal``, whatever script mode puts in its place later (``ddp_core.script.deferred``): ddpjob's
# own handlers are installed with it, never taken for a script's.
install = signal.signal


def release(*sigs: int) -> None:
    """Unblock ``sigs`` in this thread, once their handlers are installed: one already pending is handled now."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, set(sigs))


def ignore_from_now(warning: str) -> None:
    """The attempt's outcome is recorded: from here to the process's end neither signal can change it. Ignored, as
    an ignored disposition survives interpreter teardown, which puts handled signals back to their default (a
    warning in the last moment of a finished attempt killed both ranks, and Slurm called the job FAILED)."""
    for sig in held(warning):
        install(sig, signal.SIG_IGN)


def hold(*sigs: int) -> None:
    """Block ``sigs`` in this thread again: one that arrives stays pending until ``release``."""
    signal.pthread_sigmask(signal.SIG_BLOCK, set(sigs))


def when_held(sig: int, act: Callable[[], None], grace_s: float = 2.0, poll_s: float = 0.5) -> threading.Thread:
    """Script mode, rank 0 of a plain script that resumes itself (``script.resume_args``): calls ``act`` once, from a
    daemon thread, when ``sig`` has stayed pending for ``grace_s`` with no handler of the script's (held by
    script mode: the script would run on into the time limit). The grace lets a framework that installs
    its handler late take the signal first. Start it from a thread that holds ``sig`` (and SIGTERM): the thread
    inherits the mask, so the kernel never delivers either to it."""

    def watch() -> None:
        since = None
        while True:
            time.sleep(poll_s)
            if sig not in signal.sigpending() or callable(signal.getsignal(sig)):
                since = None
                continue
            since = since if since is not None else time.monotonic()
            if time.monotonic() - since >= grace_s:
                act()
                return

    thread = threading.Thread(target=watch, name="held-warning", daemon=True)
    thread.start()
    return thread
