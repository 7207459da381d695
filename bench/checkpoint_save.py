"""Checkpoint save cost: ddpjob's crash-safe save (atomic + fsync + sha256 manifest) vs a plain torch.save,
for the digits example model and a ~100M-parameter model, each with AdamW state. Training is blocked for
the whole save (it is synchronous), so "blocked" equals the save time.

    .venv/bin/python bench/checkpoint_save.py [--params 100e6]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from ddp_core import checkpoint
from ddp_core.tasks.digits import DigitsTask


def model_with_state(model: nn.Module) -> dict:
    opt = torch.optim.AdamW(model.parameters())
    loss = sum(p.sum() for p in model.parameters())
    loss.backward()
    opt.step()  # materialise the optimizer state (2 tensors per parameter)
    return {"model": model.state_dict(), "optimizer": opt.state_dict()}


def big_model(params: float) -> nn.Module:
    width = 4096
    layers = max(1, round(params / (width * width)))
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


def save_fsync(state: dict, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


def timed(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def measure(name: str, model: nn.Module, tmp: Path) -> None:
    n = sum(p.numel() for p in model.parameters())
    state = model_with_state(model)
    repeats = 5 if n < 1e6 else 2
    plain = timed(lambda: torch.save(state, tmp / "plain.pt"), repeats)
    durable = timed(lambda: save_fsync(state, tmp / "durable.pt"), repeats)
    ours = timed(lambda: checkpoint.save(tmp / "ck", 1, state, keep_last=1), repeats)
    info = checkpoint.find_latest(tmp / "ck")
    assert info is not None
    verify = timed(lambda: checkpoint.find_latest(tmp / "ck"), repeats)
    load = timed(lambda: checkpoint.load(info), repeats)
    print(f"{name:>12}: {n / 1e6:7.1f}M params, file {info.size / 1e6:8.1f} MB")
    print(f"    plain torch.save {plain:6.3f} s | torch.save+fsync {durable:6.3f} s")
    print(f"    ddpjob save (atomic, fsync, sha256 manifest; blocks training) {ours:6.3f} s")
    print(f"    ratio: {ours / plain:4.2f}x plain, {ours / durable:4.2f}x plain+fsync")
    print(f"    verify newest (sha256) {verify:6.3f} s | load {load:6.3f} s")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--params", type=float, default=100e6)
    args = parser.parse_args()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory(dir="/var/tmp") as tmp:
        measure("digits MLP", DigitsTask().build_model(), Path(tmp))
        measure(f"{args.params / 1e6:.0f}M params", big_model(args.params), Path(tmp))


if __name__ == "__main__":
    main()
