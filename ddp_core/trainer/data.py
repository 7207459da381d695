"""Data sharding that can resume mid-epoch: the same sample stream, minus what was already consumed.

Map-style datasets: an epoch is one seeded permutation, the global stream, dealt out to the ranks in turn (sample i
of the stream to rank i % world); ``ResumableShardSampler`` starts this rank's share where the train state's position
(epoch, samples of the stream consumed) says, so a resume at another world size continues at the stream's next
sample: none repeated, none skipped. Iterable datasets (streams): ``RankShard`` gives each rank and loader worker its
share, and torchdata's ``StatefulDataLoader`` keeps where each worker is; its ``state_dict`` goes into every
checkpoint, per rank. ``TrainData`` hides the difference from the loop. Under ``train.invariant``,
``BlockShardSampler`` cuts each global batch into contiguous blocks instead, so that a step's micro-batch shards are
the same samples at any world size.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Optional

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler, Subset, get_worker_info

from ddp_core.config import DataConfig
from ddp_core.errors import DdpJobError

if TYPE_CHECKING:
    from ddp_core.checkpoint.train_state import Position

log = logging.getLogger(__name__)


class ResumableShardSampler(Sampler[int]):
    """DistributedSampler's order (seeded shuffle per epoch, drop the tail so shards are equal), plus ``start``:
    the samples of the epoch's stream already consumed (by all ranks together), skipped without loading them.

    From ``start`` on, rank r takes the stream's samples ``start + r``, ``start + r + world``, ... (as many for
    every rank). With ``start`` a multiple of ``world`` these are DistributedSampler's shard minus its first
    ``start / world`` indices: the same order as a run that never stopped."""

    def __init__(self, size: int, rank: int, world: int, shuffle: bool, seed: int) -> None:
        self.size, self.rank, self.world, self.shuffle, self.seed = size, rank, world, shuffle, seed
        self.epoch = 0
        self.start = 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        self.epoch, self.start = epoch, start

    def order(self) -> list[int]:
        """The epoch's global stream."""
        if self.shuffle:
            return torch.randperm(self.size, generator=torch.Generator().manual_seed(self.seed + self.epoch)).tolist()
        return list(range(self.size))

    def shard(self) -> list[int]:
        end = self.start + (self.size - self.start) // self.world * self.world  # equal shares: drop the tail
        return self.order()[self.start + self.rank : end : self.world]

    def __iter__(self) -> Iterator[int]:
        return iter(self.shard())

    def __len__(self) -> int:
        return (self.size - self.start) // self.world


class BlockShardSampler(ResumableShardSampler):
    """``train.invariant``'s order: each global batch (``step_samples`` of the stream from ``start`` on, whole
    steps only) is cut into contiguous blocks, one per rank, in rank order. Read in micro-batches, rank r's k-th of
    a step is the global batch's shard ``r * shards / world + k``: the same samples at any world size."""

    def __init__(self, size: int, rank: int, world: int, shuffle: bool, seed: int, step_samples: int) -> None:
        super().__init__(size, rank, world, shuffle, seed)
        self.step_samples = step_samples

    def shard(self) -> list[int]:
        order, block = self.order(), self.step_samples // self.world
        mine = []
        for base in range(self.start, self.size - self.step_samples + 1, self.step_samples):
            mine += order[base + self.rank * block : base + (self.rank + 1) * block]
        return mine

    def __len__(self) -> int:
        return (self.size - self.start) // self.step_samples * (self.step_samples // self.world)


def train_loader(
    dataset: Dataset,
    sampler: ResumableShardSampler,
    cfg: DataConfig,
    seed: int,
    pin_memory: bool = False,
    collate_fn: Optional[Callable[[list[Any]], Any]] = None,
) -> DataLoader:
    """One loader for a whole attempt: each pass over it reads the sampler's current epoch and start. Workers
    persist across epochs (no start-up per epoch). The sample order is the sampler's, so it is exact across
    resumes; randomness inside workers should come from (epoch, index), as worker RNG restarts per attempt."""
    # Its own generator: otherwise the iterator draws a base seed from the global RNG, and a resumed run's
    # stream would shift (worker seeds, random transforms).
    generator = torch.Generator().manual_seed(seed)
    assert isinstance(cfg.batch_size, int), cfg.batch_size  # auto: the trainer gives each replica's share
    return DataLoader(
        dataset,
        batch_size=cfg.batch_size,
        sampler=sampler,
        num_workers=cfg.num_workers,
        drop_last=True,
        generator=generator,
        persistent_workers=cfg.num_workers > 0,
        pin_memory=pin_memory,  # page-locked batches: the copy to the GPU (non_blocking) overlaps compute
        collate_fn=collate_fn,
    )


def eval_loader(
    dataset: Dataset,
    rank: int,
    world: int,
    cfg: DataConfig,
    pin_memory: bool = False,
    collate_fn: Optional[Callable[[list[Any]], Any]] = None,
) -> DataLoader:
    # Strided shards without padding: every sample is evaluated exactly once across ranks.
    if isinstance(dataset, IterableDataset):
        shard: Dataset = RankShard(dataset, rank, world, drop_tail=False)
    else:
        shard = Subset(dataset, range(rank, len(dataset), world))  # type: ignore[arg-type]
    return DataLoader(
        shard,
        batch_size=cfg.eval_batch_size,
        num_workers=cfg.num_workers,
        persistent_workers=cfg.num_workers > 0 and not isinstance(dataset, IterableDataset),
        pin_memory=pin_memory,
        collate_fn=collate_fn,
    )


class RankShard(IterableDataset):
    """This rank's (and loader worker's) share of a stream: of every ``world x workers`` consecutive samples, the
    one at this rank's and worker's place. ``drop_tail`` (training) drops an incomplete last round, so every rank
    gets as many samples, hence as many steps, as the others (a rank with one more batch would wait in a collective
    forever). Every rank reads the whole stream; a dataset that shards its files by rank itself can be faster."""

    def __init__(self, dataset: IterableDataset, rank: int, world: int, drop_tail: bool) -> None:
        self.dataset, self.rank, self.world, self.drop_tail = dataset, rank, world, drop_tail

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        span, mine = self.world * workers, self.rank + self.world * worker  # sample i -> rank i % world
        held, have = None, False
        for i, sample in enumerate(self.dataset):
            if i % span == mine:
                held, have = sample, True
                if not self.drop_tail:
                    yield held
                    have = False
            if self.drop_tail and i % span == span - 1 and have:
                yield held
                have = False


class TrainData:
    """An attempt's training batches, one pass per epoch, resumable mid-epoch.

    ``epoch(pos)`` starts the next epoch in ``pos`` when the current one is done (fewer samples left in its stream
    than a global batch), and returns this pass's batches (from ``pos.samples_in_epoch`` on, for a map-style set).
    ``step_samples``: the samples one optimizer step consumes, all replicas together (the global batch); the loop
    adds it to ``pos.samples_in_epoch`` after each step. ``state_dict``: where a stream's loader is (per rank; a
    map-style set's position is ``pos`` alone, so it is empty)."""

    def __init__(
        self,
        dataset: Dataset,
        rank: int,
        world: int,
        cfg: DataConfig,
        grad_accum: int,
        seed: int,
        pin_memory: bool,
        collate_fn: Optional[Callable[[list[Any]], Any]],
        blocks: bool = False,
    ) -> None:
        assert isinstance(cfg.batch_size, int), cfg.batch_size  # auto: the trainer gives each replica's share
        self.batch_size, self.grad_accum = cfg.batch_size, grad_accum
        self.step_samples = cfg.batch_size * grad_accum * world
        self.streaming = isinstance(dataset, IterableDataset)
        self.finished = False  # a stream's last pass reached its end
        self.sampler: Optional[ResumableShardSampler] = None
        if self.streaming and blocks:
            raise DdpJobError(
                "config key 'train.invariant' = true needs a map-style training set: this task's is a stream "
                "(IterableDataset), which each rank reads its own share of",
                "give the task a map-style dataset (len and indexing), or set train.invariant=false",
            )
        if self.streaming:
            from torchdata.stateful_dataloader import StatefulDataLoader  # only runs that stream import it

            self.shard = RankShard(dataset, rank, world, drop_tail=True)  # type: ignore[arg-type]
            # Workers start anew each epoch (no persistent_workers): they see the dataset's set_epoch.
            self.loader: Any = StatefulDataLoader(
                self.shard,
                batch_size=cfg.batch_size,
                num_workers=cfg.num_workers,
                drop_last=True,
                generator=torch.Generator().manual_seed(seed),
                pin_memory=pin_memory,
                collate_fn=collate_fn,
            )
            return
        self.size = len(dataset)  # type: ignore[arg-type]
        if blocks:  # train.invariant: a step's shards are the same samples at any world size
            self.sampler = BlockShardSampler(self.size, rank, world, cfg.shuffle, seed, self.step_samples)
        else:
            self.sampler = ResumableShardSampler(self.size, rank, world, cfg.shuffle, seed)
        self.loader = train_loader(dataset, self.sampler, cfg, seed, pin_memory, collate_fn)
        if self.size < self.step_samples:
            raise ValueError(
                f"an epoch has fewer than grad_accum={grad_accum} batches of {cfg.batch_size} per rank "
                f"({self.size} samples for a global batch of {self.step_samples})"
            )

    def epoch(self, pos: Position) -> Iterable[Any]:
        if not self.streaming:
            assert self.sampler is not None
            if self.size - pos.samples_in_epoch < self.step_samples:  # what is left makes no whole step
                pos.epoch, pos.samples_in_epoch = pos.epoch + 1, 0
            # The loader (and its workers) lives for the whole attempt; each pass reads the sampler's epoch anew.
            self.sampler.set_epoch(pos.epoch, start=pos.samples_in_epoch)
            return self.loader
        if self.finished:
            if pos.samples_in_epoch == 0:  # a whole pass without one step: the loop would spin forever
                raise DdpJobError(
                    f"the training stream gave no {self.grad_accum} batches of {self.batch_size} per rank in an epoch",
                    "lower data.batch_size, train.grad_accum or data.global_batch_size, or give the task's stream more "
                    "samples",
                )
            pos.epoch, pos.samples_in_epoch, self.finished = pos.epoch + 1, 0, False
        self.shard.set_epoch(pos.epoch)
        return self._pass()

    def _pass(self) -> Iterator[Any]:
        yield from self.loader
        self.finished = True  # reached only when the loop read the whole pass (not when it stopped at max_steps)

    def state_dict(self) -> dict[str, Any]:
        return self.loader.state_dict() if self.streaming else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.streaming and state:
            self.loader.load_state_dict(state)
