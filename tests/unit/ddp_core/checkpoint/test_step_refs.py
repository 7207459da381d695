"""A pipeline step's ``${steps.NAME.FIELD}``, resolved as the step starts (ddp_core.checkpoint.step_refs): from the
record the login node wrote into the step's run directory and the earlier step's run directory as it is now."""

from __future__ import annotations

import pytest
import torch

from ddp_core.checkpoint import step_refs
from ddp_core.checkpoint import store as checkpoint
from ddp_core.config import Config
from ddp_core.errors import DdpJobError
from ddp_core.run.rundir import RunDir


def step(tmp_path, train_dir, *args: str) -> tuple[Config, RunDir]:
    cfg = Config()
    cfg.script.path, cfg.script.args = "/x/export.py", list(args)
    run = RunDir(tmp_path / "export")
    step_refs.write_record(run.path, "p", "export", {"train": str(train_dir)})
    return cfg, run


def train_run(tmp_path) -> RunDir:
    train = RunDir(tmp_path / "train")
    train.initialize(Config())
    return train


def test_run_dir_and_best_checkpoint_are_what_the_earlier_run_has_now(tmp_path):
    train = train_run(tmp_path)
    cfg, run = step(tmp_path, train.path, "--ckpt", "${steps.train.best_checkpoint}", "${steps.train.run_dir}/m.pt")
    args = "script.args"
    assert step_refs.references(cfg) == [(args, "train", "best_checkpoint"), (args, "train", "run_dir")]
    state = {"model": {"w": torch.zeros(2)}}
    best = checkpoint.save(train.checkpoints, 10, state, keep_last=5)
    checkpoint.save(train.checkpoints, 20, state, keep_last=5)
    checkpoint.mark_best(train.checkpoints, 10, "max:eval/accuracy", 0.9)
    resolved = step_refs.resolve(cfg, run)
    assert resolved.script.args == ["--ckpt", str(best.path), f"{train.path}/m.pt"]
    latest = step(tmp_path, train.path, "${steps.train.latest_checkpoint}")
    assert step_refs.resolve(*latest).script.args == [str(train.checkpoints / "step_00000020.pt")]


def test_a_config_without_references_is_left_alone(tmp_path):
    cfg, run = step(tmp_path, tmp_path, "--plain", "${other}")
    assert step_refs.resolve(cfg, run) is cfg and cfg.script.args == ["--plain", "${other}"]


def test_no_best_checkpoint_is_one_line_naming_the_step_and_the_fix(tmp_path):
    train = train_run(tmp_path)
    cfg, run = step(tmp_path, train.path, "${steps.train.best_checkpoint}")
    with pytest.raises(DdpJobError, match=r"step 'train' \(.*\) has no best checkpoint marked") as err:
        step_refs.resolve(cfg, run)
    assert "checkpoint.monitor" in err.value.hint


def test_a_step_the_record_does_not_know_is_refused(tmp_path):
    cfg, run = step(tmp_path, tmp_path, "${steps.prepare.run_dir}")
    with pytest.raises(DdpJobError, match="no earlier step 'prepare'"):
        step_refs.resolve(cfg, run)
