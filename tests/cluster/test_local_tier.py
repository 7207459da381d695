"""The node-local checkpoint tier on the real local cluster: a rank SIGKILLed at a chosen step, long after the last
durable checkpoint, costs only the steps since the newest node-local copy in /dev/shm, and the run ends bitwise
equal to an uninterrupted one; under fsdp on two nodes, a node that lost its copies with its rank gets its shards
from their replica on the other node. The tier's parts (agreement, integrity, pruning, a full-state node served by a
peer, replicas): tests/unit/ddp_core/checkpoint/test_local_tier.py."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from ddp_core.run import private
from tests.support.cli_runner import field, run_cli
from tests.support.helpers import (
    ROOT,
    cached_reference,
    digests,
    events,
    final_digests,
    rank_logs,
    run_trainer,
    two_rank_reference,
)

# 2-CPU jobs (tests/support/cluster_guard.py), run as ddpjob-alice on the site profile (the user pass)
pytestmark = [pytest.mark.cluster_shared("b"), pytest.mark.cluster_user]
DIGITS = str(ROOT / "configs" / "digits.yaml")
CONFIG = ["train.max_steps=40", "checkpoint.every_steps=50", "train.log_every=5", "train.eval_every=0",
          "data.batch_size=16", "task.model.dropout=0.2", "wandb.mode=disabled"]  # fmt: skip
EVERY = 2
# Rank 1 kills itself at its 30th training batch of each attempt (the attempt's priming batch, then 29): in step 29,
# after step 28. The requeued attempt, resumed past step 20, needs fewer batches than that and completes.
KILLED = ["task.target=tests.support.tasks:CrashingTask", "task.data.crash_rank=1", "task.data.crash_at=30",
          "task.data.error=SIGKILL"]  # fmt: skip


@pytest.fixture(scope="module")
def reference(pytestconfig, tmp_path_factory) -> str:
    """The uninterrupted run, without the local tier: 2 ranks under torchrun outside Slurm (bitwise a 2-rank job's)."""
    return two_rank_reference(pytestconfig, tmp_path_factory, "local-tier", DIGITS, CONFIG)


def test_a_killed_rank_costs_only_the_steps_since_the_newest_local_copy(reference, tmp_path):
    # Pinned to n1: a requeued attempt would land where the copies are (a node of its own /dev/shm, by host name).
    proc = run_cli(
        "submit", DIGITS, "--wait", *CONFIG, *KILLED, f"checkpoint.local_every_steps={EVERY}",
        "slurm.additional.nodelist=n1", cwd=tmp_path,
    )  # fmt: skip
    run_dir, job_id = Path(field(proc.stdout, "run dir")), field(proc.stdout, "job")
    copies = Path("/dev/shm") / private.per_user_name(job_id)
    try:
        assert proc.returncode == 0, proc.stdout + proc.stderr
        seen = [(e["event"], e.get("kind")) for e in events(run_dir) if e["event"] not in ("rank_failed", "excluded")]
        assert seen == [("start", None), ("failure", "infrastructure"), ("restarted", "infrastructure"),
                        ("start", None), ("completed", None)], seen  # fmt: skip
        first, second = events(run_dir, "start")
        assert "tier" not in first and first["step"] == 0
        # The newest copy when rank 1 died was step 28's, unless its write was cut short too (at most one is in
        # flight): then step 26's. No durable checkpoint existed (every 50 steps): the old path restarted at 0.
        assert second["tier"] == "local" and second["step"] in (28, 28 - EVERY), second
        # Restarted in the same allocation (slurm.max_restarts): the same attempt's next job step, on the same node.
        assert (second["restart_count"], second["launch"], second["job_id"]) == (0, 1, job_id)
        logs = rank_logs(run_dir, job_id)
        line = f"resumed from the node-local copy of step {second['step']} (epoch 0) from this node, newer than the "
        assert line + "newest durable checkpoint (none): tier local" in logs[0], logs[0][-3000:]
        print(f"resumed at step {second['step']} after the kill in step 29")
        assert digests(logs) == {0: reference, 1: reference}
        assert not copies.exists()  # removed once the run completed
    finally:
        shutil.rmtree(copies, ignore_errors=True)


FSDP = [*CONFIG, "strategy.name=fsdp"]


@pytest.fixture(scope="module")
def fsdp_reference(pytestconfig, tmp_path_factory) -> str:
    """The uninterrupted fsdp run: 2 ranks under torchrun outside Slurm (bitwise a 2-node job's)."""

    def run() -> str:
        d = final_digests(run_trainer(DIGITS, tmp_path_factory.mktemp("ref") / "run", FSDP, nproc=2))
        assert len(d) == 2 and len(set(d)) == 1
        return d[0]

    return cached_reference(pytestconfig, "local-tier-fsdp", [DIGITS, *FSDP, "nproc=2"], run)


def test_a_node_that_lost_its_copies_gets_its_shards_from_the_peer_nodes_replica(fsdp_reference, tmp_path):
    # Copies every 5 steps: the last before the loss (step 25) and its replica are complete long before step 29.
    proc = run_cli(
        "submit", DIGITS, "--wait", *FSDP, "checkpoint.local_every_steps=5", "slurm.nodes=2", "slurm.tasks_per_node=1",
        "slurm.partition=wide", "slurm.additional.nodelist=n1,n2", "task.target=tests.support.tasks:NodeLossDigitsTask",
        "task.data.crash_rank=1", "task.data.crash_at=30", cwd=tmp_path,
    )  # fmt: skip
    run_dir, job_id = Path(field(proc.stdout, "run dir")), field(proc.stdout, "job")
    copies = Path("/dev/shm") / private.per_user_name(job_id)
    try:
        assert proc.returncode == 0, proc.stdout + proc.stderr
        first, second = events(run_dir, "start")
        assert (first["step"], first["nodes"], second["step"], second["tier"]) == (0, 2, 25, "local"), second
        logs = rank_logs(run_dir, job_id)
        peer = re.findall(r"slurm on (n\d): rank 0/2 ", logs[0])
        assert len(set(peer)) == 1, logs[0][:2000]  # rank 0 on the same node in both attempts
        assert "resumed from the node-local copy of step 25 (epoch 0) from this node," in logs[0]
        assert f"resumed from the node-local copy of step 25 (epoch 0) from rank 0 on {peer[0]}," in logs[1], logs[1]
        assert digests(logs) == {0: fsdp_reference, 1: fsdp_reference}
        assert not copies.exists()
    finally:
        shutil.rmtree(copies, ignore_errors=True)
