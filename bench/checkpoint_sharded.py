"""Checkpoint save cost on 2 ranks (gloo, CPU), ~100M parameters with AdamW state (1.2 GB in all), through the
trainer's own ``save_checkpoint``:

- full: ddp's path, every rank a replica; rank 0 writes one file (atomic, fsync, checksummed manifest), all wait;
- async full: the same with ``checkpoint.async_save``; training blocks while rank 0 copies the state to host memory
  (the whole copy: with no training step here, the trainer's overlap of it is ``bench/checkpoint_save.py``'s);
- sharded: fsdp's path, every rank writes its half with DCP; rank 0 checksums the files and writes the manifest;
- async sharded: the same through ``dcp.async_save``; training blocks only while the state is copied (reported),
  the rest completes in the background (reported as "complete").

Every figure is the time training is blocked, on rank 0, best of ``--repeats``.

    OMP_NUM_THREADS=1 .venv/bin/python bench/checkpoint_sharded.py [--params 100e6] [--repeats 3]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from ddp_core.checkpoint.manager import CheckpointManager
from ddp_core.checkpoint.train_state import Carried, Position, TrainState
from ddp_core.cluster.env import DistEnv
from ddp_core.config import StrategyConfig, StrategyName, load_config
from ddp_core.run.rundir import RunDir
from ddp_core.strategies import build_strategy
from ddp_core.trainer.metrics import RunningLoss
from ddp_core.trainer.optim import build_optimizer, build_scheduler

WIDTH = 4096


def big_model(params: float) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(max(1, round(params / (WIDTH * WIDTH))))])


def measure(
    name: str, rank: int, world: int, params: float, repeats: int, tmp: Path, async_save: bool = False
) -> tuple[float, float, int]:
    """(seconds blocked, seconds until complete, bytes on disk) of ``repeats`` saves, the best of each."""
    cfg = load_config(None, ["run.name=bench", "checkpoint.keep_last=1"])
    env = DistEnv(rank=rank, world_size=world)
    strategy = build_strategy(StrategyConfig(name=StrategyName(name)), env, torch.device("cpu"))
    model = strategy.wrap(big_model(params))
    optimizer = build_optimizer(cfg.optim, model)
    scheduler = build_scheduler(cfg.optim, optimizer, cfg.train.max_steps)
    model(torch.ones(1, WIDTH)).sum().backward()
    optimizer.step()  # materialise AdamW's state: 2 more tensors per parameter
    optimizer.zero_grad(set_to_none=True)
    run_dir = RunDir(tmp / f"{name}-{async_save}")
    cfg.checkpoint.async_save = async_save
    manager = CheckpointManager(cfg.checkpoint, run_dir, env, strategy, model, optimizer)
    writer = manager.sharded or manager.full
    state = TrainState(scheduler, RunningLoss(), Carried({}, {}), {})

    def save(step: int) -> tuple[float, float]:
        if writer is not None:
            writer.wait()  # the previous async save is not part of this one's figures
        dist.barrier()
        state.pos = Position(step=step)
        manager.save(state)
        blocked = manager.last_save_s
        total = blocked + (writer.wait() if writer is not None else 0.0)
        return blocked, total

    times = [save(step) for step in range(1, repeats + 1)]
    manager.close()
    size = sum(p.stat().st_size for p in run_dir.checkpoints.rglob("*") if p.is_file())
    return min(t[0] for t in times), min(t[1] for t in times), size  # best: the least disturbed by other I/O


def worker(rank: int, world: int, store: str, params: float, repeats: int, tmp: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    rows = [
        ("full state from rank 0 (ddp)", measure("ddp", rank, world, params, repeats, Path(tmp))),
        ("async full from rank 0 (ddp)", measure("ddp", rank, world, params, repeats, Path(tmp), async_save=True)),
        ("sharded DCP (fsdp)", measure("fsdp", rank, world, params, repeats, Path(tmp))),
        ("async sharded DCP (fsdp)", measure("fsdp", rank, world, params, repeats, Path(tmp), async_save=True)),
    ]
    if rank == 0:
        n = sum(p.numel() for p in big_model(params).parameters())
        print(f"{n / 1e6:.1f}M parameters + AdamW state, {world} ranks (gloo, CPU), best of {repeats}")
        full = rows[0][1][0]
        for label, (blocked, total, size) in rows:
            extra = f" (complete after {total:.2f} s)" if total > blocked + 1e-3 else ""
            print(f"  {label:<30} blocks {blocked:6.2f} s  {blocked / full:5.2f}x full   {size / 1e9:.2f} GB{extra}")
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--params", type=float, default=100e6)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir="/var/tmp") as tmp:
        store = str(Path(tmp) / "store")
        torch.multiprocessing.spawn(worker, args=(2, store, args.params, args.repeats, tmp), nprocs=2)


if __name__ == "__main__":
    main()
