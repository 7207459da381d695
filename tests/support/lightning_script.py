"""A plain Lightning script, written the way Lightning's docs write one for Slurm (``Trainer(num_nodes=2,
strategy="ddp")``): Lightning picks its ``SLURMEnvironment``, whose handler for USR1 saves an hpc checkpoint and
requeues the job, and whose next attempt resumes from that checkpoint. Nothing here knows ddpjob.

The test's one addition, ``WarnAt``: rank 0 asks Slurm for the warning signal (``scancel --signal=USR1 JOB``, delivered
to every task as Slurm's timer would) at a moment chosen per attempt (``--warn``, the first for the first attempt,
and so on), and then carries on: where each rank is when the signal lands is not arranged. The moments:

- ``setup``: in the module's ``setup`` hook, before Lightning has installed its handler;
- ``forward@K``: in ``training_step`` at global step K, so rank 0 is in Python while rank 1, done with its forward,
  already waits in backward's gradient all-reduce for it (the moment that hung under ddpjob, Lightning issue 21406);
- ``thread@S``: from a timer thread S seconds after training started, wherever the ranks then are;
- ``stall@K``: as ``forward@K``, and rank 1 then never finishes building its part of the checkpoint (a save that
  hangs on one rank): the ranks stop making progress after the warning.
"""

from __future__ import annotations

import argparse
import functools
import os
import signal
import subprocess
import threading
import time

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset


def warn() -> None:
    # Run from a rank, scancel is a process of the job's step too, and Slurm's USR1 would end it: held in it.
    hold = functools.partial(signal.pthread_sigmask, signal.SIG_BLOCK, {signal.SIGUSR1})
    subprocess.run(["scancel", "--signal=USR1", os.environ["SLURM_JOB_ID"]], check=True, preexec_fn=hold)


class Regression(L.LightningModule):
    def __init__(self, step_s: float, moment: str) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)
        self.step_s = step_s
        self.moment, _, at = moment.partition("@")
        self.at = float(at) if at else 0.0

    def setup(self, stage: str) -> None:
        if self.moment == "setup" and self.trainer.is_global_zero:
            warn()

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        if self.moment in ("forward", "stall") and self.trainer.global_step == self.at and self.trainer.is_global_zero:
            warn()
        time.sleep(self.step_s)
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class WarnAt(L.Callback):
    def __init__(self, moment: str) -> None:
        self.moment, _, at = moment.partition("@")
        self.at = float(at) if at else 0.0

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        restart = os.environ.get("SLURM_RESTART_COUNT", "0")
        print(f"rank {trainer.global_rank}: training from step {trainer.global_step} (restart {restart})", flush=True)
        if self.moment == "thread" and trainer.is_global_zero:
            threading.Timer(self.at, warn).start()

    def on_save_checkpoint(self, trainer: L.Trainer, *args: object) -> None:
        print(f"rank {trainer.global_rank}: saving at step {trainer.global_step}", flush=True)
        if self.moment == "stall" and trainer.global_rank == 1:
            time.sleep(3600)  # rank 0 writes the file, then waits at the save's barrier for ever


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warn", action="append", default=[], help="the moment of the warning, one per attempt")
    parser.add_argument("--step-s", type=float, default=0.1)
    args = parser.parse_args()
    attempt = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
    moment = args.warn[attempt] if attempt < len(args.warn) else "none"
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(256, 8), torch.randn(256, 1))
    trainer = L.Trainer(num_nodes=2, devices=1, accelerator="cpu", strategy="ddp", max_steps=args.steps,
                        callbacks=[WarnAt(moment)], enable_progress_bar=False,
                        enable_checkpointing=False, logger=False)  # fmt: skip
    trainer.fit(Regression(args.step_s, moment), DataLoader(data, batch_size=8))
    print(f"rank {trainer.global_rank}: finished at step {trainer.global_step}", flush=True)


if __name__ == "__main__":
    main()
