"""Script mode on the real local cluster: users' own torchrun-style scripts, submitted as they are.

The PyTorch DDP tutorial's pattern across two nodes (submitit path and plain sbatch; and with script.launcher=torchrun,
2 ranks per node), the char-level transformer script interrupted twice (a requeue after a requeue: more would repeat
it) ending bitwise equal to an uninterrupted run (and under torchrun, interrupted once, equal to srun mode's), a failing
rank named, and a task module edited while its job waits for a requeue (the requeued attempt runs the code as
submitted).
"""

from __future__ import annotations

import random
import re
import subprocess
import time
from pathlib import Path

import pytest

from tests.support import cluster_guard
from tests.support.cli_runner import field, run_cli
from tests.support.helpers import FINAL_DIGEST, ROOT, digests, events, metric_steps, rank_logs, wait_for, wait_gone

pytestmark = [pytest.mark.cluster_shared("a")]  # 2-CPU jobs: see tests/support/cluster_guard.py
TUTORIAL = str(ROOT / "examples" / "ddp_tutorial.py")
CHARLM = str(ROOT / "examples" / "charlm_script.py")
CHARLM_ARGS = ["--", "--steps", "300", "--save-every", "1000", "--log-every", "5", "--batch", "4"]
CHARLM_COMMON = ["--script", CHARLM, "slurm.tasks_per_node=2"]


def _submitted(proc: subprocess.CompletedProcess[str]) -> tuple[str, Path]:
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return field(proc.stdout, "job"), Path(field(proc.stdout, "run dir"))


def rank_output(run_dir: Path, job_id: str) -> dict[int, str]:
    """Each rank's stdout then stderr: a script prints to stdout, ddpjob logs to stderr."""
    out = {}
    for rank, err in rank_logs(run_dir, job_id).items():
        path = run_dir / "slurm" / f"{job_id}_{rank}_log.out"
        out[rank] = (path.read_text() if path.exists() else "") + err
    return out


def _nodes(job_id: str) -> str:
    """The job's node list in accounting, once it is final: slurmdbd (22.05) answers COMPLETED with the first node
    alone ("n1") for a few seconds before the whole list (seen: 3 s; a flake of this module's 2-node test)."""

    def listed() -> str:
        return subprocess.run(["sacct", "-n", "-X", "-P", "-o", "NodeList", "-j", job_id], capture_output=True,
                              text=True).stdout.strip()  # fmt: skip

    try:
        return wait_for(lambda: (nodes := listed()) != "n1" and nodes, 30, f"job {job_id}'s node list in accounting")
    except AssertionError:
        return listed()


@pytest.fixture(scope="module")
def charlm_reference(slurm_cluster, tmp_path_factory) -> str:
    """The uninterrupted charlm_script run in srun mode (2 ranks): the digest both interrupted runs must end with."""
    cwd = tmp_path_factory.mktemp("charlm-ref")
    with cluster_guard.turn(shared=True):  # a module fixture runs before the test's own turn
        proc = run_cli("submit", *CHARLM_COMMON, "wandb.mode=disabled", "--wait", *CHARLM_ARGS, cwd=cwd)
    job, run_dir = _submitted(proc)
    final = set(digests(rank_output(run_dir, job)).values())
    assert len(final) == 1
    return final.pop()


@pytest.mark.slurm_interface
@pytest.mark.cluster_user
def test_tutorial_script_runs_unchanged_on_two_nodes(slurm_cluster, tmp_path):
    """examples/ddp_tutorial.py (no ddpjob import) as a 2-node job: world size 2, one rank on each of n1 and n2;
    then the same through the sbatch template (scripts/submit.sh)."""
    job_id, run_dir = _submitted(run_cli("submit", "--script", TUTORIAL, "slurm.nodes=2", "slurm.tasks_per_node=1",
                                         "--wait", "--", "--steps", "5", cwd=tmp_path))  # fmt: skip
    logs = rank_output(run_dir, job_id)
    assert sorted(logs) == [0, 1]
    for rank in (0, 1):
        assert re.search(rf"rank {rank}/2 local_rank 0 master n1:\d+", logs[rank]), logs[rank]
        assert f"rank {rank}: final loss" in logs[rank]
    assert _nodes(job_id) == "n[1-2]"
    assert [e["event"] for e in events(run_dir)] == ["start", "completed"]

    proc = subprocess.run([str(ROOT / "scripts" / "submit.sh"), "--script", TUTORIAL, "slurm.nodes=2",
                           "slurm.tasks_per_node=1", "--", "--steps", "5"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    job_id, run_dir = _submitted(proc)
    assert wait_gone(job_id) == "COMPLETED", (run_dir / "slurm" / f"{job_id}_batch.out").read_text()
    assert "ENTRY=ddp_core.script" in (run_dir / "slurm" / "job.sbatch").read_text()
    logs = rank_output(run_dir, job_id)
    assert all(f"rank {r}: final loss" in logs[r] for r in (0, 1)) and _nodes(job_id) == "n[1-2]"


def test_charlm_script_interrupted_twice_ends_bitwise_equal(charlm_reference, tmp_path):
    """examples/charlm_script.py, 2 ranks, ``scancel --signal=USR2`` twice at random moments: one job id,
    restart count 2, the steps continue without a gap, and the uninterrupted twin's weights. (W&B across a script's
    attempts: tests/unit/ddp_core/script/test_script_mode.py sends it only the steps not sent before, and the writer's
    offline records of one run across attempts are tests/unit/ddp_core/trainer/test_wandb.py's and, across Slurm
    requeues, tests/cluster/test_preemption.py's.)"""
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    job_id, run_dir = _submitted(run_cli("submit", *CHARLM_COMMON, "wandb.mode=disabled", *CHARLM_ARGS, cwd=tmp_path))
    stopped = [0]
    for i in range(2):
        wait_for(lambda n=i: len(events(run_dir, "start")) > n and max(metric_steps(run_dir), default=0)
                 > stopped[-1] + 5, 120, f"attempt {i + 1} to train")  # fmt: skip
        time.sleep(rng.uniform(0.0, 1.0))
        subprocess.run(["scancel", "--signal=USR2", job_id], check=True)
        wait_for(lambda n=i: len(events(run_dir, "interrupted")) > n, 60, f"interruption {i + 1}")
        stopped.append(events(run_dir, "interrupted")[-1]["step"])
    assert wait_gone(job_id) == "COMPLETED", f"seed {seed}"
    starts = events(run_dir, "start")
    assert [s["restart_count"] for s in starts] == [0, 1, 2] and {s["job_id"] for s in starts} == {job_id}
    assert len(events(run_dir, "requeued")) == 2 and events(run_dir)[-1]["event"] == "completed"
    logs = rank_output(run_dir, job_id)
    resumed = [int(m) for m in re.findall(r"rank 0: resumed from step_(\d+)\.pt \(restart \d\)", logs[0])]
    assert resumed == stopped[1:], f"seed {seed}: stopped at {stopped[1:]}, resumed at {resumed}"
    steps = metric_steps(run_dir)
    assert steps == list(range(5, 301, 5)), steps  # every logged step once, none lost
    assert digests(logs) == {0: charlm_reference, 1: charlm_reference}, f"seed {seed}"


@pytest.mark.slurm_interface
@pytest.mark.cluster_user
def test_tutorial_under_torchrun_on_two_nodes(slurm_cluster, tmp_path):
    """script.launcher=torchrun, 2 nodes x 2 ranks: one Slurm task per node (its log holds the node's ranks), whose
    torchrun agent starts ranks 0-1 on n1 and 2-3 on n2, world size 4, rendezvous on n1."""
    job_id, run_dir = _submitted(run_cli("submit", "--script", TUTORIAL, "script.launcher=torchrun", "slurm.nodes=2",
                                         "slurm.tasks_per_node=2", "--wait", "--", "--steps", "5",
                                         cwd=tmp_path))  # fmt: skip
    logs = rank_output(run_dir, job_id)  # one file per task: here, per node
    assert sorted(logs) == [0, 1], sorted(logs)
    for node, host in enumerate(("n1", "n2")):
        assert f"slurm on {host}: torchrun agent node {node}/2, 2 ranks per node, restart 0" in logs[node]
        for local in (0, 1):
            rank = 2 * node + local
            assert f"torchrun on {host}: rank {rank}/4 local {local}/2 node {node}/2 restart 0" in logs[node]
            assert re.search(rf"rank {rank}/4 local_rank {local} master n1:\d+", logs[node]), logs[node]
            assert f"rank {rank}: final loss" in logs[node]
    assert _nodes(job_id) == "n[1-2]"
    assert [e["event"] for e in events(run_dir)] == ["start", "completed"]
    assert events(run_dir, "start")[0]["world_size"] == 4


def test_charlm_under_torchrun_requeued_once_matches_srun_mode(charlm_reference, tmp_path):
    """examples/charlm_script.py with script.launcher=torchrun (2 ranks on one node), ``scancel --signal=USR2`` once:
    the same job requeued, restart count 1, resumed from the interruption's checkpoint, every logged step once, and
    the weights of the same script and arguments run uninterrupted in srun mode."""
    job_id, run_dir = _submitted(run_cli("submit", *CHARLM_COMMON, "wandb.mode=disabled", "script.launcher=torchrun",
                                         *CHARLM_ARGS, cwd=tmp_path))  # fmt: skip
    wait_for(lambda: events(run_dir, "start") and max(metric_steps(run_dir), default=0) > 20, 120, "it to train")
    subprocess.run(["scancel", "--signal=USR2", job_id], check=True)
    wait_for(lambda: events(run_dir, "interrupted"), 60, "the interruption")
    stopped = events(run_dir, "interrupted")[0]["step"]
    assert wait_gone(job_id) == "COMPLETED"
    starts = events(run_dir, "start")
    assert [s["restart_count"] for s in starts] == [0, 1] and {s["job_id"] for s in starts} == {job_id}
    assert [e["event"] for e in events(run_dir)][-2:] == ["start", "completed"]
    assert len(events(run_dir, "requeued")) == 1
    (node,) = rank_output(run_dir, job_id).values()  # one task: the node's agent and both of its ranks
    for rank in (0, 1):
        assert f"rank {rank}: resumed from step_{stopped:08d}.pt (restart 1)" in node, node[-3000:]
    assert metric_steps(run_dir) == list(range(5, 301, 5))
    final = FINAL_DIGEST.findall(node)
    assert final == [charlm_reference] * 2


def test_failing_rank_ends_the_job_fast_and_is_named(slurm_cluster, tmp_path):
    script = tmp_path / "fails.py"
    script.write_text(
        "import os, time\n"
        "import torch.distributed as dist\n"
        "dist.init_process_group('gloo')\n"
        "if dist.get_rank() == 1:\n"
        "    raise ValueError('bad batch at step 3')\n"
        "time.sleep(300)\n"
    )
    started = time.monotonic()
    proc = run_cli("submit", "--script", str(script), "slurm.tasks_per_node=2", "--wait", cwd=tmp_path)
    took = time.monotonic() - started
    assert proc.returncode == 1, proc.stdout + proc.stderr
    job_id, run_dir = field(proc.stdout, "job"), Path(field(proc.stdout, "run dir"))
    logs = rank_output(run_dir, job_id)
    assert re.search(r"rank 1/2 on \S+ failed: ValueError: bad batch at step 3", logs[1]), logs[1]
    assert took < 120, f"the job took {took:.0f} s to end after rank 1 failed"


TASK = """
import logging
from tests.support.tasks import SlowDigitsTask
from {pkg}.settings import MARK


class MarkedTask(SlowDigitsTask):
    def build_model(self, **kwargs):
        logging.getLogger("ddp_core").warning("snapshot mark: %s", MARK)
        return super().build_model(**kwargs)
"""


def test_requeued_attempt_runs_the_code_as_submitted(slurm_cluster, tmp_path):
    """The task's package is edited while its job runs; the attempt after a requeue still imports the snapshot."""
    pkg = tmp_path / "src" / "marktask"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "settings.py").write_text('MARK = "as submitted"\n')
    (pkg / "task.py").write_text(TASK.format(pkg="marktask"))
    env = {"PYTHONPATH": f"{tmp_path / 'src'}:{ROOT}"}
    # One rank: what rank 0's attempts import is the point.
    config = [str(ROOT / "configs" / "digits.yaml"), "task.target=marktask.task:MarkedTask", "train.max_steps=60",
              "train.log_every=5", "train.eval_every=0", "wandb.mode=disabled", "task.data.pause_s=0.05",
              "slurm.tasks_per_node=1"]  # fmt: skip
    job_id, run_dir = _submitted(run_cli("submit", *config, cwd=tmp_path, env=env))
    wait_for(lambda: max(metric_steps(run_dir), default=0) >= 5, 120, "the first attempt to train")
    (pkg / "settings.py").write_text('MARK = "edited later"\n')
    subprocess.run(["scancel", "--signal=USR2", job_id], check=True)
    assert wait_gone(job_id) == "COMPLETED"
    assert len(events(run_dir, "start")) == 2
    marks = re.findall(r"snapshot mark: (.+)", rank_output(run_dir, job_id)[0])
    assert marks == ["as submitted", "as submitted"], marks


def test_cancelled_script_run_resumes_from_its_checkpoint(slurm_cluster, tmp_path):
    """``ddpjob cancel`` a charlm script run mid-training: it saves and is not requeued; ``ddpjob resume`` reruns the
    recorded script and arguments from the run's snapshot and continues at the saved step, to the end. One rank: the
    ranks' agreement on a signal is every other test's."""
    job_id, run_dir = _submitted(run_cli("submit", "--script", CHARLM, "slurm.tasks_per_node=1", "wandb.mode=disabled",
                                         "--", "--steps", "400", "--save-every", "1000", "--log-every", "5",
                                         "--batch", "4", cwd=tmp_path))  # fmt: skip
    wait_for(lambda: max(metric_steps(run_dir), default=0) >= 20, 120, "the first attempt to train")
    cancel = run_cli("cancel", str(run_dir), cwd=tmp_path)
    assert cancel.returncode == 0, cancel.stdout + cancel.stderr
    assert wait_gone(job_id).startswith("CANCELLED")
    (stop,) = events(run_dir, "interrupted")
    assert stop["kind"] == "cancelled" and not events(run_dir, "requeued")
    resumed = run_cli("resume", str(run_dir), "--wait", cwd=tmp_path)
    new_job = field(resumed.stdout, "job")
    assert resumed.returncode == 0 and new_job != job_id, resumed.stdout + resumed.stderr
    out = rank_output(run_dir, new_job)[0]
    assert f"rank 0: resumed from step_{stop['step']:08d}.pt" in out and "final weights sha256" in out
    assert events(run_dir)[-1]["event"] == "completed" and metric_steps(run_dir)[-1] == 400


@pytest.fixture(scope="module")
def uninterrupted_weights(slurm_cluster, tmp_path_factory) -> str:
    """tests/support/resume_script.py's final weights, uninterrupted, in the layout of the tests below (2 ranks, one
    node)."""
    script = str(ROOT / "tests" / "support" / "resume_script.py")
    plain = run_cli("submit", "--script", script, "slurm.tasks_per_node=2", "wandb.mode=disabled", "--wait",
                    cwd=tmp_path_factory.mktemp("uninterrupted"))  # fmt: skip
    assert plain.returncode == 0, plain.stdout + plain.stderr
    ref = rank_output(Path(field(plain.stdout, "run dir")), field(plain.stdout, "job"))[0]
    assert "resumed" not in ref, ref
    return re.search(r"finished at step 20, weights (\w+)", ref)[1]  # type: ignore[index]


@pytest.mark.parametrize("launcher", ["srun", "torchrun"])
def test_a_plain_script_with_resume_args_survives_a_requeue_and_a_kill(
    slurm_cluster, tmp_path, launcher, uninterrupted_weights
):
    """script.resume_args: a plain script that saves its own checkpoints, given the warning signal on its first
    attempt (it has no handler: ddpjob requeues it) and with a rank killed by SIGKILL on its second
    (tests/support/resume_script.py: restarted in that attempt's allocation, a new rendezvous under torchrun too),
    finishes in the same job, resuming from its own checkpoint each time, with the
    weights of an uninterrupted run. Under torchrun too: its rank 0 worker gets the warning from Slurm as an srun rank
    does, and the agent reports the worker the signal killed."""
    script = str(ROOT / "tests" / "support" / "resume_script.py")
    proc = run_cli("submit", "--script", script, "slurm.tasks_per_node=2", "script.resume_args=[--resume]",
                   f"script.launcher={launcher}", "wandb.mode=disabled", "--wait", "--", "--interrupt",
                   cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    job_id, run_dir = field(proc.stdout, "job"), Path(field(proc.stdout, "run dir"))
    out = rank_output(run_dir, job_id)
    ranks = "\n".join(out.values())  # under torchrun, the node's one task prints both ranks
    for rank in (0, 1):
        resumed = re.findall(rf"rank {rank}: resumed from step (\d+) of its own checkpoint", ranks)
        assert resumed == ["5", "12"], ranks
        assert f"rank {rank}: finished at step 20, weights {uninterrupted_weights}" in ranks, ranks
    failures = [(e["kind"], e["rank"], e["error"]) for e in events(run_dir, "failure")]
    signal = {"srun": "Killed", "torchrun": "SIGKILL"}[launcher]
    assert failures == [("infrastructure", 1, f"killed by a signal ({signal})")], failures
    # The warning requeues the job (attempt 1); the kill restarts the ranks in that attempt's allocation (job step 1).
    assert [(e["restart_count"], e["launch"]) for e in events(run_dir, "start")] == [(0, 0), (1, 0), (1, 1)]
    assert [e["kind"] for e in events(run_dir, "requeued")] == ["preemption"]
    assert [(e["restart_count"], e["launch"]) for e in events(run_dir, "restarted")] == [(1, 1)]
    assert "the warning signal (SIGUSR2) came and the script has no handler for it" in ranks
