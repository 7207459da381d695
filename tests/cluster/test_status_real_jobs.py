"""``ddpjob status``, ``logs`` and ``cancel`` on real jobs, and status without accounting then a cancel that saves.
(Fabricated run directories and sacct/squeue output: tests/unit/jobs/runs/test_status.py.)"""

from __future__ import annotations

import io
import os
import re
import time
from pathlib import Path

import pytest

from ddp_core.run.rundir import RunDir
from jobs.runs import logs, status, throughput
from tests.support import faults
from tests.support.cli_runner import field, run_cli
from tests.support.helpers import ROOT, events, wait_for, wait_gone, wait_out_of_queue


@pytest.mark.cluster_shared("b")  # one 2-rank job at a time on one node: see tests/support/cluster_guard.py
@pytest.mark.slurm_interface
@pytest.mark.cluster_user
def test_status_logs_and_cancel_on_real_jobs(slurm_cluster, tmp_path):
    digits = str(ROOT / "configs" / "digits.yaml")
    proc = run_cli("submit", digits, "--wait", "train.max_steps=30", "train.eval_every=0", "checkpoint.every_steps=10",
                   "wandb.mode=disabled", cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run_dir, job_id = Path(field(proc.stdout, "run dir")), field(proc.stdout, "job")
    (row,) = status.collect([run_dir], "eval/accuracy")
    assert (row.state(time.time()), row.last_step, row.job_label) == ("COMPLETED", 30, job_id)
    assert row.metric is not None and row.checkpoint_mtime is not None
    text, active = status.status_text(str(run_dir), "eval/accuracy")
    assert not active and "COMPLETED" in text and job_id in text
    out = io.StringIO()
    logs.show(RunDir(run_dir), 0, "err", "all", out)
    assert f"==> job {job_id}" in out.getvalue() and "finished at step 30" in out.getvalue()

    slow = run_cli("submit", digits, "task.target=tests.support.tasks:SlowDigitsTask", "task.data.pause_s=0.05",
                   "train.max_steps=100000", "wandb.mode=disabled", cwd=tmp_path)  # fmt: skip
    assert slow.returncode == 0, slow.stdout + slow.stderr
    slow_dir, slow_job = Path(field(slow.stdout, "run dir")), field(slow.stdout, "job")
    wait_for(lambda: events(slow_dir, "start"), 120, "the slow job to start training")
    assert status.collect([slow_dir], "eval/accuracy")[0].active(time.time())
    # Its throughput and ETA once it has a progress line; then profiling turned on while it runs (RUN/profile-now).
    wait_for(lambda: throughput.last_line(RunDir(slow_dir).metrics()), 60, "the slow job's first progress line")
    text, _ = status.status_text(str(slow_dir), "eval/accuracy")
    assert re.search(r"throughput at step \d+: [\d,]+ samples/s, .*; ETA [\d:]+ to step 100000 \(train.max_steps\)",
                     text), text  # fmt: skip
    (slow_dir / "profile-now").write_text("2\n")
    traces = lambda: sorted(p.name for p in (slow_dir / "profiles").glob("steps_*/rank*.pt.trace.json"))  # noqa: E731
    wait_for(lambda: traces() == ["rank0.pt.trace.json", "rank1.pt.trace.json"], 60, "the requested profile")
    assert list(logs.cancel([str(tmp_path / "runs")])) == [slow_job]  # the completed run has nothing to cancel
    assert wait_gone(slow_job).startswith("CANCELLED")
    assert status.collect([slow_dir], "eval/accuracy")[0].history(time.time()) == "CANCELLED"
    assert logs.cancel([str(slow_dir)]) == {}


# exclusive: stopping slurmdbd is global to the cluster (tests/support/cluster_guard.py); as alice, through the fault
# broker (tests/support/faults.py)
@pytest.mark.cluster_user
def test_status_without_accounting_then_a_cancel_that_saves(slurm_cluster, tmp_path):
    """A site without the accounting client, then one whose slurmdbd is down: status still reads the running job's
    state, from the controller, and says in one line what it cannot know. Then ``ddpjob cancel`` (a plain
    ``scancel``): the run saves where it stopped and is never requeued."""
    slow = run_cli("submit", str(ROOT / "configs" / "digits.yaml"), "task.target=tests.support.tasks:SlowDigitsTask",
                   "task.data.pause_s=0.05", "train.max_steps=100000", "wandb.mode=disabled", cwd=tmp_path)  # fmt: skip
    assert slow.returncode == 0, slow.stdout + slow.stderr
    run_dir, job_id = Path(field(slow.stdout, "run dir")), field(slow.stdout, "job")
    try:
        wait_for(lambda: events(run_dir, "start"), 120, "the slow job to start training")
        clients = tmp_path / "bin"  # every command of PATH, the release's clients first, but no sacct: a site
        clients.mkdir()  # where the accounting client is not installed (the newer releases' wrappers need the rest)
        for folder in os.environ["PATH"].split(os.pathsep):
            for found in Path(folder).glob("*") if Path(folder).is_dir() else []:
                if found.name not in ("sacct", "sacctmgr") and not (clients / found.name).exists():
                    (clients / found.name).symlink_to(found)
        bare = run_cli("status", str(run_dir), cwd=tmp_path, env={"PATH": str(clients)})
        assert bare.returncode == 0 and f"{job_id}  RUNNING" in bare.stdout, bare.stdout + bare.stderr
        assert "no accounting (sacct is not installed here): states come from the controller" in bare.stdout
        stopped = faults.slurm_local("stop-accounting")
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr
        down = run_cli("status", str(run_dir), cwd=tmp_path)
        assert down.returncode == 0 and f"{job_id}  RUNNING" in down.stdout, down.stdout + down.stderr
        assert "no accounting (sacct: error: Problem talking to the database: Connection refused)" in down.stdout
    finally:
        logs.cancel([str(run_dir)])
        started = faults.slurm_local("start-accounting")
        assert started.returncode == 0, started.stdout + started.stderr
        wait_out_of_queue(job_id, 120)
    # The controller told the ranks it was a cancel (accounting plays no part in that): saved, not requeued.
    (stop,) = events(run_dir, "interrupted")
    assert stop["kind"] == "cancelled" and not events(run_dir, "requeued")
    assert (run_dir / "checkpoints" / f"step_{stop['step']:08d}.json").exists()  # saved: within the budget
    assert len(events(run_dir, "start")) == 1
