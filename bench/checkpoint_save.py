"""Full checkpoint save cost: ddpjob's crash-safe save (atomic, fsync, checksummed manifest), synchronous and async
(``checkpoint.async_save``), against ``torch.save`` + fsync, for the digits example model and a ~100M-parameter model,
each with AdamW state, and what an async save costs the training step after it.

- torch.save+fsync: the floor, ``torch.save`` into an open file, flushed and fsynced;
- sync: ``FullWriter.save`` as the trainer calls it; training is blocked for all of it but the deletion of the oldest
  checkpoint (a thread of its own);
- async: ``FullWriter.save`` with ``async_save`` and the optimizer, as the trainer calls it, then a training step
  (forward, backward, optimizer step). The parameters' and moments' copy runs during the forward and backward and the
  optimizer's step waits for it. "blocks" is the time training stood still: in the save and in that wait; "lost" is
  what the save and the step took up to the optimizer's step, less the same step without a save, in the same round:
  the blocked time plus what the copy took from the forward and backward running beside it (CPUs, memory bandwidth).
  "async done" is the save's start to its manifest.

The four (torch.save, sync, async + step, step alone) run alternated, ``--repeats`` rounds after one untimed warm-up
round (the async writer's first save also allocates its staging buffers: reported as "first"); every figure is a
median. ``rows()`` returns the table as dicts for an aggregator.

    OMP_NUM_THREADS=1 .venv/bin/python bench/checkpoint_save.py [--params 100e6] [--repeats 5] [--device cuda]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch import nn

from ddp_core.checkpoint import store as checkpoint
from ddp_core.checkpoint.full import FullWriter
from ddp_core.tasks.digits import DigitsTask


class Trained:
    """A model, AdamW with its state, and one batch: a training step, timed up to the optimizer's step."""

    def __init__(self, model: nn.Module, device: str, batch: int = 8) -> None:
        self.model, self.device = model.to(device), device
        self.optimizer = torch.optim.AdamW(model.parameters(), foreach=True)
        width = next(m for m in model.modules() if isinstance(m, nn.Linear)).in_features
        self.batch = torch.randn(batch, width, device=device)
        self.reached: list[float] = []  # when each optimizer step began (after the writer's hook: registered later)
        self.step()  # materialise the optimizer state (2 tensors per parameter)
        self.state = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def _reached(self, *_: Any) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()
        self.reached.append(time.perf_counter())

    def watch(self) -> None:
        """Time steps from here on: call after the async writer hooked the optimizer, so its wait comes first."""
        self.optimizer.register_step_pre_hook(self._reached)

    def step(self) -> float:
        """A forward, backward and optimizer step. Returns the seconds from its start to the optimizer's step."""
        started = time.perf_counter()
        self.model(self.batch).float().square().mean().backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        return self.reached[-1] - started if self.reached else 0.0


def big_model(params: float) -> nn.Module:
    width = 4096
    layers = max(1, round(params / (width * width)))
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


def save_fsync(state: dict[str, Any], path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


def _seconds(fn: Callable[[], Any]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def measure(name: str, model: nn.Module, tmp: Path, repeats: int, device: str = "cpu") -> dict[str, Any]:
    """One row: medians of ``repeats`` alternated rounds of the saves and the plain step, and verify/load of the
    result. On ``device`` cuda the state lives on the GPU, as in training: every save copies it to host memory first
    (the async one into pinned buffers)."""
    n = sum(p.numel() for p in model.parameters())
    trained = Trained(model, device)
    state = trained.state
    sync = FullWriter(tmp / f"{name}-sync", keep_last=1, async_save=False)
    background = FullWriter(tmp / f"{name}-async", keep_last=1, async_save=True, optimizer=trained.optimizer)
    trained.watch()
    times: dict[str, list[float]] = {key: [] for key in ("baseline", "sync", "blocked", "saved_step", "step", "done")}

    def run_async(step: int) -> None:
        started = time.perf_counter()
        blocked = background.save(step, state)
        trained.step()
        times["saved_step"].append(trained.reached[-1] - started)
        times["blocked"].append(blocked + background.fence_s)
        background.wait()
        assert background.last_write_s is not None
        times["done"].append(background.last_write_s)

    first_blocked = 0.0
    for step in range(repeats + 1):  # round 0 warms up (page cache, allocator, staging buffers)
        order = ["baseline", "sync", "async", "step"]
        order = order[step % 4 :] + order[: step % 4]  # each goes first, second, ... as often
        for which in order:
            # Both write a fresh file and then delete the one before, untimed: the baseline as a loop saving
            # ckpt_<step>.pt and removing the last would, ddpjob in its prune (a thread, while training goes on).
            # Then os.sync(), untimed: on a file system mounted with discard, freed blocks are trimmed at the next
            # journal commit, which is the next fsync, i.e. inside the next case's time (the rotation below makes
            # that always the same case: sync follows baseline). In a run the journal commits them within seconds
            # (commit interval), long before the next save.
            if which == "baseline":
                path = tmp / f"{name}-plain{step}.pt"
                took = _seconds(lambda: save_fsync(state, path))  # noqa: B023 (called at once)
                (tmp / f"{name}-plain{step - 1}.pt").unlink(missing_ok=True)
                times["baseline"].append(took)
            elif which == "sync":
                times["sync"].append(sync.save(step, state))  # the seconds it blocked: all but the prune
                sync.wait()
            elif which == "async":
                run_async(step)
            else:
                times["step"].append(trained.step())
            os.sync()
        if step == 0:
            first_blocked = times["blocked"][0]
            for values in times.values():
                values.clear()
    background.close()
    info = checkpoint.find_latest(tmp / f"{name}-sync")
    assert info is not None
    median = {key: statistics.median(values) for key, values in times.items()}
    # Paired by round: the step alone and the step after a save ran in the same round, minutes of drift apart at most.
    lost = statistics.median(a - b for a, b in zip(times["saved_step"], times["step"], strict=True))
    return {
        "model": name,
        "params_m": round(n / 1e6, 1),
        "file_mb": round(info.size / 1e6, 1),
        "repeats": repeats,
        "baseline_s": median["baseline"],  # torch.save + fsync
        "sync_s": median["sync"],
        "sync_ratio": median["sync"] / median["baseline"],
        "async_blocked_s": median["blocked"],
        "async_blocked_of_sync": median["blocked"] / median["sync"],
        "async_lost_s": lost,
        "async_lost_of_sync": lost / median["sync"],
        "async_first_blocked_s": first_blocked,  # the first save allocates its staging buffers
        "async_done_s": median["done"],
        "step_s": median["step"],
        "verify_s": statistics.median(_seconds(lambda: checkpoint.find_latest(tmp / f"{name}-sync")) for _ in range(3)),
        "load_s": statistics.median(_seconds(lambda: checkpoint.load(info)) for _ in range(3)),
    }


def rows(
    params: float = 100e6, repeats: int = 5, directory: Optional[Path] = None, device: str = "cpu"
) -> list[dict[str, Any]]:
    """The digits MLP and a ``params``-parameter model, each a dict of medians (seconds and ratios)."""
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory(dir=directory or "/var/tmp") as tmp:
        return [
            measure("digits MLP", DigitsTask().build_model(), Path(tmp), max(repeats, 20), device),
            measure(f"{params / 1e6:.0f}M params", big_model(params), Path(tmp), repeats, device),
        ]


def print_table(table: list[dict[str, Any]]) -> None:
    print(f"full checkpoint save, AdamW state included; medians of alternated rounds ({checkpoint.CHECKSUM} checksum)")
    print(f"{'model':>12} {'params':>8} {'file':>9} | {'torch.save':>10} | {'ddpjob sync':>16} | {'async blocks':>12} "
          f"{'async lost':>19} {'first':>7} | {'async done':>10} | {'step':>7} | "
          f"{'verify':>7} {'load':>7}")  # fmt: skip
    print(f"{'':>12} {'':>8} {'':>9} | {'+fsync':>10} | {'(x torch.save)':>16} | {'':>12} {'(of sync)':>19} "
          f"{'':>7} | {'':>10} | {'':>7} | {'':>7} {'':>7}")  # fmt: skip
    for r in table:
        print(f"{r['model']:>12} {r['params_m']:7.1f}M {r['file_mb']:7.1f}MB | {r['baseline_s']:8.3f} s | "
              f"{r['sync_s']:7.3f} s {r['sync_ratio']:5.2f}x | {r['async_blocked_s']:10.3f} s "
              f"{r['async_lost_s']:8.3f} s {100 * r['async_lost_of_sync']:6.1f} % "
              f"{r['async_first_blocked_s']:5.2f} s | {r['async_done_s']:8.3f} s | {r['step_s']:5.3f} s | "
              f"{r['verify_s']:5.3f} s {r['load_s']:5.3f} s")  # fmt: skip


def summary(quick: bool = False) -> list[dict[str, Any]]:
    """The ratio lines of ``bench/run``: sync save against torch.save+fsync, and the training an async save costs
    against the sync save: blocked (the target), and lost (blocked, and what its copy and write took from the forward
    and backward running beside them)."""
    out = []
    for r in rows(repeats=3 if quick else 5):
        big = r["params_m"] >= 50  # the targets are the 100M model's; the MLP's save is milliseconds
        out += [{
            "case": f"full checkpoint, {r['model']} ({r['file_mb']:.0f} MB): sync save vs torch.save+fsync",
            "baseline": f"{r['baseline_s']:.3f} s", "ddpjob": f"{r['sync_s']:.3f} s", "ratio": r["sync_ratio"],
            "target": "<= 1.20x" if big else "", "met": r["sync_ratio"] <= 1.2 if big else None,
        }, {
            "case": f"full checkpoint, {r['model']}: async save, time training blocked vs sync save",
            "baseline": f"{r['sync_s']:.3f} s", "ddpjob": f"{r['async_blocked_s']:.3f} s",
            "ratio": r["async_blocked_of_sync"], "target": "<= 0.10x" if big else "",
            "met": r["async_blocked_of_sync"] <= 0.1 if big else None,
        }, {
            "case": f"full checkpoint, {r['model']}: async save, training lost to the next optimizer step (blocked, "
                    "and the copy and write taking CPUs from the forward and backward) vs sync save",
            "baseline": f"{r['sync_s']:.3f} s", "ddpjob": f"{r['async_lost_s']:.3f} s",
            "ratio": r["async_lost_of_sync"], "target": "", "met": None,
        }]  # fmt: skip
    return out


def main(argv: Optional[list[str]] = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=float, default=100e6)
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds per model (the digits MLP: at least 20)")
    parser.add_argument("--device", default="cpu", help="where the state lives: cpu (default) or cuda")
    parser.add_argument("--dir", type=Path, help="where the checkpoints are written (default: /var/tmp)")
    args = parser.parse_args(argv)
    table = rows(args.params, args.repeats, args.dir, args.device)
    print_table(table)
    return table


if __name__ == "__main__":
    main()
