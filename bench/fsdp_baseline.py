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

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.data import DataLoader, DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parent))  # ddp_baseline beside it, also when run from elsewhere
from ddp_baseline import parse_args, report, train_window

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
    seconds, loss = train_window(model, optimizer, loader, sampler, device, args)
    report(args, device, seconds, loss, " (hand-written FSDP2)")


if __name__ == "__main__":
    main()
    # As ddp_baseline: end without the interpreter's teardown, which gloo's threads can abort after a successful run.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
