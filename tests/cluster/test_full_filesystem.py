"""A shared filesystem that fills up under a running job: the run directory on the local cluster's small tmpfs
(``scripts/slurm-local``'s ``$H/smallfs``, mounted before the slurmds start, so every node sees the same one),
filled from outside at a chosen step and emptied again at another (the task waits at both: tests/support/gated_tasks).
The checkpoint in between is not written, training goes on, the log names the full disk, and once space is back the
run saves again and ends bitwise equal to an uninterrupted one. (Each failure mode on a real full tmpfs, without
Slurm: tests/unit/ddp_core/run/test_full_disk.py, tests/unit/ddp_core/checkpoint/test_resave.py.)"""

from __future__ import annotations

import shutil
import time
import uuid
from pathlib import Path

import pytest

from tests.support import cluster_guard
from tests.support.cli_runner import field, run_cli
from tests.support.filesystems import fill
from tests.support.helpers import ROOT, digests, events, rank_logs, two_rank_reference, wait_gone

DIGITS = str(ROOT / "configs" / "digits.yaml")
CONFIG = ["train.max_steps=40", "checkpoint.every_steps=10", "train.log_every=5", "train.eval_every=0",
          "wandb.mode=disabled", "slurm.nodes=1", "slurm.tasks_per_node=2"]  # fmt: skip
SMALL_FS = cluster_guard.HOME / "smallfs"
FULL_AT, FREED_AT = 12, 25  # batches (the first is DDP's priming one): in steps 11 and 24, around step 20's save


@pytest.fixture(scope="module")
def reference(pytestconfig, tmp_path_factory) -> str:
    return two_rank_reference(pytestconfig, tmp_path_factory, "full-filesystem", DIGITS, CONFIG)


def at_gate(gate: Path, batch: int, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not (gate / f"at-{batch}").exists():
        assert time.monotonic() < deadline, f"the job never reached batch {batch}"
        time.sleep(0.1)


def test_a_run_whose_filesystem_fills_up_waits_it_out_and_ends_bitwise_equal(reference, tmp_path):
    assert SMALL_FS.is_mount(), f"{SMALL_FS}: scripts/slurm-local up mounts it"
    root, gate = SMALL_FS / f"full-{uuid.uuid4().hex[:8]}", tmp_path / "gate"
    gate.mkdir()
    gated = ["task.target=tests.support.gated_tasks:GatedDigitsTask", f"task.data.gate_dir={gate}",
             f"task.data.gates=[{FULL_AT},{FREED_AT}]"]  # fmt: skip
    filler = None
    try:
        proc = run_cli("submit", DIGITS, *CONFIG, *gated, f"run.root={root}", cwd=tmp_path)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        run_dir, job_id = Path(field(proc.stdout, "run dir")), field(proc.stdout, "job")
        at_gate(gate, FULL_AT)
        filler = fill(SMALL_FS, leave=64 * 1024)  # a log line or an event still fits; a checkpoint does not
        (gate / f"go-{FULL_AT}").touch()
        at_gate(gate, FREED_AT)
        failed = [e["step"] for e in events(run_dir, "save_failed")]
        assert failed == [20], events(run_dir)
        filler.unlink()
        filler = None
        (gate / f"go-{FREED_AT}").touch()
        assert wait_gone(job_id, 180) == "COMPLETED"
        logs = rank_logs(run_dir, job_id)
        assert f"no space left on {SMALL_FS}" in logs[0], logs[0][-3000:]
        assert digests(logs) == {0: reference, 1: reference}
        saved = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*.json"))
        assert saved[-1] == "step_00000040.json", saved
        assert [e["event"] for e in events(run_dir) if e["event"] in ("failure", "requeued", "restarted")] == []
    finally:
        if filler is not None:
            filler.unlink(missing_ok=True)
        shutil.rmtree(root, ignore_errors=True)
