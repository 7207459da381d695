"""A step that runs out of memory on any rank, done again by every rank with less memory, the global batch kept.

The step's micro-batches run forward and backward on the strategy's local module (``Strategy.local_model``: no
collective inside, so a rank that runs out stops there and waits for nothing), then every rank says whether it ran
out, in one all-reduce (``memory.ranks_out``). If any did, every rank drops the step's gradients, puts back its
random streams and its training sums, takes the relief, records it, and does the step again from its start;
otherwise the gradients are reduced (``Strategy.reduce_gradients``) and the trainer's optimizer step follows.

Two reliefs, one per mode:

- ``data.batch_size=auto`` (``Halve``): half the micro-batch, twice the accumulation (``memory.Fit.shrink``), the
  event ``micro_batch_shrunk``. The bits are those of the smaller micro-batch. At the smallest, activations are
  recomputed once (as below) before the run ends.
- ``train.invariant`` (``Recompute``): its micro-batch is the leaf of the fixed summation tree, so it is never cut.
  Activation checkpointing is turned on for the rest of the attempt instead (``Strategy.recompute_activations``):
  the units' activations are recomputed in the backward from the same inputs, with the same random streams, so
  the step's gradients are bitwise what they would have been; the event ``activations_recomputed``. With
  ``data.batch_size=auto`` the leaf is chosen once, by the run's first probe, and kept by every later attempt on
  any hardware (``sharded``): the run's bits are those of the run with that micro-batch written in.

Where the relief is spent (a micro-batch of one; activations already recomputed) the step raises ``OutOfMemory``:
one line with the memory used, the memory there is and the keys to change.

Where the strategy's steps communicate (fsdp: ``Strategy.steps_communicate``) no rank can stop in a step and agree:
its peers wait in the forward's collectives. A rank that runs out raises ``memory.RanOut`` with its micro-batch
instead; the attempt ends, the allocation runs it again from the newest checkpoint (``cluster.policy``), and the
next attempt's probe takes half (``memory.below``; its rank 0 records the ``micro_batch_shrunk`` event).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, ContextManager, Optional

import torch
from torch import nn
from torch.utils.data import Dataset

from ddp_core.cluster.env import DistEnv
from ddp_core.cluster.failures import Kind, classify, out_of_memory
from ddp_core.config import Config
from ddp_core.config.batch import invariant_micro_batches, job_replicas
from ddp_core.distributed import collectives, rng
from ddp_core.errors import DdpJobError
from ddp_core.strategies import Strategy
from ddp_core.tasks.base import Task
from ddp_core.trainer.memory import (
    INVARIANT_FIX,
    Fit,
    OutOfMemory,
    RanOut,
    allocator_words,
    below,
    first_samples,
    free,
    give_up,
    no_fit,
    out_of_memory_error,
    probe,
    ranks_out,
    split,
    under,
)
from ddp_core.trainer.metrics import TrainSums
from ddp_core.trainer.steps import to_device

log = logging.getLogger(__name__)
Events = list[dict[str, Any]]  # the run's (``RunDir.events``)


class StepAbandoned(RuntimeError):
    """Raised by the ranks that did not run out when a step cannot be done again: the rank that did raises
    ``OutOfMemory``, and the job's failure is its (``failures.diagnose`` takes a memory error before this one)."""


def ends_the_job(error: Exception) -> bool:
    """Whether no attempt of this job runs again after this rank's ``error``: a user error, an out-of-memory, or a
    peer's out-of-memory that a step could not survive (``StepAbandoned``, which the peer's error decides)."""
    if isinstance(error, RanOut):  # the allocation runs the attempt again, from these copies too
        return False
    return isinstance(error, StepAbandoned) or classify(error) in (Kind.user, Kind.memory)


class Halve:
    """``data.batch_size=auto``: each replica's share of a step cut into the fitted micro-batch, halved when a rank
    runs out."""

    def __init__(self, fit: Fit, strategy: Strategy, local: nn.Module) -> None:
        self.fit, self.strategy, self.local = fit, strategy, local

    def cut(self, group: list[Any]) -> list[Any]:
        return split(group[0], self.fit.micro)  # the loader gives the share whole: one "micro-batch" of it

    def give_up(self, step: int, device: torch.device, words: str) -> OutOfMemory:
        """Where the strategy's steps communicate: this attempt's end (``memory.give_up``)."""
        return give_up(self.fit.micro, self.fit.candidates, step, device, words, self.strategy)

    def relieve(self, step: int, device: torch.device, words: str) -> tuple[str, dict[str, Any], str]:
        was = self.fit.micro
        if (
            self.fit.halved is None
        ):  # nothing left to halve: activations recomputed (the same bits), once, before the end
            if not self.strategy.recompute_activations(self.local):
                raise no_fit(step, was, device, words, self.strategy)
            again = f"with a micro-batch of {was}, the smallest: the step again, its activations recomputed"
            return "activations_recomputed", {"micro_batch": was}, again
        self.fit.shrink(step, device, words)
        fields = {"was": was, "micro_batch": self.fit.micro, "grad_accum": self.fit.accumulation}
        again = f"with a micro-batch of {was}: the step again with {self.fit.micro} x {self.fit.accumulation}"
        return "micro_batch_shrunk", fields, again


class Recompute:
    """``train.invariant``: the loader's micro-batches (the tree's shards) as they are, or under auto (``fit``) the
    share cut into the kept shard; activations recomputed from the first out-of-memory on."""

    def __init__(self, strategy: Strategy, model: nn.Module, micro: int, fit: Optional[Fit] = None) -> None:
        self.strategy, self.model, self.micro, self.fit = strategy, model, micro, fit

    def cut(self, group: list[Any]) -> list[Any]:
        return split(group[0], self.micro) if self.fit is not None else group

    def relieve(self, step: int, device: torch.device, words: str) -> tuple[str, dict[str, Any], str]:
        if not self.strategy.recompute_activations(self.model):
            how = " even recomputing its activations"
            raise out_of_memory_error(step, self.micro, device, words, "a train.invariant shard", how, INVARIANT_FIX)
        return "activations_recomputed", {}, "the step again, its activations recomputed (the same bits)"


class RedoneStep:
    """One optimizer step's forward and backward, done again while a rank runs out of memory (module docstring).
    ``record``: rank 0's event writer (None on the others)."""

    def __init__(
        self,
        relief: Halve | Recompute,
        task: Task,
        strategy: Strategy,
        model: nn.Module,
        sums: TrainSums,
        amp: ContextManager[Any],
        record: Optional[Callable[..., None]],
    ) -> None:
        self.relief, self.task, self.strategy, self.amp = relief, task, strategy, amp
        self.model, self.local, self.sums, self.record = model, strategy.local_model(model), sums, record

    @property
    def fit(self) -> Optional[Fit]:
        """The probe's choice under ``data.batch_size=auto``; None with the micro-batch written in."""
        return self.relief.fit

    def __call__(self, group: list[Any], step: int) -> list[torch.Tensor]:
        if self.strategy.steps_communicate:  # no rank can stop and agree: one that runs out ends the attempt
            return self.run(self.relief.cut(group), step)[0]
        self.strategy.sync_buffers(self.model)  # before any micro-batch: no rank can have run out yet
        streams, mark = rng.rng_state(), self.sums.mark()
        while True:
            losses, what = self.run(self.relief.cut(group), step)
            ran_out = ranks_out(what is not None)
            if not ran_out:
                break
            self.model.zero_grad(set_to_none=True)
            rng.set_rng_state(streams)
            self.sums.rollback(mark)
            self.strategy.begin_step(step)
            why = f"rank {ran_out[0]}: {collectives.gather_to_all(what)[ran_out[0]]}"  # the first rank's words
            try:  # a rank that ran out says its own words and memory
                event, fields, again = self.relief.relieve(step, self.strategy.device, what or why)
            except OutOfMemory:
                if what is None:
                    raise StepAbandoned(f"step {step} abandoned: rank {ran_out[0]} could not fit it") from None
                raise
            ranks = ",".join(map(str, ran_out))
            log.warning("out of memory at step %d on rank(s) %s %s (%s)", step, ranks, again, why)
            if self.record is not None:
                self.record(event, step=step, **fields, ranks=ran_out, error=why)
        self.strategy.reduce_gradients(self.local)
        return losses

    def run(self, parts: list[Any], step: int) -> tuple[list[torch.Tensor], Optional[str]]:
        """This rank's micro-batches; the allocator's message if it ran out (the references to the failed step's
        tensors dropped with the exception). Where the strategy's steps communicate: on the wrapped model, the
        gradients reduced with the last, and an out-of-memory raised (``Halve.give_up``)."""
        losses: list[torch.Tensor] = []
        what, talks = None, self.strategy.steps_communicate
        try:
            for i, part in enumerate(parts):
                with self.amp:
                    batch = to_device(part, self.strategy.device)
                    sync = talks and i == len(parts) - 1
                    model = self.model if talks else self.local
                    losses.append(self.strategy.forward_backward(self.task, model, batch, len(parts), sync))
        except Exception as err:  # an allocator's failure is agreed on; the rest is raised
            if not out_of_memory(err):
                raise
            what = allocator_words(err)[:300]
            if talks and isinstance(self.relief, Halve):
                raise self.relief.give_up(step, self.strategy.device, what) from None
        if what is not None:  # the exception, and the step's tensors its frames held, are gone here
            free(self.strategy.device)
            return [], what
        return losses, None


def fitted(
    parts: tuple[Any, ...], train_set: Dataset, collate: Any, share: int, cfg: Config, events: Events, env: DistEnv
) -> RedoneStep:
    """Collective, ``data.batch_size=auto``: the attempt's probe (``memory.probe``, on the training set's first
    samples) and the steps that cut each share into the micro-batch it chose. ``parts``: the task, strategy, model,
    optimizer, training sums, autocast context and rank 0's event writer. ``events``: the run's, for the cap of this
    allocation's earlier out-of-memory (``memory.below``: a strategy whose steps communicate; its rank 0 records the
    shrink) or, under ``train.invariant``, the shard the run's first probe chose (``sharded``)."""
    task, strategy, model, optimizer, sums, amp, record = parts
    batch = first_samples(train_set, int(share * (1 + cfg.data.batch_headroom)) + 1, collate)
    if cfg.train.invariant:
        return sharded(parts, batch, share, cfg, kept_shard(events))
    cap, failure = below(events, env.job_id, env.restart_count)
    smaller = under(share, strategy.micro_multiple, cap) if cap is not None else []
    if failure is not None and smaller and record is not None:  # what the probe tries now: the largest under cap
        was, why = int(failure["micro_batch"]), f"rank {failure.get('rank')}: {failure.get('error')}"
        log.warning(
            "the attempt before ran out with a micro-batch of %d: this one tries %d (%s)", was, smaller[-1], why
        )
        fields = {"was": was, "micro_batch": smaller[-1], "grad_accum": share // smaller[-1], "restarted": True}
        record("micro_batch_shrunk", step=failure.get("step"), **fields, ranks=[failure.get("rank")], error=why)
    fit = probe(task, strategy, model, optimizer, batch, share, cfg.data.batch_headroom, amp, cap)
    return RedoneStep(Halve(fit, strategy, strategy.local_model(model)), task, strategy, model, sums, amp, record)


def kept_shard(events: Events) -> Optional[int]:
    """The micro-batch a ``train.invariant`` run's first probe chose (its first ``start`` event with shards), if
    an attempt got that far."""
    return next((int(e["micro_batch"]) for e in events if e["event"] == "start" and e.get("shards")), None)


def sharded(parts: tuple[Any, ...], batch: Any, share: int, cfg: Config, kept: Optional[int]) -> RedoneStep:
    """Collective, ``data.batch_size=auto`` under ``train.invariant``: the shard is the summation tree's leaf, so it
    decides the bits. The run's first probe chooses it, the largest that fits with the headroom among the shards
    every replica count of the job divides (``config.batch.invariant_micro_batches``); a later attempt (a restart, a
    requeue or resume on other hardware) keeps it and only checks that it fits, with activation checkpointing
    turned on where it does not (the same bits). A step that runs out later recomputes its activations too."""
    task, strategy, model, optimizer, sums, amp, record = parts
    assert cfg.data.global_batch_size is not None  # config.batch.validate_auto's
    total, worlds = cfg.data.global_batch_size, [*job_replicas(cfg), strategy.data_world]
    choices = invariant_micro_batches(total, worlds)
    if kept is not None and kept not in choices:
        raise DdpJobError(
            f"config key 'train.invariant' = true: this run's shard of {kept} samples (its first probe's choice, "
            f"kept for its bits) does not cut data.global_batch_size={total} into a power of two of shards that "
            f"{strategy.data_world} data-parallel replicas divide",
            f"resume it with its global batch on 1, 2, 4, ... up to {total // kept} ranks, or start a new run",
        )
    headroom, among = (cfg.data.batch_headroom, choices) if kept is None else (0.0, [kept])  # what its steps take
    fit = probe(task, strategy, model, optimizer, batch, share, headroom, amp, None, among)
    fit.shards, fit.kept = total // fit.micro, kept is not None
    local = strategy.local_model(model)
    return RedoneStep(Recompute(strategy, local, fit.micro, fit), task, strategy, model, sums, amp, record)


def recomputing(parts: tuple[Any, ...], micro: int) -> RedoneStep:
    """``train.invariant``: the steps whose out-of-memory is survived by recomputing activations."""
    task, strategy, model, _, sums, amp, record = parts
    return RedoneStep(Recompute(strategy, strategy.local_model(model), micro), task, strategy, model, sums, amp, record)
