"""A node whose ranks keep dying is excluded, and the run completes on the others (docs/failures.md), on the local
cluster's three nodes. It takes the cluster alone (tests/cluster_guard.py): Slurm then places a job of partition
"wide" on n1 and n2 (the spare n3 has a higher weight), so the bad node, n2, is known before the job starts."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests.conftest import field, run_cli
from tests.helpers import digests, events, rank_logs
from tests.test_slurm_jobs import DIGITS, QUICK

pytestmark = pytest.mark.slurm


def test_a_node_whose_ranks_keep_dying_is_excluded_and_the_run_completes_exactly_on_the_others(slurm_cluster, tmp_path):
    """Two nodes of partition "wide" (n1-n3; Slurm takes n1 and n2 first, n3 is the spare). Uninterrupted: one rank
    on each of n1 and n2. Then every rank on n2 dies by SIGKILL at its 25th batch of every attempt, as on a node
    whose processes keep dying: the second failure there excludes n2, and the same job, requeued off it, resumes
    from its checkpoint on n1 and n3 and ends with the uninterrupted run's weights."""
    two = [*QUICK, "slurm.nodes=2", "slurm.tasks_per_node=1", "slurm.partition=wide"]
    proc = run_cli("submit", DIGITS, "--wait", *two, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    logs = rank_logs(Path(field(proc.stdout, "run dir")), field(proc.stdout, "job"))
    hosts = {rank: re.search(r"slurm on (\S+): rank (\d)/2 local 0/1 node (\d)/2", text) for rank, text in logs.items()}
    assert all(hosts.values()), logs
    assert {m[1] for m in hosts.values()} == {"n1", "n2"} and {m[3] for m in hosts.values()} == {"0", "1"}
    reference = digests(logs)
    assert reference[0] == reference[1]

    proc = run_cli("submit", DIGITS, "--wait", *two, "task.target=tests.tasks:CrashingTask", "task.data.crash_host=n2",
                   "task.data.crash_at=25", "task.data.error=SIGKILL", cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run_dir, job_id = Path(field(proc.stdout, "run dir")), field(proc.stdout, "job")
    seen = [(e["event"], e.get("kind"), e.get("host")) for e in events(run_dir) if e["event"] != "rank_failed"]
    assert seen == [
        ("start", None, None), ("failure", "infrastructure", "n2"), ("requeued", "failure", None),
        ("start", None, None), ("failure", "infrastructure", "n2"), ("excluded", None, "n2"),
        ("requeued", "failure", None), ("start", None, None), ("completed", None, None),
    ], seen  # fmt: skip
    shown = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True).stdout
    assert "ExcNodeList=n2" in shown and re.search(r"\bNodeList=n\[1,3\]", shown), shown
    logs = rank_logs(run_dir, job_id)
    assert "resumed from step_00000040.pt" in logs[0] and digests(logs) == reference, logs
