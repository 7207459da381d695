"""A fixed global batch (``data.global_batch_size``) and the data position in samples of the global stream: a run
interrupted and resumed at other world sizes (torchrun, no Slurm) trains every sample of the stream once, in order,
a global batch per step, and its loss curve goes on as an uninterrupted run's."""

from __future__ import annotations

import pytest
import torch

from tests.support.helpers import ROOT, events, final_digests, run_trainer
from tests.support.sample_logs import SEED, TRAIN_SIZE, expected_steps, logged_steps, train_losses

DIGITS = str(ROOT / "configs" / "digits.yaml")
COMMON = ["train.eval_every=0", "optim.warmup_steps=5", "train.log_every=1", "checkpoint.every_steps=1000",
          "wandb.mode=disabled", "task.target=tests.support.metric_tasks:SampleLogDigitsTask", "data.batch_size=16",
          "task.model.dropout=0.0", "train.stop_check_ms=0"]  # fmt: skip


def test_the_sampler_deals_the_stream_from_any_offset():
    """From a sample offset, the ranks take the epoch's stream in turn, as many each: at an offset that is a
    multiple of the world size exactly the rest of DistributedSampler's shards (what a run that never stopped
    reads), at any offset the stream's next samples, none twice."""
    from ddp_core.trainer.data import ResumableShardSampler

    size = 103
    order = torch.randperm(size, generator=torch.Generator().manual_seed(7 + 2)).tolist()
    for world in (1, 2, 3, 4):
        for offset in range(0, size, 5):
            shards = []
            for rank in range(world):
                sampler = ResumableShardSampler(size, rank, world, shuffle=True, seed=7)
                sampler.set_epoch(2, start=offset)
                shards.append(list(sampler))
                assert len(sampler) == len(shards[-1]) == (size - offset) // world
                if offset % world == 0:
                    assert shards[-1] == order[: size // world * world][rank::world][offset // world :]
            dealt = [shards[r][k] for k in range(len(shards[0])) for r in range(world)]
            assert dealt == order[offset : offset + len(dealt)]


@pytest.mark.parametrize(
    ("saved", "world_size", "config", "samples"),
    [({"step": 25, "epoch": 1, "micro_in_epoch": 10}, 2, {"data": {"batch_size": 32}, "strategy": {"name": "ddp"}},
      640),
     ({"step": 5, "epoch": 0, "micro_in_epoch": 6}, 4,
      {"data": {"batch_size": 16}, "strategy": {"name": "pipeline", "stages": 2}}, 192),
     ({"step": 5, "epoch": 0, "micro_in_epoch": 6}, 1, {"data": {"batch_size": 16}, "strategy": {"name": "dp"}}, 96),
     ({"step": 7, "epoch": 2, "samples_in_epoch": 448}, 4, {}, 448)],
    ids=["ddp", "pipeline", "dp", "samples"],
)  # fmt: skip
def test_a_checkpoint_that_counted_micro_batches_per_rank_loads_as_samples(saved, world_size, config, samples):
    """Checkpoints written before positions were counted in samples hold micro-batches per replica: they convert
    with the micro-batch and replicas they were written with; a new checkpoint's samples load as they are."""
    from ddp_core.checkpoint.train_state import Position, read_position

    expected = Position(step=saved["step"], epoch=saved["epoch"], samples_in_epoch=samples)
    assert read_position(saved, world_size, config) == expected


@pytest.mark.parametrize(
    ("strategy", "worlds", "signals", "stages"),
    [("ddp", (2, 4, 1), ("1:13", "3:19"), 1), ("pipeline", (2, 4, 2), ("1:25", "3:31"), 2)],
    ids=["ddp-2-4-1", "pipeline-2-4-2"],
)  # fmt: skip
def test_a_resume_at_another_world_size_trains_every_sample_once(tmp_path, strategy, worlds, signals, stages):
    """30 steps of a global batch of 64 (22 per epoch of 1438 samples): attempt 1 at ``worlds[0]`` ranks is stopped
    by a signal, attempt 2 resumes at ``worlds[1]`` (full checkpoints for ddp, sharded DCP ones for a 2-stage
    pipeline, whose replicas go from 1 to 2 and back: 2 replicas train as 1 does; fsdp's DCP resharding is
    test_fsdp.py's) and is stopped again after the epoch boundary, attempt
    3 finishes at ``worlds[2]``. Every step trained exactly the global stream's next 64 samples (no sample repeated
    or skipped, each replica's micro-batches of 16 accumulated 64 / (16 x replicas) times), and the loss curve is
    an uninterrupted run's at ``worlds[0]`` ranks, to float rounding (a different world size sums in another order;
    measured: within 1e-7 relative)."""
    logs, run = tmp_path / "samples", tmp_path / "run"
    logs.mkdir()
    common = [*COMMON, f"strategy.name={strategy}", "train.max_steps=30", "data.global_batch_size=64",
              f"task.data.log_dir={logs}"]  # fmt: skip
    if strategy == "pipeline":
        common += [f"strategy.stages={stages}", "strategy.microbatches=2"]
    ref = tmp_path / "ref"
    ref_log = run_trainer(DIGITS, ref, common, worlds[0], {"DDPJOB_TEST_ATTEMPT": "ref"})
    assert len(set(final_digests(ref_log))) == 1
    run_trainer(DIGITS, run, common, worlds[0], {"DDPJOB_TEST_ATTEMPT": "a1", "DDPJOB_TEST_SIGNAL_AT": signals[0]},
                stopped=True)  # fmt: skip
    run_trainer(str(run), run, [], worlds[1], {"DDPJOB_TEST_ATTEMPT": "a2", "DDPJOB_TEST_SIGNAL_AT": signals[1]},
                stopped=True)  # fmt: skip
    log = run_trainer(str(run), run, [], worlds[2], {"DDPJOB_TEST_ATTEMPT": "a3"})
    stops = [e["step"] for e in events(run, "interrupted")]
    starts = [(e["step"], e["world_size"], e["global_batch"], e["grad_accum"]) for e in events(run, "start")]
    assert len(stops) == 2 and 0 < stops[0] < 22 < stops[1] < 30, stops  # the second attempt crossed an epoch
    accum = [4 * stages // w for w in worlds]  # 64 samples = 16 x accumulation x replicas (ranks / stages)
    assert starts == [(0, worlds[0], 64, accum[0]), (stops[0], worlds[1], 64, accum[1]),
                      (stops[1], worlds[2], 64, accum[2])], starts  # fmt: skip
    attempts = [logged_steps(logs, a, 16, 64, stages) for a in ("a1", "a2", "a3")]
    assert [len(a) for a in attempts] == [stops[0], stops[1] - stops[0], 30 - stops[1]]
    assert [s for a in attempts for s in a] == expected_steps(30, 64)
    assert logged_steps(logs, "ref", 16, 64, stages) == expected_steps(30, 64)
    assert "finished at step 30" in log
    resumed, uninterrupted = train_losses(run), train_losses(ref)
    assert sorted(resumed) == list(range(1, 31)) == sorted(uninterrupted)
    for step, loss in uninterrupted.items():
        assert resumed[step] == pytest.approx(loss, rel=1e-5), (step, resumed[step], loss)
    assert uninterrupted[30] < 0.8 * uninterrupted[1]  # it learns: the curve has a shape to follow


def test_without_a_global_batch_a_resume_at_another_world_size_continues_the_stream(tmp_path):
    """data.batch_size keeps its per-rank meaning: at 2 ranks a step trains 2 x 16 samples, resumed at 1 rank 16.
    The position is in samples of the stream all the same, so the resumed attempt starts at the stream's next
    sample, and its epoch ends where fewer than 16 samples are left."""
    logs, run = tmp_path / "samples", tmp_path / "run"
    logs.mkdir()
    common = [*COMMON, "train.max_steps=100", f"task.data.log_dir={logs}"]
    run_trainer(DIGITS, run, common, 2, {"DDPJOB_TEST_ATTEMPT": "a1", "DDPJOB_TEST_SIGNAL_AT": "1:10"}, stopped=True)
    run_trainer(str(run), run, [], 1, {"DDPJOB_TEST_ATTEMPT": "a2"})
    (stop,) = [e["step"] for e in events(run, "interrupted")]
    first, second = logged_steps(logs, "a1", 16, 32), logged_steps(logs, "a2", 16, 16)
    assert [len(first), len(second)] == [stop, 100 - stop]
    epochs = [torch.randperm(TRAIN_SIZE, generator=torch.Generator().manual_seed(SEED + e)).tolist() for e in (0, 1)]
    assert first == [set(epochs[0][32 * k : 32 * (k + 1)]) for k in range(stop)]
    left = (TRAIN_SIZE - 32 * stop) // 16  # whole steps of 16 left in epoch 0 after attempt 1's samples
    expected = [set(epochs[0][32 * stop + 16 * k :][:16]) for k in range(left)]
    expected += [set(epochs[1][16 * k : 16 * (k + 1)]) for k in range(100 - stop - left)]
    assert second == expected


@pytest.mark.parametrize(
    ("strategy", "nproc", "extra"),
    [("ddp", 2, []), ("fsdp", 2, []), ("dp", 1, []),
     ("pipeline", 2, ["strategy.stages=2", "strategy.microbatches=2",
                      "task.target=tests.support.tasks:SlowDigitsTask"])],
    ids=["ddp", "fsdp", "dp", "pipeline"],
)  # fmt: skip
def test_accumulated_micro_batches_step_as_one_global_batch(tmp_path, strategy, nproc, extra):
    """The same global batch of 64 as 4 accumulated micro-batches per replica or as one: the gradient is the mean
    over the global batch either way (each micro-batch's loss divided by the accumulation; DDP and FSDP communicate
    on the last micro-batch only), so plain SGD (whose step is linear in the gradient, unlike Adam's) follows the
    same loss curve, to float rounding (measured: within 1.5e-7 relative)."""
    replicas = 1 if strategy in ("dp", "pipeline") else nproc
    common = [*COMMON, "task.target=ddp_core.tasks.digits:DigitsTask", f"strategy.name={strategy}", *extra,
              "optim.name=sgd", "optim.lr=0.3", "optim.warmup_steps=0", "train.max_steps=20",
              "data.global_batch_size=64"]  # fmt: skip
    curves, logs = [], []
    for micro in (64 // (4 * replicas), 64 // replicas):
        logs.append(run_trainer(DIGITS, tmp_path / f"b{micro}", [*common, f"data.batch_size={micro}"], nproc))
        curves.append(train_losses(tmp_path / f"b{micro}"))
    assert "x 4 micro-batches" in logs[0] and "x 1 micro-batches" in logs[1]
    assert sorted(curves[0]) == list(range(1, 21)) == sorted(curves[1])
    for step, loss in curves[1].items():
        assert curves[0][step] == pytest.approx(loss, rel=1e-5), (step, curves[0][step], loss)
    assert curves[1][20] < 0.8 * curves[1][1]


def test_a_world_size_that_cannot_divide_the_global_batch_is_refused_at_start(tmp_path):
    """Outside Slurm nothing checked the world size before the start: the trainer refuses it itself, one line."""
    import os
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=3", "-m", "ddp_core",
           DIGITS, "--run-dir", str(tmp_path / "run"), *COMMON, "data.global_batch_size=64"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SUBMITIT_"))} | {"OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode != 0
    assert (
        "config key 'data.global_batch_size' = 64 is invalid: this attempt has 3 data-parallel replicas, and the "
        "global batch must be a multiple of data.batch_size x replicas (16 x 3 = 48) (hint: set "
        "data.global_batch_size to a multiple of 48 (e.g. 48, 96)" in proc.stderr
    ), proc.stderr[-3000:]
    assert not (tmp_path / "run" / "checkpoints").exists() or not list((tmp_path / "run" / "checkpoints").iterdir())
