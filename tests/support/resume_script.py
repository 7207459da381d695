"""A plain torchrun-style script that saves its own checkpoint after every step and loads it when given ``--resume``
(what ``script.resume_args`` appends after the run's first attempt). Nothing here imports ddp_core.

With ``--interrupt``, the test's interruptions come at chosen steps, from inside: on the first attempt rank 0 sends
the job Slurm's warning signal at step 5 (``scancel --signal=USR2``, as the time limit's warning does), which this
script has no handler for, so ddpjob requeues the job (SIGTERM ends both ranks); on the second, rank 1 is killed by
SIGKILL at step 12 (the OOM killer), after which the batch script restarts the ranks in the same allocation, and
that job step finishes.

With ``--pause S --mark FILE`` (the first attempt only), every step takes S seconds more and rank 0 writes FILE after
step 2, so that the test can take a node down from outside at that step while the run still has its steps to go.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
import subprocess
import time
from pathlib import Path

import torch
import torch.distributed as dist


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--interrupt", action="store_true", help="the test's interruptions (module docstring)")
    parser.add_argument("--pause", type=float, default=0.0, help="seconds per step, first attempt (docstring)")
    parser.add_argument("--mark", type=Path, help="written by rank 0 after step 2 of the first attempt (docstring)")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt = Path(os.environ["DDPJOB_CHECKPOINT_DIR"]) / "own.pt"
    done = 0
    if args.resume:
        state = torch.load(ckpt)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        done = state["step"]
        print(f"rank {rank}: resumed from step {done} of its own checkpoint", flush=True)
    restart = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
    while done < args.steps:
        g = torch.Generator().manual_seed(1000 * done + rank)
        x, y = torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()
        opt.step()
        done += 1
        if rank == 0:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": done}, ckpt.with_suffix(".tmp"))
            os.replace(ckpt.with_suffix(".tmp"), ckpt)
        dist.barrier()
        if restart == 0 and args.pause:
            time.sleep(args.pause)
        if restart == 0 and args.mark and done == 2 and rank == 0:
            args.mark.write_text(f"{time.time():.3f}\n")
        if args.interrupt and restart == 0 and done == 5 and rank == 0:
            subprocess.run(["scancel", "--signal=USR2", os.environ["SLURM_JOB_ID"]], check=True)
            time.sleep(120)  # the requeue's SIGTERM ends this attempt
        if args.interrupt and restart == 1 and done == 12 and rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
    print(f"rank {rank}: finished at step {done}, weights {digest}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
