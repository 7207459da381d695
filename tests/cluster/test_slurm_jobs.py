"""End to end on the real local Slurm cluster: submit, train with DDP, checkpoint, fail fast, resume."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddp_core.run import private
from ddp_core.run.rundir import RunDir
from tests.support.cli_runner import field, run_cli
from tests.support.digits import DIGITS, QUICK
from tests.support.helpers import digests, events, rank_logs, run_script, sacct_state, wait_gone

pytestmark = [pytest.mark.cluster_shared("a")]  # 2-CPU jobs: see tests/support/cluster_guard.py


# Not a release pass's (slurm_interface): submitit's submission, the job's accounting and a multi-rank job show there
# in test_gpu_slurm's 2-node job, test_status_real_jobs's and the drill.
@pytest.mark.cluster_user
def test_ddp_job_completes_with_two_ranks(slurm_cluster, tmp_path):
    proc = run_cli("submit", DIGITS, "--wait", *QUICK, "wandb.mode=offline", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run_dir, job_id = Path(field(proc.stdout, "run dir")), field(proc.stdout, "job")
    assert "final eval: accuracy" in proc.stdout
    # --wait's live line (plain lines: stdout is no terminal): the state Slurm gave, then the job's end and result.
    assert re.search(rf"^job {job_id} (PENDING \(\w+\), (start estimate |no start)|RUNNING, )", proc.stdout, re.M)
    assert re.search(rf"^job {job_id} COMPLETED after", proc.stdout, re.M), proc.stdout
    logs = rank_logs(run_dir, job_id)
    assert sorted(logs) == [0, 1]
    for rank, text in logs.items():
        assert "slurm on n" in text and f": rank {rank}/2 " in text, text[:2000]
    # checkpoints written by rank 0 only
    manifests = sorted((run_dir / "checkpoints").glob("step_*.json"))
    assert [m.name for m in manifests] == ["step_00000020.json", "step_00000040.json", "step_00000060.json"]
    assert all(json.loads(m.read_text())["writer"]["rank"] == 0 for m in manifests)
    assert "checkpoint step" in logs[0] and "checkpoint step" not in logs[1]
    # DDP kept the replicas identical
    d = digests(logs)
    assert d[0] == d[1]
    # the local metrics log and the W&B run exist, the W&B id was fixed in run.json
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(steps) and steps[-1] == 60
    run_id = json.loads((run_dir / "run.json").read_text())["run_id"]
    assert list((run_dir / "wandb").glob(f"offline-run-*-{run_id}"))
    assert sacct_state(job_id) == "COMPLETED"
    # What `ddpjob submit --dry-run` renders is the script this job was queued with (one renderer for both).
    run = RunDir((tmp_path / run_dir).resolve())
    (submitted,) = run.slurm.glob(f"{job_id}_submission.sh")
    assert run_script(run.load_config(), run) == submitted.read_text()


def test_a_user_error_fails_fast_and_says_where(slurm_cluster, tmp_path):
    # A bug: rank 1 raises ValueError at its 30th batch, and would on every attempt. Never retried.
    started = time.monotonic()
    proc = run_cli(
        "submit", DIGITS, "--wait", *QUICK, "train.max_steps=100000", "task.target=tests.support.tasks:CrashingTask",
        "task.data.crash_rank=1", "task.data.crash_at=30", "task.data.error=ValueError", cwd=tmp_path,
    )  # fmt: skip
    elapsed = time.monotonic() - started
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert elapsed < 60, f"job took {elapsed:.0f} s to fail"
    run_dir, job_id = Path(field(proc.stdout, "run dir")), field(proc.stdout, "job")
    logs = rank_logs(run_dir, job_id)
    # The error line names the rank and the host it ran on.
    assert re.search(r"rank 1/2 on n[12] failed: ValueError: injected failure at batch 30", logs[1]), logs[1][-2000:]
    assert sacct_state(job_id) == "FAILED", sacct_state(job_id)
    (failure,) = [e for e in events(run_dir) if e["event"] == "failure"]
    # the 30th call of compute: the attempt's priming batch, then 29 batches; the failing step follows step 28
    assert failure["kind"] == "user" and failure["rank"] == 1 and failure["step"] == 28, failure
    assert events(run_dir)[-1]["event"] == "failed" and not [e for e in events(run_dir) if e["event"] == "requeued"]
    first_raise = next(e for e in events(run_dir) if e["event"] == "rank_failed")["t"]
    assert events(run_dir)[-1]["t"] - first_raise < 30
    status = run_cli("status", str(run_dir), cwd=tmp_path)
    host = failure["host"]
    line = f"failure in {run_dir.name} at step 28: rank 1 on {host}: ValueError: injected failure at batch 30"
    assert f"{line} (a user error, not retried)" in status.stdout, status.stdout
    shown = run_cli("logs", str(run_dir), "--rank", "1", cwd=tmp_path)
    assert "ValueError: injected failure at batch 30" in shown.stdout and line in shown.stderr, shown.stderr


def test_infrastructure_failures_requeue_within_max_failures(slurm_cluster, tmp_path):
    # Rank 1 is killed by SIGKILL at its 10th batch of every attempt: one requeue (slurm.max_failures=1), then the
    # budget is spent and the job ends FAILED, saying so, and its node-local copies are removed. No restart inside the
    # allocation (slurm.max_restarts=0): the queue's budget alone (test_restart_in_allocation shows the two together).
    proc = run_cli(
        "submit", DIGITS, "--wait", *QUICK, "train.max_steps=100000", "task.target=tests.support.tasks:CrashingTask",
        "task.data.crash_rank=1", "task.data.crash_at=10", "task.data.error=SIGKILL", "slurm.max_failures=1",
        "slurm.max_restarts=0", "checkpoint.local_every_steps=2",
        cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode != 0, proc.stdout + proc.stderr
    run_dir, job_id = Path(field(proc.stdout, "run dir")), field(proc.stdout, "job")
    seen = [(e["event"], e.get("kind")) for e in events(run_dir) if e["event"] not in ("rank_failed", "excluded")]
    assert seen == [
        ("start", None), ("failure", "infrastructure"), ("requeued", "failure"),
        ("start", None), ("failure", "infrastructure"), ("budget_exhausted", None),
    ], seen  # fmt: skip
    # Even with both failures on one node (each attempt may land on either), nothing is excluded: Slurm says the
    # nodes are fine, and a killed process is no evidence against its node.
    assert events(run_dir, "excluded") == []
    assert {e["job_id"] for e in events(run_dir)} == {job_id}
    reason = events(run_dir)[-1]["reason"]
    assert reason == "requeue budget exhausted after 2 failures (slurm.max_failures=1)", reason
    assert sacct_state(job_id) == "FAILED"
    # The job ended for good: its node-local copies (a copy every 2 steps) went with it (the local cluster's nodes
    # share this machine's /dev/shm).
    assert not (Path("/dev/shm") / private.per_user_name(job_id)).exists()


def test_resumes_submit_one_job_which_skips_a_truncated_checkpoint(slurm_cluster, tmp_path):
    """Four `ddpjob resume RUN` at once: one submits, the others wait for it at the run's submit lock and then
    see its job queued; run.json keeps every job id. That job skips the truncated newest checkpoint with a warning
    and resumes from the one before. A resume that changes the model's shape is refused. One rank: nothing here
    depends on more."""
    first = run_cli("submit", DIGITS, "--wait", *QUICK, "slurm.tasks_per_node=1", cwd=tmp_path)
    assert first.returncode == 0, first.stdout + first.stderr
    run_dir = Path(field(first.stdout, "run dir"))
    newest = run_dir / "checkpoints" / "step_00000060.pt"
    newest.write_bytes(newest.read_bytes()[:1000])
    cmd = [sys.executable, "-m", "jobs", "resume", str(run_dir), "train.max_steps=80"]
    procs = [subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(4)]  # fmt: skip
    outputs = [p.communicate(timeout=120) for p in procs]
    submitted = [out for (out, _), p in zip(outputs, procs, strict=True) if p.returncode == 0]
    refused = [err for (_, err), p in zip(outputs, procs, strict=True) if p.returncode == 2]
    assert len(submitted) == 1 and len(refused) == 3, outputs
    job = field(submitted[0], "job")
    assert all(f"still queued or running as job {job}" in err for err in refused), refused
    # the config's cosine schedule decays to max_steps: said before anything is submitted (docs/preemption.md)
    assert "exactness: train.max_steps 60 -> 80 with optim.schedule=cosine" in submitted[0], submitted[0]
    jobs = [j["job_id"] for j in json.loads((run_dir / "run.json").read_text())["jobs"]]
    assert jobs == [field(first.stdout, "job"), job]
    assert wait_gone(job) == "COMPLETED"
    log = rank_logs(run_dir, job)[0]
    assert "skipping checkpoint step_00000060.pt: size 1000" in log, log
    assert "resumed from step_00000040.pt (step 40" in log and "finished at step 80" in log, log
    # changing the model's shape is refused
    bad = run_cli("resume", str(run_dir), "task.model.hidden=7", cwd=tmp_path)
    assert bad.returncode == 2 and "task.model" in bad.stderr


def mangling_sbatch(tmp_path: Path) -> dict[str, str]:
    """A PATH whose ``sbatch`` queues the job with the real one, then prints an answer that names no job id (as a
    site wrapper that rewrites sbatch's output might): the submission fails after Slurm accepted the job."""
    real = shutil.which("sbatch")
    assert real
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    wrapper = bin_dir / "sbatch"
    wrapper.write_text(f'#!/bin/bash\nout=$({real} "$@") || exit $?\necho "${{out/job /id }}"\n')
    wrapper.chmod(0o755)
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}"}


def withdrawn_job(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "sbatch's answer names no job id: 'Submitted batch id " in lines[0], stderr
    found = re.search(r"\(cancelled (?:job|array) (\d+), which sbatch had queued\)", lines[0])
    assert found, stderr
    wait_gone(found.group(1), timeout=30)
    assert sacct_state(found.group(1)).startswith("CANCELLED")
    return found.group(1)


def test_a_submission_that_fails_after_sbatch_leaves_no_job_behind(slurm_cluster, tmp_path):
    """The submission still writes files after sbatch accepts a job; if that fails, the job is cancelled, not left
    to run against a deleted run directory. Fresh submits remove the directory, resumes keep the old config, and a
    sweep can be rerun as it was."""
    mangled, root = mangling_sbatch(tmp_path), tmp_path / "runs"
    fresh = run_cli("submit", DIGITS, *QUICK, f"run.root={root}", cwd=tmp_path, env=mangled)
    assert fresh.returncode == 2
    withdrawn_job(fresh.stderr)
    assert not list(root.glob("*/config.yaml"))

    first = run_cli("submit", DIGITS, *QUICK, f"run.root={root}", "slurm.partition=local", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    subprocess.run(["scancel", field(first.stdout, "job")], check=True)
    wait_gone(field(first.stdout, "job"))
    run_dir = Path(field(first.stdout, "run dir"))
    config = (run_dir / "config.yaml").read_text()
    resumed = run_cli("resume", str(run_dir), "train.max_steps=80", cwd=tmp_path, env=mangled)
    assert resumed.returncode == 2
    withdrawn_job(resumed.stderr)
    assert (run_dir / "config.yaml").read_text() == config

    sweep = run_cli("sweep", DIGITS, "optim.lr=0.1,0.2", *QUICK, f"run.root={root}", "--name", "s", cwd=tmp_path,
                    env=mangled)  # fmt: skip
    assert sweep.returncode == 2
    withdrawn_job(sweep.stderr)
    again = run_cli("sweep", DIGITS, "optim.lr=0.1,0.2", *QUICK, f"run.root={root}", "--name", "s", "--dry-run",
                    cwd=tmp_path)  # fmt: skip
    assert again.returncode == 0 and again.stdout.count(" resume ") == 2, again.stdout


def test_a_node_failing_its_health_check_is_excluded_and_the_run_completes_elsewhere(slurm_cluster, tmp_path):
    # A site's health check (slurm.health_check) that fails on one node: the first node to run it marks itself bad,
    # as a node whose GPU fell off the bus would. The same job is requeued off that node and completes on the other;
    # a later `ddpjob resume` stays off it until --include-node takes it back.
    bad = tmp_path / "bad-node"
    check = (f'[ -s {bad} ] || hostname > {bad}; [ "$(hostname)" != "$(cat {bad})" ] '
             '|| { echo "GPU 0 fell off the bus" >&2; exit 1; }')  # fmt: skip
    # One rank: the check runs once per node, whatever the ranks.
    proc = run_cli("submit", DIGITS, "--wait", *QUICK, "slurm.tasks_per_node=1", f"slurm.health_check={check!r}",
                   cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run_dir, job_id = Path(field(proc.stdout, "run dir")), field(proc.stdout, "job")
    host = bad.read_text().strip()
    seen = [(e["event"], e.get("kind"), e.get("host")) for e in events(run_dir) if e["event"] != "rank_failed"]
    assert seen == [
        ("failure", "health", host), ("excluded", None, host), ("requeued", "health_failure", None),
        ("start", None, None), ("completed", None, None),
    ], seen  # fmt: skip
    failure = events(run_dir)[[e["event"] for e in events(run_dir)].index("failure")]
    said = f"health check on {host}: slurm.health_check failed: GPU 0 fell off the bus"
    assert failure["error"] == f"HealthCheckFailed: {said}", failure
    shown = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True).stdout
    assert f"ExcNodeList={host}" in shown and "JobState=COMPLETED" in shown, shown
    assert "GPU 0 fell off the bus" in rank_logs(run_dir, job_id)[0]
    status = run_cli("status", str(run_dir), cwd=tmp_path).stdout
    assert f"excluded in {run_dir.name}: {host} (failed a health check: {failure['error']})" in status, status
    # resume: off the node, as the requeued attempt was; --include-node takes it back (and only an excluded one)
    again = run_cli("resume", str(run_dir), "train.max_steps=80", "slurm.health_check=null", cwd=tmp_path)
    assert again.returncode == 0 and f"excluding {host}: failed a health check" in again.stdout, again.stdout
    resumed = field(again.stdout, "job")
    shown = subprocess.run(["scontrol", "show", "job", resumed], capture_output=True, text=True).stdout
    assert f"ExcNodeList={host}" in shown, shown
    subprocess.run(["scancel", resumed], check=True)  # its placement is what this resume shows: no need to train
    assert wait_gone(resumed, 120).split()[0] in ("CANCELLED", "COMPLETED")
    wrong = run_cli("resume", str(run_dir), "--include-node", "n9", cwd=tmp_path)
    assert f"--include-node n9: the run has not excluded it (excluded: {host})" in wrong.stderr, wrong.stderr
    taken_back = run_cli("resume", str(run_dir), "train.max_steps=100", "--include-node", host, "--wait", cwd=tmp_path)
    assert taken_back.returncode == 0 and "excluding" not in taken_back.stdout, taken_back.stdout
    assert events(run_dir)[-1]["event"] == "completed"
    assert "excluded in" not in run_cli("status", str(run_dir), cwd=tmp_path).stdout
