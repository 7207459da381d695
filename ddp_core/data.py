"""Data sharding that can resume mid-epoch: the same index stream, minus what was already consumed."""

from __future__ import annotations

from typing import Iterator

import torch
from torch.utils.data import DataLoader, Dataset, Sampler, Subset

from ddp_core.config import DataConfig


class ResumableShardSampler(Sampler[int]):
    """DistributedSampler's order (seeded shuffle per epoch, drop the tail so shards are equal), plus
    ``start``: the number of this shard's indices to skip, for resuming mid-epoch without loading them."""

    def __init__(self, size: int, rank: int, world: int, shuffle: bool, seed: int) -> None:
        self.size, self.rank, self.world, self.shuffle, self.seed = size, rank, world, shuffle, seed
        self.per_shard = size // world
        self.epoch = 0
        self.start = 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        self.epoch, self.start = epoch, start

    def shard(self) -> list[int]:
        if self.shuffle:
            order = torch.randperm(self.size, generator=torch.Generator().manual_seed(self.seed + self.epoch)).tolist()
        else:
            order = list(range(self.size))
        return order[: self.per_shard * self.world][self.rank :: self.world]

    def __iter__(self) -> Iterator[int]:
        return iter(self.shard()[self.start :])

    def __len__(self) -> int:
        return self.per_shard - self.start


def train_loader(
    dataset: Dataset, sampler: ResumableShardSampler, cfg: DataConfig, seed: int, pin_memory: bool = False
) -> DataLoader:
    """One loader for a whole attempt: each pass over it reads the sampler's current epoch and start. Workers
    persist across epochs (no start-up per epoch). The sample order is the sampler's, so it is exact across
    resumes; randomness inside workers should come from (epoch, index), as worker RNG restarts per attempt."""
    # Its own generator: otherwise the iterator draws a base seed from the global RNG, and a resumed run's
    # stream would shift (worker seeds, random transforms).
    generator = torch.Generator().manual_seed(seed)
    return DataLoader(
        dataset,
        batch_size=cfg.batch_size,
        sampler=sampler,
        num_workers=cfg.num_workers,
        drop_last=True,
        generator=generator,
        persistent_workers=cfg.num_workers > 0,
        pin_memory=pin_memory,  # page-locked batches: the copy to the GPU (non_blocking) overlaps compute
    )


def eval_loader(dataset: Dataset, rank: int, world: int, cfg: DataConfig, pin_memory: bool = False) -> DataLoader:
    # Strided shards without padding: every sample is evaluated exactly once across ranks.
    shard = Subset(dataset, range(rank, len(dataset), world))  # type: ignore[arg-type]
    return DataLoader(
        shard,
        batch_size=cfg.eval_batch_size,
        shuffle=False,
        num_workers=cfg.num_workers,
        persistent_workers=cfg.num_workers > 0,
        pin_memory=pin_memory,
    )
