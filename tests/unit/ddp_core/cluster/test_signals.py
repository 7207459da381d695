"""A task holds the warning signal and SIGTERM from its first instruction until a handler takes them (cluster.signals).

Each case runs a real process, started the way a Slurm task is (``task_prefix``), signalled with ``os.kill`` while it
holds the signal: it must survive, and the handler installed later must receive the signal that was held.
"""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from ddp_core.cluster import signals

# Sends itself the warning signal while it is held, then shows what happens once ``SETUP`` has run.
CHILD = """
import os, signal, sys, time
from ddp_core.cluster import signals
blocked = lambda sig: int(open("/proc/self/status").read().split("SigBlk:")[1].split()[0], 16) >> (sig - 1) & 1
print("held at start:", blocked(signal.SIGUSR2), blocked(signal.SIGTERM), flush=True)
os.kill(os.getpid(), signal.SIGUSR2)
time.sleep(0.2)
print("alive while held", flush=True)
{setup}
time.sleep(0.2)
print("done", flush=True)
"""


# Script mode's interception of the warning signal (ddp_core.script.deferred), for a lone process: its handler runs at
# once, as Python would run it.
INTERCEPT = (
    "import tempfile\nfrom pathlib import Path\n"
    "from ddp_core.cluster.env import DistEnv\n"
    "from ddp_core.config import load_config\n"
    "from ddp_core.run.rundir import RunDir\n"
    "from ddp_core.script.deferred import DeferredWarning\n"
    "cfg = load_config(None, ['run.name=held', 'slurm.signal=USR2'])\n"
    "DeferredWarning(cfg, RunDir(Path(tempfile.mkdtemp())), DistEnv.from_env({}), lambda *a: 0).intercept()\n"
)


def run_held(setup: str) -> str:
    """``CHILD`` started as a Slurm task is (``task_prefix``); returns its output."""
    command = [*signals.task_prefix("USR2", sys.executable), sys.executable, "-c", CHILD.format(setup=setup)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "held at start: 1 1\nalive while held\n" in proc.stdout, proc.stdout + proc.stderr
    return proc.stdout


def test_a_held_warning_reaches_the_stop_flag_once_it_is_installed():
    out = run_held(
        "from ddp_core.cluster.preemption import StopFlag\n"
        "flag = StopFlag('USR2')\n"
        "time.sleep(0.05)\n"
        "print('received', flag.received, flush=True)"
    )
    assert f"received {int(signal.SIGUSR2)}\n" in out


def test_the_python_bootstrap_holds_where_env_cannot(monkeypatch):
    monkeypatch.setattr(signals.shutil, "which", lambda name: None)  # no env at all: the bootstrap is used
    signals.env_blocks_signals.cache_clear()
    try:
        prefix = signals.task_prefix("USR2", sys.executable)
    finally:
        signals.env_blocks_signals.cache_clear()
    assert prefix[:3] == [sys.executable, "-I", "-S"]
    proc = subprocess.run([*prefix, sys.executable, "-c", CHILD.format(setup="")], capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    assert proc.returncode == 0 and "held at start: 1 1\nalive while held\ndone\n" in proc.stdout, proc.stderr


def test_script_mode_gives_a_held_warning_to_the_handler_a_framework_installs():
    """As Lightning does: it installs its handler only where none is set, and getsignal says none is."""
    out = run_held(
        INTERCEPT + "print('disposition', signal.getsignal(signal.SIGUSR2) == signal.SIG_DFL, flush=True)\n"
        "handler = lambda s, f: got.append(s)\n"
        "got = []\n"
        "signal.signal(signal.SIGUSR2, handler)\n"
        "time.sleep(0.05)\n"
        "print('handled', got, signal.getsignal(signal.SIGUSR2) is handler, flush=True)\n"
        "signal.signal(signal.SIGUSR2, signal.SIG_DFL)  # the framework's teardown: never fatal again\n"
        "os.kill(os.getpid(), signal.SIGUSR2)\n"
        "time.sleep(0.1)\n"
        "print('survived', signal.getsignal(signal.SIGUSR2) == signal.SIG_DFL, got, flush=True)\n"
        "previous = signal.signal(signal.SIGUSR2, handler)  # a second fit(): it gets the one that came meanwhile\n"
        "time.sleep(0.05)\n"
        "print('handled', got, previous == signal.SIG_DFL, flush=True)  # the default it put back, not ddpjob's\n"
    )
    usr2 = int(signal.SIGUSR2)
    expected = f"disposition True\nhandled [{usr2}] True\nsurvived True [{usr2}]\nhandled [{usr2}, {usr2}] True\ndone\n"
    assert expected in out


def test_a_plain_script_keeps_the_warning_held():
    out = run_held(INTERCEPT + "os.kill(os.getpid(), signal.SIGUSR2)")
    assert out.endswith("done\n")


@pytest.mark.parametrize("sig", [signal.SIGUSR2, signal.SIGTERM])
def test_after_the_outcome_a_signal_is_ignored_to_the_end(sig):
    """Python's teardown puts handled signals back to their default: a finished attempt must not die of one there."""
    proc = subprocess.run([sys.executable, "-c", (
        "import os, signal\n"
        "from ddp_core.cluster.preemption import StopFlag\n"
        "from ddp_core.cluster import signals\n"
        "flag = StopFlag('USR2')\n"
        "signals.ignore_from_now('USR2')\n"
        f"os.kill(os.getpid(), {int(sig)})\n"
        "print('survived', flag.received)\n"
    )], capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 0 and proc.stdout == "survived 0\n", proc.stderr


def test_a_held_warning_with_no_handler_is_acted_on_once_after_the_grace():
    """when_held (script mode, a plain script that resumes itself): the held warning is acted on once it has stayed
    pending for the grace with no handler; a framework that installs its handler within the grace gets it instead."""
    out = run_held(
        INTERCEPT + "acted = []\n"
        "signals.when_held(signal.SIGUSR2, lambda: acted.append(time.monotonic()), grace_s=0.3, poll_s=0.05)\n"
        "time.sleep(1.0)\n"
        "print('acted', len(acted), 'still held', signal.SIGUSR2 in signal.sigpending(), flush=True)"
    )
    assert "acted 1 still held True\n" in out
    out = run_held(
        INTERCEPT + "acted, got = [], []\n"
        "signals.when_held(signal.SIGUSR2, lambda: acted.append(1), grace_s=0.5, poll_s=0.05)\n"
        "time.sleep(0.1)\n"
        "signal.signal(signal.SIGUSR2, lambda s, f: got.append(s))\n"
        "time.sleep(0.8)\n"
        "print('acted', len(acted), 'handled', len(got), flush=True)"
    )
    assert "acted 0 handled 1\n" in out
