"""The kernel's OOM killer read from its log (``ddp_core.cluster.oom_log``) and the failure it makes of a SIGKILLed
task (``failures.diagnose``). The records are the kernel's own lines, as /dev/kmsg gave them on this machine; the
real kill, through Slurm, is tests/cluster/test_memory_fit.py's."""

from __future__ import annotations

import os
import time

from ddp_core.cluster.env import DistEnv
from ddp_core.cluster.failures import Kind, TaskEnd, diagnose
from ddp_core.cluster.oom_log import Kill, kills, note_pid, read, reader, records

UID = os.getuid()


def kmsg(at: float, message: str) -> str:
    return f"6,1349,{int(at * 1e6)},-;{message}\n"


def memcg_kill(at: float, pid: int, cgroup: str, uid: int = UID) -> str:
    return (
        kmsg(at, "memory: usage 262144kB, limit 262144kB, failcnt 42")
        + kmsg(at, f"oom-kill:constraint=CONSTRAINT_MEMCG,nodemask=(null),cpuset=/,mems_allowed=0,oom_memcg={cgroup},"
                   f"task_memcg={cgroup},task=python3,pid={pid},uid={uid}")
        + " SUBSYSTEM=memory\n"
        + kmsg(at, f"Memory cgroup out of memory: Killed process {pid} (python3) total-vm:610156kB, anon-rss:154004kB, "
                   f"file-rss:79068kB, shmem-rss:0kB, UID:{uid} pgtables:728kB oom_score_adj:0")
    )  # fmt: skip


GLOBAL = kmsg(
    50.0, f"Out of memory: Killed process 77 (python) total-vm:9kB, anon-rss:1024kB, file-rss:1024kB, UID:{UID} x"
)


def test_the_kills_are_read_with_their_cgroup_resident_memory_and_limit(tmp_path):
    log = tmp_path / "kmsg"
    log.write_text(memcg_kill(10.5, 12986, "/slurm_n1/uid_0/job_42/step_0/task_1") + GLOBAL)
    first, second = kills(records(str(log)))
    assert first == Kill(12986, "python3", 154004 + 79068, UID, 10.5, "/slurm_n1/uid_0/job_42/step_0/task_1",
                         "Memory cgroup out of memory", 262144)  # fmt: skip
    assert first.said() == (
        "killed by the kernel's OOM killer: resident 227 MiB at the kill, a memory cgroup's limit of 256 MiB (kernel "
        "log: Memory cgroup out of memory: Killed process 12986 (python3))"
    )
    assert (second.pid, second.limit_kib, second.cgroup) == (77, None, "")  # the node's memory: no cgroup's report
    assert second.said().startswith("killed by the kernel's OOM killer: resident 2 MiB at the kill, the node's ")
    assert records(str(tmp_path / "absent")) == []  # unreadable (dmesg_restrict for a plain user): nothing said


def test_only_this_users_kills_since_the_step_began_and_none_of_another_job(tmp_path):
    log = tmp_path / "kmsg"
    log.write_text(
        memcg_kill(5.0, 1, "/ddpjob-test")  # before the step
        + memcg_kill(20.0, 2, "/ddpjob-test", uid=UID + 1)  # another user's
        + memcg_kill(21.0, 3, "/slurm/uid_0/job_7/step_0/task_0")  # another job's
        + memcg_kill(22.0, 4, "/slurm/uid_0/job_42/step_0/task_1")
        + memcg_kill(23.0, 5, "/ddpjob-test")  # no job in its path: a node's own limit
    )
    assert [k.pid for k in read(10.0, "42", str(log)).kills] == [4, 5]


def test_a_task_sigkilled_is_out_of_memory_only_where_the_log_has_the_kill_of_the_pid_its_rank_noted(
    tmp_path, monkeypatch
):
    log, slurm = tmp_path / "kmsg", tmp_path / "slurm"
    slurm.mkdir()
    log.write_text(memcg_kill(20.0, 4242, "/ddpjob-test") + memcg_kill(21.0, 777, "/ddpjob-test"))
    monkeypatch.setenv("SLURMD_NODENAME", "n1")
    monkeypatch.setattr(os, "getpid", lambda: 4242)
    note_pid(slurm, DistEnv(rank=1, slurm_job_id="42"))
    assert (slurm / "42_1.pid").read_text() == "4242\n"
    (slurm / "42_0.pid").write_text("999\n")  # rank 0's process: not killed by the OOM killer
    started = time.time() - time.clock_gettime(time.CLOCK_MONOTONIC) + 10.0  # 10 s after boot, as a wall time
    kernel = reader(slurm, started, "42", str(log))
    assert kernel is not None and reader(slurm, None, "42") is None
    killed = [TaskEnd("n1", 0, "Killed"), TaskEnd("n1", 1, "Killed")]
    memory = diagnose([], killed, 137, 5, kernel=kernel)
    assert (memory.kind, memory.rank, memory.host, memory.step) == (Kind.memory, 1, "n1", 5)
    assert memory.error.startswith("killed by the kernel's OOM killer: resident 227 MiB at the kill, a memory cgroup")
    for ends in ([TaskEnd("n1", 0, "Killed")], [TaskEnd("n2", 1, "Killed")], [TaskEnd("n1", 1, "Segmentation fault")]):
        signal = diagnose([], ends, 137, 5, kernel=kernel)  # another pid; another node's task; not a SIGKILL
        assert signal.kind is Kind.infrastructure and signal.error.startswith("killed by a signal ("), signal
    # script.launcher=torchrun: the agent is the task, and reports its worker's signal in a rank_failed event.
    agent = {"event": "rank_failed", "rank": 1, "host": "n1", "step": None, "kind": "infrastructure",
             "error": "killed by a signal (SIGKILL)", "signal": "SIGKILL", "t": 1.0}  # fmt: skip
    assert diagnose([agent], [], 1, None, kernel=kernel).kind is Kind.memory
    assert diagnose([{**agent, "rank": 0}], [], 1, None, kernel=kernel).error == agent["error"]
