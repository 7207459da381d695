"""A plain Lightning script keeps Lightning's own Slurm requeue under ddpjob (script mode), whatever the moment of the
warning signal.

Lightning registers its auto-requeue handler for USR1 only where no handler is set. ddpjob's script launcher holds the
warning signal and reports no handler, so Lightning's ``SLURMEnvironment`` installs its own; ddpjob keeps it and calls
it at an optimizer step every rank agrees on (``ddp_core.script.deferred``): on the warning it saves its hpc checkpoint
and runs ``scontrol requeue``, and the requeued attempt resumes from that checkpoint. Run where the signal found each
rank, its save's barrier deadlocked against a rank waiting in backward's all-reduce. One run, five attempts: the
warning comes at a different moment of each of the first four (tests/support/lightning_script.py), and in the fourth a
rank's save never finishes, which the watchdog armed by the warning catches and requeues.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.support.cli_runner import field, run_cli
from tests.support.helpers import ROOT, events, rank_logs

pytestmark = [pytest.mark.cluster_shared("b")]  # 1 CPU on each node
pytest.importorskip("lightning", reason="the test extras install it (pip install -e .[dev])")
SCRIPT = str(ROOT / "tests" / "support" / "lightning_script.py")


def test_lightning_requeues_on_its_signal_at_any_moment_and_resumes_from_its_checkpoint(slurm_cluster, tmp_path):
    moments = ["forward@10", "thread@1.5", "setup", "stall@40"]
    warn = [arg for moment in moments for arg in ("--warn", moment)]
    proc = run_cli("submit", "--script", SCRIPT, "slurm.nodes=2", "slurm.tasks_per_node=1", "slurm.signal=USR1",
                   "watchdog.stall_s=15", "wandb.mode=disabled", "--wait", "--", "--steps", "60", *warn,
                   cwd=tmp_path, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    job_id, run_dir = field(proc.stdout, "job"), Path(field(proc.stdout, "run dir"))
    # Slurm's requeue ends an attempt by SIGTERM (which Lightning bypasses), then SIGKILL: if the script returned in
    # between, its attempt is recorded as requeued by the script, never as the run completed. Rank 0 returning first
    # also breaks rank 1's next collective: rank 1 may then record its own failure (a peer gone, infrastructure) of an
    # attempt Slurm is ending anyway; the watcher decides nothing for a job no longer running.
    seen = [(e["event"], e.get("restart_count"), e.get("kind")) for e in events(run_dir)]
    main = [e for e in seen if e[0] not in ("requeued", "rank_failed")]
    assert main == [*(("start", r, None) for r in range(4)), ("hang", None, None), ("start", 4, None),
                    ("completed", None, None)], seen  # fmt: skip
    assert ("requeued", None, "hang") in seen, seen  # the stalled attempt, by ddpjob
    assert all(e[1:] == (None, "script") for e in seen if e[0] == "requeued" and e[2] != "hang"), seen
    assert all(e[1] is not None and e[2] == "infrastructure" for e in seen if e[0] == "rank_failed"), seen
    assert {e["job_id"] for e in events(run_dir)} == {job_id}
    out = {rank: (run_dir / "slurm" / f"{job_id}_{rank}_log.out").read_text() for rank in (0, 1)}
    saved = {rank: [int(s) for s in re.findall(r"saving at step (\d+)", out[rank])] for rank in (0, 1)}
    assert saved[0] == saved[1] and len(saved[0]) == 4, out  # each warning: one save, at the same step on every rank
    for rank in (0, 1):
        resumed = [(int(s), int(r)) for s, r in re.findall(r"training from step (\d+) \(restart (\d)\)", out[rank])]
        assert resumed == [(0, 0), *((step, r + 1) for r, step in enumerate(saved[rank]))], out[rank]
        assert out[rank].rstrip().endswith(f"rank {rank}: finished at step 60"), out[rank]
    assert saved[0][0] >= 10 and saved[0][3] >= 40, saved  # never before the warning's step
    err = rank_logs(run_dir, job_id)
    assert err[0].count("rank_zero: Handling auto-requeue signal: 10") == 4, err[0]  # the logger's line, not stderr's
    assert err[0].count(f"signal_connector: requeing job {job_id}") == 3, err[0]  # not from the stalled save
    checkpoint = tmp_path / "hpc_ckpt_4.ckpt"  # Lightning's default_root_dir: the job's working directory
    assert f"Restoring states from the checkpoint path at {checkpoint}" in err[0], err[0]
    summary = (run_dir / "hangs" / f"{job_id}_3" / "summary.txt").read_text()
    assert "no progress for 15 s; suspect rank 1" in summary, summary  # asleep in its own save; rank 0 in the barrier
