"""Nodes that fail: one Slurm drains is excluded at its rank's failure, and one that dies whole (its slurmd and every
process on it) costs one requeue and is excluded; either way the run completes exactly on the other nodes
(docs/failures.md), on the local cluster's three nodes. The module takes the cluster alone
(tests/support/cluster_guard.py): Slurm then places a job of partition "wide" on n1 and n2 (the spare n3 has a higher
weight), so the bad node is known before the job starts."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests.support.bad_node import REASON, submit_drain_and_kill
from tests.support.cli_runner import field, run_cli
from tests.support.digits import DIGITS, TWO
from tests.support.helpers import digests, events, rank_logs, submit_and_kill_node


@pytest.fixture(scope="module")
def reference(slurm_cluster, tmp_path_factory) -> dict[int, str]:
    """The uninterrupted 2-node run's weight digests, which also shows its placement: one rank on each of n1 and n2."""
    proc = run_cli("submit", DIGITS, "--wait", *TWO, cwd=tmp_path_factory.mktemp("reference"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    logs = rank_logs(Path(field(proc.stdout, "run dir")), field(proc.stdout, "job"))
    hosts = {rank: re.search(r"slurm on (\S+): rank (\d)/2 local 0/1 node (\d)/2", text) for rank, text in logs.items()}
    assert all(hosts.values()), logs
    assert {m[1] for m in hosts.values()} == {"n1", "n2"} and {m[3] for m in hosts.values()} == {"0", "1"}
    assert {rank: m[1] for rank, m in hosts.items()} == {0: "n1", 1: "n2"}, logs  # the batch script runs on n1 too
    found = digests(logs)
    assert found[0] == found[1]
    return found


def test_a_node_slurm_drains_is_excluded_at_its_ranks_failure_and_the_run_completes_exactly_on_the_others(
    slurm_cluster, tmp_path, reference
):
    """Two nodes of partition "wide" (n1-n3; Slurm takes n1 and n2 first, n3 is the spare). At its 25th batch rank 1,
    on n2, halts; Slurm drains n2 (as an admin or a site's health daemon would, with a reason) and the rank is
    SIGKILLed, both from outside. The drain is the evidence: n2 is excluded at this first failure (a rank's death
    alone excludes nothing, tests/cluster/test_restart_in_allocation.py), so no restart inside the allocation, which
    cannot do without it; the same job, requeued off it, resumes from its checkpoint on n1 and n3 and ends with the
    uninterrupted run's weights."""
    halted = tmp_path / "halted"
    halt = ["task.data.crash_host=n2", "task.data.crash_at=25", "task.data.error=HALT", f"task.data.halt_file={halted}"]
    args = [DIGITS, *TWO, "task.target=tests.support.tasks:CrashingTask", *halt]
    code, out, err = submit_drain_and_kill(args, tmp_path, "n2", halted)
    assert code == 0, out + err
    run_dir, job_id = Path(field(out, "run dir")), field(out, "job")
    seen = [(e["event"], e.get("kind"), e.get("host")) for e in events(run_dir) if e["event"] != "rank_failed"]
    assert seen == [
        ("start", None, None), ("failure", "infrastructure", "n2"), ("excluded", None, "n2"),
        ("requeued", "failure", None), ("start", None, None), ("completed", None, None),
    ], seen  # fmt: skip
    [excluded] = events(run_dir, "excluded")
    assert excluded["reason"].startswith(f"Slurm says State=MIXED+DRAIN (Reason={REASON})"), excluded
    shown = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True).stdout
    assert "ExcNodeList=n2" in shown and re.search(r"\bNodeList=n\[1,3\]", shown), shown
    logs = rank_logs(run_dir, job_id)
    assert "resumed from step_00000020.pt" in logs[0] and digests(logs) == reference, logs


def test_a_node_that_dies_whole_is_replaced_and_the_run_completes_exactly(slurm_cluster, tmp_path, reference):
    """n1, the node of rank 0 and of the batch script, dies whole at rank 0's 25th batch: its slurmd and every process
    on it are killed from outside (scripts/slurm-local kill-node), so nothing there records or decides anything. Slurm
    marks it DOWN (SlurmdTimeout), ends the attempt (NODE_FAIL) and requeues the job; the next attempt's batch script
    records the failure on n1 before srun (ddp_core.cluster.node_loss), and the run resumes from its checkpoint on n2
    and n3 and ends with the uninterrupted run's weights."""
    halted = tmp_path / "halted"
    halt = ["task.data.crash_host=n1", "task.data.crash_at=25", "task.data.error=HALT", f"task.data.halt_file={halted}"]
    overrides = [DIGITS, "--wait", *TWO, "task.target=tests.support.tasks:CrashingTask", *halt]
    code, out, err = submit_and_kill_node(overrides, tmp_path, "n1", halted)
    assert code == 0, out + err
    assert halted.read_text() == "n1 rank 0 at batch 25\n"
    run_dir, job_id = Path(field(out, "run dir")), field(out, "job")
    seen = [(e["event"], e.get("kind"), e.get("host")) for e in events(run_dir) if e["event"] != "rank_failed"]
    assert seen == [("start", None, None), ("failure", "infrastructure", "n1"), ("excluded", None, "n1"),
                    ("start", None, None), ("completed", None, None)], seen  # fmt: skip
    [failure] = [e for e in events(run_dir) if e["event"] == "failure"]
    assert failure["restart_count"] == 0 and "n1 stopped responding" in failure["error"], failure
    assert "NODE_FAIL" in failure["error"], failure
    rows = subprocess.run(["sacct", "-n", "-P", "-D", "-X", "-o", "State,NodeList", "-j", job_id],
                          capture_output=True, text=True).stdout.split()  # fmt: skip
    assert rows == ["NODE_FAIL|n[1-2]", "COMPLETED|n[2-3]"], rows
    logs = rank_logs(run_dir, job_id)
    assert "resumed from step_00000020.pt" in logs[0] and digests(logs) == reference, logs
    status = run_cli("status", str(run_dir), cwd=tmp_path)
    assert f"at step 20: node n1: {failure['error']} (infrastructure: requeued)" in status.stdout, status.stdout
