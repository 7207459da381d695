"""The Hugging Face example (``ddp_core.tasks.hf_gpt2``) measured here: peak host memory (RSS) per rank of ddp vs
fsdp with one shard unit per GPT2Block, 2 ranks on gloo (a ~26M-parameter GPT-2, AdamW), and ms/step of one
process with and without ``train.compile`` (``nn.Module.compile``, as the trainer does).

Each configuration runs in fresh processes (``torch.multiprocessing.spawn``): build the model (same seed), wrap it
with the strategy, take AdamW steps on random bytes, then report ``ru_maxrss`` (the peak, which includes building
the whole model before it is sharded), the RSS after the steps once freed heap is returned to the OS
(``malloc_trim``), and the bytes of this rank's parameters and optimizer state.

    .venv/bin/python bench/hf_model.py [--steps 5] [--n-layer 8] [--n-embd 512]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import resource
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ddp_core.cluster.env import DistEnv
from ddp_core.config import StrategyConfig, StrategyName
from ddp_core.strategies import build_strategy
from ddp_core.tasks.hf_gpt2 import HFGPT2Task

SEQ = 64


def _rss_mb() -> float:
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def _tensor_mb(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> float:
    """This rank's parameters and optimizer state in MB (a sharded parameter counts its local shard only)."""

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if hasattr(t, "to_local") else t

    tensors = [local(p) for p in model.parameters()]
    tensors += [local(v) for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors) / 2**20


def _train(rank: int, world: int, name: str, model_args: dict[str, int], steps: int, compile_: bool,
           store: str, out: str) -> None:  # fmt: skip
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    task = HFGPT2Task(seq_len=SEQ)
    torch.manual_seed(0)
    model = task.build_model(**model_args)
    params = sum(p.numel() for p in model.parameters())
    if compile_:
        model.compile()
    strategy = build_strategy(StrategyConfig(name=StrategyName(name)), DistEnv(rank=rank, world_size=world),
                              torch.device("cpu"), task)  # fmt: skip
    model = strategy.wrap(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, 256, (4, SEQ + 1), generator=torch.Generator().manual_seed(rank))
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        strategy.forward_backward(task, model, (tokens[:, :-1], tokens[:, 1:]), 1, True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - started)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed heap goes back to the OS: RSS then shows what is held
    held = _tensor_mb(model, optimizer)
    # the first step compiles (or warms up): the median of the rest
    later = sorted(times[1:]) or times
    Path(f"{out}.{rank}").write_text(
        f"{params} {peak:.0f} {_rss_mb():.0f} {1000 * later[len(later) // 2]:.1f} {held:.0f}"
    )
    dist.destroy_process_group()


def measure(name: str, world: int, model_args: dict[str, int], steps: int, compile_: bool = False) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = f"{tmp}/result"
        args = (world, name, model_args, steps, compile_, f"{tmp}/store", out)
        torch.multiprocessing.spawn(_train, args=args, nprocs=world)
        ranks = [Path(f"{out}.{r}").read_text().split() for r in range(world)]
    return {
        "run": f"{name}{' compiled' if compile_ else ''} ({world} rank{'s' * (world > 1)})",
        "params_m": round(int(ranks[0][0]) / 1e6, 1),
        "peak_rss_mb": max(float(r[1]) for r in ranks),
        "rss_after_mb": max(float(r[2]) for r in ranks),
        "ms_per_step": max(float(r[3]) for r in ranks),
        "tensors_mb": max(float(r[4]) for r in ranks),
    }


def rows(steps: int = 5, n_layer: int = 8, n_embd: int = 512) -> list[dict[str, Any]]:
    big = {"n_layer": n_layer, "n_embd": n_embd, "n_head": 8}
    small = {"n_layer": 2, "n_embd": 128, "n_head": 4}
    return [
        measure("ddp", 2, big, steps),
        measure("fsdp", 2, big, steps),
        measure("ddp", 1, small, steps + 5),
        measure("ddp", 1, small, steps + 5, compile_=True),
    ]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--n-layer", type=int, default=8)
    parser.add_argument("--n-embd", type=int, default=512)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    for row in rows(args.steps, args.n_layer, args.n_embd):
        print(f"{row['run']:>26}: {row['params_m']:5.1f}M params  peak RSS/rank {row['peak_rss_mb']:7.0f} MB  "
              f"RSS after steps {row['rss_after_mb']:7.0f} MB  params+optimizer {row['tensors_mb']:5.0f} MB  "
              f"{row['ms_per_step']:8.1f} ms/step")  # fmt: skip


if __name__ == "__main__":
    main()
