"""Pipeline strategy without Slurm: equivalence with single-process training, exact resume, validation."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from ddp_core.cluster.env import DistEnv
from ddp_core.config import load_config
from ddp_core.errors import DdpJobError
from ddp_core.strategies.pipeline import PipelineStrategy
from tests.support.digits import trainer
from tests.support.helpers import ROOT, final_digests

PIPE = ["strategy.name=pipeline", "strategy.stages=2", "strategy.microbatches=4", "data.batch_size=16"]
BASE = ["train.eval_every=0", "train.log_every=5", "wandb.mode=disabled", "optim.warmup_steps=0"]


def export(run_dir: Path) -> dict[str, torch.Tensor]:
    out = run_dir / "export.pt"
    proc = subprocess.run(
        [sys.executable, "-m", "jobs", "export", str(run_dir), str(out)], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    return torch.load(out, weights_only=True)


def last_loss(run_dir: Path) -> float:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["split"] == "train"][-1]["loss"]


# Same global batch, no dropout, SGD (Adam would blow float reassociation noise up on near-zero gradients).
SAME = [*BASE, "data.batch_size=16", "task.model.dropout=0.0", "optim.name=sgd", "optim.lr=0.05", "train.max_steps=10",
        "checkpoint.every_steps=0"]  # fmt: skip


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> tuple[dict[str, torch.Tensor], float]:
    """The single-process run both schedules must match (one config: trained and exported once)."""
    run = tmp_path_factory.mktemp("single") / "run"
    trainer(run, *SAME)
    return export(run), last_loss(run)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipeline_matches_single_process(tmp_path, schedule, single):
    trainer(tmp_path / "pipe", *SAME, *PIPE, f"strategy.schedule={schedule}", nproc=2)
    weights, loss = single
    pipe = export(tmp_path / "pipe")
    assert list(weights) == list(pipe)
    for key in weights:
        diff = (weights[key] - pipe[key]).norm() / weights[key].norm().clamp(min=1e-12)
        assert diff < 1e-5, (key, float(diff))
    assert last_loss(tmp_path / "pipe") == pytest.approx(loss, rel=1e-5)


def test_pipeline_resume_is_bitwise_exact_and_reloads_at_world_size_1(tmp_path):
    common = [*BASE, *PIPE, "train.max_steps=40", "checkpoint.every_steps=10", "checkpoint.keep_last=10",
              "task.model.dropout=0.2"]  # fmt: skip
    ref = final_digests(trainer(tmp_path / "run", *common, nproc=2))
    assert len(ref) == 2 and len(set(ref)) == 1
    for path in (tmp_path / "run" / "checkpoints").glob("step_*"):
        if int(path.name.split("_")[1].split(".")[0]) > 20:
            subprocess.run(["rm", "-rf", str(path)], check=True)
    log = trainer(tmp_path / "run", *common, nproc=2)
    assert "resumed from step_00000020.dcp" in log
    assert final_digests(log) == ref
    # the sharded checkpoint continues in one process under ddp (world size 2 -> 1)
    cfg = (tmp_path / "run" / "config.yaml").read_text().replace("name: pipeline", "name: ddp")
    (tmp_path / "run" / "config.yaml").write_text(cfg.replace("max_steps: 40", "max_steps: 45"))
    one = subprocess.run([sys.executable, "-m", "ddp_core", str(tmp_path / "run")], capture_output=True, text=True)
    assert one.returncode == 0, one.stderr
    assert "resumed from step_00000040.dcp" in one.stderr and "finished at step 45" in one.stderr


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["strategy.stages=3"], "'strategy.stages' = 3 is invalid: must divide the world size (2"),
        (["strategy.microbatches=5"], "'strategy.microbatches' = 5 is invalid: must divide data.batch_size (16)"),
        (["strategy.schedule=zigzag"], "'strategy.schedule'"),
        (["strategy.split=[3]"], "needs one entry per stage (2)"),
    ],
)
def test_impossible_pipelines_are_refused_on_the_login_node(overrides, needle):
    with pytest.raises(DdpJobError) as err:
        load_config(ROOT / "configs" / "digits.yaml", [*PIPE, *overrides])
    assert needle in str(err.value)


def test_more_stages_than_layers_is_a_clear_error():
    cfg = load_config(ROOT / "configs" / "digits.yaml", [*PIPE, "strategy.stages=4", "slurm.tasks_per_node=4"])
    strategy = PipelineStrategy(cfg.strategy, DistEnv(world_size=4), torch.device("cpu"))
    with pytest.raises(DdpJobError, match=r"'strategy\.stages' = 4 exceeds the model's 3 top-level layers"):
        strategy.wrap(nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2)))
