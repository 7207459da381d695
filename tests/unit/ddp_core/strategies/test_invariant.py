"""World-size-invariant training (``train.invariant``): with dropout on, the char LM ends with bitwise-identical
weights at 1 rank and when a run stopped by a signal at 2 ranks resumes at 4, and at 1 from 4 (torchrun, CPU, one
thread per rank). The digits MLP shows the same across node counts in tests/cluster/test_elastic.py (its uninterrupted
one-node job against one resumed from one node on two); the shards and the tree are the model's, not the task's.
Bad configs are rows of tests/unit/test_bad_inputs.py."""

from __future__ import annotations

import torch

from tests.support.helpers import ROOT, events, final_digests, run_trainer

COMMON = ["train.invariant=true", "train.max_steps=8", "train.eval_every=0", "train.log_every=1",
          "checkpoint.every_steps=1000", "wandb.mode=disabled", "train.stop_check_ms=0", "optim.warmup_steps=2",
          "task.model.dropout=0.1"]  # fmt: skip
CHARLM = [
    "task.target=tests.support.tasks:SignalledCharLMTask",
    "data.batch_size=4",
    "data.global_batch_size=16",
    "task.model.n_layers=1",
    "task.data.max_chars=50000",
    "task.data.seq_len=32",
]  # 4 shards: 1, 2 or 4 per rank


def test_the_shards_and_their_sum_are_the_same_at_every_world_size():
    """Rank r of W reads shards r*S/W .. (r+1)*S/W - 1 of each step, the same samples at every W (the stream's next
    global batch, cut in order); and its subtree sums, added by the ranks' tree, are the one-process tree's sum,
    bitwise, where a sequential sum of the same 8 shards is not."""
    from ddp_core.strategies.invariant import PairwiseSum
    from ddp_core.trainer.data import BlockShardSampler

    size, batch, shards = 103, 4, 8
    order = torch.randperm(size, generator=torch.Generator().manual_seed(7 + 1)).tolist()
    for world in (1, 2, 4, 8):
        samplers = [BlockShardSampler(size, r, world, True, 7, batch * shards) for r in range(world)]
        for s in samplers:
            s.set_epoch(1, start=32)
        dealt = [list(s) for s in samplers]
        per_rank = batch * shards // world
        for step in range(2):  # (103 - 32) // 32 whole steps
            cut = [dealt[r][step * per_rank : (step + 1) * per_rank] for r in range(world)]
            assert [i for part in cut for i in part] == order[32 + 32 * step : 64 + 32 * step]
        assert all(len(d) == len(s) == 2 * per_rank for d, s in zip(dealt, samplers, strict=True))
    leaves = [torch.randn(1000, generator=torch.Generator().manual_seed(i)) * 10**i for i in range(shards)]
    sums = []
    for world in (1, 2, 4, 8):
        parts = []
        for r in range(world):
            tree = PairwiseSum()
            for leaf in leaves[r * shards // world : (r + 1) * shards // world]:
                tree.push(leaf.clone())
            parts.append(tree.pop_root())
        top = PairwiseSum()
        for part in parts:
            top.push(part)
        sums.append(top.pop_root())
    assert all(torch.equal(s, sums[0]) for s in sums)
    assert not torch.equal(sum(leaves, torch.zeros(1000)), sums[0])  # the order of additions shows in the bits


def test_invariant_weights_at_1_2_and_4_ranks_and_across_resumes(tmp_path):
    """8 steps of 4 shards with dropout: one digest for the uninterrupted run at 1 rank and for a run stopped by a
    signal at step 3 at 2 ranks, resumed at 4 ranks and stopped at step 6, finished at 1 rank: the resumed run's
    steps at 2 and at 4 ranks stand for uninterrupted runs at 2 and 4, which would run the same steps again (each
    launch costs 15-40 s on 2 cores: the suite's budget)."""
    config = ROOT / "configs" / "charlm.yaml"
    common = [*COMMON, *CHARLM]
    log = run_trainer(str(config), tmp_path / "w1", common, 1)
    assert "train.invariant: 4 shards of 4 samples, 4 per rank" in log
    (uninterrupted,) = final_digests(log)
    run = tmp_path / "resumed"
    # A signal in a step stops the run after the next one (the ranks agree on it a step late): rank 1's 3rd shard
    # (2 a step) is in step 1 of 0..7, rank 3's 2nd (1 a step) in the resumed attempt's second, step 4.
    run_trainer(str(config), run, common, 2, {"DDPJOB_TEST_SIGNAL_AT": "1:3"}, stopped=True)
    run_trainer(str(run), run, [], 4, {"DDPJOB_TEST_SIGNAL_AT": "3:2"}, stopped=True)
    log = run_trainer(str(run), run, [], 1)
    assert [e["step"] for e in events(run, "interrupted")] == [3, 6]
    assert [(e["step"], e["world_size"]) for e in events(run, "start")] == [(0, 2), (3, 4), (6, 1)]
    assert final_digests(log) == [uninterrupted]
    assert "train.invariant seeds every shard's RNG itself" in log and "RNG streams restart" not in log


def test_settings_that_may_break_invariance_are_named():
    """What rank 0 warns about at start: precision, compile, loader workers, a GPU without deterministic kernels,
    batch norm's running statistics; nothing for the plain fp32 CPU run the tests above make."""
    from torch import nn

    from ddp_core.strategies.invariant import invariance_warnings

    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    mlp = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.1))
    assert invariance_warnings(mlp, "fp32", False, 0, False, cpu) == []
    found = invariance_warnings(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)), "bf16", True, 2, False, gpu)
    assert [w.split(":")[0] for w in found[:4]] == [
        "train.precision=bf16",
        "train.compile=true",
        "data.num_workers=2",
        "train.deterministic=false on a GPU",
    ]
    assert len(found) == 5 and found[4].startswith("1 module(s) with running statistics (1)"), found
