"""Recovery inside the allocation (docs/failures.md): a rank killed from outside, or a whole node lost, costs a new job
step in the same allocation, never a trip through the queue, and the run still ends bitwise equal to an uninterrupted
one; past slurm.max_restarts, and when the batch node itself dies, the queue is the fallback. Two nodes of partition
"wide" (n1 and n2 on an idle cluster; n3 weighs more and is the spare); the module takes the cluster alone. The tests
marked cluster_user run as ddpjob-alice on the site profile (the user pass), the node deaths through the fault broker
(tests/support/faults.py); one stays root's: the waiting job's --priority=TOP is an operator's. On the site profile
a node killed under a running step keeps that step's memory on the other nodes (Slurm 22.05: "unable to update job's
core use information due to job resizing"): the next step, on the spare or on the survivor alone, asks for none
(--mem=0, ddp_core.cluster.supervise), or Slurm refuses it ("Memory required by task is not available")."""

from __future__ import annotations

import re
import socket
import subprocess
from pathlib import Path

import pytest

from tests.support.cli_runner import field, run_cli
from tests.support.digits import DIGITS, TWO
from tests.support.helpers import (
    ROOT,
    SLURM_POLL_S,
    digests,
    events,
    rank_logs,
    submit_and_kill_node,
    submit_and_lose_batch_node,
    wait_for,
)

KILLED_ONCE = ["task.target=tests.support.tasks:CrashingTask", "task.data.crash_at=25", "task.data.error=SIGKILL",
               "task.data.crash_launch=0"]  # fmt: skip


@pytest.fixture(scope="module")
def reference(slurm_cluster, tmp_path_factory) -> dict[int, str]:
    """The uninterrupted 2-node run's weight digests."""
    proc = run_cli("submit", DIGITS, "--wait", *TWO, cwd=tmp_path_factory.mktemp("reference"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    found = digests(rank_logs(Path(field(proc.stdout, "run dir")), field(proc.stdout, "job")))
    assert found[0] == found[1]
    return found


def sacct(job_id: str, fields: str) -> list[str]:
    return subprocess.run(["sacct", "-n", "-P", "-X", "-D", "-o", fields, "-j", job_id],
                          capture_output=True, text=True).stdout.split()  # fmt: skip


def test_a_killed_rank_restarts_in_the_allocation_ahead_of_a_waiting_job(slurm_cluster, tmp_path, reference):
    """Rank 1 dies by SIGKILL at its 25th batch while a top-priority job waits for two whole nodes of the partition
    (n3 and one of the run's): the ranks run again as a new job step of the same allocation from the checkpoint at
    step 20, the waiting job never gets the run's nodes, and the run ends with the uninterrupted run's weights."""
    waiting = subprocess.run(
        ["sbatch", "--parsable", "-p", "wide", "-N", "2", "--exclusive", "--priority=TOP", "-J", "competitor",
         "-o", str(tmp_path / "competitor.out"), "--begin=now+3", "--wrap", "sleep 1"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert waiting.returncode == 0, waiting.stderr
    competitor = waiting.stdout.strip()
    proc = run_cli("submit", DIGITS, "--wait", *TWO, "task.data.crash_rank=1", *KILLED_ONCE, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run_dir, job_id = Path(field(proc.stdout, "run dir")), field(proc.stdout, "job")
    seen = [(e["event"], e.get("launch")) for e in events(run_dir) if e["event"] not in ("rank_failed",)]
    assert seen == [("start", 0), ("failure", None), ("restarted", 1), ("start", 1), ("completed", None)], seen
    [failure] = events(run_dir, "failure")
    assert failure["kind"] == "infrastructure" and failure["rank"] == 1 and "killed by a signal" in failure["error"]
    assert {e["restart_count"] for e in events(run_dir, "start")} == {0}  # one attempt: no requeue
    assert sacct(job_id, "State") == ["COMPLETED"], sacct(job_id, "State")
    shown = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True).stdout
    assert "Restarts=0" in shown, shown
    wait_for(
        lambda: sacct(competitor, "State") == ["COMPLETED"],
        60,
        "the waiting job to run after the run",
        poll=SLURM_POLL_S,
    )
    [run_end] = sacct(job_id, "End")
    [competitor_start] = sacct(competitor, "Start")
    assert competitor_start >= run_end, (competitor_start, run_end)
    logs = rank_logs(run_dir, job_id)
    assert "resumed from step_00000020.pt" in logs[0] and digests(logs) == reference, logs
    status = run_cli("status", str(run_dir), cwd=tmp_path)
    assert "(infrastructure: restarted in the allocation on n1,n2)" in status.stdout, status.stdout


@pytest.mark.cluster_user
def test_a_spent_restart_budget_falls_back_to_the_queue(slurm_cluster, tmp_path, reference):
    """slurm.max_restarts=1: rank 1 (on n2) dies at its 25th batch of the first job step and again of the second.
    Two kills of a process are no evidence that its node is bad (Slurm says n2 is fine), so nothing is excluded: the
    first failure restarts the ranks in the allocation, the second finds the restart budget spent and requeues the
    job through the queue (within slurm.max_failures), and its next attempt completes with the uninterrupted run's
    weights."""
    proc = run_cli(
        "submit", DIGITS, "--wait", *TWO, "task.target=tests.support.tasks:CrashingTask", "task.data.crash_at=25",
        "task.data.error=SIGKILL", "task.data.crash_rank_by_launch=[1,1]", "slurm.max_restarts=1", cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run_dir, job_id = Path(field(proc.stdout, "run dir")), field(proc.stdout, "job")
    seen = [(e["event"], e.get("restart_count"), e.get("launch")) for e in events(run_dir)
            if e["event"] in ("start", "restarted", "requeued", "excluded", "completed")]  # fmt: skip
    assert seen == [("start", 0, 0), ("restarted", 0, 1), ("start", 0, 1), ("requeued", None, None),
                    ("start", 1, 0), ("completed", None, None)], seen  # fmt: skip
    assert [(e["host"], e["kind"]) for e in events(run_dir, "failure")] == [("n2", "infrastructure")] * 2
    [requeued] = events(run_dir, "requeued")
    assert requeued["kind"] == "failure" and requeued["count"] == 1 and requeued["step"] == 43, requeued
    logs = rank_logs(run_dir, job_id)
    assert "resumed from step_00000040.pt" in logs[0] and digests(logs) == reference, logs


@pytest.mark.cluster_user
@pytest.mark.slurm_interface  # --no-kill, the resized job and the restart step's --overlap --mem=0: each release's own
def test_a_dead_node_is_replaced_by_the_spare_without_a_requeue(slurm_cluster, tmp_path, reference):
    """slurm.spare_nodes=1: the job holds n1, n2 and n3; the batch script runs on n1, which is kept as the spare, and
    the ranks run on n2 and n3. n2 dies whole at its rank's 25th batch (its slurmd and every process on it killed from
    outside, scripts/slurm-local kill-node): the allocation survives (--no-kill), and the next job step runs on n3 and
    the spare n1, from the checkpoint at step 20, with the uninterrupted run's weights."""
    halted = tmp_path / "halted"
    halt = ["task.data.crash_host=n2", "task.data.crash_at=25", "task.data.error=HALT", f"task.data.halt_file={halted}",
            "task.data.crash_launch=0"]  # fmt: skip
    overrides = [DIGITS, "--wait", *TWO, "slurm.spare_nodes=1", "task.target=tests.support.tasks:CrashingTask", *halt]
    code, out, err = submit_and_kill_node(overrides, tmp_path, "n2", halted)
    assert code == 0, out + err
    run_dir, job_id = Path(field(out, "run dir")), field(out, "job")
    seen = [(e["event"], e.get("host")) for e in events(run_dir) if e["event"] not in ("rank_failed",)]
    # n2 was lost, but the job (2 nodes and a spare) cannot do without it in partition "wide" (n1-n3): kept.
    assert seen == [("start", None), ("failure", "n2"), ("not_excluded", "n2"), ("restarted", None), ("start", None),
                    ("completed", None)], seen  # fmt: skip
    [restarted] = events(run_dir, "restarted")
    assert restarted["nodes"] == ["n3", "n1"] and restarted["restart_count"] == 0, restarted
    starts = [(e["launch"], e["nodes"]) for e in events(run_dir, "start")]
    assert starts == [(0, 2), (1, 2)], starts
    # Slurm took the dead node out of the allocation (a RESIZING record of the one before) and kept the job running.
    assert sacct(job_id, "State,NodeList") == ["RESIZING|n[1-3]", "COMPLETED|n[1,3]"], sacct(job_id, "State,NodeList")
    logs = rank_logs(run_dir, job_id)
    assert "resumed from step_00000020.pt" in logs[0] and digests(logs) == reference, logs


@pytest.mark.cluster_user
def test_a_taken_rendezvous_port_is_replaced_by_one_the_ranks_agree_on(slurm_cluster, tmp_path):
    """Another process listens on the port the job's ranks would meet on (here: the one its MASTER_PORT names, as a
    job sharing the node whose id maps to the same port would): rank 0 listens on a free port instead and publishes
    it in the run directory, rank 1 reads it there, and the job completes."""
    with socket.socket() as holder:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        holder.bind(("", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        proc = run_cli("submit", DIGITS, "--wait", *TWO, f"slurm.setup=['export MASTER_PORT={taken}']", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run_dir, job_id = Path(field(proc.stdout, "run dir")), field(proc.stdout, "job")
    published = int((run_dir / "slurm" / "rendezvous" / f"{job_id}.0.0").read_text())
    logs = rank_logs(run_dir, job_id)
    assert published != taken and f"rendezvous port {taken} is in use on n1: listening on {published}" in logs[0]
    assert f"master n1:{taken}" in logs[1]  # its derived port, as logged before it read the published one


@pytest.mark.cluster_user
def test_a_dead_batch_node_sends_the_job_through_the_queue_without_losing_a_step(slurm_cluster, tmp_path, reference):
    """slurm.spare_nodes=1: the batch script (and its watcher) runs on n1, the spare, and the ranks on n2 and n3. n1
    dies at rank 0's 5th batch: frozen whole (scripts/slurm-local freeze-node), so its connections go silent as a dead
    host's do; a SIGKILL here would close them at once, and the other nodes' stepds sometimes cancel the step for it
    within a second, which a real power cut never shows them. Slurm keeps the job running on n2 and n3 (--no-kill),
    with nothing left to requeue it: rank 0 sees Slurm mark n1 gone, every rank stops after the same step and
    checkpoints, and rank 0 requeues the job as an infrastructure failure of n1. Once n1 is back the next attempt
    resumes from that very step and ends with the uninterrupted run's weights."""
    mark = tmp_path / "marked"
    args = [DIGITS, *TWO, "slurm.spare_nodes=1", "task.target=tests.support.marked_tasks:MarkedSlowFirstAttemptTask",
            "task.data.pause_s=1.0", f"task.data.mark_file={mark}"]  # fmt: skip
    code, out, err = submit_and_lose_batch_node(args, tmp_path, mark)
    assert code == 0, out + err
    run_dir = Path(field(out, "run dir"))
    job_id = field(out, "job")
    seen = [(e["event"], e.get("host")) for e in events(run_dir)]
    # n1 was lost, but the job (2 nodes and a spare) cannot do without it in partition "wide": kept, and the job
    # waits for it in the queue.
    assert seen == [("start", None), ("failure", "n1"), ("not_excluded", "n1"), ("requeued", None), ("start", None),
                    ("completed", None)], seen  # fmt: skip
    [failure] = events(run_dir, "failure")
    assert failure["kind"] == "infrastructure" and "batch node n1" in failure["error"], failure
    stopped = failure["step"]
    assert 5 <= stopped < 60 and events(run_dir, "start")[1]["step"] == stopped, stopped  # no step lost
    logs = rank_logs(run_dir, job_id)
    assert "the batch node n1 is gone" in logs[0] and f"resumed from step_{stopped:08d}.pt" in logs[0], logs[0]
    assert digests(logs) == reference


@pytest.mark.cluster_user
def test_a_dead_batch_node_requeues_a_script_through_its_warning_signal(slurm_cluster, tmp_path):
    """Script mode, as above: a plain script with script.resume_args and spare nodes (tests/support/resume_script.py,
    a step every 2 s in its first attempt), its batch node n1 frozen after step 2. Rank 0's launcher sees Slurm mark n1
    gone and sends the warning signal itself; the script has no handler for it, so ddpjob requeues the job, and the
    next attempt resumes from the script's own checkpoint and finishes."""
    mark, script = tmp_path / "marked", str(ROOT / "tests" / "support" / "resume_script.py")
    args = ["--script", script, "slurm.nodes=2", "slurm.tasks_per_node=1", "slurm.partition=wide",
            "slurm.spare_nodes=1", "script.resume_args=[--resume]", "wandb.mode=disabled", "--", "--pause", "2",
            "--mark", str(mark)]  # fmt: skip
    code, out, err = submit_and_lose_batch_node(args, tmp_path, mark)
    assert code == 0, out + err
    run_dir = Path(field(out, "run dir"))
    job_id = field(out, "job")
    assert [e["event"] for e in events(run_dir)] == ["start", "interrupted", "requeued", "start", "completed"]
    logs = rank_logs(run_dir, job_id)
    assert "since batch node n1 is gone: ddpjob sends it itself" in logs[0], logs[0]
    printed = (run_dir / "slurm" / f"{job_id}_0_log.out").read_text()
    resumed = re.findall(r"rank 0: resumed from step (\d+) of its own checkpoint", printed)
    assert len(resumed) == 1 and 2 <= int(resumed[0]) < 20 and "rank 0: finished at step 20" in printed, printed


# An elastic job of two ranks a node on partition "local" (n1, the batch node, and n2: tasks_per_node=2 makes Slurm
# give it both), under train.invariant: its weights do not depend on how many nodes each attempt had.
ELASTIC = [DIGITS, "--wait", "slurm.partition=local", "slurm.tasks_per_node=2", "train.invariant=true",
           "data.global_batch_size=64", "data.batch_size=16", "train.max_steps=60", "checkpoint.every_steps=20",
           "train.eval_every=0", "train.log_every=20", "wandb.mode=disabled", "task.model.dropout=0.1"]  # fmt: skip


@pytest.fixture(scope="module")
def elastic_reference(slurm_cluster, tmp_path_factory) -> set[str]:
    """The weight digests of an uninterrupted ELASTIC run on one node."""
    proc = run_cli("submit", *ELASTIC, "slurm.nodes=1", cwd=tmp_path_factory.mktemp("elastic-reference"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    found = set(digests(rank_logs(Path(field(proc.stdout, "run dir")), field(proc.stdout, "job"))).values())
    assert len(found) == 1, found
    return found


@pytest.mark.cluster_user
def test_an_elastic_jobs_dead_batch_node_is_requeued_from_its_second_node(slurm_cluster, tmp_path, elastic_reference):
    """slurm.nodes=1-2, no spare: ranks 0 and 1 run on the batch node n1, ranks 2 and 3 on n2. n1 dies at rank 0's 5th
    batch (frozen, as above) and stays dead: ranks 0 and 1 and the batch script's watcher die with it, the job stays
    RUNNING (--no-kill) and the ranks on n2 wait on rank 0 in a collective. Rank 2's launcher sees Slurm mark n1 gone
    and requeues the job as an infrastructure failure of n1. The next attempt runs on n2 alone; its rank 0 finds the
    run directory's lock still held by the dead rank 0 (a frozen process keeps it, as a shared filesystem does a dead
    client's until its lease ends) and breaks it, resumes from the last checkpoint, and ends bitwise on the
    uninterrupted run."""
    mark = tmp_path / "marked"
    # Partition "wide": the job starts on n1 and n2 (n3 weighs more); its requeued attempt takes n2 and n3, or n3
    # alone when Slurm drained n2 ("Kill task failed": under load its stepd, reporting to the frozen batch node's
    # srun, outlasted the kill's timeout; the cluster guard resumes it for the next test).
    args = [*ELASTIC, "slurm.partition=wide", "slurm.nodes=1-2", f"task.data.mark_file={mark}",
            "task.target=tests.support.marked_tasks:MarkedSlowFirstAttemptTask", "task.data.pause_s=1.0"]  # fmt: skip
    code, out, err = submit_and_lose_batch_node(args, tmp_path, mark, thaw=False)
    assert code == 0, out + err
    run_dir, job_id = Path(field(out, "run dir")), field(out, "job")
    seen = [(e["event"], e.get("host")) for e in events(run_dir)]
    assert seen == [("start", None), ("failure", "n1"), ("excluded", "n1"), ("requeued", None), ("start", None),
                    ("completed", None)], seen  # fmt: skip
    first, then = [(e["world_size"], e["nodes"]) for e in events(run_dir, "start")]
    assert first == (4, 2) and then in ((2, 1), (4, 2)), (first, then)  # n2 and n3, or one of them: never n1
    logs = rank_logs(run_dir, job_id)
    assert "the batch node n1 is gone" in logs[2], logs[2]
    assert "breaking the trainer lock" in logs[0] and "(host n1 pid" in logs[0], logs[0]
    final = digests({rank: text for rank, text in logs.items() if rank < 2})  # the last attempt's two ranks
    assert set(final.values()) == elastic_reference, (final, elastic_reference)


@pytest.mark.cluster_user
def test_an_elastic_job_goes_on_with_fewer_nodes_when_one_dies_and_keeps_the_bits(
    slurm_cluster, tmp_path, elastic_reference
):
    """slurm.nodes=1-2, no spare: the job runs on n1 and n2 (2 ranks each; the batch script on n1). n2 dies whole at
    its ranks' 25th batch (scripts/slurm-local kill-node): with no spare left, the next job step runs on n1 alone, 2
    ranks at the same global batch, from the checkpoint at step 20; under train.invariant its final weights are
    bitwise those of an uninterrupted run on one node."""
    halted = tmp_path / "halted"
    halt = ["task.target=tests.support.tasks:CrashingTask", "task.data.crash_host=n2", "task.data.crash_at=25",
            "task.data.error=HALT", f"task.data.halt_file={halted}", "task.data.crash_launch=0"]  # fmt: skip
    code, out, err = submit_and_kill_node([*ELASTIC, "slurm.nodes=1-2", *halt], tmp_path, "n2", halted)
    assert code == 0, out + err
    run_dir, job_id = Path(field(out, "run dir")), field(out, "job")
    starts = [(e["launch"], e["world_size"], e["nodes"], e["grad_accum"]) for e in events(run_dir, "start")]
    assert starts == [(0, 4, 2, 1), (1, 2, 1, 2)], starts  # the same global batch: 4 x 16, then 2 x 2 x 16
    [restarted] = events(run_dir, "restarted")
    assert restarted["nodes"] == ["n1"] and restarted["restart_count"] == 0, restarted
    assert [(e["event"], e.get("host")) for e in events(run_dir) if e["event"] == "failure"] == [("failure", "n2")]
    logs = rank_logs(run_dir, job_id)
    assert "resumed from step_00000020.pt" in logs[0], logs[0]
    final = digests({rank: text for rank, text in logs.items() if rank < 2})  # ranks 2 and 3 died with n2
    assert set(final.values()) == elastic_reference, (final, elastic_reference)
