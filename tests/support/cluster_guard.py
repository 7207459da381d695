"""Turns on the local cluster for tests, and keeps one cluster test's failure from becoming the next test's.

Most cluster tests size their jobs for an idle cluster (preemption fills both nodes, a drill targets a node, sweeps
and the 8-rank run take every CPU): they take the cluster alone. Tests marked ``cluster_shared`` submit small jobs
(at most 2 CPUs per node, no GPUs, nothing global) and may run beside one other shared test. ``turn`` is that
rule, as a reader-writer lock on a file beside the cluster's state (shared tests read, the others write) behind a
turnstile, so a waiting exclusive test is not starved by shared tests arriving after it. pytest-xdist runs the
cluster tests in two lanes (tests/conftest.py); most of the time a lane waits on Slurm, not on the CPU.

A job a failed test left behind, or a node Slurm drained or marked down, would make every following test wait out
its timeouts (once, in CI, ten tests of 300 s each). So before an exclusive test whatever is still queued gets a
short grace to finish, then is cancelled; before any cluster test nodes that are down or drained are resumed. Each
repair is printed with what Slurm said, so it shows in the test's output. After a failed cluster test its report
carries the cluster's state: the queue, the nodes and the controller's last lines.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import subprocess
import time
from pathlib import Path
from typing import Iterator, Mapping

from tests.support import faults

DEFAULT_HOME = Path("/var/tmp/ddpjob-slurm")


def cluster_home(env: Mapping[str, str]) -> Path:
    """The state dir of the cluster the tests talk to: DDPJOB_SLURM_HOME, else the one whose slurm.conf SLURM_CONF
    names (scripts/slurm-local writes it to <state dir>/etc/slurm.conf), else the default instance's."""
    if env.get("DDPJOB_SLURM_HOME"):
        return Path(env["DDPJOB_SLURM_HOME"])
    conf = Path(env.get("SLURM_CONF", ""))
    return conf.parent.parent if conf.parts[-2:] == ("etc", "slurm.conf") else DEFAULT_HOME


def instance_mismatch(env: Mapping[str, str]) -> str | None:
    """Why the client commands would reach another cluster than the one whose lock the tests take, or None.
    A second instance (scripts/slurm-local env) is reached through SLURM_CONF; without it the commands read
    /etc/slurm, the default instance's, whose jobs a test's cleanup would then cancel."""
    home = cluster_home(env)
    conf = env.get("SLURM_CONF")
    default = home.resolve() == DEFAULT_HOME.resolve()
    if conf and Path(conf).parent.parent != home and not (default and conf == "/etc/slurm/slurm.conf"):
        return f"SLURM_CONF={conf} is not the slurm.conf of DDPJOB_SLURM_HOME={home}"
    if not conf and not default:
        return f"DDPJOB_SLURM_HOME={home} without SLURM_CONF: Slurm's commands would reach the default cluster"
    return None


HOME = cluster_home(os.environ)
UNHEALTHY = ("down", "drain", "drng", "fail", "failg", "maint", "unk")
LOCK_FILES = ("tests.turnstile", "tests.lock")  # a user's pass needs them writable (tests/support/as_user.py)
LEFTOVER_GRACE_S = 30  # a cancelled or finishing job of the last test may still be completing


def _run(*cmd: str) -> str:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"({' '.join(cmd)}: {err})"
    return proc.stdout + proc.stderr


def queued() -> list[str]:
    return _run("squeue", "-h", "-o", "%i %P %j %T %M %R").strip().splitlines()


def unhealthy_nodes() -> dict[str, str]:
    """Node -> 'state: reason' for nodes that cannot take jobs."""
    out = {}
    for line in _run("sinfo", "-h", "-N", "-o", "%N|%t|%E").splitlines():
        node, state, reason = [*line.split("|"), "", ""][:3]
        if state.rstrip("*~#!%$@^-").lower() in UNHEALTHY or state.endswith("*"):
            out[node] = f"{state}: {reason}"
    return out


def _settle(timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not queued():
            return True
        time.sleep(0.5)
    return not queued()


@contextlib.contextmanager
def turn(shared: bool) -> Iterator[list[str]]:
    """Hold the cluster, alone or (``shared``) beside other shared tests, and heal it first; yields the repairs."""
    HOME.mkdir(parents=True, exist_ok=True)
    gate_name, lock_name = LOCK_FILES
    with open(HOME / gate_name, "a") as gate, open(HOME / lock_name, "a") as lock:
        fcntl.flock(gate, fcntl.LOCK_EX)  # in arrival order: a waiting exclusive test holds the gate
        try:
            fcntl.flock(lock, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
        finally:
            fcntl.flock(gate, fcntl.LOCK_UN)
        try:
            yield heal() if shared else make_idle()
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def make_idle() -> list[str]:
    """Bring the cluster to idle and healthy; returns what had to be repaired (empty when it already was)."""
    repairs = []
    if queued() and not _settle(LEFTOVER_GRACE_S):
        left = queued()
        repairs.append("cancelled jobs a previous test left: " + "; ".join(left))
        _run("scancel", "--me")
        if not _settle(60):
            repairs.append("still queued after scancel: " + "; ".join(queued()))
    return repairs + heal()


def heal() -> list[str]:
    """Resume nodes that are down or drained (a shared test must not cancel its neighbour's jobs)."""
    repairs = []
    for node, why in unhealthy_nodes().items():
        repairs.append(f"resumed node {node} ({why})")
        faults.resume_node(node)  # root's to do: a plain user's pass asks its broker
    if repairs:
        deadline = time.monotonic() + 30
        while unhealthy_nodes() and time.monotonic() < deadline:
            time.sleep(0.5)
    return repairs


def snapshot(lines: int = 40) -> str:
    """The queue, the nodes and the controller's last lines: what a failed cluster test's report carries."""
    log = HOME / "log" / "slurmctld.log"
    try:
        tail = log.read_text(errors="replace").splitlines()[-lines:]
    except OSError as err:  # none yet, or a plain user's pass (tests/support/as_user.py): the log is root's, 0600
        tail = [f"({log}: {err.strerror})"]
    return "\n".join([
        "$ squeue", *queued(),
        "$ sinfo -N", _run("sinfo", "-N", "-o", "%N %T %C %G %E").rstrip(),
        f"$ tail -{lines} {log}", *tail,
    ])  # fmt: skip
