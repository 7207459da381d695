"""Rank 0's lock on its run directory (``ddp_core.cluster.run_lock``): a live holder is refused; an earlier attempt of
the same job on a node Slurm says is gone holds a lock that outlived it, which is broken. The holder is a real process
holding the lock; Slurm's answers about its node come from a fabricated gateway."""

from __future__ import annotations

import functools
import subprocess
import sys

import pytest

from ddp_core.cluster import run_lock
from ddp_core.cluster.env import DistEnv
from ddp_core.cluster.slurm import SlurmGateway
from ddp_core.errors import DdpJobError
from ddp_core.run.rundir import TRAINER_LOCK, RunDir
from tests.support.helpers import ROOT

HOLDER = """
import sys, time
from pathlib import Path
from ddp_core.run.rundir import RunDir
lock = RunDir(Path(sys.argv[1])).hold_trainer_lock({"host": "n9", "pid": 1, "job": sys.argv[2]})
print("held", flush=True)
time.sleep(120)
"""
ENV = DistEnv(rank=0, world_size=2, job_id="57", slurm_job_id="57", restart_count=1)


def node_in(state: str) -> SlurmGateway:
    return SlurmGateway(lambda cmd: subprocess.CompletedProcess(cmd, 0, f"NodeName={cmd[-1]} State={state}\n", ""))


@pytest.fixture
def held(tmp_path):
    """Makes a run directory whose lock a live process holds, recorded as job 57's (or ``job``'s) on n9."""

    def hold(job: str = "57") -> RunDir:
        proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path / job), job], cwd=ROOT,
                                stdout=subprocess.PIPE, text=True)  # fmt: skip
        procs.append(proc)
        assert proc.stdout is not None and proc.stdout.readline() == "held\n"
        return RunDir(tmp_path / job)

    procs: list[subprocess.Popen[str]] = []
    yield hold
    for proc in procs:
        proc.kill()
        proc.wait()


def take(run: RunDir, gateway: SlurmGateway):
    return run.hold_trainer_lock({"host": "here", "job": "57"}, 0.0, functools.partial(run_lock.dead, env=ENV,
                                 gateway=gateway))  # fmt: skip


def test_an_earlier_attempt_on_a_node_slurm_says_is_gone_loses_its_lock(held, caplog):
    run = held()
    with pytest.raises(DdpJobError, match=r"is in use by a trainer \(host n9 pid 1 job 57\)"):
        take(run, node_in("ALLOCATED"))  # its node is up: it is a trainer to wait for
    with pytest.raises(DdpJobError, match=r"is in use by a trainer"):
        take(run, node_in("MIXED+NOT_RESPONDING"))  # only silent: the holder may be alive behind a slow network
    lock = take(run, node_in("DOWN+NOT_RESPONDING"))
    assert "breaking the trainer lock" in caplog.text and (run.path / TRAINER_LOCK).read_text() == "host here job 57\n"
    lock.close()


def test_another_jobs_holder_is_never_taken_for_dead(held):
    run = held("58")
    with pytest.raises(DdpJobError, match=r"job 58\)"):
        take(run, node_in("DOWN"))
    outside = DistEnv(job_id="57")  # no Slurm job: nothing to ask about
    assert not run_lock.dead({"host": "n9", "job": "57"}, env=outside, gateway=node_in("DOWN"))
