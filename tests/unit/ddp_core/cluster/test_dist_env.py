"""Rank bootstrap from SLURM, torchrun, submitit-local and single-process environments."""

import subprocess
import sys
import time

import pytest

from ddp_core.cluster.env import DistEnv, derive_master_port, expand_nodelist, expand_tasks_per_node
from ddp_core.errors import DdpJobError


@pytest.mark.parametrize(
    ("nodelist", "hosts"),
    [
        ("n1", ["n1"]),
        ("n[1-2]", ["n1", "n2"]),
        ("gpu[01-04,07]", ["gpu01", "gpu02", "gpu03", "gpu04", "gpu07"]),
        ("a[1-2],b3", ["a1", "a2", "b3"]),
        ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
        ("node[098-101]", ["node098", "node099", "node100", "node101"]),
    ],
)
def test_expand_nodelist(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


def test_expand_tasks_per_node():
    assert expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert expand_tasks_per_node("4") == [4]
    with pytest.raises(DdpJobError, match="tasks-per-node"):
        expand_tasks_per_node("2(3)")


def slurm_env(**extra):
    env = {
        "SLURM_JOB_ID": "4242",
        "SLURM_PROCID": "3",
        "SLURM_LOCALID": "1",
        "SLURM_NTASKS": "4",
        "SLURM_STEP_NUM_TASKS": "4",
        "SLURM_NODEID": "1",
        "SLURM_STEP_NUM_NODES": "2",
        "SLURM_STEP_NODELIST": "gpu[07-08]",
        "SLURM_JOB_NODELIST": "gpu[07-08]",
        "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
        "SLURM_STEP_ID": "0",
        "SLURM_CPUS_PER_TASK": "6",
    }
    env.update(extra)
    return env


def test_slurm_task():
    env = DistEnv.from_env(slurm_env(SLURM_RESTART_COUNT="2"))
    assert (env.rank, env.local_rank, env.world_size, env.local_world_size) == (3, 1, 4, 2)
    assert (env.node_rank, env.num_nodes, env.master_addr) == (1, 2, "gpu07")
    assert env.master_port == derive_master_port(4242)
    assert (env.job_id, env.restart_count, env.cpus_per_rank, env.source) == ("4242", 2, 6, "slurm")
    assert not env.is_main and env.distributed


def test_batch_shell_without_srun_is_single_process():
    # The batch step has SLURM_PROCID/NTASKS too; without a step id it must not wait for peers.
    raw = slurm_env()
    del raw["SLURM_STEP_ID"]
    env = DistEnv.from_env(raw)
    assert env.source == "single" and env.world_size == 1


def test_torchrun_wins_over_slurm():
    raw = slurm_env(
        RANK="5", LOCAL_RANK="1", WORLD_SIZE="8", LOCAL_WORLD_SIZE="4", GROUP_RANK="1",
        MASTER_ADDR="10.0.0.1", MASTER_PORT="29400", TORCHELASTIC_RUN_ID="abc",
    )  # fmt: skip
    env = DistEnv.from_env(raw)
    assert (env.rank, env.world_size, env.local_world_size, env.num_nodes) == (5, 8, 4, 2)
    assert (env.master_addr, env.master_port, env.source) == ("10.0.0.1", 29400, "torchrun")


def test_submitit_local_and_single():
    env = DistEnv.from_env({"SUBMITIT_LOCAL_GLOBALID": "1", "SUBMITIT_LOCAL_LOCALID": "1", "SUBMITIT_LOCAL_NTASKS": "2",
                            "SUBMITIT_LOCAL_JOB_ID": "777"})  # fmt: skip
    assert (env.rank, env.world_size, env.source) == (1, 2, "submitit-local")
    single = DistEnv.from_env({})
    assert (single.rank, single.world_size, single.source) == (0, 1, "single")


def test_reading_env_does_not_write_it():
    raw = slurm_env()
    before = dict(raw)
    DistEnv.from_env(raw)
    assert raw == before


def test_env_is_immutable():
    env = DistEnv.from_env({})
    with pytest.raises(AttributeError):
        env.rank = 3  # type: ignore[misc]


def test_bad_integer_names_the_variable():
    with pytest.raises(DdpJobError, match="SLURM_PROCID"):
        DistEnv.from_env(slurm_env(SLURM_PROCID="x"))


def test_master_port_separates_jobs():
    ports = {derive_master_port(job) for job in range(100_000, 112_000)}
    assert len(ports) == 12_000  # consecutive job ids never share a port
    assert all(20_000 <= p <= 32_000 for p in ports) and 29_500 not in ports  # torch's default port is skipped
    # Array tasks have their own SLURM_JOB_ID: the task id does not feed the port (it made ports collide).
    a = DistEnv.from_env(slurm_env(SLURM_ARRAY_TASK_ID="3"))
    assert a.master_port == derive_master_port(4242)
    arrays = [(base + task, task) for base in range(5000, 15000, 1000) for task in range(1000)]  # 10 x 1,000
    assert len({derive_master_port(job) for job, _ in arrays}) == len(arrays)
    # an explicit MASTER_PORT wins
    assert DistEnv.from_env(slurm_env(MASTER_PORT="31000")).master_port == 31000


def test_single_process_in_a_batch_script_keeps_the_job_identity():
    raw = slurm_env(SLURM_RESTART_COUNT="2")
    del raw["SLURM_STEP_ID"]
    env = DistEnv.from_env(raw)
    assert (env.source, env.slurm_job_id, env.job_id, env.restart_count) == ("single", "4242", "4242", 2)


def test_hand_exported_rank_variables_under_srun_keep_slurms_local_rank():
    env = DistEnv.from_env(slurm_env(RANK="3", WORLD_SIZE="4", MASTER_ADDR="n1"))
    assert (env.rank, env.local_rank, env.local_world_size, env.node_rank) == (3, 1, 2, 1)


@pytest.mark.parametrize("nodelist", ["n[5-3]", "n[a-b]", "[,]", "n[0-99999999999]", "n[1-2"])
def test_malformed_nodelists_are_project_errors(nodelist):
    with pytest.raises(DdpJobError, match="nodelist"):
        expand_nodelist(nodelist)


def test_process_started_is_when_the_process_began():
    # A fresh interpreter's start, from /proc: after the spawn, before its imports finish (to the kernel's 10 ms ticks).
    code = "import time; from ddp_core.cluster.env import process_started; print(process_started(), time.time())"
    spawned = time.time()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    started, imported = map(float, out.split())
    assert spawned - 0.05 <= started <= imported
