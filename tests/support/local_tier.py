"""The node-local tier's test rig, shared by its tests (tests/unit/ddp_core/checkpoint/test_local_tier*.py): a model,
AdamW, a schedule, a train state and the checkpoint manager, trained as the trainer does, and where the copies go."""

from __future__ import annotations

import socket
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ddp_core.checkpoint.manager import CheckpointManager
from ddp_core.checkpoint.train_state import Carried, TrainState
from ddp_core.cluster.env import DistEnv
from ddp_core.config import CheckpointConfig, StrategyConfig, StrategyName
from ddp_core.run import private
from ddp_core.run.rundir import RunDir
from ddp_core.strategies import build_strategy
from ddp_core.trainer.metrics import RunningLoss

CPU = torch.device("cpu")


@dataclass
class Rig:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    state: TrainState
    manager: CheckpointManager


def rig(tmp: Path, seed: int = 0, run: str = "run", env: DistEnv | None = None, strategy: str = "ddp", **keys) -> Rig:
    """A model, AdamW, a schedule, a train state and its checkpoint manager, as the trainer builds them."""
    env = env or DistEnv(job_id="77")
    layout = build_strategy(StrategyConfig(name=StrategyName(strategy)), env, CPU)
    torch.manual_seed(seed)
    model = layout.wrap(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 / (1 + step))
    state = TrainState(scheduler, RunningLoss(), Carried({}, {}), {"train": {"invariant": False}})
    cfg = CheckpointConfig(**({"every_steps": 10, "local_every_steps": 2, "local_path": str(tmp / "shm")} | keys))
    (tmp / "shm").mkdir(parents=True, exist_ok=True)
    (tmp / run).mkdir(parents=True, exist_ok=True)  # the run directory, as the trainer's
    return Rig(model, optimizer, state, CheckpointManager(cfg, RunDir(tmp / run), env, layout, model, optimizer))


def train(r: Rig, steps: int) -> None:
    """``steps`` optimizer steps on batches fixed by the step, with the trainer's saves after each."""
    for _ in range(steps):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(r.state.pos.step))
        (r.model(x).sum() + torch.rand(()) * 0).backward()  # the RNG is drawn from, as dropout would
        r.optimizer.step()
        r.optimizer.zero_grad()
        r.state.scheduler.step()
        r.state.pos.step += 1
        if r.manager.due(r.state.pos.step, 1000):
            r.manager.save(r.state)
        elif r.manager.local_due(r.state.pos.step, 1000):
            r.manager.save_local(r.state)


def weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def steps_in(folder: Path) -> list[int]:
    return sorted(int(p.stem.removeprefix("step_")) for p in folder.glob("step_*.json"))


def node_folder(tmp: Path, job: str = "77", host: str | None = None, local_path: Path | None = None) -> Path:
    """A node's folder of the tier: ``local_path`` (the rig's ``tmp/shm`` by default)/ddpjob-USER-JOB/HOST."""
    return (local_path or tmp / "shm") / private.per_user_name(job) / (host or socket.gethostname())
