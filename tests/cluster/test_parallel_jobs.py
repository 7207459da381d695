"""An FSDP job on the real local cluster: sharded checkpoints through a signal and requeue, and export to a plain state
dict. A sharded checkpoint continued at another world size is the same on Slurm as under torchrun, where
tests/unit/ddp_core/strategies/test_fsdp.py (FSDP at 2 and 1 ranks), tests/unit/ddp_core/strategies/test_pipeline.py (a
pipeline's, at world size 1 under ddp) and tests/unit/ddp_core/trainer/test_global_batch.py prove it; a pipeline's
resume likewise (tests/unit/ddp_core/strategies/test_pipeline.py, tests/unit/ddp_core/trainer/test_trainer.py)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from ddp_core.tasks.digits import DigitsTask
from ddp_core.trainer.steps import weights_digest
from tests.support.cli_runner import field, run_cli
from tests.support.helpers import ROOT, digests, events, rank_logs, wait_gone
from tests.support.interrupts import interrupt

pytestmark = [pytest.mark.cluster_shared("a")]  # 2-CPU jobs: see tests/support/cluster_guard.py
DIGITS = str(ROOT / "configs" / "digits.yaml")
COMMON = ["task.target=tests.support.tasks:SlowDigitsTask", "train.max_steps=200", "train.log_every=5",
          "train.eval_every=100", "checkpoint.every_steps=50", "data.batch_size=16", "task.model.dropout=0.2",
          "wandb.mode=disabled"]  # fmt: skip
STRATEGIES = {"fsdp": ["strategy.name=fsdp"]}


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_sharded_job_survives_a_signal_and_exports(slurm_cluster, tmp_path, strategy):
    config = [*COMMON, *STRATEGIES[strategy]]
    ref = run_cli("submit", DIGITS, "--wait", *config, cwd=tmp_path)
    assert ref.returncode == 0, ref.stdout + ref.stderr
    reference = digests(rank_logs(Path(field(ref.stdout, "run dir")), field(ref.stdout, "job")))
    assert len(set(reference.values())) == 1

    proc = run_cli("submit", DIGITS, *config, "task.data.pause_s=0.03", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    job_id, run_dir = field(proc.stdout, "job"), Path(field(proc.stdout, "run dir"))
    interrupt(job_id, run_dir, 1, random.Random(4))
    assert wait_gone(job_id) == "COMPLETED"
    assert [e["event"] for e in events(run_dir)].count("requeued") == 1
    assert digests(rank_logs(run_dir, job_id)) == reference
    assert list((run_dir / "checkpoints").glob("step_*.dcp"))

    # export: one plain state dict that the task's model loads, with the trainer's final weights
    out = tmp_path / f"{strategy}.pt"
    exported = run_cli("export", str(run_dir), "--step", "200", str(out), cwd=tmp_path)
    assert exported.returncode == 0, exported.stdout + exported.stderr
    state = torch.load(out, weights_only=True)
    model = DigitsTask().build_model(hidden=128, depth=2, dropout=0.2)
    model.load_state_dict(state)
    assert weights_digest(model.state_dict()) == reference[0]
