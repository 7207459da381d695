"""World-size-invariant data parallelism (``train.invariant``): the final weights are bitwise identical for every
world size that divides the global batch's shards, and across resumes at other world sizes.

The global batch is ``S`` micro-batch shards (a power of two); shard ``j`` of a step is the same samples at any
world size (``trainer.data.BlockShardSampler``), and rank ``r`` of ``W`` holds shards ``r*S/W .. (r+1)*S/W - 1``.
Each shard runs alone: its RNG streams (dropout) seeded from (train.seed, step, shard), its loss divided by ``S``
(a power of two: exact), its backward into fresh gradients. The shards' gradients are summed in one fixed binary
tree: each rank folds its shards into the subtree they form (``PairwiseSum``), the ranks exchange the subtree sums
and add them up in the same tree (``combine``). Floating-point addition is commutative but not associative, so the
tree's fixed shape, not the order of arrival, decides every rounding: one process and ``W`` ranks add the same pairs.

The first level of the tree comes from autograd: an odd shard's backward accumulates onto its left neighbour's
gradients, one addition per element, which is what the tree would compute; only leaf pairs are flattened. (One
corner: a parameter without a gradient in one shard of a pair but with one in the other holds that gradient, where
the tree's sum with a zero would turn a -0.0 into +0.0 where the pair's shards are on two ranks: a zero's sign.)

Why a tree rather than exact integer (fixed-point) summation, which is order-free: fixed point needs a scale agreed
before the sum (one more collective per step, or a guessed bound that overflows or flushes small gradients),
int64 doubles the bytes on the wire, and the result is a quantised gradient. The tree keeps fp32 gradients (pairwise
summation: more accurate than sequential accumulation) and sends what a ring all-reduce sends (``combine``).

No DDP wrapper: DDP's bucketed all-reduce would add the ranks' gradients in an order set by the world size.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from ddp_core.config import Config
from ddp_core.strategies.ddp import DDPStrategy, flat_grads
from ddp_core.strategies.units import candidate_units, checkpoint_activations
from ddp_core.tasks.base import Task

log = logging.getLogger(__name__)


def shard_seed(seed: int, step: int, shard: int) -> int:
    """The seed of shard ``shard`` of optimizer step ``step``: the same on whichever rank runs it."""
    digest = hashlib.sha256(f"{seed}/{step}/{shard}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def seed_streams(seed: int, device: torch.device) -> None:
    """torch's random streams, the CPU's and ``device``'s, from ``seed`` (dropout draws from them; Python's and
    NumPy's are left alone: seeding Python's costs more than the rest together). Through the generators themselves:
    ``torch.manual_seed`` also queues a lazy seeding of every accelerator backend, formatting a stack trace for
    each, ~0.8 ms a call here, more than a digits shard's forward."""
    torch.default_generator.manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.default_generators[device.index if device.index is not None else 0].manual_seed(seed)


class PairwiseSum:
    """Sums the tensors pushed, in order, by a complete binary tree: each pair of equal-height subtrees is added as
    soon as both exist, left + right. Pushing ``2**k`` leaves gives the root of their tree; pushing ``W`` subtree
    roots of equal height gives the root of the tree above them, the same value as all leaves pushed to one sum."""

    def __init__(self) -> None:
        self.stack: list[tuple[int, torch.Tensor]] = []  # (height, sum of that subtree), heights decreasing

    def push(self, value: torch.Tensor, height: int = 0) -> None:
        while self.stack and self.stack[-1][0] == height:
            _, left = self.stack.pop()
            value = left.add_(value)  # in place into the left sum: the same rounding as left + value
            height += 1
        self.stack.append((height, value))

    def pop_root(self) -> torch.Tensor:
        assert len(self.stack) == 1, [h for h, _ in self.stack]  # a power of two of leaves: one complete tree
        return self.stack.pop()[1]


class InvariantDDPStrategy(DDPStrategy):
    """ddp (or one process) with ``train.invariant``: per-shard RNG, a fixed summation tree over shards and ranks."""

    invariant = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.seed, self.step, self.done = 0, 0, 0  # train.seed; the optimizer step; this step's shards run so far
        self.tree = PairwiseSum()
        self.params: list[nn.Parameter] = []  # the trainable parameters, listed at each step's first shard

    def wrap(self, model: nn.Module) -> nn.Module:
        model = model.to(self.device)
        if self.cfg.activation_checkpointing:  # recomputation restores the RNG state: dropout masks are kept
            checkpoint_activations(candidate_units(model, self.cfg.wrap_classes))
        if dist.is_initialized():  # as DDP does: every replica starts from rank 0's weights and buffers
            for tensor in model.state_dict().values():
                dist.broadcast(tensor, src=0)
        return model

    def begin_step(self, step: int) -> None:
        self.step, self.done, self.tree = step, 0, PairwiseSum()  # a step done again starts its tree again

    def reduce_gradients(self, model: nn.Module) -> None:
        """After every shard ran on this rank without its last one's combine (``trainer.redo``): the same sum."""
        assert self.done > 0, "no shard ran this step"
        self.set_grads(self.params, self.combine(self.tree.pop_root()))

    def prime(self, task: Task, model: nn.Module, batch: Any) -> None:
        return None  # no DDP buckets to settle

    def exchange_bytes(self, model: nn.Module) -> tuple[int, int]:
        """Bytes of gradient each rank receives per step: this mode's (``combine``), and a ring all-reduce's (plain
        DDP) of the same gradients."""
        params = [p for p in model.parameters() if p.requires_grad]
        numel, item = sum(p.numel() for p in params), max((p.element_size() for p in params), default=4)
        world, size = self.data_world, numel * item
        ring = 2 * (world - 1) * size // world
        if world <= 2:
            return (world - 1) * size, ring
        return 2 * (world - 1) * -(-numel // world) * item, ring  # chunks padded to equal length

    def forward_backward(self, task: Task, model: nn.Module, batch: Any, grad_accum: int, sync: bool) -> torch.Tensor:
        """One shard: seeded, ``loss / S``, its own backward, folded into this rank's subtree; after the last one
        (``sync``) the ranks' subtrees are combined and every parameter's ``.grad`` is the global batch's sum."""
        shards = grad_accum * self.data_world
        shard = self.data_rank * grad_accum + self.done
        seed_streams(shard_seed(self.seed, self.step, shard), self.device)
        if self.done == 0:  # once a step: the list costs a walk over the modules
            self.params = [p for p in model.parameters() if p.requires_grad]
        params = self.params
        if self.done % 2 == 0:  # fresh gradients: this shard's alone (an odd shard adds itself to its left pair)
            for p in params:
                p.grad = None
        with self.work.forward():
            out = task.compute(model, batch)
        self.on_train_output(out)
        loss = out.loss / shards if shards > 1 else out.loss  # a power of two: exact
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
        if grad_accum == 1:  # one leaf per rank: the tree starts above the ranks
            self.tree.push(flat_grads(params))
        elif self.done % 2 == 1:  # autograd added this shard's gradients onto its left neighbour's: a leaf pair
            self.tree.push(flat_grads(params), height=1)
        self.done += 1
        if sync:
            assert self.done == grad_accum, (self.done, grad_accum)
            self.set_grads(params, self.combine(self.tree.pop_root()))
        # The logged loss as the other strategies give it: the shard's loss / the rank's micro-batches (one rank:
        # the loss above, without another kernel).
        if shards == grad_accum:
            return loss.detach()
        return (out.loss / grad_accum if grad_accum > 1 else out.loss).detach()

    def combine(self, subtree: torch.Tensor) -> torch.Tensor:
        """The ranks' subtree sums (rank order = shard order) added in the tree above them, on every rank.

        At 2 ranks, one all-gather of the whole sums (what a ring all-reduce sends, in one collective). Beyond, a
        reduce-scatter in the tree: rank r receives chunk r of every rank's sum (all-to-all), adds them in the tree,
        and the chunks are all-gathered: ``2 (W - 1) / W`` of the gradient bytes, a ring's, where gathering whole
        sums would take ``W - 1``. The tree works elementwise, so both give the same bits."""
        world = dist.get_world_size() if dist.is_initialized() else 1
        if world == 1:
            return subtree
        tree = PairwiseSum()
        if world == 2:
            gathered = [torch.empty_like(subtree) for _ in range(world)]
            dist.all_gather(gathered, subtree)
            for part in gathered:
                tree.push(part)
            return tree.pop_root()
        size, chunk = subtree.numel(), -(-subtree.numel() // world)
        padded = torch.nn.functional.pad(subtree, (0, chunk * world - size))
        received = torch.empty_like(padded)
        dist.all_to_all_single(received, padded)  # row k: rank k's chunk of this rank's slice
        for part in received.view(world, chunk):
            tree.push(part)
        chunks = [torch.empty(chunk, dtype=subtree.dtype, device=subtree.device) for _ in range(world)]
        dist.all_gather(chunks, tree.pop_root().contiguous())
        return torch.cat(chunks)[:size]


def invariance_warnings(
    model: nn.Module, precision: str, compile_: bool, num_workers: int, deterministic: bool, device: torch.device
) -> list[str]:
    """What in this run's setup may break ``train.invariant``'s bitwise-equal weights (logged at start)."""
    found: list[Optional[str]] = [
        f"train.precision={precision}: only fp32 is tested for world-size invariance" if precision != "fp32" else None,
        "train.compile=true: compiled kernels are not tested for world-size invariance" if compile_ else None,
        f"data.num_workers={num_workers}: random transforms in loader workers are seeded per worker, not per shard"
        if num_workers > 0
        else None,
        "train.deterministic=false on a GPU: non-deterministic kernels (atomics) change the last bits run to run"
        if device.type == "cuda" and not deterministic
        else None,
    ]
    stats = [name for name, m in model.named_modules() if getattr(m, "track_running_stats", False)]
    if stats:
        found.append(
            f"{len(stats)} module(s) with running statistics ({', '.join(stats[:3])}): their buffers (batch-norm "
            "running mean and variance, in the weights digest) depend on the world size; parameters do not"
        )
    return [w for w in found if w is not None]


def log_invariance(cfg: Config, strategy: Any, model: nn.Module, micro: int, grad_accum: int) -> None:
    """Rank 0, at start: what train.invariant holds to (``micro``: its shard's samples, data.batch_size or the probe's
    choice), and what in this run may break it (warnings)."""
    assert isinstance(strategy, InvariantDDPStrategy) and cfg.data.global_batch_size is not None
    received, ring = strategy.exchange_bytes(model)
    log.info(
        "train.invariant: %d shards of %d samples, %d per rank, %d intra-op threads per rank (weights match only "
        "across runs with the same count); gradient exchange %d bytes per rank per step (a ring all-reduce: %d)",
        cfg.data.global_batch_size // micro, micro, grad_accum, torch.get_num_threads(), received, ring,
    )  # fmt: skip
    train = cfg.train
    found = invariance_warnings(
        model, train.precision.value, train.compile, cfg.data.num_workers, train.deterministic, strategy.device
    )
    for warning in found:
        log.warning("train.invariant: %s", warning)
