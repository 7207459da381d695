"""The PyTorch DDP tutorial's script, as torchrun runs it: no ddpjob import, nothing ddpjob-specific.

    torchrun --standalone --nproc-per-node=2 examples/ddp_tutorial.py --steps 20
    python examples/ddp_tutorial.py                          # alone: a one-process group
    ddpjob submit --script examples/ddp_tutorial.py -- --steps 20   # under ddpjob, as a Slurm job

The launcher provides RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT; ``init_process_group()`` reads them
(env://). Started alone (no RANK), the script makes a one-process group on an in-memory store, so the DDP code below
is the same at every world size.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn, optim
from torch.nn.parallel import DistributedDataParallel as DDP


class ToyModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net2(self.relu(self.net1(x)))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--lr", type=float, default=0.001)
    args = parser.parse_args()

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if "RANK" in os.environ:
        dist.init_process_group(backend)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    master = f"{os.environ.get('MASTER_ADDR', '-')}:{os.environ.get('MASTER_PORT', '-')}"
    print(f"rank {rank}/{world} local_rank {local_rank} master {master}", flush=True)

    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    torch.manual_seed(rank)  # different data on each rank; DDP copies rank 0's initial weights to every rank
    model = ToyModel().to(device)
    ddp_model = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None)
    loss_fn = nn.MSELoss()
    optimizer = optim.SGD(ddp_model.parameters(), lr=args.lr)

    for _ in range(args.steps):
        optimizer.zero_grad()
        outputs = ddp_model(torch.randn(20, 10, device=device))
        labels = torch.randn(20, 5, device=device)
        loss = loss_fn(outputs, labels)
        loss.backward()
        optimizer.step()

    print(f"rank {rank}: final loss {loss.item():.4f} after {args.steps} steps", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
