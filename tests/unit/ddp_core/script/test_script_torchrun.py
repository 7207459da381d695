"""``script.launcher: torchrun`` without Slurm: the request it makes, what validation refuses, the agent's torchrun
command line and exit codes, and real runs of ``python -m ddp_core.script RUN`` as one node's agent (2 workers):
the tutorial, the environment contract, signals passed on to the workers, a failing rank, and ``--local``."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Optional, Sequence

import pytest

from ddp_core import python_m
from ddp_core.cluster.env import DistEnv, derive_master_port
from ddp_core.cluster.exits import ExitCode
from ddp_core.config import load_config
from ddp_core.errors import DdpJobError
from ddp_core.run.rundir import RunDir
from ddp_core.script.torchrun import Rendezvous, exit_code, rendezvous, torchrun_argv, worker_pids
from jobs.runs import logs
from jobs.submission import checks
from jobs.submission import partitions as cluster
from jobs.submission.request import SlurmRequest
from tests.support.cli_runner import run_cli
from tests.support.golden import RUN, check_golden
from tests.support.helpers import ROOT, events, template_script
from tests.support.script_ranks import clean_env, free_port

HOST = socket.gethostname()
TUTORIAL = str(ROOT / "examples" / "ddp_tutorial.py")
DIGITS = str(ROOT / "configs" / "digits.yaml")
TORCHRUN = ["script.launcher=torchrun", f"script.path={TUTORIAL}", "run.name=tr"]
EXIT_STOPPED = ExitCode.STOPPED


# --- the request ------------------------------------------------------------------------------------------------


def test_request_is_one_task_per_node_with_all_its_ranks_cpus():
    slurm = ["slurm.nodes=2", "slurm.tasks_per_node=2", "slurm.cpus_per_task=3"]
    srun = SlurmRequest.resolve(load_config(None, [*TORCHRUN[1:], *slurm]))
    tr = SlurmRequest.resolve(load_config(None, [*TORCHRUN, *slurm]))
    assert (srun.nodes, srun.tasks_per_node, srun.cpus_per_task) == (2, 2, 3)
    assert (tr.nodes, tr.tasks_per_node, tr.cpus_per_task) == (2, 1, 6)  # the node's CPUs: the same
    # The agent's task holds 6 CPUs: each of its 2 ranks gets 3 threads, not 6.
    assert tr.environment[0] == "export OMP_NUM_THREADS=$(( ${SLURM_CPUS_PER_TASK:-2} / 2 ))"
    assert srun.environment[0] == "export OMP_NUM_THREADS=${SLURM_CPUS_PER_TASK:-1}"
    # srun is told the task's CPUs itself: since Slurm 22.05 it does not take them from the allocation
    assert (srun.srun_args[-1], tr.srun_args[-1]) == ("--cpus-per-task=3", "--cpus-per-task=6")
    own = ("ntasks-per-node", "cpus-per-task")
    assert {k: v for k, v in tr.sbatch_options().items() if k not in own} == {
        k: v for k, v in srun.sbatch_options().items() if k not in own
    }


def test_gpu_request_gives_the_one_task_all_gpus():
    cfg = load_config(None, [*TORCHRUN, "slurm.gpus_per_node=4", "slurm.nodes=2", "slurm.cpus_per_task=null"])
    request = SlurmRequest.resolve(cfg)
    # 4 ranks (one per GPU) x 4 CPUs per GPU (the default without a known partition), every GPU of the node.
    assert (request.tasks_per_node, request.cpus_per_task, request.gpus) == (1, 16, {"gpus_per_node": 4})
    one = SlurmRequest.resolve(load_config(None, [*TORCHRUN, "slurm.gpus_per_node=4", "strategy.name=dp"]))
    assert (one.tasks_per_node, one.cpus_per_task) == (1, 16)  # dp: one rank per node drives the 4 GPUs
    assert SlurmRequest.resolve(
        load_config(None, [*TORCHRUN, "slurm.gpus_per_node=4", "strategy.name=dp"])
    ).environment[0] == ("export OMP_NUM_THREADS=${SLURM_CPUS_PER_TASK:-1}")


def test_dry_run_prints_the_torchrun_request(tmp_path):
    proc = run_cli("submit", "--script", TUTORIAL, "script.launcher=torchrun", "slurm.nodes=2",
                   "slurm.tasks_per_node=2", "slurm.cpus_per_task=3", "--dry-run", "--no-cluster-check", "--",
                   "--steps", "3", cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    sbatch = [line for line in lines if line.startswith("#SBATCH --") and "=" in line and "%j" not in line]
    assert sbatch == ["#SBATCH --cpus-per-task=6", "#SBATCH --job-name=ddp_tutorial", "#SBATCH --nodes=2",
                      "#SBATCH --ntasks-per-node=1", "#SBATCH --open-mode=append", "#SBATCH --signal=USR2@120",
                      "#SBATCH --time=60", "#SBATCH --wckey=submitit"]  # fmt: skip
    assert "# script.launcher=torchrun: one task per node, a torchrun agent that starts 2 ranks" in lines
    assert "export OMP_NUM_THREADS=$(( ${SLURM_CPUS_PER_TASK:-2} / 2 ))" in lines
    assert "  launcher: torchrun" in lines and "  cpus_per_task: 3" in lines  # per rank, as recorded
    assert not (tmp_path / "runs").exists()


def test_template_for_torchrun():
    cfg = load_config(None, [*TORCHRUN, "slurm.tasks_per_node=2", "slurm.cpus_per_task=2", "slurm.time_min=30"])
    text = template_script(cfg, RUN, python="/usr/bin/python3")
    check_golden("template-script-torchrun.sbatch", text)
    assert "#SBATCH --ntasks-per-node=1\n" in text and "#SBATCH --cpus-per-task=4\n" in text
    assert "\nENTRY=ddp_core.script\n" in text
    assert '-u "${PYTHON_M[@]}" "$ENTRY" "$RUN_DIR"' in text  # the same srun line


def test_cluster_check_and_local_executor_use_the_layout(tmp_path, monkeypatch):
    part = cluster.Partition("gpu", nodes=2, cpus_per_node=12, gpus_per_node=4, default=True)
    monkeypatch.setattr(cluster, "query_partitions", lambda: [part])
    cfg = load_config(None, [*TORCHRUN, "slurm.gpus_per_node=4", "slurm.cpus_per_task=null"])
    checks.resolve(cfg, checks.check_place(cfg))  # 12 CPUs / 4 GPUs: 3 per rank
    assert cfg.slurm.cpus_per_task == 3 and SlurmRequest.resolve(cfg).cpus_per_task == 12
    too_big = load_config(None, [*TORCHRUN, "slurm.tasks_per_node=4", "slurm.cpus_per_task=4"])
    with pytest.raises(DdpJobError, match="needs 16 CPUs per node; partition 'gpu' nodes have 12"):
        checks.resolve(too_big, checks.check_place(too_big))
    local = load_config(None, [*TORCHRUN, "slurm.tasks_per_node=2", f"run.root={tmp_path}"])
    assert checks.resolve(local, checks.check_place(local, local=True)).tasks_per_node == 1  # --local's processes


# --- validation -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--script", TUTORIAL, "script.launcher=mpirun"],
         "config key 'script.launcher' = 'mpirun' is invalid: must be one of srun, torchrun"),
        ([DIGITS, "script.launcher=torchrun"], "config key 'script.launcher' = 'torchrun' is set but no script is"),
        (["--script", TUTORIAL, "script.launcher=torchrun", "slurm.gpus_per_node=2", "slurm.gpu_bind=task"],
         "'script.launcher' = 'torchrun' and 'slurm.gpu_bind' = 'task' cannot be combined"),
    ],
    ids=["value", "no_script", "gpu_bind_task"],
)  # fmt: skip
def test_refused_in_one_line(tmp_path, args, needle):
    proc = run_cli("submit", *args, "--dry-run", "--no-cluster-check", cwd=tmp_path)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and needle in lines[0] and "hint:" in lines[0], proc.stderr
    assert not (tmp_path / "runs").exists()


def test_sweep_cannot_vary_the_launcher(tmp_path):
    proc = run_cli("sweep", "--script", TUTORIAL, "script.launcher=srun,torchrun", "--dry-run", "--no-cluster-check",
                   cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 2 and "sweep key 'script.launcher' cannot vary" in proc.stderr, proc.stderr


# --- the agent's command line and exit code ---------------------------------------------------------------------


def agent_slurm_env(node: int, **extra: str) -> dict[str, str]:
    """What the agent's srun task on node ``node`` of a 2-node, one-task-per-node step has."""
    return {"SLURM_JOB_ID": "4242", "SLURM_PROCID": str(node), "SLURM_LOCALID": "0", "SLURM_NTASKS": "2",
            "SLURM_STEP_NUM_TASKS": "2", "SLURM_NODEID": str(node), "SLURM_STEP_NUM_NODES": "2",
            "SLURM_STEP_NODELIST": "n[1-2]", "SLURM_STEP_TASKS_PER_NODE": "1(x2)", "SLURM_STEP_ID": "0",
            "SLURM_CPUS_PER_TASK": "6", "SLURM_RESTART_COUNT": "1", **extra}  # fmt: skip


def test_agent_argv_static_rendezvous_on_the_first_node(tmp_path):
    from torch.distributed import run as torchrun

    first = rendezvous(DistEnv.from_env(agent_slurm_env(0)), tmp_path)  # node 0's agent publishes the port first
    rdzv = rendezvous(DistEnv.from_env(agent_slurm_env(1)), tmp_path, timeout_s=5)
    assert first == Rendezvous(2, 0, "n1", derive_master_port(4242), "4242")
    assert rdzv == Rendezvous(2, 1, "n1", derive_master_port(4242), "4242")
    argv = torchrun_argv(rdzv, 2, Path("/runs/r"))
    assert argv == ["--nnodes=2", "--nproc-per-node=2", "--rdzv-backend=static", "--rdzv-id=4242", "--node-rank=1",
                    "--master-addr=n1", f"--master-port={derive_master_port(4242)}", "--max-restarts=0",
                    "--monitor-interval=0.2", "--no-python", sys.executable, "-u", "-c", python_m.BOOT, "-m",
                    "ddp_core.script", "/runs/r"]  # fmt: skip
    config, cmd, cmd_args = torchrun.config_from_args(torchrun.parse_args(argv))  # what torchrun makes of it
    assert (config.min_nodes, config.max_nodes, config.nproc_per_node, config.max_restarts) == (2, 2, 2, 0)
    assert (config.rdzv_backend, config.rdzv_endpoint, config.rdzv_configs["rank"]) == (
        "static", f"n1:{derive_master_port(4242)}", 1)  # fmt: skip
    # The worker runs python -m ddp_core.script, unshadowed by a ddp_core.py in its working directory (python_m).
    assert (cmd, cmd_args) == (sys.executable, ["-u", "-c", python_m.BOOT, "-m", "ddp_core.script", "/runs/r"])


def test_agent_rendezvous_refusals_and_local(monkeypatch, tmp_path):
    two_tasks = agent_slurm_env(0, SLURM_NTASKS="4", SLURM_STEP_NUM_TASKS="4", SLURM_STEP_TASKS_PER_NODE="2(x2)")
    with pytest.raises(DdpJobError, match="runs one Slurm task per node, but this step has 4 tasks on 2 node"):
        rendezvous(DistEnv.from_env(two_tasks), tmp_path)
    with pytest.raises(DdpJobError, match="already rank 1 of 2"):
        rendezvous(DistEnv.from_env({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h"}), tmp_path)
    monkeypatch.setenv("MASTER_PORT", "23456")
    local = rendezvous(DistEnv.from_env({}), tmp_path)
    assert (local.nnodes, local.node_rank, local.master_addr, local.master_port) == (1, 0, "127.0.0.1", 23456)
    assert local.run_id == f"local-{os.getpid()}"


def test_agents_meet_on_another_port_when_the_derived_one_is_taken(tmp_path):
    """Another process listens on the job's derived port: node 0's agent takes a free one and publishes it in the run
    directory, and node 1's agent, which would have guessed the taken one, reads it there."""
    with socket.socket() as holder:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        holder.bind(("", derive_master_port(4242, 2)))
        holder.listen()
        first = rendezvous(DistEnv.from_env(agent_slurm_env(0, DDPJOB_LAUNCH="2")), tmp_path)
        second = rendezvous(DistEnv.from_env(agent_slurm_env(1, DDPJOB_LAUNCH="2")), tmp_path, timeout_s=5)
    assert first.master_port != derive_master_port(4242, 2) and second.master_port == first.master_port
    assert (tmp_path / "slurm" / "rendezvous" / "4242.1.2").read_text() == f"{first.master_port}\n"
    with pytest.raises(DdpJobError, match=r"published no port in .*4242\.1\.3 within dist\.init_timeout_s"):
        rendezvous(DistEnv.from_env(agent_slurm_env(1, DDPJOB_LAUNCH="3")), tmp_path, timeout_s=0.2)


def test_worker_identity_is_torchruns_with_slurms_job():
    """A worker inherits its agent's SLURM_* (SLURM_PROCID is the agent's): torchrun's variables win, the restart
    count and job id stay Slurm's, and the agent task's CPUs are shared among the node's workers."""
    worker = agent_slurm_env(1, RANK="3", LOCAL_RANK="1", WORLD_SIZE="4", LOCAL_WORLD_SIZE="2", GROUP_RANK="1",
                             MASTER_ADDR="n1", MASTER_PORT="20123", TORCHELASTIC_RUN_ID="4242",
                             TORCHELASTIC_USE_AGENT_STORE="True")  # fmt: skip
    env = DistEnv.from_env(worker)
    assert (env.source, env.rank, env.local_rank, env.world_size, env.local_world_size) == ("torchrun", 3, 1, 4, 2)
    assert (env.node_rank, env.num_nodes, env.master_addr, env.master_port) == (1, 2, "n1", 20123)
    assert (env.slurm_job_id, env.restart_count, env.cpus_per_rank, env.agent_store) == ("4242", 1, 3, True)


def failure(exitcode: int, local_rank: int = 0):
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    return ProcessFailure(local_rank=local_rank, pid=1000 + local_rank, exitcode=exitcode, error_file="")


@pytest.mark.parametrize(
    ("codes", "expected"),
    [
        ({}, 0),
        ({0: -signal.SIGTERM, 1: 1}, 1),  # rank 1 raised; torch's agent then stopped rank 0
        ({0: EXIT_STOPPED, 1: EXIT_STOPPED}, EXIT_STOPPED),  # runtime.requeue() outside Slurm
        ({0: 3}, 3),  # rank 0 alone: requeue budget spent
        ({0: 143, 1: 143}, 143),  # runtime.requeue() after SIGTERM
        ({2: -signal.SIGTERM, 3: -signal.SIGKILL}, 137),  # the OOM killer first
        ({0: -signal.SIGTERM, 1: -signal.SIGTERM}, 143),  # a plain script, SIGTERM passed on
    ],
)
def test_exit_code_keeps_the_workers_meaning(codes, expected):
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    error = ChildFailedError("ddp_core.script", {r: failure(c, r % 2) for r, c in codes.items()}) if codes else None
    assert exit_code(error, "h", 4) == expected
    assert exit_code(RuntimeError("rendezvous timed out"), "h", 4) == 1


def test_logs_split_attempts_at_the_agents_banner():
    node_log = "".join(
        f"12:00:0{i} [agent node 0/2] INFO ddp_core.script: slurm on n1: torchrun agent node 0/2, 2 ranks per node, "
        f"restart {i}\n"
        f"12:00:0{i} [rank 0/4] INFO ddp_core.script: torchrun on n1: rank 0/4 local 0/2 node 0/2 restart {i}\n"
        f"12:00:0{i} [rank 1/4] INFO ddp_core.script: torchrun on n1: rank 1/4 local 1/2 node 0/2 restart {i}\n"
        for i in range(2)
    )
    attempts = logs.split_attempts(node_log)
    assert len(attempts) == 2 and all(a.count("torchrun on n1: rank") == 2 for a in attempts)
    srun = "x [rank 0/2] INFO ddp_core.script: slurm on n1: rank 0/2 local 0/2 node 0/1 restart 0\n"
    assert len(logs.split_attempts(srun * 2)) == 2  # srun mode: each rank's banner, as before


# --- real runs: python -m ddp_core.script RUN as one node's agent, no Slurm --------------------------------------


def make_torchrun_run(tmp_path: Path, script: str, args: Sequence[str] = (), name: str = "run") -> Path:
    cfg = load_config(None, [f"script.path={script}", "script.launcher=torchrun", "slurm.tasks_per_node=2",
                             "run.name=tr", f"run.root={tmp_path}", "wandb.mode=disabled"])  # fmt: skip
    cfg.script.args = list(args)
    rd = RunDir(tmp_path / name)
    rd.initialize(cfg)
    return rd.path


class Agent:
    """``python -m ddp_core.script RUN`` started alone: this host is the run's one node."""

    def __init__(self, run: Path, logs_dir: Path, env: Optional[dict[str, str]] = None) -> None:
        self.out, self.err = logs_dir / "agent.out", logs_dir / "agent.err"
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.proc = subprocess.Popen([sys.executable, "-m", "ddp_core.script", str(run)], stdout=out, stderr=err,
                                         env=env or clean_env(), cwd=ROOT)  # fmt: skip

    def wait(self, timeout: float = 120) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:  # its workers too: each in a session of its own, they would outlive it
                for pid in [*worker_pids(self.proc.pid), self.proc.pid]:
                    os.kill(pid, signal.SIGKILL)
                self.proc.wait()

    def wait_output(self, needle: str, count: int, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while self.out.read_text().count(needle) < count:
            assert time.monotonic() < deadline and self.proc.poll() is None, self.text()
            time.sleep(0.05)

    def text(self) -> str:
        return self.out.read_text() + self.err.read_text()


def test_tutorial_under_the_agent_two_workers(tmp_path):
    port = free_port()
    run = make_torchrun_run(tmp_path, TUTORIAL, ["--steps", "5"])
    agent = Agent(run, tmp_path, clean_env(MASTER_PORT=str(port)))
    assert agent.wait() == 0, agent.text()
    out = agent.text()
    for rank in (0, 1):  # WORLD_SIZE 2, RANK and LOCAL_RANK 0/1, the agent's store as master
        assert f"rank {rank}/2 local_rank {rank} master 127.0.0.1:{port}" in out, out
        assert f"rank {rank}: final loss" in out and "after 5 steps" in out, out
    assert f"single on {HOST}: torchrun agent node 0/1, 2 ranks per node, restart 0" in out
    assert f"--nproc-per-node=2 --rdzv-backend=static --rdzv-id=local-{agent.proc.pid}" in out
    assert [e["event"] for e in events(run)] == ["start", "completed"]
    assert events(run, "start")[0]["world_size"] == 2


CONTRACT = """\
import os
keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
        "MASTER_ADDR", "DDPJOB_RUN_DIR", "DDPJOB_CHECKPOINT_DIR", "DDPJOB_RESTART_COUNT", "DDPJOB_SIGNAL",
        "OMP_NUM_THREADS", "TORCHELASTIC_USE_AGENT_STORE"]
print("contract", " ".join(f"{k}={os.environ.get(k)}" for k in keys), flush=True)
"""


def test_workers_get_script_modes_environment_contract(tmp_path):
    """No Slurm step, but SLURM_RESTART_COUNT and SLURM_CPUS_PER_TASK set (as a one-task job's batch shell has them):
    the restart count reaches the workers, and each gets half of the task's 4 CPUs."""
    script = tmp_path / "contract.py"
    script.write_text(CONTRACT)
    run = make_torchrun_run(tmp_path, str(script))
    env = {k: v for k, v in clean_env().items() if k != "OMP_NUM_THREADS"}
    agent = Agent(run, tmp_path, env | {"SLURM_RESTART_COUNT": "3", "SLURM_CPUS_PER_TASK": "4", "DDPJOB_SIGNAL": "x"})
    assert agent.wait() == 0, agent.text()
    found = sorted(re.findall(r"^contract (.*)$", agent.out.read_text(), re.M))
    assert found == [
        f"RANK={r} LOCAL_RANK={r} WORLD_SIZE=2 LOCAL_WORLD_SIZE=2 GROUP_RANK=0 GROUP_WORLD_SIZE=1 ROLE_RANK={r} "
        f"MASTER_ADDR=127.0.0.1 DDPJOB_RUN_DIR={run} DDPJOB_CHECKPOINT_DIR={run / 'checkpoints'} "
        "DDPJOB_RESTART_COUNT=3 DDPJOB_SIGNAL=USR2 OMP_NUM_THREADS=2 TORCHELASTIC_USE_AGENT_STORE=True"
        for r in (0, 1)
    ]
    assert events(run, "start")[0]["restart_count"] == 3


STOPS = """\
import time
import torch.distributed as dist
from ddp_core import runtime
dist.init_process_group("gloo")
print(f"rank {dist.get_rank()} ready", flush=True)
step = 0
while True:
    step += 1
    time.sleep(0.02)
    if runtime.stop_requested():
        print(f"rank {dist.get_rank()}: stopping at step {step}", flush=True)
        runtime.requeue(step=step)
"""


@pytest.mark.parametrize("sig", [signal.SIGUSR2, signal.SIGTERM], ids=["USR2", "TERM"])
def test_signal_to_the_agent_reaches_both_workers(tmp_path, sig):
    """Only the agent is signalled (torch starts each worker in a session of its own: nothing else reaches them):
    both ranks see stop_requested() after the same step and stop cleanly (outside Slurm: exit 4, kept by the agent)."""
    script = tmp_path / "stops.py"
    script.write_text(STOPS)
    run = make_torchrun_run(tmp_path, str(script))
    agent = Agent(run, tmp_path)
    agent.wait_output(" ready", 2)
    time.sleep(0.3)  # a few steps in
    os.kill(agent.proc.pid, sig)
    assert agent.wait(90) == EXIT_STOPPED, agent.text()
    steps = re.findall(r"rank (\d): stopping at step (\d+)", agent.out.read_text())
    assert sorted(r for r, _ in steps) == ["0", "1"] and steps[0][1] == steps[1][1], agent.text()
    stop = events(run, "interrupted")[0]
    assert (stop["kind"], stop["step"]) == ("stopped", int(steps[0][1]))
    assert f"rank 0/2 on {HOST} exited with code {EXIT_STOPPED} first" in agent.text()


def test_warning_waits_for_a_worker_to_handle_it(tmp_path):
    """The warning signal arrives while the workers still ignore it (``ddp_core.runtime`` not imported yet): the
    agent keeps it and passes it on once each worker handles it (srun mode would lose it)."""
    script = tmp_path / "late.py"
    script.write_text("import time\ntime.sleep(2)\n" + STOPS)
    run = make_torchrun_run(tmp_path, str(script))
    agent = Agent(run, tmp_path)
    deadline = time.monotonic() + 60
    while agent.err.read_text().count(f"torchrun on {HOST}: rank") < 2:  # both workers run, runtime not imported
        assert time.monotonic() < deadline and agent.proc.poll() is None, agent.text()
        time.sleep(0.05)
    os.kill(agent.proc.pid, signal.SIGUSR2)
    assert agent.wait(90) == EXIT_STOPPED, agent.text()
    assert len(re.findall(r"rank \d: stopping at step \d+", agent.out.read_text())) == 2, agent.text()


PLAIN = """\
import time
import torch.distributed as dist
dist.init_process_group("gloo")
print(f"rank {dist.get_rank()} ready", flush=True)
for _ in range(40):
    time.sleep(0.05)
    dist.barrier()
print(f"rank {dist.get_rank()} done", flush=True)
"""


def test_plain_script_runs_on_through_the_warning_signal(tmp_path):
    """A script without ddp_core.runtime ignores the warning signal, as in srun mode: the agent does not pass it to
    a worker that would die of it, and the run completes."""
    script = tmp_path / "plain.py"
    script.write_text(PLAIN)
    run = make_torchrun_run(tmp_path, str(script))
    agent = Agent(run, tmp_path)
    agent.wait_output(" ready", 2)
    os.kill(agent.proc.pid, signal.SIGUSR2)
    assert agent.wait(90) == 0, agent.text()
    assert agent.out.read_text().count(" done") == 2
    assert [e["event"] for e in events(run)] == ["start", "completed"]


def test_failing_worker_is_named_and_the_agent_ends_fast(tmp_path):
    script = tmp_path / "fails.py"
    script.write_text(
        textwrap.dedent("""\
        import time
        import torch.distributed as dist
        dist.init_process_group("gloo")
        if dist.get_rank() == 1:
            raise ValueError("bad batch at step 3")
        time.sleep(300)
    """)
    )
    run = make_torchrun_run(tmp_path, str(script))
    started = time.monotonic()
    agent = Agent(run, tmp_path)
    assert agent.wait(120) == 1, agent.text()
    assert time.monotonic() - started < 60
    err = agent.err.read_text()
    assert f"[rank 1/2] ERROR ddp_core.script: rank 1/2 on {HOST} failed: ValueError: bad batch at step 3" in err, err
    assert f"rank 1/2 on {HOST} exited with code 1 first" in err, err


def test_local_submit_runs_one_agent(tmp_path):
    """``ddpjob submit --local``: submitit's local executor starts one task, ddp_core.script.run, whose agent runs
    the two ranks."""
    proc = run_cli("submit", "--script", TUTORIAL, "--local", "script.launcher=torchrun", "slurm.tasks_per_node=2",
                   "--", "--steps", "3", cwd=tmp_path, timeout=180, env=clean_env())  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (run,) = (tmp_path / "runs").iterdir()
    slurm = sorted(p.name.split("_", 1)[1] for p in (run / "slurm").glob("*_log.*"))
    assert slurm == ["0_log.err", "0_log.out"]  # one task
    out = "".join(p.read_text() for p in (run / "slurm").glob("*_0_log.out"))
    assert "rank 0: final loss" in out and "rank 1: final loss" in out, out
    assert [e["event"] for e in RunDir(run).events()] == ["start", "completed"]
