"""Strategies dp and model_parallel: bitwise equal to plain training, plain checkpoints, login-node validation,
and the charlm task end to end (no Slurm)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from typing import Optional

import pytest
import torch
from torch import nn

from ddp_core.checkpoint import store as checkpoint
from ddp_core.cluster.env import DistEnv
from ddp_core.config import Config, OptimConfig, StrategyConfig, StrategyName, load_config, ranks_per_node
from ddp_core.errors import DdpJobError
from ddp_core.strategies import Strategy, build_strategy
from ddp_core.strategies.model_parallel import StagedModel, balanced_split
from ddp_core.tasks.charlm import CharLMTask, Windows
from ddp_core.trainer.optim import build_optimizer
from jobs.submission import partitions as cluster
from jobs.submission.request import SlurmRequest
from tests.support.helpers import ROOT

CPU = torch.device("cpu")
MODEL_ARGS = {"d_model": 32, "n_layers": 2, "n_heads": 2, "dropout": 0.1}  # 4 top-level layers


@pytest.fixture(autouse=True)
def _one_thread():
    # Both sides of a comparison run with the same thread count; one also keeps this suite light on CPU.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def strategy(name: str, split: Optional[list[int]] = None, world_size: int = 1) -> Strategy:
    return build_strategy(StrategyConfig(name=StrategyName(name), split=split), DistEnv(world_size=world_size), CPU)


def run_steps(strat: Optional[Strategy], steps: int = 5) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """``steps`` AdamW steps on one fixed batch, the trainer's way: same seed for the weights, then for dropout."""
    task = CharLMTask(seq_len=16)
    torch.manual_seed(0)
    model = task.build_model(**MODEL_ARGS)
    if strat is not None:
        model = strat.wrap(model)
    optimizer = build_optimizer(OptimConfig(lr=1e-2), model)
    tokens = torch.randint(0, 256, (8, 17), generator=torch.Generator().manual_seed(1))
    batch = (tokens[:, :-1], tokens[:, 1:])
    torch.manual_seed(1)
    losses = []
    for _ in range(steps):
        out = task.compute(model, batch)
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(out.loss.detach())
    return losses, strat.model_state(model) if strat is not None else model.state_dict()


@pytest.mark.parametrize(
    ("name", "split"), [("dp", None), ("model_parallel", None), ("model_parallel", [1, 2, 1]), ("ddp", None)]
)
def test_strategy_matches_plain_training_bitwise(name, split):
    ref_losses, ref_state = run_steps(None)
    losses, state = run_steps(strategy(name, split))
    assert torch.equal(torch.stack(losses), torch.stack(ref_losses))
    assert list(state) == list(ref_state)  # plain keys: no "module." prefix in checkpoints
    assert all(torch.equal(state[k], ref_state[k]) for k in ref_state)
    assert not torch.equal(ref_state["0.tokens.weight"], run_steps(None, steps=0)[1]["0.tokens.weight"])  # it trained


def test_model_parallel_stages_and_state_round_trip():
    model = CharLMTask(seq_len=16).build_model(**MODEL_ARGS)
    strat = strategy("model_parallel", [1, 3])
    wrapped = strat.wrap(model)
    assert isinstance(wrapped, StagedModel) and strat.unwrap(wrapped) is model
    assert [len(layers) for _, layers in wrapped._stages] == [1, 3]
    assert strat.data_rank == 0 and strat.data_world == 1
    fresh = strategy("model_parallel").wrap(CharLMTask(seq_len=16).build_model(**MODEL_ARGS))
    strat.load_model_state(fresh, strat.model_state(wrapped))
    assert all(
        torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), wrapped.state_dict().values(), strict=True)
    )


def test_model_parallel_accepts_a_stages_attribute():
    class Staged(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stages = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 2)])

    wrapped = strategy("model_parallel", [1, 1]).wrap(Staged())
    assert wrapped(torch.ones(3, 4)).shape == (3, 2)


def test_balanced_split_minimises_the_largest_stage():
    assert balanced_split([10, 1, 1, 10], 2) == [2, 2]
    assert balanced_split([1, 1, 1, 9], 2) == [3, 1]
    assert balanced_split([5, 5], 4) == [1, 1]  # never an empty stage
    assert balanced_split([3, 0, 3], 1) == [3]  # the CPU: one device


@pytest.mark.parametrize(
    ("make", "strat", "message"),
    [
        (lambda: nn.Linear(4, 4), strategy("model_parallel"), "needs an nn.Sequential"),
        (lambda: nn.Sequential(nn.Linear(4, 4)), strategy("model_parallel", [1, 1]), "'strategy.split' = [1, 1]"),
        (lambda: nn.Sequential(nn.Linear(4, 4)), strategy("dp", world_size=2), "started 2"),
        (
            lambda: nn.Sequential(nn.Linear(4, 4)),
            strategy("model_parallel", world_size=2),
            "started 2",
        ),
    ],
)
def test_wrap_errors_name_the_problem(make, strat, message):
    with pytest.raises(DdpJobError, match=re.escape(message)):
        strat.wrap(make())


def cfg(*overrides: str) -> Config:
    return load_config(None, ["run.name=t", *overrides])


@pytest.mark.parametrize("name", ["dp", "model_parallel"])
def test_single_process_strategies_refuse_several_nodes(name):
    with pytest.raises(DdpJobError) as err:
        cfg(f"strategy.name={name}", "slurm.nodes=2")
    assert "'strategy.name'" in str(err.value) and "'slurm.nodes'" in str(err.value)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["strategy.name=model_parallel", "strategy.split=[2,0]"], "'strategy.split' = [2, 0] is invalid"),
        (["strategy.split=[]"], "'strategy.split' = [] is invalid"),
        (["strategy.name=model_parallel", "slurm.gpus_per_node=2", "strategy.split=[1,1,1]"], "3 stages need 3 GPUs"),
    ],
)
def test_split_validation(overrides, message):
    with pytest.raises(DdpJobError, match=re.escape(message)):
        cfg(*overrides)


def test_one_task_per_node_with_all_gpus_for_dp_and_model_parallel():
    assert ranks_per_node(cfg("slurm.gpus_per_node=4")) == 4
    assert ranks_per_node(cfg("slurm.tasks_per_node=3")) == cfg("slurm.tasks_per_node=3").slurm.ranks_per_node == 3
    for name in ("dp", "model_parallel"):
        dp = cfg(f"strategy.name={name}", "slurm.gpus_per_node=4", "slurm.cpus_per_task=8")
        request = SlurmRequest.resolve(dp)
        assert ranks_per_node(dp) == 1 and request.tasks_per_node == 1 and request.gpus == {"gpus_per_node": 4}
    part = cluster.Partition("p", nodes=1, cpus_per_node=4, gpus_per_node=0)
    wide = cfg("slurm.tasks_per_node=4", "slurm.cpus_per_task=2")
    with pytest.raises(DdpJobError, match=re.escape("4 ranks x slurm.cpus_per_task = 2 needs 8 CPUs")):
        SlurmRequest.resolve(wide).check_fits(part)
    dp = cfg("strategy.name=dp", "slurm.tasks_per_node=4", "slurm.cpus_per_task=2")
    SlurmRequest.resolve(dp).check_fits(part)  # one process x 2 CPUs fits


def test_charlm_windows_are_fixed_shifted_and_disjoint():
    train, held_out = CharLMTask(seq_len=32, max_chars=20_000, eval_fraction=0.1).build_datasets()
    assert isinstance(train, Windows) and len(train) == (18_000 - 1) // 32 and len(held_out) == (2_000 - 1) // 32
    x, y = train[3]
    assert x.dtype == torch.long and torch.equal(x[1:], y[:-1]) and torch.equal(x[:1], train.data[96:97].long())
    assert torch.equal(CharLMTask(seq_len=32, max_chars=20_000).build_datasets()[0][5][0], train[5][0])


def test_model_parallel_run_end_to_end_then_resumed_under_dp(tmp_path):
    run_dir = tmp_path / "run"
    common = ["--run-dir", str(run_dir), "wandb.mode=disabled", "task.data.max_chars=100000", "train.eval_every=0",
              "train.log_every=3", "checkpoint.every_steps=3", "optim.warmup_steps=0"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SUBMITIT_"))} | {"OMP_NUM_THREADS": "1"}

    def trainer(*overrides: str) -> str:
        cmd = [sys.executable, "-m", "ddp_core", str(ROOT / "configs" / "charlm.yaml"), *common, *overrides]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return proc.stderr

    log = trainer("strategy.name=model_parallel", "strategy.split=[2,2]", "train.max_steps=6")
    assert "model_parallel stage 1 on cpu: layers 2-3" in log and "finished at step 6" in log
    latest = checkpoint.find_latest(run_dir / "checkpoints")
    assert latest is not None and latest.path.name == "step_00000006.pt"
    plain = CharLMTask().build_model(d_model=64, n_layers=2, n_heads=4)
    plain.load_state_dict(checkpoint.load(latest)["model"])  # strict: exactly the plain model's keys

    log = trainer("strategy.name=dp", "train.max_steps=9")  # the same checkpoint, another strategy
    assert "resumed from step_00000006.pt" in log and "finished at step 9" in log
