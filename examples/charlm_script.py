"""A plain DDP training script that survives preemption through ``ddp_core.runtime``: checkpoint, stop, requeue, resume.

A small byte-level transformer (``ddp_core.tasks.charlm``'s model and text) trained with AdamW. What makes the
resumed run bitwise equal to an uninterrupted one: the same initial weights on every rank (seeded before the model
is built), data that is a function of the step alone (each step's batch indices come from a generator seeded with
the step), and checkpoints holding model, optimizer, step and every rank's RNG state (dropout).

    ddpjob submit --script examples/charlm_script.py -- ARGS     # under ddpjob, as a Slurm job
    torchrun --standalone --nproc-per-node=2 examples/charlm_script.py --checkpoint-dir /tmp/ckpt

It prints ``final weights sha256 <hex>`` on every rank at the end, in the trainer's format.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_core import runtime  # installs the signal handlers: before the setup below, which may take a while
from ddp_core.tasks.charlm import VOCAB, CharLMTask

CHECKPOINT = re.compile(r"step_(\d{8})\.pt")


def batch_indices(n_items: int, step: int, batch: int, rank: int, world: int, seed: int) -> torch.Tensor:
    """This rank's share of step ``step``'s global batch: the same on every attempt, with no sampler state to save."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    indices = torch.randint(n_items, (world * batch,), generator=generator)
    return indices[rank * batch : (rank + 1) * batch]


def latest_checkpoint(folder: Path) -> Optional[Path]:
    found = sorted(p for p in folder.iterdir() if CHECKPOINT.fullmatch(p.name))
    return found[-1] if found else None


def save(folder: Path, step: int, model: torch.nn.Module, optimizer: Any, keep: int) -> None:
    """Collective: every rank's RNG state to rank 0, which writes the checkpoint atomically (temp file, then rename:
    a reader never sees half a file, and a crash mid-write leaves only a temp file that is ignored)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    rngs: list[Any] = [None] * world
    dist.all_gather_object(rngs, torch.get_rng_state())
    if rank == 0:
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step, "rng": rngs}
        final = folder / f"step_{step:08d}.pt"
        tmp = folder / f".{final.name}.tmp"
        torch.save(state, tmp)
        os.replace(tmp, final)
        for old in sorted(p for p in folder.iterdir() if CHECKPOINT.fullmatch(p.name))[:-keep]:
            old.unlink()
    dist.barrier()  # nobody stops (or requeues) before the checkpoint is on disk


def weights_digest(model: torch.nn.Module) -> str:
    """sha256 over the parameters' names and bytes: equal digests mean bitwise-equal weights."""
    h = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        h.update(name.encode())
        h.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank and step")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save-every", type=int, default=50)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--keep", type=int, default=2, help="checkpoints kept")
    parser.add_argument("--checkpoint-dir", type=Path, help="outside ddpjob only (under ddpjob: RUN/checkpoints)")
    args = parser.parse_args()

    if "RANK" in os.environ:
        dist.init_process_group("gloo")
    else:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    rank, world = dist.get_rank(), dist.get_world_size()
    folder = runtime.checkpoint_dir() if runtime.in_ddpjob() else args.checkpoint_dir
    if folder is None:
        parser.error("--checkpoint-dir is required outside ddpjob")
    folder.mkdir(parents=True, exist_ok=True)
    torch.use_deterministic_algorithms(True)

    task = CharLMTask(seq_len=32, max_chars=200_000)
    train_set, _ = task.build_datasets()
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = task.build_model(d_model=64, n_layers=2, n_heads=4, dropout=0.1)
    start, rng = 0, None
    newest = latest_checkpoint(folder)
    if newest is not None:
        state = torch.load(newest, weights_only=True)
        model.load_state_dict(state["model"])
        start, rng = state["step"], state["rng"][rank]
    ddp_model = DDP(model)
    optimizer = torch.optim.AdamW(ddp_model.parameters(), lr=args.lr)
    if newest is not None:
        optimizer.load_state_dict(state["optimizer"])
        print(f"rank {rank}: resumed from {newest.name} (restart {runtime.restart_count()})", flush=True)
    torch.manual_seed(args.seed * 1000 + rank + 1)  # each rank its own dropout stream...
    if rng is not None:
        torch.set_rng_state(rng)  # ...continued exactly where the checkpoint left it

    model.train()
    for step in range(start, args.steps):
        idx = batch_indices(len(train_set), step, args.batch, rank, world, args.seed)
        x, y = (torch.stack(t) for t in zip(*(train_set[int(i)] for i in idx), strict=True))
        loss = F.cross_entropy(ddp_model(x).reshape(-1, VOCAB), y.reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        done = step + 1
        if done % args.log_every == 0:
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            runtime.log({"loss": mean.item() / world}, step=done)
        if done % args.save_every == 0 and done < args.steps:
            save(folder, done, model, optimizer, args.keep)
        if runtime.stop_requested():  # every rank gets the same answer here, so they all stop after this step
            save(folder, done, model, optimizer, args.keep)
            print(f"rank {rank}: stopping at step {done}", flush=True)
            runtime.requeue(step=done)

    print(f"final weights sha256 {weights_digest(model)}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
