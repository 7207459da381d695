"""Schedules of interruptions for the continuation property (tests/unit/ddp_core/trainer/test_continuation_property.py):
what one is made of, the task that carries out an attempt's interruption from inside the rank, and the runner that
plays a schedule on one run directory with the trainer alone or under torchrun.

An attempt is interrupted from inside a rank at a chosen training forward of the attempt (``InterruptedDigitsTask``),
never by a race with a process outside.
"""

from __future__ import annotations

import json
import os
import re
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch.distributed as dist
from torch import nn

from ddp_core.checkpoint import store
from ddp_core.task import Output
from ddp_core.tasks.digits import DigitsTask
from tests.support.digits import DIGITS
from tests.support.helpers import events, final_digests, run_trainer

# Optimizer steps of every run: two epochs and more in every setup (digits: 1438 samples, micro-batches of 64; 11 steps
# an epoch at 1 rank with 2 micro-batches a step), so resumes land mid-epoch and across epoch boundaries.
TOTAL = 24
EVERY = 4  # checkpoint.every_steps: the kills land right after one


class InterruptedDigitsTask(DigitsTask):
    """Digits whose attempt is interrupted from inside a rank (``DDPJOB_TEST_INTERRUPT=KIND:RANK:BATCH``) at its
    BATCH-th training forward (evaluation's are not counted; DDP's priming forward is, ``DDPStrategy.prime``):
    ``signal`` sends the warning signal (the trainer checkpoints and stops at a step boundary), ``kill`` SIGKILLs the
    rank, as the OOM killer would: no handler, no save. ``DDPJOB_TEST_STALL=PID:BATCH`` stops process PID (SIGSTOP: a
    storage server that stops answering) at rank 0's BATCH-th training forward."""

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        kind, rank, batch = os.environ.get("DDPJOB_TEST_INTERRUPT", "none:-1:0").split(":")
        self.kind, self.rank, self.batch, self.forwards = kind, int(rank), int(batch), 0
        self.stall_pid, self.stall_batch = map(int, os.environ.get("DDPJOB_TEST_STALL", "0:0").split(":"))

    def compute(self, model: nn.Module, batch: tuple) -> Output:
        if model.training:
            self.forwards += 1
            rank = dist.get_rank() if dist.is_initialized() else 0
            if rank == self.rank and self.forwards == self.batch:
                os.kill(os.getpid(), signal.SIGKILL if self.kind == "kill" else signal.SIGUSR2)
            if rank == 0 and self.stall_pid and self.forwards == self.stall_batch:
                os.kill(self.stall_pid, signal.SIGSTOP)
        return super().compute(model, batch)


@dataclass(frozen=True)
class Setup:
    """What stays the same across a schedule: ranks (the first attempt's, under invariance), micro-batches per step,
    background saves, world-size invariance."""

    nproc: int
    accum: int
    async_save: bool
    invariant: bool

    def overrides(self) -> list[str]:
        common = [
            "task.target=tests.support.continuation:InterruptedDigitsTask", "task.model.dropout=0.2",
            "optim.schedule=constant", "optim.warmup_steps=2", "train.stop_check_ms=0", "data.batch_size=64",
            f"checkpoint.every_steps={EVERY}", "checkpoint.keep_last=20", "wandb.mode=disabled",
            f"checkpoint.async_save={str(self.async_save).lower()}",
        ]  # fmt: skip
        if self.invariant:  # 4 shards of 64: 4 micro-batches a step at 1 rank, 2 at 2
            return [*common, "train.invariant=true", "data.global_batch_size=256"]
        return [*common, f"train.grad_accum={self.accum}"]

    def micro_batches(self, nproc: int) -> int:
        return 4 // nproc if self.invariant else self.accum


@dataclass(frozen=True)
class Attempt:
    """One attempt of a schedule. ``stop``: how it ends before ``TOTAL``: ``signal`` (the warning signal during its
    ``at``-th step: it checkpoints and stops after the next), ``kill`` (SIGKILL at the first micro-batch of the step
    after the checkpoint at ``at``), ``finish`` (it completes a run of ``at`` steps, a later attempt extends it), or
    None (it runs to the end). ``nproc``: its ranks (another world size only under invariance); ``eval_every`` and
    ``log_every``: its own cadence."""

    stop: Optional[str]
    at: int
    rank: int
    nproc: int
    eval_every: int
    log_every: int


RESUMED = re.compile(r"resumed from step_(\d{8})\.pt")


def reference(setup: Setup, run_dir: Path) -> list[str]:
    """The uninterrupted run's final digests (one per rank)."""
    log = run_trainer(DIGITS, run_dir, [*setup.overrides(), f"train.max_steps={TOTAL}", "train.eval_every=0",
                                        "train.log_every=5"], setup.nproc, torchrun=True)  # fmt: skip
    return final_digests(log)


def play(setup: Setup, schedule: list[Attempt], run_dir: Path) -> str:
    """Every attempt of ``schedule`` on ``run_dir``, then one that runs to the end; returns the last attempt's log.
    Checks that each attempt resumed from the newest checkpoint and stopped where it was meant to, so a schedule that
    did not interrupt what it says fails rather than passing as an uninterrupted run, and that no step was logged
    twice."""
    for attempt in [*schedule, Attempt(None, TOTAL, 0, schedule[-1].nproc if schedule else setup.nproc, 0, 5)]:
        step = newest_checkpoint(run_dir)  # where this attempt resumes
        overrides = [*setup.overrides(), f"train.eval_every={attempt.eval_every}",
                     f"train.log_every={attempt.log_every}",
                     f"train.max_steps={attempt.at if attempt.stop == 'finish' else TOTAL}"]  # fmt: skip
        micro = setup.micro_batches(attempt.nproc)
        primes = 0 if setup.invariant else 1  # DDP's discarded first forward of an attempt (DDPStrategy.prime)
        # A signal during the attempt's (at - step)-th step; a kill at the first micro-batch after the checkpoint at
        # `at`.
        steps_before = attempt.at - step - (1 if attempt.stop == "signal" else 0)
        env = {"DDPJOB_TEST_INTERRUPT": f"{attempt.stop}:{attempt.rank}:{primes + steps_before * micro + 1}"}
        stopped = attempt.stop in ("signal", "kill")
        log = run_trainer(DIGITS, run_dir, overrides, attempt.nproc, env, stopped=stopped, torchrun=True)
        resumed = RESUMED.findall(log)
        assert (int(resumed[-1]) if resumed else 0) == step, (step, resumed, log[-3000:])
        if attempt.stop == "signal":
            assert events(run_dir, "interrupted")[-1]["step"] == attempt.at + 1, (attempt, log[-3000:])
        if attempt.stop == "kill" and not setup.async_save:  # a background save may still be writing at the kill
            assert newest_checkpoint(run_dir) == attempt.at, (attempt, log[-3000:])
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    logged = [r["step"] for r in records if r["split"] == "train"]
    assert logged == sorted(set(logged)), logged  # no step logged twice, whichever checkpoint an attempt resumed from
    if setup.async_save:  # the saves between the signal's and the last were written in the background, and timed
        assert any(r.get("write_s", 0) > 0 for r in records if r["split"] == "checkpoint"), records
    return log


def newest_checkpoint(run_dir: Path) -> int:
    """The step of the newest checkpoint whose manifest was written (0: none), where the next attempt resumes."""
    return max(store.steps(run_dir / "checkpoints"), default=0)
