"""The hand-written reference that scripts/gpu-check compares the trainer against: the char LM of
configs/charlm.yaml trained the way PyTorch's DDP tutorial does it, and nothing else. One process per GPU
(torchrun's environment variables), init_process_group from the environment, DDP(model,
device_ids=[local_rank]), a DistributedSampler, AdamW, bf16 autocast, backward, step. No per-step .item(), no
checkpoints, no logging inside the loop: the only synchronisations are torch.cuda.synchronize() at the
edges of the timed window (steps window_start+1 .. steps).

    PYTHONPATH=. torchrun --standalone --nproc-per-node=G bench/ddp_baseline.py --d-model 1024 --layers 8 \
        --seq-len 512 --batch-size 24 --steps 40 --window-start 10 --out timing.json

Rank 0 writes the timing (and the peak GPU memory) as JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from ddp_core.tasks.charlm import CharLMTask


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--max-chars", type=int, default=4_000_000)
    parser.add_argument("--eval-fraction", type=float, default=0.01)
    parser.add_argument("--batch-size", type=int, default=24, help="per rank")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--window-start", type=int, default=10, help="steps before the timed window (warm-up)")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="rank 0 writes its timing here as JSON")
    args = parser.parse_args()
    if not 0 <= args.window_start < args.steps:
        parser.error("--window-start must be >= 0 and below --steps")
    return args


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main() -> None:
    args = parse_args()
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl")
    else:  # the CPU rehearsal: same loop on gloo
        device = torch.device("cpu")
        dist.init_process_group("gloo")

    torch.manual_seed(args.seed)
    task = CharLMTask(seq_len=args.seq_len, max_chars=args.max_chars, eval_fraction=args.eval_fraction)
    model = task.build_model(d_model=args.d_model, n_layers=args.layers, n_heads=args.heads, dropout=0.0)
    model = model.to(device)
    ddp_model = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None)
    train_set, _ = task.build_datasets()
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    loader = DataLoader(
        train_set, batch_size=args.batch_size, sampler=sampler, drop_last=True, pin_memory=device.type == "cuda"
    )
    optimizer = torch.optim.AdamW(ddp_model.parameters(), lr=args.lr, weight_decay=args.weight_decay)

    seconds, loss = train_window(ddp_model, optimizer, loader, sampler, device, args)
    report(args, device, seconds, loss, "")


def train_window(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    loader: DataLoader,
    sampler: DistributedSampler,
    device: torch.device,
    args: argparse.Namespace,
) -> tuple[float, torch.Tensor]:
    """The hand-written loop (also bench/fsdp_baseline.py's): bf16 autocast, backward, step; the seconds of steps
    window_start+1 .. steps, synchronised at the edges only, and the last loss."""
    step, epoch = 0, 0
    window_started = 0.0
    if args.window_start == 0:
        synchronize()
        window_started = time.perf_counter()
    while step < args.steps:
        sampler.set_epoch(epoch)
        for inputs, targets in loader:
            inputs = inputs.to(device, non_blocking=True)
            targets = targets.to(device, non_blocking=True)
            with torch.autocast(device_type=device.type, dtype=torch.bfloat16):
                logits = model(inputs)
                loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            if step == args.window_start:
                synchronize()
                window_started = time.perf_counter()
            if step == args.steps:
                break
        epoch += 1
    synchronize()
    return time.perf_counter() - window_started, loss


def report(args: argparse.Namespace, device: torch.device, seconds: float, loss: torch.Tensor, label: str) -> None:
    """Rank 0 writes the timing (and the largest peak GPU memory over ranks, as the trainer reports it) to --out;
    every rank prints its ms/step (``label``: which loop); then the group ends."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    peak = None
    if device.type == "cuda":
        peak_t = torch.tensor([torch.cuda.max_memory_allocated(device) / 1e9], device=device)
        dist.all_reduce(peak_t, op=dist.ReduceOp.MAX)
        peak = peak_t.item()
    ms = 1000 * seconds / (args.steps - args.window_start)
    if rank == 0 and args.out is not None:
        timing = {
            "world_size": world_size,
            "batch_size": args.batch_size,
            "window": [args.window_start, args.steps],
            "seconds": seconds,
            "ms_per_step": ms,
            "peak_mem_gb": peak,
            "final_loss": loss.item(),
            "device": str(device),
        }
        args.out.write_text(json.dumps(timing, indent=2) + "\n")
    print(f"rank {rank}/{world_size}: {ms:.1f} ms/step{label}", flush=True)
    dist.barrier(device_ids=[device.index] if device.type == "cuda" else None)  # then destroy: gloo can abort at exit
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # Barrier and destroy are not always enough: gloo's threads can still abort CPython's teardown after a successful
    # run ("terminate called without an active exception", exit 134; seen here on a loaded 2-core machine). End as
    # the trainer does (ddp_core.cluster.exits), without the interpreter's teardown, once the output is out.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
