"""What ``ddpjob resume RUN key=value`` says about exactness (``ddp_core.config.continuation.breaks``): one line per
change that makes the continuation differ from a run that had the new values from the start, none for the changes
that keep the bits (docs/preemption.md's table)."""

from __future__ import annotations

import pytest

from ddp_core.config import load_config
from ddp_core.config.continuation import breaks
from tests.support.helpers import ROOT

DIGITS = ROOT / "configs" / "digits.yaml"
BASE = ["run.name=x", "train.max_steps=200", "data.batch_size=16"]


def said(*changes: str, base: tuple[str, ...] = ()) -> list[str]:
    old = load_config(DIGITS, [*BASE, *base])
    return breaks(old, load_config(DIGITS, [*BASE, *base, *changes]))


@pytest.mark.parametrize(
    "changes",
    [
        ("train.max_steps=400",),  # the constant schedule of base: the extension is a longer run (test_preemption)
        ("train.eval_every=7", "train.log_every=3", "checkpoint.every_steps=10", "checkpoint.async_save=true"),
        ("slurm.time_min=240", "slurm.max_failures=9", "wandb.mode=disabled", "watchdog.stall_s=100"),
        ("slurm.tasks_per_node=4",),  # with a global batch and train.invariant: bitwise at any world size
    ],
)
def test_changes_that_keep_the_bits_say_nothing(changes):
    base = ("optim.schedule=constant", "data.global_batch_size=64", "train.invariant=true")
    assert said(*changes, base=base) == []


@pytest.mark.parametrize(
    ("changes", "line"),
    [
        (("train.max_steps=400",), "train.max_steps 200 -> 400 with optim.schedule=cosine: the learning rate decays"),
        (("data.batch_size=32",), "data.batch_size 16 -> 32 changes each replica's batch"),
        (("optim.name=sgd",), "optim.name adamw -> sgd changes the optimizer's update from the checkpoint on"),
        (("train.seed=3",), "train.seed 0 -> 3 changes the data order and every random stream"),
        (("slurm.tasks_per_node=4",), "slurm.tasks_per_node 2 -> 4: another number of data-parallel replicas"),
        (("train.precision=bf16",), "train.precision fp32 -> bf16 changes every step's arithmetic"),
    ],
)
def test_each_change_that_breaks_them_is_one_line(changes, line):
    lines = said(*changes)
    assert len(lines) == 1 and lines[0].startswith(line) and "\n" not in lines[0], lines


def test_a_world_size_change_with_a_global_batch_but_without_invariance_is_close_not_bitwise():
    lines = said("slurm.tasks_per_node=4", base=("data.global_batch_size=64",))
    assert lines == [
        "slurm.tasks_per_node 2 -> 4: the same global batch, but its gradients are summed in another order: close to "
        "the longer run, not bitwise (train.invariant keeps the bits)"
    ]
