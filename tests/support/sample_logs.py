"""The samples each optimizer step trained, from the micro-batch logs of
``tests.support.metric_tasks.SampleLogDigitsTask`` (digits), and the global stream they must match."""

from __future__ import annotations

import json
from pathlib import Path

import torch

TRAIN_SIZE, SEED = 1438, 0  # digits: the training split's samples; train.seed (the epoch's permutation)


def logged_steps(log_dir: Path, attempt: str, batch: int, global_batch: int, stages: int = 1) -> list[set[int]]:
    """One attempt's optimizer steps as the sets of samples they trained, from every rank's log of its
    micro-batches (tests.support.metric_tasks.SampleLogDigitsTask): replica r's micro-batches k*A .. k*A+A-1 are its
    part of step k. A pipeline's replica is ``stages`` consecutive ranks, which all see its batches."""
    logged = {}
    for path in sorted(log_dir.glob(f"{attempt}_*.jsonl")):
        logged[int(path.stem.split("_")[1])] = [json.loads(line) for line in path.read_text().splitlines()]
    world = logged[0][0]["world"]
    assert sorted(logged) == list(range(world)) and all(m["world"] == world for r in logged.values() for m in r)
    assert all(logged[r] == logged[r - r % stages] for r in logged)  # every stage of a replica saw its batches
    ranks = {r // stages: logged[r] for r in range(0, world, stages)}
    world //= stages
    accum = global_batch // (batch * world)
    lengths = {len(micro) for micro in ranks.values()}
    assert len(lengths) == 1 and lengths.pop() % accum == 0, (attempt, {r: len(m) for r, m in ranks.items()})
    steps = []
    for k in range(len(ranks[0]) // accum):
        samples = [i for r in range(world) for m in ranks[r][k * accum : (k + 1) * accum] for i in m["samples"]]
        assert all(len(m["samples"]) == batch for r in range(world) for m in ranks[r][k * accum : (k + 1) * accum])
        assert len(samples) == global_batch == len(set(samples)), (attempt, k, len(samples))
        steps.append(set(samples))
    return steps


def expected_steps(count: int, global_batch: int) -> list[set[int]]:
    """The global stream, a global batch per step: epoch e is the seeded permutation (train.seed + e), whole steps
    only (its tail that makes no global batch is dropped)."""
    per_epoch, steps = TRAIN_SIZE // global_batch, []
    for t in range(count):
        epoch, k = divmod(t, per_epoch)
        order = torch.randperm(TRAIN_SIZE, generator=torch.Generator().manual_seed(SEED + epoch)).tolist()
        steps.append(set(order[k * global_batch : (k + 1) * global_batch]))
    return steps


def train_losses(run: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if r["split"] == "train"}
