"""The failure table (ddp_core.cluster.failures) and what the batch script's watcher reads (cluster.supervise).

The jobs that fail for real, requeue and resume are in tests/cluster/test_preemption.py and
tests/cluster/test_slurm_jobs.py.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ddp_core.cluster import failures, node_loss, supervise
from ddp_core.cluster.env import DistEnv
from ddp_core.cluster.exits import ExitCode
from ddp_core.cluster.failures import Kind, TaskEnd, classify, describe, diagnose, srun_task_ends
from ddp_core.cluster.slurm import SlurmGateway, gateway_for
from ddp_core.config import SlurmConfig, load_config
from ddp_core.errors import DdpJobError
from ddp_core.run.rundir import RunDir
from jobs.submission.request import SlurmRequest
from tests.support.helpers import ROOT

CPU_OOM = "DefaultCPUAllocator: can't allocate memory: you tried to allocate 4294967296 bytes. Error code 12"
GLOO_PEER = "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.1.2]:29500"


@pytest.mark.parametrize(
    ("err", "kind"),
    [
        (ValueError("bad batch"), Kind.user),
        (KeyError("labels"), Kind.user),
        (ModuleNotFoundError("No module named 'mytask'"), Kind.user),
        (DdpJobError("the training loss became nan by step 40", "lower optim.lr"), Kind.user),
        (FileNotFoundError(errno.ENOENT, "No such file", "/data/train.bin"), Kind.user),
        (RuntimeError(GLOO_PEER), Kind.infrastructure),
        (dist.DistBackendError("NCCL communicator was aborted on rank 3"), Kind.infrastructure),
        (ConnectionResetError(errno.ECONNRESET, "Connection reset by peer"), Kind.infrastructure),
        (OSError(errno.EIO, "Input/output error"), Kind.infrastructure),
        (RuntimeError("CUDA error: uncorrectable ECC error encountered"), Kind.infrastructure),
        (RuntimeError("something odd in a C++ extension"), Kind.unknown),
        (MemoryError(), Kind.memory),  # Python's own: the host's
        (RuntimeError(f"[enforce fail at alloc_cpu.cpp:127] err == 0. {CPU_OOM}"), Kind.memory),
        (RuntimeError("DataLoader worker (pid 4242) is killed by signal: Killed. "), Kind.memory),
        (OSError(errno.ENOMEM, "Cannot allocate memory"), Kind.memory),  # a worker's fork refused
        (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), Kind.memory),
    ],
)
def test_classify(err, kind):
    assert classify(err) is kind


def test_a_memory_failure_says_whose_memory_ran_out():
    """Host memory (the CPU allocator, a loader worker, a memory limit's kill) told apart from a device's."""
    from ddp_core.cluster.failures import LIMIT_KILLED, memory_side

    host = ["RuntimeError: DefaultCPUAllocator: can't allocate memory", "MemoryError", LIMIT_KILLED,
            "RuntimeError: DataLoader worker (pid 4242) is killed by signal: Killed.",
            "out of memory: a task's peak 150 MiB of the job's 308M (slurm.mem_gb=0.3)"]  # fmt: skip
    device = ["OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 39.4 GiB total capacity)"]
    assert [memory_side(e) for e in host + device] == ["host"] * len(host) + ["device"] * len(device)


def test_describe_keeps_the_first_line_and_cuts_long_messages():
    assert describe(ValueError("first\nsecond")) == "ValueError: first"
    assert describe(RuntimeError()) == "RuntimeError"
    long = describe(RuntimeError("x" * 1000), limit=50)
    assert len(long) == 50 and long.endswith("...")


SRUN = """\
12:01:02 [rank 0/2] INFO ddp_core: step 40
srun: error: n2: task 1: Killed
srun: launch/slurm: _step_signal: Terminating StepId=57.0
srun: error: n1: tasks 0,2-3: Exited with exit code 1
srun: error: n1: task 4: Terminated
"""


def test_srun_report_names_the_task_killed_by_a_signal():
    ends = srun_task_ends(SRUN.splitlines())
    assert ends == [
        TaskEnd("n2", 1, "Killed"),
        TaskEnd("n1", 0, "Exited with exit code 1"),
        TaskEnd("n1", 4, "Terminated"),
    ]
    assert [e.by_signal for e in ends] == [True, False, False]


def rank_failed(rank, kind, error, step=40, t=1.0, host="n1"):
    return {"event": "rank_failed", "rank": rank, "host": host, "kind": kind, "error": error, "step": step, "t": t}


def test_diagnose_prefers_a_user_error_then_a_signal_death_then_the_first_error():
    peer = rank_failed(0, "infrastructure", f"RuntimeError: {GLOO_PEER}", t=1.0)
    user = rank_failed(1, "user", "ValueError: bad batch", step=50, t=2.0, host="n2")
    killed = TaskEnd("n2", 1, "Killed")
    assert diagnose([peer, user], [killed], 1, None).fields() == {
        "kind": "user", "rank": 1, "host": "n2", "step": 50, "error": "ValueError: bad batch"
    }  # fmt: skip
    got = diagnose([peer], [TaskEnd("n1", 0, "Exited with exit code 1"), killed], 1, 12)
    assert (got.kind, got.rank, got.host, got.step, got.error) == (
        Kind.infrastructure, 1, "n2", 40, "killed by a signal (Killed)"
    )  # fmt: skip
    assert diagnose([peer], [], 1, None).kind is Kind.infrastructure
    # A torchrun agent's report of its worker killed by a signal comes after its peers' errors, and explains them.
    agent = rank_failed(1, "infrastructure", "killed by a signal (SIGKILL)", t=3.0) | {"signal": "SIGKILL"}
    got = diagnose([peer, agent], [TaskEnd("n1", 0, "Exited with exit code 137")], 137, 12)
    assert (got.kind, got.rank, got.error) == (Kind.infrastructure, 1, "killed by a signal (SIGKILL)")
    nothing = diagnose([], [], 137, 12)
    assert (nothing.kind, nothing.rank, nothing.step) == (Kind.unknown, None, 12)
    assert "status 137 and no rank said why" in nothing.error


def test_the_watcher_reads_only_its_own_attempt(tmp_path):
    env = DistEnv(job_id="57", slurm_job_id="57", restart_count=1)
    events = [
        {"event": "start", "job_id": "57", "restart_count": 0},
        {"event": "requeued", "job_id": "57", "kind": "timeout"},
        {"event": "start", "job_id": "57", "restart_count": 1},
        rank_failed(1, "unknown", "RuntimeError: x") | {"job_id": "57", "restart_count": 1},
    ]
    assert [e["event"] for e in failures.attempt_events(events, env)] == ["start", "rank_failed"]
    # An attempt that failed before its start event: only its own ranks' records.
    early = DistEnv(job_id="57", slurm_job_id="57", restart_count=2)
    failed = rank_failed(0, "user", "ImportError: x") | {"job_id": "57", "restart_count": 2}
    assert failures.attempt_events([*events, failed], early) == [failed]
    log = tmp_path / "57_0_log.err"
    marker = supervise.MARKER.format
    log.write_text(
        f"{marker(restart=0, job=57)} on n1\nsrun: error: n1: task 0: Killed\n"
        f"{marker(restart=1, job=57)} on n1\nsrun: error: n2: task 1: Killed\n"
    )
    assert srun_task_ends(supervise.srun_lines(log, env)) == [TaskEnd("n2", 1, "Killed")]
    assert supervise.srun_lines(log, early) == []  # no marker of that attempt: nothing of another one


def test_the_watcher_leaves_a_success_and_anything_outside_slurm_alone(tmp_path):
    outside = subprocess.run(
        [sys.executable, "-m", "ddp_core.cluster.supervise", str(tmp_path), str(tmp_path / "log"), "137"],
        capture_output=True, text=True, cwd=ROOT, env={"PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert outside.returncode == 137 and outside.stderr == ""
    assert supervise.main(["", "log", "1"]) == 1  # the template's script ended before it had a run directory
    assert supervise.main([str(tmp_path), "log", "0"]) == 0
    assert supervise.main([str(tmp_path), "log"]) == 2
    assert not Path(tmp_path / "attempts.jsonl").exists()


def failure_event(host, kind="infrastructure"):
    return {"event": "failure", "host": host, "kind": kind, "error": "killed by a signal (Killed)"}


def test_a_node_is_excluded_on_evidence_about_it_never_on_a_count_of_killed_processes():
    """A rank killed twice on n2 (the OOM killer, a user's kill) says nothing about n2; a failed health check, a
    device error, a node Slurm lost, or Slurm's DOWN/FAIL/drained state does."""
    from ddp_core.cluster.failures import Failure, excluded_hosts, to_exclude

    killed = Failure(Kind.infrastructure, 1, "n2", 40, "killed by a signal (Killed)")
    many = [failure_event("n2")] * 5
    assert to_exclude(many, killed) == {}
    assert to_exclude(many, killed, {"NodeName": "n2", "State": "MIXED"}) == {}
    assert to_exclude(many, killed, {"State": "IDLE*"}) == {}  # not responding alone: a slow network, a busy slurmd
    assert to_exclude(many, killed, None) == {}  # Slurm could not say
    drained = {"NodeName": "n2", "State": "MIXED+DRAIN", "Reason": "bad DIMM"}
    assert to_exclude([], killed, drained) == {
        "n2": "Slurm says State=MIXED+DRAIN (Reason=bad DIMM), after: killed by a signal (Killed)"
    }
    assert to_exclude([], killed, {"State": "DOWN*"}) == {
        "n2": "Slurm says State=DOWN*, after: killed by a signal (Killed)"
    }
    lost = Failure(Kind.infrastructure, None, "n1", 20, "node failure: n1 stopped responding", lost="NODE_FAIL")
    assert to_exclude([], lost, {"State": "IDLE"}) == {"n1": "lost: NODE_FAIL"}  # back by now, but it was lost
    xid = Failure(Kind.infrastructure, 0, "n3", 7, "RuntimeError: CUDA error: uncorrectable ECC error encountered")
    assert to_exclude([], xid) == {"n3": f"a device error: {xid.error}"}
    sick = Failure(Kind.health, 0, "n3", None, "HealthCheckFailed: health check on n3: slurm.health_check failed: x")
    assert to_exclude([], sick) == {"n3": f"failed a health check: {sick.error}"}
    assert to_exclude([], Failure(Kind.user, 1, "n2", 3, "ValueError: x"), drained) == {}
    assert to_exclude([], Failure(Kind.storage, 0, "n2", 3, "OSError: [Errno 28] full"), drained) == {}
    events = [{"event": "excluded", "host": "n3", "reason": "r3"}, {"event": "excluded", "host": "n2", "reason": "r2"},
              {"event": "included", "host": "n3"}]  # fmt: skip
    assert excluded_hosts(events) == {"n2": "r2"}
    assert to_exclude(events, killed, drained) == {}  # already excluded


def test_health_check_of_a_node(tmp_path):
    from ddp_core.cluster.health import HealthCheckFailed, check_node
    from ddp_core.run.rundir import RunDir

    run, env = RunDir(tmp_path), DistEnv(rank=0, local_rank=0)
    check_node(run, env, "echo fine")
    with pytest.raises(HealthCheckFailed, match=r"slurm\.health_check failed: GPU 0 fell off the bus"):
        check_node(run, env, "echo checking; echo 'GPU 0 fell off the bus' >&2; exit 3")
    check_node(run, DistEnv(rank=1, local_rank=1), "exit 1")  # a node's first rank runs the site's command
    with pytest.raises(HealthCheckFailed, match=r"did not finish within 0.5 s"):
        check_node(run, env, "sleep 5", timeout_s=0.5)
    assert classify(HealthCheckFailed("x")) is Kind.health
    tmp_path.chmod(0o500)
    try:
        if os.access(tmp_path, os.W_OK):  # root writes anyway: the check is for an ordinary user
            return
        with pytest.raises(HealthCheckFailed, match="the run directory is not writable"):
            check_node(run, env, None)
    finally:
        tmp_path.chmod(0o700)


def test_a_full_run_filesystem_is_not_the_nodes_fault(tmp_path):
    """The health check's probe file on a real full tmpfs: the filesystem's failure (storage: requeued, no node
    excluded), named by its mount point, never a bad node."""
    from ddp_core.cluster.health import check_node
    from ddp_core.run.diskfull import StorageFailing
    from ddp_core.run.rundir import RunDir
    from tests.support.filesystems import fill, small_tmpfs

    with small_tmpfs(tmp_path / "shared", 64 * 1024) as shared:
        run = RunDir(shared / "run")
        run.path.mkdir()
        check_node(run, DistEnv(rank=0, local_rank=0), None)
        filler = fill(shared)
        with pytest.raises(StorageFailing, match=f"no space left on {shared}") as err:
            check_node(run, DistEnv(rank=0, local_rank=0), None)
        assert classify(err.value) is Kind.storage and not list(run.path.iterdir())  # no probe left behind
        filler.unlink()
        check_node(run, DistEnv(rank=0, local_rank=0), None)  # space back: the node is fine


def node_fail_gateway(down: str) -> SlurmGateway:
    """Slurm's answers after a node failure ended attempt 0 of job 57 on n[1-2], ``down`` the node that went."""

    def runner(cmd):
        answers = {
            "sacct": "NODE_FAIL|n[1-2]|2026-11-26T21:13:26|2026-11-26T21:14:08\n"
            "RUNNING|n[2-3]|2026-11-26T21:14:15|Unknown\n",
            "sacctmgr": f"{down}|2026-11-26T21:14:08|DOWN*\n",
        }
        return subprocess.CompletedProcess(cmd, 0, answers.get(cmd[0], ""), "")

    return gateway_for(runner)


def test_a_node_failure_nobody_recorded_is_counted_before_the_next_attempt(tmp_path):
    run, n1_gone = RunDir(tmp_path), node_fail_gateway("n1")
    run.log_event("start", job_id="57", restart_count=0)
    second = DistEnv(job_id="57", slurm_job_id="57", restart_count=1)
    assert node_loss.begin(run, second, "n[2-3]", SlurmConfig(), n1_gone) == node_loss.GO_ON
    [failure] = [e for e in run.events() if e["event"] == "failure"]
    assert (failure["kind"], failure["host"], failure["rank"], failure["restart_count"]) == ("infrastructure", "n1",
                                                                                            None, 0)  # fmt: skip
    assert failure["error"] == "node failure: n1 stopped responding (Slurm ended the attempt: NODE_FAIL)"
    # Lost with the attempt (NODE_FAIL, Slurm's word): excluded at once; this attempt, on n2 and n3, runs.
    [excluded] = [e for e in run.events() if e["event"] == "excluded"]
    assert (excluded["host"], excluded["reason"]) == ("n1", "lost: Slurm ended the attempt for it (NODE_FAIL)")
    assert node_loss.begin(run, second, "n[2-3]", SlurmConfig(), n1_gone) == node_loss.GO_ON  # decided already
    assert len([e for e in run.events() if e["event"] == "failure"]) == 1
    # n1 dies again under attempt 1 (taken back meanwhile): excluded again, and a budget of one is spent.
    run.log_event("included", host="n1")
    run.log_event("start", job_id="57", restart_count=1)
    third = DistEnv(job_id="57", slurm_job_id="57", restart_count=2)
    assert node_loss.begin(run, third, "n[2-3]", SlurmConfig(max_failures=1), n1_gone) == ExitCode.BUDGET_SPENT
    assert [(e["event"], e.get("host")) for e in run.events()][-3:] == [
        ("failure", "n1"), ("excluded", "n1"), ("budget_exhausted", None)
    ]  # fmt: skip
    assert "slurm.max_failures=1" in run.events()[-1]["reason"]
    # Any other end of the previous attempt is not a node's loss: nothing to add.
    run.log_event("start", job_id="57", restart_count=2)
    fourth = DistEnv(job_id="57", slurm_job_id="57", restart_count=3)
    timeout = gateway_for(lambda cmd: subprocess.CompletedProcess(cmd, 0, "TIMEOUT|n[1-2]|a|b\n", ""))
    assert node_loss.begin(run, fourth, "n[1-2]", SlurmConfig(), timeout) == node_loss.GO_ON
    assert run.events()[-1]["event"] == "start"


def test_a_requeued_attempt_of_a_completed_run_ends_completed_before_srun(tmp_path):
    """Slurm 24.11 requeues a job that was preempted once more when its next attempt ends (docs/local-cluster.md):
    the batch script's check before srun finds the run completed by this job and ends the attempt with exit 0,
    starting nothing; a run another job completed (a resume that goes on training) still starts."""
    request = SlurmRequest.resolve(load_config(str(ROOT / "configs" / "digits.yaml"), []), python=sys.executable)
    script = "\n".join([*request.watch_lines(str(tmp_path), str(tmp_path / "log")), "ddpjob_begin", "echo srun"])
    run = RunDir(tmp_path)
    run.log_event("start", job_id="57", restart_count=1)
    run.log_event("completed", job_id="57", step=40, final=True)
    env = {
        **os.environ,
        "SLURM_JOB_ID": "57",
        "SLURM_RESTART_COUNT": "2",
        "PATH": "/usr/bin:/bin",
        "PYTHONPATH": str(ROOT),
    }
    again = subprocess.run(["bash", "-c", script], capture_output=True, text=True, cwd=ROOT, env=env)
    assert (again.returncode, again.stdout) == (0, "")
    assert "Slurm started job 57 again after its run completed: nothing to run" in again.stderr
    resumed = subprocess.run(
        ["bash", "-c", script], capture_output=True, text=True, cwd=ROOT, env={**env, "SLURM_JOB_ID": "58"}
    )
    assert (resumed.returncode, resumed.stdout) == (0, "srun\n"), resumed.stderr


def test_without_accounting_a_lost_node_is_not_guessed(tmp_path, caplog):
    run = RunDir(tmp_path)
    run.log_event("start", job_id="57", restart_count=0)
    said = "sacct: error: Problem talking to the database"
    down = gateway_for(lambda cmd: subprocess.CompletedProcess(cmd, 1, "", said))
    second = DistEnv(job_id="57", slurm_job_id="57", restart_count=1)
    assert node_loss.begin(run, second, "n[2-3]", SlurmConfig(), down) == node_loss.GO_ON
    assert not [e for e in run.events() if e["event"] == "failure"]
    assert "accounting does not answer (sacct: error: Problem talking to the database)" in caplog.text
