"""What a plain user may not do on a shared cluster, done as ``ddpjob-alice`` on the site profile (issue 54): each
refusal is Slurm's own one line, recorded here exactly, and what ddpjob itself asks of Slurm on her behalf (an
exclusion list and a node range on her pending job, a lower time limit) works without a privilege. Another
user's job she can read (``PrivateData`` is unset, as on most sites); another user's run directory she cannot
(tests/unit/jobs/runs/test_run_reference.py: one line). The jobs are root's and hers: the test itself runs as root
(making root's job needs it), her commands under her real uid (``tests/support/users.py``)."""

from __future__ import annotations

import logging
from typing import Iterator

import pytest

from ddp_core.cluster import policy, preemption
from ddp_core.cluster.env import DistEnv
from ddp_core.cluster.slurm import GATEWAY
from ddp_core.config.schema import SlurmConfig
from tests.support import users
from tests.support.helpers import wait_for

# One-CPU jobs held or sleeping, nothing global (draining is refused before it happens).
pytestmark = [pytest.mark.cluster_profile("site"), pytest.mark.cluster_shared("a")]


@pytest.fixture(scope="module")
def alice() -> users.User:
    return users.ensure("alice")


@pytest.fixture(scope="module")
def jobs(alice: users.User) -> Iterator[dict[str, str]]:
    """A pending job of root's and a running one and a pending one of alice's, for the module (her QOS counts a
    cancelled job until it has completed: three per test, one test after the other, passed her 6)."""
    later = ["--begin=now+1hour", "-t", "5", "-o", "/dev/null"]
    made = {"root": GATEWAY.sbatch_wrap(later, "true")}
    try:
        made["pending"] = users.gateway_as(alice).sbatch_wrap([*later, "-N", "1-2", "-n", "2"], "true")
        made["running"] = users.gateway_as(alice).sbatch_wrap(["-t", "2", "-o", "/dev/null"], "sleep 120")
        assert all(made.values()), made
        wait_for(lambda: queued_state(made["running"]) == "RUNNING", 60, "alice's job to start")
        yield made
    finally:
        GATEWAY.cancel([j for j in made.values() if j])


def queued_state(job_id: str) -> str:
    return GATEWAY.run("squeue", "-h", "-j", job_id, "-o", "%T").stdout.strip()


def as_alice(alice: users.User, *cmd: str) -> tuple[int, list[str]]:
    proc = users.gateway_as(alice).run(*cmd)
    return proc.returncode, (proc.stdout + proc.stderr).strip().splitlines()


def test_what_only_an_administrator_may_do_is_refused_in_one_line(slurm_cluster, alice, jobs):
    running, root = jobs["running"], jobs["root"]
    refused = {
        # over what she asked for: a running job's time limit only goes down
        ("scontrol", "update", f"JobId={running}", "TimeLimit=10"): f"Access/permission denied for job {running}",
        ("scontrol", "update", f"JobId={running}", "Priority=100000"):
            f"Changes to job priority are not persistent, change nice instead for job {running}",
        ("scontrol", "update", f"JobId={running}", "Nice=-100"): f"Access/permission denied for job {running}",
        ("scontrol", "update", "NodeName=n1", "State=DRAIN", "Reason=alice"): "slurm_update error: Invalid user id",
        ("scontrol", "update", "NodeName=n1", "State=RESUME"): "slurm_update error: Invalid user id",
        ("scontrol", "update", f"JobId={root}", "TimeLimit=1"): f"Invalid user id for job {root}",
        ("scontrol", "requeue", root): f"Access/permission denied for job {root}",
        ("scancel", root): f"scancel: error: Kill job error on job id {root}: Access/permission denied",
        ("sdiag", "-r"): "slurm_reset_statistics: Access/permission denied",
    }  # fmt: skip
    answers = {cmd: as_alice(alice, *cmd) for cmd in refused}
    assert {cmd: lines for cmd, (_, lines) in answers.items()} == {cmd: [line] for cmd, line in refused.items()}
    assert all(code != 0 for code, _ in answers.values()), answers
    assert queued_state(root) == "PENDING" and "drain" not in GATEWAY.run("sinfo", "-h", "-n", "n1",
                                                                               "-o", "%T").stdout  # fmt: skip


def test_what_ddpjob_asks_of_slurm_for_her_works_without_a_privilege(slurm_cluster, alice, jobs):
    pending, running = jobs["pending"], jobs["running"]
    gateway = users.gateway_as(alice)
    # jobs.cluster.policy's exclusion list and ddp_core.cluster.preemption's elastic range, on her pending job
    assert gateway.update_job(pending, ExcNodeList="n1").returncode == 0
    assert gateway.update_job(pending, NumNodes="1-2", NumTasks=1).returncode == 0
    shown = GATEWAY.run("scontrol", "show", "job", pending).stdout
    assert "ExcNodeList=n1" in shown and "NumTasks=1" in shown, shown
    assert gateway.run("scontrol", "update", f"JobId={running}", "TimeLimit=1").returncode == 0  # down is hers
    # Her requeue of her own job (the trainer's): tests/cluster/test_deadline.py, as alice. Not here: on 22.05 a job
    # requeued while running, then cancelled, leaks one of her QOS's MaxSubmitJobsPU slots until slurmctld restarts.


def test_another_users_job_is_readable(slurm_cluster, alice, jobs):
    root = jobs["root"]
    assert as_alice(alice, "squeue", "-h", "-j", root, "-o", "%i %u %T") == (0, [f"{root} root PENDING"])
    sacct = ("sacct", "-n", "-X", "-P", "-j", root, "-o", "JobID,User,State")
    wait_for(lambda: GATEWAY.run(*sacct).stdout.strip(), 30, "root's job in accounting")  # slurmdbd has it late
    assert as_alice(alice, *sacct) == (0, [f"{root}|root|PENDING"])
    code, shown = as_alice(alice, "scontrol", "show", "job", root)
    assert code == 0 and shown[0].startswith(f"JobId={root} ") and "UserId=root(0)" in shown[1], shown


def test_what_ddpjob_may_not_do_for_her_is_one_line_of_its_own(slurm_cluster, alice, jobs, caplog):
    """ddpjob's own calls that need a privilege, made as her on a job not hers (root's): each is one line naming the
    job, what it wanted and Slurm's reason, and none is retried (a requeue refused for good is not asked again).
    Draining a node ddpjob never asks: it keeps a run off a node with the job's own ExcNodeList (above). A job id
    not hers is not a run of hers either: status, logs and cancel say so in one line and touch nothing."""
    root, gateway = jobs["root"], users.gateway_as(alice)
    with caplog.at_level(logging.INFO):
        policy.keep_off(gateway, root, ["n1"], tries=1)
        preemption.elastic_again(root, SlurmConfig(nodes="1-2"), gateway, per_node=1)
        refused = preemption.requeue(DistEnv(slurm_job_id=root), gateway, tries=3, pause_s=0)
    denied, not_hers = f"Invalid user id for job {root}", f"Access/permission denied for job {root}"
    assert refused is not None and refused.why == not_hers, refused
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("ERROR", f"job {root} could not exclude n1: {denied}"),
        ("WARNING", f"job {root} will wait for the node count it had: giving it back 1-2 nodes failed: {denied}"),
        ("ERROR", f"scontrol requeue {root} failed (try 1 of 3): {not_hers}"),
    ]
    for command in ("status", "logs", "cancel"):
        proc = users.run(alice, [users.SYSTEM_PYTHON, "-m", "jobs", command, root], env=users.slurm_env())
        assert (proc.returncode, proc.stdout) == (2, ""), proc
        assert proc.stderr.splitlines() == [f"ddpjob: error: no run under 'runs' has job '{root}' (hint: pass the run "
                                            "directory, or --root (there is no runs here))"]  # fmt: skip
    assert (
        queued_state(root) == "PENDING" and "ExcNodeList=(null)" in GATEWAY.run("scontrol", "show", "job", root).stdout
    )
