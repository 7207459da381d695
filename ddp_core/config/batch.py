"""The global batch: how ``data.global_batch_size``, the micro-batch ``data.batch_size``, the data-parallel replicas
and the accumulation (micro-batches per replica per optimizer step) relate, on both sides.

``global = data.batch_size x accumulation x replicas``. Without a global batch, accumulation is ``train.grad_accum``
and the global batch follows from the world size (the old meaning of ``data.batch_size``). With one, the global
batch is fixed and each attempt derives its accumulation from its own replicas (``grad_accum``): the login node
checks it for every world size the job may run at (``validate_batches``, ``job_world_sizes``: one per node count
of an elastic ``slurm.nodes: MIN-MAX``), the trainer again for the world it started in.
"""

from __future__ import annotations

import math
from typing import Any

from ddp_core.config.problems import require
from ddp_core.config.schema import SINGLE_PROCESS_STRATEGIES, DataConfig, StrategyName, TrainConfig
from ddp_core.config.tree import Config, ranks_per_node
from ddp_core.errors import DdpJobError

KEY = "data.global_batch_size"
MAX_GLOBAL_BATCH = 1 << 30  # past it a value is a typo
AUTO = "auto"  # data.batch_size: each attempt fits the micro-batch to its memory (``trainer.memory``)


def is_auto(data: DataConfig) -> bool:
    return data.batch_size == AUTO


def fixed_micro(data: DataConfig) -> int:
    """``data.batch_size`` where it is a number: never auto there (resolved per attempt, or refused before)."""
    assert isinstance(data.batch_size, int), data.batch_size
    return data.batch_size


def is_auto_value(key: str, value: Any) -> bool:
    """``value`` is ``data.batch_size``'s "auto" (the range checks skip it: ``check_micro_batch`` checked it)."""
    return key == "data.batch_size" and value == AUTO


def check_micro_batch(data: DataConfig) -> None:
    """``data.batch_size``: a number, or the word "auto"; ``data.batch_headroom`` in [0, 4]."""
    value = data.batch_size
    if isinstance(value, str) and value != AUTO:
        raise DdpJobError(
            f"config key 'data.batch_size' = {value!r} is invalid: must be a number of samples, or {AUTO!r}",
            "fix it in the YAML or with data.batch_size=... (auto: fitted to memory, with data.global_batch_size)",
        )
    require(0 <= data.batch_headroom <= 4, "data.batch_headroom", data.batch_headroom, "must be in [0, 4]")


def per_replica(data: DataConfig, data_world: int, where: str = "the job") -> int:
    """``data.batch_size=auto``: each replica's samples per step, ``data.global_batch_size / data_world``, which the
    micro-batch divides (``micro_batch_candidates``)."""
    assert data.global_batch_size is not None  # validate_auto's check
    share, rest = divmod(data.global_batch_size, data_world)
    if rest or not share:
        plural = "s" if data_world != 1 else ""
        raise DdpJobError(
            f"config key '{KEY}' = {data.global_batch_size} is invalid with data.batch_size=auto: {where} has "
            f"{data_world} data-parallel replica{plural}, and the global batch must be a multiple of them",
            f"set {KEY} to a multiple of {data_world} (e.g. {max(1, share) * data_world})",
        )
    return share


def micro_batch_candidates(share: int, multiple: int = 1) -> list[int]:
    """The micro-batches a replica with ``share`` samples per step may take, smallest first: the divisors of
    ``share`` (accumulation makes up the step exactly) that are multiples of ``multiple`` (a pipeline's
    ``strategy.microbatches``: every micro-batch is cut into that many)."""
    return [n for n in range(multiple, share + 1, multiple) if share % n == 0]


def invariant_micro_batches(global_batch: int, data_worlds: list[int]) -> list[int]:
    """``data.batch_size=auto`` under ``train.invariant``: the micro-batches (the tree's shards) it may take, smallest
    first: ``global / micro`` is a power of two of shards that every replica count in ``data_worlds`` divides."""
    found = [global_batch >> k for k in range(global_batch.bit_length()) if global_batch % (1 << k) == 0]
    return sorted(m for m in found if all((global_batch // m) % w == 0 for w in data_worlds))


def validate_auto(cfg: Config) -> None:
    """``data.batch_size=auto``: a fixed global batch. Every strategy takes it: ddp's and one process's steps hold no
    collective until their micro-batches are done (a rank's out-of-memory is agreed on and the step done again);
    fsdp's and a pipeline's do, so there the attempt ends and the allocation runs it again at half the micro-batch
    (``trainer.redo``, ``cluster.policy``). Under ``train.invariant`` the micro-batch is the leaf of the fixed
    summation tree, so it decides the bits: the run's first probe chooses it among ``invariant_micro_batches``, and
    every later attempt keeps it (``trainer.redo.sharded``)."""
    if not is_auto(cfg.data):
        return
    if cfg.data.global_batch_size is None:
        raise DdpJobError(
            "config key 'data.batch_size' = 'auto' needs data.global_batch_size: the micro-batch is fitted to memory "
            "and accumulation makes up a global batch that must not change with it",
            f"set {KEY} (the samples of one optimizer step), or give data.batch_size a number",
        )
    worlds = job_replicas(cfg)
    if cfg.train.invariant and not invariant_micro_batches(cfg.data.global_batch_size, worlds):
        counts = ", ".join(map(str, worlds))
        raise DdpJobError(
            f"config key '{KEY}' = {cfg.data.global_batch_size} is invalid with train.invariant=true and "
            f"data.batch_size=auto: no micro-batch cuts it into a power of two of shards that the job's "
            f"data-parallel replicas ({counts}) divide",
            f"set {KEY} to a power of two times a micro-batch (e.g. {max(worlds) * 16}), and run on 1, 2, 4, ... ranks",
        )


def replicas(strategy: str, stages: int, world_size: int) -> int:
    """Data-parallel replicas of a run of ``world_size`` processes: one for dp and model_parallel (one process sees
    every sample), a pipeline's ``world_size / stages``, every rank for ddp and fsdp. Plain values, so a saved
    config's (a checkpoint's) can be read back too."""
    if strategy in {s.value for s in SINGLE_PROCESS_STRATEGIES}:
        return 1
    if strategy == StrategyName.pipeline.value:
        return max(1, world_size // stages)
    return world_size


def job_world_sizes(cfg: Config) -> list[int]:
    """Every world size (processes) the job may run at, smallest first: one per node count of ``slurm.nodes`` (a
    single one unless it is a range MIN-MAX), times the ranks per node."""
    low, high = cfg.slurm.node_range
    return [nodes * ranks_per_node(cfg) for nodes in range(low, high + 1)]


def job_replicas(cfg: Config) -> list[int]:
    """The data-parallel replicas of each world size the job may run at (``job_world_sizes``)."""
    return [replicas(cfg.strategy.name.value, cfg.strategy.stages, world) for world in job_world_sizes(cfg)]


def grad_accum(data: DataConfig, train: TrainConfig, data_world: int, where: str = "the job") -> int:
    """Micro-batches per replica per optimizer step at ``data_world`` replicas. Raises ``DdpJobError`` when
    ``data.global_batch_size`` is not a multiple of ``data.batch_size x data_world`` (``where``: whose replicas)."""
    if data.global_batch_size is None:
        return train.grad_accum
    assert isinstance(data.batch_size, int), data.batch_size  # auto: resolved per attempt (trainer.memory)
    if train.invariant:  # first: its rules are stricter than the multiple below, and its hint is right for it
        check_invariant_shards(data, data_world, where)
    per_micro = data.batch_size * data_world
    if data.global_batch_size % per_micro:
        lower = data.global_batch_size // per_micro * per_micro
        nearest = ", ".join(str(n) for n in (lower, lower + per_micro) if n > 0)
        plural = "s" if data_world != 1 else ""
        raise DdpJobError(
            f"config key '{KEY}' = {data.global_batch_size} is invalid: {where} has {data_world} data-parallel "
            f"replica{plural}, and the global batch must be a multiple of data.batch_size x replicas "
            f"({data.batch_size} x {data_world} = {per_micro})",
            f"set {KEY} to a multiple of {per_micro} (e.g. {nearest}), or change data.batch_size or the ranks",
        )
    return data.global_batch_size // per_micro


def power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def check_invariant_shards(data: DataConfig, data_world: int, where: str) -> None:
    """``train.invariant``: the global batch is ``S = global / micro-batch`` shards, summed by one fixed binary tree
    whose subtrees the ranks take (``S / replicas`` leaves each): S must be a power of two, the replicas divide it."""
    assert data.global_batch_size is not None  # validate_invariant's check
    shards, rest = divmod(data.global_batch_size, fixed_micro(data))
    if rest or not power_of_two(shards):
        low = 1 << max(0, shards.bit_length() - 1)
        raise DdpJobError(
            f"config key '{KEY}' = {data.global_batch_size} is invalid with train.invariant=true: it must be "
            f"data.batch_size ({data.batch_size}) x a power of two, the micro-batch shards that one fixed binary "
            "tree sums",
            f"set {KEY} to e.g. {data.batch_size * low} or {data.batch_size * low * 2}, or change data.batch_size",
        )
    if shards % data_world:
        raise DdpJobError(
            f"config key 'train.invariant' = true is invalid at {data_world} data-parallel replicas ({where}): "
            f"the replicas must be a power of two that divides the {shards} shards of {KEY} / data.batch_size",
            f"run on 1, 2, 4, ... up to {shards} ranks (slurm.nodes x slurm.tasks_per_node), or set "
            "train.invariant=false",
        )


def validate_invariant(cfg: Config) -> None:
    """``train.invariant``'s strategy (ddp, or one process) and its fixed global batch; the shard count and the
    replicas are checked with the accumulation (``grad_accum``)."""
    if not cfg.train.invariant:
        return
    if cfg.strategy.name is not StrategyName.ddp:
        raise DdpJobError(
            f"config key 'train.invariant' = true is invalid with strategy.name={cfg.strategy.name.value!r}: "
            "world-size-invariant training sums whole replicas' gradients, which only ddp (or one process) holds",
            "use strategy.name=ddp, or set train.invariant=false",
        )
    if cfg.data.global_batch_size is None:
        raise DdpJobError(
            f"config key 'train.invariant' = true needs '{KEY}': the global batch (and its shards) must not change "
            "with the world size",
            f"set {KEY} to data.batch_size x a power of two (e.g. {cfg.data.batch_size * 4})",
        )


def validate_batches(cfg: Config) -> None:
    """Login-node checks of how the batch is cut: a pipeline's micro-batches in ``data.batch_size``, and
    ``data.global_batch_size`` (a range, train.grad_accum left to it, a multiple of the micro-batch times the replicas
    of every world size the job may run at: an elastic job's each node count)."""
    s = cfg.strategy
    validate_auto(cfg)  # auto: with a global batch (and, under train.invariant, shards the replicas divide)
    auto = is_auto(cfg.data)
    if not auto and s.name is StrategyName.pipeline and s.microbatches >= 1 and fixed_micro(cfg.data) % s.microbatches:
        raise DdpJobError(
            f"config key 'strategy.microbatches' = {s.microbatches!r} is invalid: must divide data.batch_size "
            f"({cfg.data.batch_size}): every micro-batch has the same shape",
            "fix it in the YAML or with strategy.microbatches=...",
        )
    validate_invariant(cfg)
    value: Any = cfg.data.global_batch_size
    if value is None:
        return
    if not 0 < value <= MAX_GLOBAL_BATCH:
        raise DdpJobError(
            f"config key '{KEY}' = {value} is invalid: must be in [1, {MAX_GLOBAL_BATCH}] (or null)",
            f"fix it in the YAML or with {KEY}=...",
        )
    if cfg.train.grad_accum != 1:
        raise DdpJobError(
            f"config key 'train.grad_accum' = {cfg.train.grad_accum} is set, but with {KEY} = {value} the "
            "accumulation is derived from each attempt's world size",
            "drop train.grad_accum (or set data.global_batch_size=null to choose the accumulation yourself)",
        )
    # Invariant mode's shard rules come first, with their hint; auto's shares are checked below.
    if cfg.slurm.elastic and not cfg.train.invariant and not auto:
        _validate_elastic(cfg, value)
    for world, data_world in zip(job_world_sizes(cfg), job_replicas(cfg), strict=True):
        where = f"the job at {world // ranks_per_node(cfg)} node(s)" if cfg.slurm.elastic else "the job"
        if auto:  # each replica's share, which the fitted micro-batch divides
            share = per_replica(cfg.data, data_world, where)
            if s.name is StrategyName.pipeline and share % s.microbatches:
                raise DdpJobError(
                    f"config key '{KEY}' = {value} is invalid with data.batch_size=auto and strategy.microbatches="
                    f"{s.microbatches}: {where}'s share of a replica, {share}, has no micro-batch that is a multiple "
                    "of it",
                    f"set {KEY} to a multiple of {s.microbatches * data_world}, or strategy.microbatches to a divisor "
                    f"of {share}",
                )
        else:  # and train.invariant's shards, at every world size
            grad_accum(cfg.data, cfg.train, data_world, where)


def _validate_elastic(cfg: Config, value: int) -> None:
    """An elastic job's global batch: a multiple of the micro-batch times the replicas at every node count of the
    range. The error names the first world size that cannot divide it, and a value that every one divides."""
    per_micro = [fixed_micro(cfg.data) * r for r in job_replicas(cfg)]
    every = math.lcm(*per_micro)
    if value % every == 0:
        return
    world, data_world = next(
        (w, r)
        for w, r in zip(job_world_sizes(cfg), job_replicas(cfg), strict=True)
        if value % (fixed_micro(cfg.data) * r)
    )
    nodes = world // ranks_per_node(cfg)
    suggest = max(every, value // every * every)
    raise DdpJobError(
        f"config key '{KEY}' = {value} is invalid: slurm.nodes = {cfg.slurm.nodes!r} may run on {nodes} node(s), "
        f"world size {world}, with {data_world} data-parallel replicas, and {value} is not a multiple of "
        f"data.batch_size x replicas ({cfg.data.batch_size} x {data_world})",
        f"set {KEY} to a multiple of {every}, which every node count of the range divides (e.g. {suggest}), or "
        "narrow slurm.nodes",
    )
