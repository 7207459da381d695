"""An elastic job (``slurm.nodes: 1-2``) on the real local cluster: it starts on the one node that is free, is
interrupted, and its requeued attempt trains on both nodes once they are free, at the same global batch, every sample
of the stream trained exactly once. Under ``train.invariant`` its final weights are bitwise those of an uninterrupted
job on one node (2 ranks): its steps at 4 ranks on two nodes are in that digest too (uninterrupted runs at other
world sizes are tests/unit/ddp_core/strategies/test_invariant.py's)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.support.cli_runner import field, run_cli
from tests.support.helpers import ROOT, digests, events, rank_logs, wait_for, wait_gone
from tests.support.sample_logs import expected_steps, logged_steps, train_losses

# Exclusive (no cluster_shared mark): a job holds a whole node (tests/support/cluster_guard.py); run as ddpjob-alice on
# the site profile (the user pass): the holder and the elastic job are her QOS's two running jobs
pytestmark = pytest.mark.cluster_user
DIGITS = str(ROOT / "configs" / "digits.yaml")
STEPS, GLOBAL, MICRO, STOP_AT = 16, 64, 16, 12  # attempt 1: 2 ranks x 2 micro-batches a step, stopped at step 6


TRAIN = [f"data.global_batch_size={GLOBAL}", f"data.batch_size={MICRO}", f"train.max_steps={STEPS}",
         "train.invariant=true", "train.eval_every=0", "train.log_every=1", "checkpoint.every_steps=1000",
         "wandb.mode=disabled", "optim.warmup_steps=5", "task.model.dropout=0.1", "train.stop_check_ms=0"]  # fmt: skip


def hold_node(node: str) -> str:
    """A job that holds ``node`` whole until cancelled; returns its id once it runs."""
    out = subprocess.run(
        ["sbatch", "--parsable", "-p", "local", f"--nodelist={node}", "-N1", "--exclusive", "-o", "/dev/null",
         "--wrap", "sleep 600"],
        capture_output=True, text=True, check=True, timeout=60,
    )  # fmt: skip
    job_id = out.stdout.strip().split(";")[0]
    running = lambda: subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True)  # noqa: E731
    try:
        wait_for(lambda: running().stdout.strip() == "RUNNING", 60, f"job {job_id} to hold {node}")
    except AssertionError:  # never left for the next test: a shared test does not clean the queue first
        subprocess.run(["scancel", job_id], timeout=30)
        raise
    return job_id


def test_an_elastic_job_starts_on_one_node_and_resumes_on_two(slurm_cluster, tmp_path):
    logs, gate = tmp_path / "samples", tmp_path / "gate"
    logs.mkdir()
    gate.mkdir()
    holder = hold_node("n2")
    try:
        proc = run_cli(
            "submit", DIGITS, "slurm.partition=local", "slurm.nodes=1-2", "slurm.tasks_per_node=2", *TRAIN,
            "task.target=tests.support.metric_tasks:GatedSampleLogDigitsTask", f"task.data.log_dir={logs}",
            f"task.data.gate_dir={gate}", f"task.data.stop_at={STOP_AT}", cwd=tmp_path,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stdout + proc.stderr
        job_id, run_dir = field(proc.stdout, "job"), Path(field(proc.stdout, "run dir"))
        # The first attempt waits at its STOP_AT-th batch: the other node is freed, then it stops itself.
        wait_for(lambda: (gate / "reached").exists(), 180, "the first attempt to reach its stop")
        assert (gate / "reached").read_text() == "2"  # one node of 2 ranks: n2 was held
    finally:
        subprocess.run(["scancel", holder], check=True, timeout=30)
    wait_gone(holder, 60)
    (gate / "go").write_text("")
    assert wait_gone(job_id, 300) == "COMPLETED", [p.read_text()[-3000:] for p in (run_dir / "slurm").glob("*.err")]

    starts = events(run_dir, "start")
    assert [(e["job_id"], e["restart_count"], e["world_size"], e["nodes"]) for e in starts] == [
        (job_id, 0, 2, 1),
        (job_id, 1, 4, 2),
    ], starts
    assert [(e["global_batch"], e["grad_accum"]) for e in starts] == [(GLOBAL, 2), (GLOBAL, 1)]
    (stop,) = [e["step"] for e in events(run_dir, "interrupted")]
    # the flag the signal sets is agreed on at the step's end, or the next one's (ddp_core.cluster.preemption)
    assert STOP_AT // 2 <= stop <= STOP_AT // 2 + 1 and stop == starts[1]["step"], (stop, starts)
    # Every step trained the global stream's next 64 samples: none repeated or skipped across the two sizes.
    first, second = logged_steps(logs, "a0", MICRO, GLOBAL), logged_steps(logs, "a1", MICRO, GLOBAL)
    assert [len(first), len(second)] == [stop, STEPS - stop]
    assert first + second == expected_steps(STEPS, GLOBAL)
    # The loss curve goes on: one value per step, and the resumed attempt starts where the first one left off.
    losses = train_losses(run_dir)
    assert sorted(losses) == list(range(1, STEPS + 1))
    before, after = [losses[s] for s in range(stop - 2, stop + 1)], [losses[s] for s in range(stop + 1, stop + 4)]
    assert 0.5 < sum(after) / sum(before) < 1.2, (before, after)
    assert losses[STEPS] < 0.9 * losses[1]  # it learns (2.31 -> 1.91 over 16 steps, warmup 5, in one run)
    # Bitwise the weights of an uninterrupted job on one node (2 ranks): train.invariant.
    ref_logs = tmp_path / "uninterrupted"
    ref_logs.mkdir()
    ref = run_cli("submit", DIGITS, "slurm.partition=local", "slurm.nodes=1", "slurm.tasks_per_node=2", *TRAIN,
                  "task.target=tests.support.metric_tasks:SampleLogDigitsTask", f"task.data.log_dir={ref_logs}",
                  cwd=tmp_path)  # fmt: skip
    assert ref.returncode == 0, ref.stdout + ref.stderr
    ref_job, ref_dir = field(ref.stdout, "job"), Path(field(ref.stdout, "run dir"))
    final = digests(rank_logs(run_dir, job_id))
    assert sorted(final) == [0, 1, 2, 3] and len(set(final.values())) == 1, final
    assert wait_gone(ref_job, 300) == "COMPLETED"
    assert events(ref_dir, "start")[0]["nodes"] == 1
    assert digests(rank_logs(ref_dir, ref_job)) == dict.fromkeys(range(2), final[0])
    status = run_cli("status", str(run_dir), cwd=tmp_path)
    assert status.returncode == 0 and " 2 > 4 " in status.stdout, status.stdout + status.stderr
