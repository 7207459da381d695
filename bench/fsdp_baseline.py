"""The hand-written FSDP2 reference that scripts/gpu-check compares ddpjob's fsdp strategy against, beside the
hand-written DDP loop (bench/ddp_baseline.py, whose arguments and timing it shares): the same char LM trained the way
PyTorch's FSDP2 tutorial does it, and nothing else. One process per GPU (torchrun's environment variables),
``fully_shard`` on each transformer block and then on the root over a 1-D mesh of all ranks, bf16 parameters with
fp32 gradient reduction (``MixedPrecisionPolicy``, what ``strategy.mixed_precision=bf16`` sets) under bf16 autocast
(``train.precision=bf16``, as gpu-check runs every strategy), AdamW over the sharded parameters, backward, step. No
per-step .item(), no checkpoints, no logging inside the loop: the only synchronisations are torch.cuda.synchronize()
at the edges of the timed window (steps window_start+1 .. steps).

    PYTHONPATH=. torchrun --standalone --nproc-per-node=G bench/fsdp_baseline.py --d-model 1024 --layers 8 \
        --seq-len 512 --batch-size 24 --steps 40 --window-start 10 --out timing.json

Rank 0 writes the timing (and the peak GPU memory) as JSON to --out. On a CPU it runs the same loop on gloo.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn import functional as F
from torch.utils.data import DataLoader, DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parent))  # ddp_baseline beside it, also when run from elsewhere
from ddp_baseline import parse_args, synchronize

from ddp_core.tasks.charlm import Block, CharLMTask


def main() -> None:
    args = parse_args()
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    mesh = init_device_mesh(device.type, (world_size,))

    torch.manual_seed(args.seed)
    task = CharLMTask(seq_len=args.seq_len, max_chars=args.max_chars, eval_fraction=args.eval_fraction)
    model = task.build_model(d_model=args.d_model, n_layers=args.layers, n_heads=args.heads, dropout=0.0).to(device)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for module in model.modules():
        if isinstance(module, Block):
            fully_shard(module, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    train_set, _ = task.build_datasets()
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, drop_last=True, pin_memory=cuda)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)

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
    seconds = time.perf_counter() - window_started

    peak = None
    if cuda:  # the largest peak over ranks, as the trainer reports it
        peak_t = torch.tensor([torch.cuda.max_memory_allocated(device) / 1e9], device=device)
        dist.all_reduce(peak_t, op=dist.ReduceOp.MAX)
        peak = peak_t.item()
    ms = 1000 * seconds / (args.steps - args.window_start)
    if rank == 0 and args.out is not None:
        timing = {"world_size": world_size, "batch_size": args.batch_size, "window": [args.window_start, args.steps],
                  "seconds": seconds, "ms_per_step": ms, "peak_mem_gb": peak, "final_loss": loss.item(),
                  "device": str(device)}  # fmt: skip
        args.out.write_text(json.dumps(timing, indent=2) + "\n")
    print(f"rank {rank}/{world_size}: {ms:.1f} ms/step (hand-written FSDP2)", flush=True)
    dist.barrier(device_ids=[local_rank] if cuda else None)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # As ddp_baseline: end without the interpreter's teardown, which gloo's threads can abort after a successful run.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
