"""A plain Lightning script, written the way Lightning's docs write one for Slurm (``Trainer(num_nodes=2,
strategy="ddp")``): Lightning picks its ``SLURMEnvironment``, whose handler for USR1 saves an hpc checkpoint and
requeues the job, and whose next attempt resumes from that checkpoint. Nothing here knows ddpjob.

The test's one addition, ``WarnAt``: at step ``--warn-at`` of the first attempt, rank 0 asks Slurm for the warning
signal (``scancel --signal=USR1 JOB``, delivered to every task as Slurm's timer would), and every rank waits for it in
interruptible Python at that same step, until Lightning's handler has saved on that rank. The interruption comes at a
chosen step instead of a raced moment, and it has to: Lightning saves inside its signal handler, whose barriers
deadlock when the signal finds one rank in a step's gradient all-reduce and another in Python (Lightning issue 21406,
seen here when the warning reached the ranks more than a step after rank 0 asked for it).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import time

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset


class Regression(L.LightningModule):
    def __init__(self, step_s: float) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)
        self.step_s = step_s

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        time.sleep(self.step_s)
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class WarnAt(L.Callback):
    def __init__(self, step: int) -> None:
        self.step = step
        self.saved = False

    def on_save_checkpoint(self, *args: object) -> None:
        self.saved = True  # every rank builds the checkpoint in Lightning's handler (rank 0 writes it)

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        restart = os.environ.get("SLURM_RESTART_COUNT", "0")
        print(f"rank {trainer.global_rank}: training from step {trainer.global_step} (restart {restart})", flush=True)

    def on_train_batch_end(self, trainer: L.Trainer, *args: object) -> None:
        first = os.environ.get("SLURM_RESTART_COUNT", "0") == "0"
        if not first or trainer.global_step != self.step:
            return
        if trainer.is_global_zero:
            subprocess.run(["scancel", "--signal=USR1", os.environ["SLURM_JOB_ID"]], check=True)
        deadline = time.monotonic() + 120
        while not self.saved:  # the handler runs inside this sleep, at the same step on every rank
            if time.monotonic() > deadline:
                raise RuntimeError(f"no USR1 within 120 s of step {self.step}")
            time.sleep(0.05)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warn-at", type=int, default=10)
    parser.add_argument("--step-s", type=float, default=0.1)
    args = parser.parse_args()
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(256, 8), torch.randn(256, 1))
    trainer = L.Trainer(num_nodes=2, devices=1, accelerator="cpu", strategy="ddp", max_steps=args.steps,
                        callbacks=[WarnAt(args.warn_at)], enable_progress_bar=False,
                        enable_checkpointing=False, logger=False)  # fmt: skip
    trainer.fit(Regression(args.step_s), DataLoader(data, batch_size=8))
    print(f"rank {trainer.global_rank}: finished at step {trainer.global_step}", flush=True)


if __name__ == "__main__":
    main()
