"""The local cluster's site profile (``scripts/slurm-local up --profile site``, docs/local-cluster.md): configured as
production sites are, it kills a job over its memory, runs each step in a cgroup of its own, refuses submissions over
a QOS limit and from users without an association, and (24.11 and later) slows a user's burst of RPCs. Real jobs, as
root and as the unprivileged ``ddpjob-alice``, through ddpjob's Slurm gateway (a gateway whose commands run as her).
Refusals' exact lines are what the submit code will parse."""

from __future__ import annotations

import os
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Iterator

import pytest

from ddp_core.cluster.slurm import GATEWAY
from ddp_core.run.rundir import RunDir
from tests.support import users
from tests.support.digits import DIGITS
from tests.support.helpers import digests, rank_logs, two_rank_reference, wait_gone

# Tiny jobs of one CPU, held jobs and refusals: nothing global (the QOS limits are per user).
# Every release's site pass runs them (slurm_interface): cgroups, limits and rate limiting differ between releases.
pytestmark = [pytest.mark.cluster_profile("site"), pytest.mark.cluster_shared("a"), pytest.mark.slurm_interface]

QOS_REFUSAL = [
    "sbatch: error: QOSMaxSubmitJobPerUserLimit",
    "sbatch: error: Batch job submission failed: Job violates accounting/QOS policy (job submit limit, user's size"
    " and/or time limits)",
]
NO_ASSOCIATION = (
    "sbatch: error: Batch job submission failed: Invalid account or account/partition combination specified"
)
RATE_LIMITED = "squeue: RPC rate limited 1 time(s). Sleeping then trying again."


user_env, gateway_as = users.slurm_env, users.gateway_as  # her environment and her Slurm gateway


@pytest.fixture
def alice() -> users.User:
    return users.ensure("alice")


@pytest.fixture
def shared_dir(alice: users.User) -> Iterator[Path]:
    """A folder both root and alice write job output to (pytest's tmp_path is root's alone)."""
    folder = Path(tempfile.mkdtemp(prefix="ddpjob-site-"))
    os.chown(folder, alice.uid, alice.gid)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def test_the_site_profile_is_configured_as_sites_are(slurm_cluster):
    config = GATEWAY.show_config()
    assert config is not None
    assert config["ProctrackType"] == "proctrack/cgroup" and config["JobAcctGatherType"] == "jobacct_gather/cgroup"
    assert set(config["TaskPlugin"].split(",")) >= {"task/cgroup", "task/affinity"}, config["TaskPlugin"]
    assert config["SelectTypeParameters"] == "CR_CORE_MEMORY" and config["DefMemPerCPU"] == "2000"
    assert "Contain" in config["PrologFlags"]
    assert set(config["AccountingStorageEnforce"].split(",")) >= {"associations", "limits", "qos"}
    release = GATEWAY.version().split(".")[:2]
    assert ("rl_enable" in config.get("SlurmctldParameters", "")) == (release != ["22", "05"]), release
    limits = {r["Name"]: r for r in GATEWAY.qos_records(["Name", "MaxSubmitPU", "MaxJobsPU", "GrpTRES"]) or []}
    assert limits["site"] == {"Name": "site", "MaxSubmitPU": "6", "MaxJobsPU": "2", "GrpTRES": "cpu=8"}
    assert config["PreemptType"] == "preempt/qos"  # a scavenger QOS: "site" preempts "low"
    for user, qos in (("root", "normal"), ("ddpjob-alice", "low,site"), ("ddpjob-mallory", "low,site")):
        assert [a["QOS"] for a in GATEWAY.associations(user, ["User", "QOS"]) or []] == [qos], user


@pytest.mark.parametrize("who", ["root", "alice"])
def test_a_job_over_its_memory_is_killed_and_its_step_runs_in_its_cgroup(slurm_cluster, alice, shared_dir, who):
    gateway, uid, python = (GATEWAY, 0, sys.executable) if who == "root" else (gateway_as(alice), alice.uid, None)
    python = python or users.SYSTEM_PYTHON  # alice cannot enter /root, where the venv's python lives
    out = shared_dir / f"{who}.out"
    script = (
        f"{python} -c 'import ddp_core.errors' || exit 3\n"  # her python runs the project's code
        f"srun {python} -c 'print(open(\"/proc/self/cgroup\").read())'\n"  # step 0
        f"{python} -c 'b = bytearray(200 * 2**20); print(len(b))'\n"  # the batch step, 200 MiB over its 64
    )
    job_id = gateway.sbatch_wrap(["--mem=64M", "-t", "2", "-o", str(out)], script)
    assert job_id, "sbatch refused"
    assert wait_gone(job_id, 60) == "OUT_OF_MEMORY", out.read_text()
    assert GATEWAY.sacct_state(job_id) == "OUT_OF_MEMORY"
    text = out.read_text()
    for ctrl in ("freezer", "memory", "cpuset"):
        # a cgroup namespace per node: the paths a real node shows, below each node's own subtree
        assert re.search(rf"^\d+:{ctrl}:/slurm_n\d/uid_{uid}/job_{job_id}/step_0(/task_0)?$", text, re.M), text
    assert "oom" in text.lower() and "Killed" in text, text


def test_a_submission_over_the_qos_limit_is_refused(slurm_cluster, alice):
    gateway = gateway_as(alice)
    held: list[str] = []
    try:
        for _ in range(6):  # MaxSubmitJobsPerUser of QOS site, alice's default QOS
            job_id = gateway.sbatch_wrap(["--hold", "-o", "/dev/null"], "true")
            assert job_id, "a submission under the limit was refused"
            held.append(job_id)
        refused = gateway.run("sbatch", "--hold", "-o", "/dev/null", "--wrap", "true")
    finally:
        GATEWAY.cancel(held)
    assert refused.returncode == 1 and refused.stderr.splitlines() == QOS_REFUSAL, refused.stderr


def test_a_user_without_an_association_is_refused(slurm_cluster):
    guest = users.ensure("guest")  # a real account of the host that scripts/slurm-local gives no association
    refused = gateway_as(guest).run("sbatch", "-o", "/dev/null", "--wrap", "true")
    assert refused.returncode == 1 and refused.stderr.splitlines() == [NO_ASSOCIATION], refused.stderr


def test_a_burst_of_rpcs_is_rate_limited(slurm_cluster, alice):
    if GATEWAY.version().startswith("22.05"):
        pytest.skip("RPC rate limiting came with Slurm 23.02")
    # squeue costs ~3 RPCs and takes ~0.1 s: a user's bucket (30 RPCs, 2 more a second) is empty after ~10. The
    # client is told to back off and sleeps; only -v says so. Root (SlurmUser) is never limited.
    burst = "for i in $(seq 40); do squeue -v -h 2>&1 | grep -F -m1 'RPC rate limited' && exit 0; done; exit 1"
    proc = users.shell(alice, burst, env=user_env())
    assert proc.returncode == 0 and proc.stdout.splitlines() == [RATE_LIMITED], proc.stdout + proc.stderr


def test_a_ddpjob_run_out_of_memory_fails_once_and_names_its_peak(slurm_cluster, alice, shared_dir):
    """A trainer's rank over slurm.mem_gb, submitted by alice with ``ddpjob submit --wait``: the cgroup's OOM handler
    kills it, and that is a row of the failure table (memory), not an infrastructure failure: no restart in the
    allocation, no requeue, no node excluded; the job ends FAILED, ``ddpjob status`` says OUT_OF_MEMORY with the
    step's peak and the limit, and the log says how to continue with more."""
    ddpjob = [users.SYSTEM_PYTHON, "-m", "jobs"]
    args = ["slurm.mem_gb=0.3", "slurm.nodes=1", "slurm.tasks_per_node=2", "wandb.mode=disabled",
            "train.max_steps=50", f"run.root={shared_dir / 'runs'}"]  # fmt: skip
    sub = users.run(
        alice, [*ddpjob, "submit", str(DIGITS), *args, "--wait"], cwd=shared_dir, env=user_env(), timeout=180
    )
    assert sub.returncode == 1, sub.stdout + sub.stderr
    (run,) = (shared_dir / "runs").iterdir()
    kinds = [(e["event"], e.get("kind")) for e in RunDir(run).events() if e["event"] != "rank_failed"]
    assert kinds == [("failure", "memory"), ("failed", None)], kinds
    status = users.run(alice, [*ddpjob, "status", str(run)], cwd=shared_dir, env=user_env())
    assert re.search(r"^\s+\d+\s+OUT_OF_MEMORY\s", status.stdout, re.M), status.stdout + status.stderr
    where = r"out of host memory in \S+ (?:at step \d+|before its first step) on n\d \(rank \d\): "
    peak = where + r"a task's peak [1-9]\d* MiB of the job's 308M \(slurm\.mem_gb=0\.3\)"
    assert re.search(peak, status.stdout), status.stdout
    log = "".join(p.read_text() for p in (run / "slurm").glob("*_0_log.err"))
    assert f"ddpjob resume {run} slurm.mem_gb=0.6" in log, log


def test_ddpjob_names_the_qos_limit_that_refuses_a_job_and_refuses_a_sweep_over_it_up_front(
    slurm_cluster, alice, shared_dir
):
    """alice's QOS allows 6 queued jobs: with 6 held, ``ddpjob submit`` is one line naming the limit and its fix,
    with nothing left behind; a sweep whose trials would pass the limit is refused before anything is created."""
    ddpjob = [users.SYSTEM_PYTHON, "-m", "jobs"]
    root = f"run.root={shared_dir / 'runs'}"
    sweep = users.run(alice, [*ddpjob, "sweep", str(DIGITS), "optim.lr=1e-3,2e-3,3e-3,4e-3,5e-3,6e-3,7e-3", root],
                      cwd=shared_dir, env=user_env(), timeout=180)  # fmt: skip
    assert sweep.returncode == 2, sweep.stdout + sweep.stderr
    assert "the sweep would queue 7 jobs (each trial is one), but QOS site MaxSubmitPU allows 6 queued and 0 are " \
        "queued now: 6 more fit" in sweep.stderr, sweep.stderr  # fmt: skip
    assert not (shared_dir / "runs").exists()
    gateway, held = gateway_as(alice), []
    try:
        for _ in range(6):
            job_id = gateway.sbatch_wrap(["--hold", "-o", "/dev/null"], "true")
            assert job_id, "a submission under the limit was refused"
            held.append(job_id)
        sub = users.run(alice, [*ddpjob, "submit", str(DIGITS), root], cwd=shared_dir, env=user_env())
    finally:
        GATEWAY.cancel(held)
    lines = [line for line in sub.stderr.splitlines() if line.startswith("ddpjob: error:")]
    assert sub.returncode == 2 and len(lines) == 1, sub.stdout + sub.stderr
    assert "sbatch refused the job: the QOS's MaxSubmitJobPerUser limit (QOSMaxSubmitJobPerUserLimit)" in lines[0]
    assert "(hint: as many of your jobs are queued as it allows" in lines[0]
    assert not (shared_dir / "runs").exists() or not any((shared_dir / "runs").iterdir())  # nothing left behind


TIER = ["train.max_steps=30", "checkpoint.every_steps=10", "train.log_every=5", "train.eval_every=0",
        "wandb.mode=disabled", "slurm.nodes=1", "slurm.tasks_per_node=2"]  # fmt: skip


def test_another_user_can_neither_plant_in_nor_read_a_users_job(slurm_cluster, alice, shared_dir, pytestconfig,
                                                               tmp_path_factory):  # fmt: skip
    """alice's private run with the node-local tier in /dev/shm, her job held back a few seconds: mallory sees its id
    in squeue and makes the tier's folder first (0777, a forged copy in it, as the review did). The job refuses her
    folder in one line and trains on with its durable checkpoints; mallory can read none of the run and write none
    of what the job unpickles; the run ends bitwise equal to an uninterrupted one."""
    mallory = users.ensure("mallory")
    shared_dir.chmod(0o755)  # a project folder others may enter: the run's own privacy is what keeps them out
    reference = two_rank_reference(pytestconfig, tmp_path_factory, "site-tier", str(DIGITS), TIER)
    args = [*TIER, "checkpoint.local_every_steps=2", "checkpoint.local_path=/dev/shm", "run.private=true",
            f"run.root={shared_dir / 'runs'}", "slurm.additional.begin=now+12"]  # fmt: skip
    sub = users.run(
        alice, [users.SYSTEM_PYTHON, "-m", "jobs", "submit", str(DIGITS), *args], cwd=shared_dir, env=user_env()
    )
    assert sub.returncode == 0, sub.stdout + sub.stderr
    job_id = next(line.split()[-1] for line in sub.stdout.splitlines() if line.startswith("job:"))
    (run,) = (shared_dir / "runs").iterdir()
    planted = Path("/dev/shm") / f"ddpjob-{alice.name}-{job_id}"  # what ddp_core.run.private names it, as alice
    attack = (f"mkdir -m 777 {planted} && mkdir -m 777 {planted}/n1 && echo forged > {planted}/n1/step_00000010.pt;"
              f" cat {run}/config.yaml; ls {run}; echo x >> {run}/config.yaml; ls {run}/slurm")  # fmt: skip
    tried = users.shell(mallory, attack)
    try:
        assert planted.is_dir() and planted.stat().st_uid == mallory.uid, tried.stderr
        assert tried.stderr.count("Permission denied") == 4, tried.stdout + tried.stderr  # read, list, write, list
        assert wait_gone(job_id, 240) == "COMPLETED"
        seen = [e["event"] for e in RunDir(run).events()]
        assert "local_tier_off" in seen and "failure" not in seen, seen
        logs = rank_logs(run, job_id)
        assert f"{planted} is owned by {mallory.name}" in logs[0], logs[0][-3000:]
        assert digests(logs) == {0: reference, 1: reference}
        assert sorted(p.name for p in planted.rglob("*")) == ["n1", "step_00000010.pt"]  # nothing of alice's there
    finally:
        shutil.rmtree(planted, ignore_errors=True)
