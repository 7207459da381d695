"""Hangs and stragglers in real jobs: a hung step dumped, requeued and resumed exactly; hangs in a collective, before
the first step and with the budget spent; a rank that never arrives at the rendezvous; a slower rank reported as
the straggler. (The watchdog and the straggler line without Slurm: tests/unit/ddp_core/trainer/test_watchdog.py.)"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from tests.support.cli_runner import field, run_cli
from tests.support.digits import DIGITS
from tests.support.hangs import HANGING, QUICK, hang_folder
from tests.support.helpers import (
    cached_reference,
    digests,
    events,
    final_digests,
    rank_logs,
    run_trainer,
    wait_gone,
)


@pytest.fixture(scope="module")
def reference(pytestconfig, tmp_path_factory) -> str:
    """The digest of the same two-rank run with no hang (the once-file exists from the start), under torchrun outside
    Slurm (bitwise a 2-rank job's); reused from pytest's cache by the release passes."""

    def run() -> str:
        cwd = tmp_path_factory.mktemp("reference")
        (cwd / "once").touch()
        overrides = [*QUICK, *HANGING, f"task.data.once_file={cwd / 'once'}"]
        d = final_digests(run_trainer(DIGITS, cwd / "run", overrides, nproc=2))
        assert len(d) == 2 and len(set(d)) == 1
        return d[0]

    return cached_reference(pytestconfig, "watchdog", [DIGITS, *QUICK, *HANGING, "nproc=2"], run)


def submit(cwd: Path, *overrides: str) -> tuple[str, Path]:
    proc = run_cli("submit", DIGITS, *QUICK, *HANGING, f"task.data.once_file={cwd / 'once'}",
                   "slurm.tasks_per_node=2", *overrides, cwd=cwd)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return field(proc.stdout, "job"), Path(field(proc.stdout, "run dir"))


def first_step_after(run: Path, t: float) -> float:
    times = [m["time"] for m in (json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines())
             if m.get("split") == "train" and m.get("time", 0) > t]  # fmt: skip
    return min(times)


@pytest.mark.slurm_interface
def test_a_hung_step_is_dumped_requeued_and_resumed_exactly(reference, tmp_path):
    job, run = submit(tmp_path, "task.data.hang_at=25")
    assert wait_gone(job) == "COMPLETED"
    (hang,) = events(run, "hang")
    (requeued,) = events(run, "requeued")
    starts = events(run, "start")
    assert requeued["kind"] == "hang" and [s["step"] for s in starts] == [0, 20]  # from the newest checkpoint
    folder = hang_folder(run)
    summary = (folder / "summary.txt").read_text()
    assert "suspect rank 1 on " in summary and "in _hang_here" in summary, summary
    stacks = (folder / "rank1.txt").read_text()
    assert "time.sleep(3600)" in stacks and "in split" in stacks
    assert "_engine_run_backward" in (folder / "rank0.txt").read_text()  # rank 0 waited in the all-reduce
    assert digests(rank_logs(run, job)) == {0: reference, 1: reference}
    stalled_at = max(m["time"] for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
                     if m.get("split") == "train" and m["time"] < hang["t"])  # fmt: skip
    assert hang["t"] - stalled_at < 8 + 30
    print(f"hang -> event {hang['t'] - stalled_at:.1f} s, -> next attempt {starts[1]['t'] - hang['t']:.1f} s, "
          f"-> first step {first_step_after(run, starts[1]['t']) - hang['t']:.1f} s")  # fmt: skip


def test_hangs_in_a_collective_and_before_the_first_step_and_a_spent_budget(reference, tmp_path):
    """Three jobs at once (the cluster has room): every rank inside a collective; a rank stuck building its
    datasets (caught by the first-step allowance); and slurm.max_hangs=0, which ends the job, saying so (a resume
    of an ended run from its checkpoint is test_preemption.py's test_requeue_budget_exhausted_then_resume)."""
    jobs = {}
    for case, extra in {
        "collective": ["task.data.hang_in=collective", "task.data.hang_at=25"],
        "datasets": ["task.data.hang_in=datasets", "watchdog.first_step_s=20"],
        "budget": ["task.data.hang_at=25", "slurm.max_hangs=0"],
    }.items():
        (tmp_path / case).mkdir()
        jobs[case] = submit(tmp_path / case, *extra)
    states = {case: wait_gone(job) for case, (job, _) in jobs.items()}
    assert states == {"collective": "COMPLETED", "datasets": "COMPLETED", "budget": "FAILED"}, states
    for case in ("collective", "datasets"):
        job, run = jobs[case]
        assert len(events(run, "hang")) == 1 and events(run, "requeued")[0]["kind"] == "hang", case
        assert digests(rank_logs(run, job)) == {0: reference, 1: reference}, case
    assert "all_reduce" in (hang_folder(jobs["collective"][1], jobs["collective"][0]) / "rank0.txt").read_text()
    (before_first,) = events(jobs["datasets"][1], "hang")
    assert before_first["step"] is None
    assert "in build_datasets" in (hang_folder(jobs["datasets"][1], jobs["datasets"][0]) / "rank1.txt").read_text()

    job, run = jobs["budget"]
    final = [e for e in events(run) if e["event"] != "rank_failed"][-1]  # a rank left in the collective may record
    assert final["event"] == "budget_exhausted"
    assert final["reason"] == "requeue budget exhausted after 1 hang (slurm.max_hangs=0)"
    status = run_cli("status", str(run), cwd=tmp_path)
    assert f"hang in {run.name} after step 23: no progress for 8 s; suspect rank 1" in status.stdout, status.stdout
    assert (run / "checkpoints" / "step_00000020.json").exists()  # what a resume continues from


def test_a_rank_that_never_arrives_ends_the_rendezvous_naming_it(slurm_cluster, tmp_path):
    """A 2-node job whose rank 1 (on n2) never reaches the rendezvous (its interpreter stalls before it, as on a node
    stuck in a cold filesystem; a wrong port can no longer keep it away: the ranks read rank 0's from the run directory,
    ``cluster.rendezvous``): rank 0 says rank 1 never arrived and who did, and the job ends FAILED within
    dist.init_timeout_s (plus start-up) instead of waiting for the default 20 minutes."""
    from ddp_core.cluster.env import derive_master_port

    site = tmp_path / "site"  # sitecustomize runs first in each task's interpreter: only SLURM_PROCID 1 stalls
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import os, time\nif os.environ.get('SLURM_PROCID') == '1' and os.environ.get('SLURM_STEP_ID') == '0':\n"
        "    time.sleep(120)\n"
    )
    proc = run_cli("submit", DIGITS, *QUICK, "slurm.nodes=2", "slurm.tasks_per_node=1", "dist.init_timeout_s=8",
                   f"slurm.setup=['export PYTHONPATH={site}:$PYTHONPATH']", cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    job, run = field(proc.stdout, "job"), Path(field(proc.stdout, "run dir"))
    started = time.monotonic()
    assert wait_gone(job, 120) == "FAILED"
    assert time.monotonic() - started < 8 + 40
    logs, good = rank_logs(run, job), derive_master_port(int(job))
    assert f"rank 1 never arrived at the rendezvous at n1:{good} within dist.init_timeout_s (8 s)" in logs[0], logs[0]
    assert "arrived: 0 on n1" in logs[0]


def test_a_rank_slower_by_50_ms_per_step_is_reported_as_the_straggler(slurm_cluster, tmp_path):
    proc = run_cli("submit", DIGITS, "--wait", *QUICK, "task.target=tests.support.tasks:StragglerDigitsTask",
                   "task.data.pause_s=0.05", "slurm.tasks_per_node=2", cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run = Path(field(proc.stdout, "run dir"))
    train = [m for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if m["split"] == "train"]
    assert all(m["slowest_rank"] == 1 for m in train[1:]), train  # the first interval holds start-up work
    assert train[-1]["straggler_rank"] == 1 and train[-1]["work_ms_max"] > 50 > train[-1]["work_ms_min"]
    host = re.search(r"on (\S+): rank 1/2", rank_logs(run, field(proc.stdout, "job"))[1]).group(1)
    assert train[-1]["slowest_host"] == host
    status = run_cli("status", str(run), cwd=tmp_path).stdout
    assert f"straggler in {run.name}: rank 1 on {host}, " in status, status
