"""The kernel's OOM killer, read from the kernel's log where this process may read it (``/dev/kmsg``: root, or a
node with ``kernel.dmesg_restrict=0``).

A rank the OOM killer ends dies of SIGKILL, which srun reports as ``task 1: Killed``, the words of a rank killed
by anyone. Where Slurm limits memory its cgroup's handler says so itself (``failures.LIMIT_KILLED``); where nothing
does (no cgroup plugin, or a limit that is not Slurm's), only the kernel's log tells the two apart: ``Out of memory:
Killed process PID (NAME) total-vm:..., anon-rss:...`` (``Memory cgroup out of memory: ...`` under a cgroup's
limit), after an ``oom-kill:`` line that names the process's cgroup and user. Each rank of a Slurm job notes its
pid where the watcher finds it (``note_pid``: ``RUN/slurm/<job>_<rank>.pid``, rewritten by each job step), and a
killed task is out of memory only if the log has the kill of that pid, of this user, since the step began, and of
no other job's (a Slurm cgroup path ``job_<id>`` names its job). Only this node's log can be read: a rank killed
on another node stays a signal's kill.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Optional

from ddp_core.cluster.env import DistEnv

KMSG = "/dev/kmsg"
KILLED = re.compile(
    r"(?P<scope>Out of memory|Memory cgroup out of memory): Killed process (?P<pid>\d+) \((?P<name>[^)]*)\) "
    r"total-vm:\d+kB, anon-rss:(?P<anon>\d+)kB, file-rss:(?P<file>\d+)kB.*UID:(?P<uid>\d+)"
)
DETAIL = re.compile(r"^oom-kill:.*?(?:task_memcg=(?P<cgroup>[^,]*),)?task=[^,]*,pid=(?P<pid>\d+),uid=\d+")
JOB = re.compile(r"/job_(\d+)(?:/|$)")
LIMIT = re.compile(r"^memory: usage \d+kB, limit (?P<limit>\d+)kB")  # a memory cgroup's report, before its kill


@dataclass(frozen=True)
class Kill:
    """One process the kernel's OOM killer ended: its pid, name, resident memory then, and where (``scope``: the
    node's memory, or a memory cgroup's limit)."""

    pid: int
    name: str
    resident_kib: int
    uid: int
    at: float  # seconds since boot (the log's clock: CLOCK_MONOTONIC)
    cgroup: str = ""
    scope: str = "Out of memory"
    limit_kib: Optional[int] = None  # a memory cgroup's limit; None: the node's memory (``MemTotal``)

    def said(self) -> str:
        of = f"a memory cgroup's limit of {self.limit_kib // 1024} MiB" if self.limit_kib else f"the node's {node()}"
        return (
            f"killed by the kernel's OOM killer: resident {self.resident_kib // 1024} MiB at the kill, {of} "
            f"(kernel log: {self.scope}: Killed process {self.pid} ({self.name}))"
        )


def node() -> str:
    """This node's memory, as ``/proc/meminfo`` says it."""
    try:
        found = re.search(r"^MemTotal:\s+(\d+) kB", Path("/proc/meminfo").read_text(), re.M)
    except OSError:
        found = None
    return f"{int(found[1]) // 1024} MiB" if found else "memory"


@dataclass(frozen=True)
class KernelLog:
    """The kills ``read`` found, on the node whose log it is (``hosts``: Slurm's name for it and its hostname)."""

    hosts: frozenset[str]
    kills: list[Kill] = field(default_factory=list)


def records(path: str = KMSG) -> list[tuple[float, str]]:
    """The kernel log's records (seconds since boot, message); none where it cannot be read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return []
    found: list[tuple[float, str]] = []
    try:
        while True:
            try:
                raw = os.read(fd, 8192)  # /dev/kmsg: one record per read
            except BlockingIOError:  # the end of the buffer
                break
            except OSError:  # EPIPE: a record overwritten while reading; the next read goes on
                continue
            if not raw:
                break
            for line in raw.decode(errors="replace").splitlines():  # a record, and its " KEY=VALUE" lines
                head, _, message = line.partition(";")
                parts = head.split(",")
                if len(parts) >= 3 and parts[2].isdigit():
                    found.append((int(parts[2]) / 1e6, message))
    finally:
        os.close(fd)
    return found


def kills(lines: list[tuple[float, str]]) -> list[Kill]:
    """The OOM killer's kills in the log's records, each with the cgroup its ``oom-kill:`` line named."""
    cgroups: dict[int, str] = {}
    found, limit = [], None
    for at, message in lines:
        if (detail := DETAIL.match(message)) is not None:
            cgroups[int(detail["pid"])] = detail["cgroup"] or ""
        elif (reported := LIMIT.match(message)) is not None:
            limit = int(reported["limit"])
        elif (m := KILLED.search(message)) is not None:
            pid, resident, cgroup = int(m["pid"]), int(m["anon"]) + int(m["file"]), m["scope"] != "Out of memory"
            kill = Kill(pid, m["name"], resident, int(m["uid"]), at, cgroups.get(pid, ""), m["scope"])
            found.append(replace(kill, limit_kib=limit if cgroup else None))
            limit = None
    return found


def read(since: float, job_id: Optional[str], path: str = KMSG) -> KernelLog:
    """This node's kills since ``since`` (seconds since boot) of processes of this user, none of another job's."""
    uid = os.getuid()

    def ours(kill: Kill) -> bool:
        job = JOB.search(kill.cgroup)
        return kill.uid == uid and kill.at >= since and (job is None or job[1] == job_id)

    hosts = frozenset({os.environ.get("SLURMD_NODENAME") or "", socket.gethostname()} - {""})  # srun's, an agent's
    return KernelLog(hosts, [k for k in kills(records(path)) if ours(k)])


def since_boot(wall: float) -> float:
    """A wall-clock time (``time.time()``'s) on the log's clock: seconds since boot."""
    return wall - time.time() + time.clock_gettime(time.CLOCK_MONOTONIC)


def pid_file(slurm_folder: Path, job_id: str, rank: int) -> Path:
    return slurm_folder / f"{job_id}_{rank}.pid"


def note_pid(slurm_folder: Path, env: DistEnv) -> None:
    """This rank's pid, where the watcher looks for it if a task is killed (``reader``); a Slurm job's ranks only."""
    if env.slurm_job_id:
        with contextlib.suppress(OSError):  # a rank is not stopped for it: its kill then reads as a signal's
            pid_file(slurm_folder, env.slurm_job_id, env.rank).write_text(f"{os.getpid()}\n")


Question = Callable[[str, int], Optional[Kill]]  # a SIGKILLed task's host and rank -> the OOM killer's kill of it


def reader(slurm_folder: Path, started: Optional[float], job_id: Optional[str], path: str = KMSG) -> Optional[Question]:
    """What ``failures.diagnose`` asks of a task killed by SIGKILL: the OOM killer's kill of the pid its rank noted
    (``note_pid``) in this node's log (read once, at the first question), since ``started`` (a wall-clock time: the
    allocation's start, the trial step's launch); None when that is not known."""
    if started is None or not job_id:
        return None
    logs: list[KernelLog] = []

    def kill_of(host: str, rank: int) -> Optional[Kill]:
        if not logs:
            logs.append(read(since_boot(started) - 1.0, job_id, path))  # the two clocks: a second apart at most
        try:
            pid = int(pid_file(slurm_folder, job_id, rank).read_text())
        except (OSError, ValueError):
            return None
        return next((k for k in reversed(logs[0].kills) if k.pid == pid), None) if host in logs[0].hosts else None

    return kill_of
