"""A plain Lightning script keeps Lightning's own Slurm requeue under ddpjob (script mode).

Lightning registers its auto-requeue handler for USR1 only where no handler is set. ddpjob's script launcher holds the
warning signal without installing one (``cluster.signals``), so Lightning's ``SLURMEnvironment`` takes it: on the
warning it saves its hpc checkpoint and runs ``scontrol requeue``, and the requeued attempt resumes from that
checkpoint. The warning comes at a chosen step, asked for by the script's rank 0 (tests/lightning_script.py).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.conftest import ROOT, field, run_cli
from tests.helpers import events, rank_logs

pytestmark = [pytest.mark.slurm, pytest.mark.cluster_shared("b")]  # 1 CPU on each node
pytest.importorskip("lightning", reason="the test extras install it (pip install -e .[dev])")
SCRIPT = str(ROOT / "tests" / "lightning_script.py")


def test_lightning_requeues_on_its_signal_and_resumes_from_its_checkpoint(slurm_cluster, tmp_path):
    proc = run_cli("submit", "--script", SCRIPT, "slurm.nodes=2", "slurm.tasks_per_node=1", "slurm.signal=USR1",
                   "wandb.mode=disabled", "--wait", "--", "--steps", "60", "--warn-at", "10", cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    job_id, run_dir = field(proc.stdout, "job"), Path(field(proc.stdout, "run dir"))
    # Slurm's requeue ends the first attempt by SIGTERM (which Lightning bypasses), then SIGKILL: if the script returned
    # in between, its attempt is recorded as requeued by the script, never as the run completed. Rank 0 returning
    # first also breaks rank 1's next collective: rank 1 may then record its own failure (a peer gone, infrastructure)
    # of that first attempt, which Slurm is ending anyway; the watcher decides nothing for a job no longer running.
    seen = [(e["event"], e.get("restart_count"), e.get("kind")) for e in events(run_dir)]
    attempts = [("start", 0, None), ("start", 1, None), ("completed", None, None)]
    assert [e for e in seen if e[0] not in ("requeued", "rank_failed")] == attempts, seen
    assert [e for e in seen[1:-2] if e[0] != "rank_failed"] in ([], [("requeued", None, "script")]), seen
    assert all(e[1:] == (0, "infrastructure") for e in seen if e[0] == "rank_failed"), seen
    assert {e["job_id"] for e in events(run_dir)} == {job_id}
    out = {rank: (run_dir / "slurm" / f"{job_id}_{rank}_log.out").read_text() for rank in (0, 1)}
    err = rank_logs(run_dir, job_id)
    assert "Handling auto-requeue signal: 10" in err[0] and f"requeing job {job_id}" in err[0], err[0]
    checkpoint = tmp_path / "hpc_ckpt_1.ckpt"  # Lightning's default_root_dir: the job's working directory
    assert checkpoint.is_file() and f"Restoring states from the checkpoint path at {checkpoint}" in err[0], err[0]
    for rank in (0, 1):
        resumed = re.findall(r"training from step (\d+) \(restart (\d)\)", out[rank])
        assert resumed[0] == ("0", "0") and resumed[1][1] == "1" and int(resumed[1][0]) >= 10, out[rank]
        assert out[rank].rstrip().endswith(f"rank {rank}: finished at step 60"), out[rank]
