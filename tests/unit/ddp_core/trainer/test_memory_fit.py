"""``data.batch_size=auto``'s pieces without a cluster (``ddp_core.trainer.memory``, ``ddp_core.config.batch``): the
probe's search, the halving, cutting a replica's share into micro-batches, a step's sums put back, and the one-line
refusals at submission. The real memory limits are tests/cluster/test_memory_fit.py's."""

from __future__ import annotations

import pytest
import torch

from ddp_core.cluster.failures import Kind, classify
from ddp_core.config import load_config
from ddp_core.config.batch import micro_batch_candidates
from ddp_core.errors import DdpJobError
from ddp_core.task import Output
from ddp_core.trainer.memory import Fit, OutOfMemory, repeat, rows, search, split
from ddp_core.trainer.metrics import TrainSums
from tests.support.digits import DIGITS


@pytest.mark.parametrize("limit", [0, 1, 5, 12, 13, 47, 48, 100])
def test_the_probe_finds_the_largest_micro_batch_that_fits_trying_the_largest_first(limit):
    candidates = micro_batch_candidates(48)
    assert candidates == [1, 2, 3, 4, 6, 8, 12, 16, 24, 48]
    best, tried = search(candidates, lambda n: n <= limit)
    assert best == max((c for c in candidates if c <= limit), default=None)
    assert tried[0] == (48, limit >= 48) and len(tried) <= 1 + 4  # the largest, then bisection of the other nine
    assert all(ok == (n <= limit) for n, ok in tried)


def test_a_step_that_runs_out_halves_the_micro_batch_to_a_divisor_of_the_share_down_to_one():
    fit, seen = Fit(share=12, micro=12), []
    while True:
        try:
            seen.append((fit.shrink(7, torch.device("cpu"), "rank 1: can't allocate memory"), fit.accumulation))
        except OutOfMemory as err:
            assert classify(err) is Kind.memory  # the failure table's row: not retried, with its fix
            assert str(err).startswith("a micro-batch of 1 does not fit at step 7 (host: ")
            assert "rank 1: can't allocate memory (hint: more memory (slurm.mem_gb)" in str(err)
            break
    assert seen == [(6, 2), (3, 4), (1, 12)]


def test_a_share_is_cut_into_micro_batches_in_order_and_a_probe_batch_repeats_what_the_set_has():
    share = (torch.arange(12).reshape(6, 2), {"y": torch.arange(6), "name": "digits"})
    parts = split(share, 2)
    assert len(parts) == 3 and all(rows(p) == 2 for p in parts)
    assert torch.equal(torch.cat([p[0] for p in parts]), share[0]) and parts[1][1]["name"] == "digits"
    assert torch.equal(torch.cat([p[1]["y"] for p in parts]), share[1]["y"])
    big = repeat(share, 14)
    assert rows(big) == 14 and torch.equal(big[1]["y"], torch.arange(6).repeat(3)[:14])
    assert rows(repeat(share, 4)) == 4


def test_a_step_done_again_counts_its_sums_once():
    sums = TrainSums()
    sums.add(Output(loss=torch.tensor(0.0), count=2, sums={"correct": torch.tensor(1.0)}))
    mark = sums.mark()
    for _ in range(3):  # the micro-batches of a step that then ran out
        sums.add(
            Output(loss=torch.tensor(0.0), count=2, sums={"correct": torch.tensor(2.0), "extra": torch.tensor(1.0)})
        )
    sums.rollback(mark)
    assert sums.count == 2 and [len(v) for v in sums.pending.values()] == [1, 0]


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        (["data.batch_size=auto"], "config key 'data.batch_size' = 'auto' needs data.global_batch_size"),
        (["data.batch_size=auto", "data.global_batch_size=24", "train.invariant=true", "slurm.tasks_per_node=16"],
         "= 24 is invalid with train.invariant=true and data.batch_size=auto: no micro-batch cuts it into a power of "
         "two of shards that the job's data-parallel replicas (16) divide"),
        (["data.batch_size=auto", "data.global_batch_size=24", "train.invariant=true", "slurm.tasks_per_node=3"],
         "replicas (3) divide"),
        (["data.batch_size=auto", "data.global_batch_size=64", "strategy.name=pipeline", "strategy.stages=2",
          "strategy.microbatches=3"],
         "= 64 is invalid with data.batch_size=auto and strategy.microbatches=3: the job's share of a replica, 64, "
         "has no micro-batch that is a multiple of it"),
        (["data.batch_size=auto", "data.global_batch_size=63"],
         "= 63 is invalid with data.batch_size=auto: the job has 2 data-parallel replicas"),
        (["data.batch_size=auto", "data.global_batch_size=64", "train.grad_accum=2"],
         "config key 'train.grad_accum' = 2 is set, but with data.global_batch_size = 64 the accumulation is derived"),
        (["data.batch_size=most"], "config key 'data.batch_size' = 'most' is invalid: must be a number of samples"),
        (["data.batch_size=auto", "data.global_batch_size=64", "data.batch_headroom=-1"],
         "config key 'data.batch_headroom' = -1"),
    ],
)  # fmt: skip
def test_auto_is_refused_in_one_line_where_it_cannot_work(overrides, says):
    with pytest.raises(DdpJobError) as err:
        load_config(DIGITS, overrides)
    assert says in str(err.value) and "\n" not in str(err.value)
    for taken in ("strategy.name=ddp", "strategy.name=fsdp", "train.invariant=true"):
        taken_cfg = load_config(DIGITS, ["data.batch_size=auto", "data.global_batch_size=64", taken])
        assert taken_cfg.data.batch_size == "auto"


def test_under_invariant_the_micro_batches_auto_may_take_cut_a_power_of_two_of_shards_every_replica_count_divides():
    from ddp_core.config.batch import invariant_micro_batches

    assert invariant_micro_batches(16, [2]) == [1, 2, 4, 8]
    assert invariant_micro_batches(48, [1, 2, 4]) == [3, 6, 12]  # 48 = 3 x 16: 16, 8 or 4 shards
    assert invariant_micro_batches(24, [16]) == [] and invariant_micro_batches(64, [3]) == []


def test_under_invariant_auto_chooses_the_shard_once_and_a_resume_at_another_world_size_keeps_it(tmp_path):
    """The run's first probe (2 ranks: a share of 32, every shard fits) chooses 32, 2 shards; the resume on one rank,
    whose own probe would take its share of 64, keeps 32 (``kept``: 2 shards, 2 micro-batches a step), and the run
    ends bitwise equal to the run with ``data.batch_size=32`` written in, uninterrupted, at 2 ranks."""
    from tests.support.helpers import events, final_digests, run_trainer

    common = ["data.global_batch_size=64", "train.invariant=true", "optim.schedule=constant", "optim.warmup_steps=0",
              "train.eval_every=0", "wandb.mode=disabled", "slurm.tasks_per_node=1"]  # fmt: skip
    run = tmp_path / "auto"
    run_trainer(DIGITS, run, [*common, "data.batch_size=auto", "train.max_steps=4"], nproc=2)
    resumed = run_trainer(DIGITS, run, [*common, "data.batch_size=auto", "train.max_steps=8"], torchrun=True)
    starts = [(e["step"], e["world_size"], e["micro_batch"], e["grad_accum"], e["shards"], e["kept"], e["probed"])
              for e in events(run, "start")]  # fmt: skip
    assert starts == [(0, 2, 32, 1, 2, False, [[32, True]]), (4, 1, 32, 2, 2, True, [[32, True]])], starts
    assert "train.invariant's shard kept from the run's first probe" in resumed
    fixed = run_trainer(DIGITS, tmp_path / "fixed", [*common, "data.batch_size=32", "train.max_steps=8"], nproc=2)
    assert len(set(final_digests(fixed))) == 1 and set(final_digests(resumed)) == set(final_digests(fixed))


def test_every_attempt_probes_again_and_the_run_goes_on_as_if_uninterrupted(tmp_path):
    """A resumed attempt probes anew (its start event says so) before it loads the checkpoint, with the same global
    batch and schedule: the run ends bitwise equal to an uninterrupted one at the micro-batch both probes chose."""
    from tests.support.helpers import events, final_digests, run_trainer

    common = ["data.global_batch_size=64", "slurm.tasks_per_node=1", "optim.schedule=constant", "optim.warmup_steps=0",
              "train.eval_every=0", "wandb.mode=disabled"]  # fmt: skip
    run = tmp_path / "auto"
    run_trainer(DIGITS, run, [*common, "data.batch_size=auto", "train.max_steps=6"])
    resumed = run_trainer(DIGITS, run, [*common, "data.batch_size=auto", "train.max_steps=12"])
    starts = events(run, "start")
    assert [(e["step"], e["micro_batch"], e["global_batch"], e["probed"]) for e in starts] == [
        (0, 64, 64, [[64, True]]), (6, 64, 64, [[64, True]])
    ]  # fmt: skip
    uninterrupted = run_trainer(DIGITS, tmp_path / "fixed", [*common, "data.batch_size=64", "train.max_steps=12"])
    assert set(final_digests(resumed)) == set(final_digests(uninterrupted)) and len(final_digests(resumed)) == 1


def test_an_out_of_memory_the_attempt_did_not_survive_is_said_with_the_memory_used_and_there():
    from ddp_core.trainer.memory import ran_out

    raw = RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory")
    said = ran_out(raw, 5, torch.device("cpu"))
    assert classify(said) is Kind.memory
    assert str(said).startswith("ran out at step 5 (host: ") and "): DefaultCPUAllocator: can't allocate" in str(said)
    assert said.hint.startswith("data.batch_size=auto fits the micro-batch to memory")
    assert str(ran_out(MemoryError(), None, torch.device("cpu"))).startswith("ran out before its first step (host: ")
    invariant = ran_out(raw, 5, torch.device("cpu"), invariant=True)  # its micro-batch is a shard: no auto
    assert invariant.hint.startswith("strategy.activation_checkpointing=true, more memory (slurm.mem_gb), or a smaller")


def test_under_invariant_the_relief_is_recomputing_activations_once_then_an_out_of_memory():
    """``train.invariant``'s relief never cuts its shard: it turns activation checkpointing on (the units' forward
    wrapped in place, the state dict's names kept), and when it already is, the step cannot be done again."""
    from ddp_core.cluster.env import DistEnv
    from ddp_core.config import StrategyConfig
    from ddp_core.strategies import build_strategy
    from ddp_core.trainer.redo import Recompute

    strategy = build_strategy(StrategyConfig(), DistEnv(), torch.device("cpu"), None, 0)
    model = strategy.wrap(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2)))
    names, relief = list(model.state_dict()), Recompute(strategy, strategy.local_model(model), 4)
    event, fields, again = relief.relieve(3, torch.device("cpu"), "can't allocate memory")
    assert (event, fields) == ("activations_recomputed", {}) and "the same bits" in again
    assert "recomputed" in model[0].forward.__name__ and list(model.state_dict()) == names
    with pytest.raises(OutOfMemory) as err:
        relief.relieve(5, torch.device("cpu"), "can't allocate memory")
    assert str(err.value).startswith("a train.invariant shard of 4 does not fit at step 5 even recomputing its ")
    assert err.value.hint.startswith("more memory (slurm.mem_gb), or a smaller data.batch_size")


def test_recomputed_activations_keep_an_invariant_runs_bits_dropout_included(tmp_path):
    """What the relief rests on: the same invariant run (digits' MLP, dropout 0.1) with and without activation
    checkpointing ends bitwise equal."""
    from tests.support.helpers import final_digests, run_trainer

    common = ["train.invariant=true", "data.global_batch_size=64", "data.batch_size=16", "train.max_steps=4",
              "optim.warmup_steps=0", "train.eval_every=0", "wandb.mode=disabled"]  # fmt: skip
    plain = run_trainer(DIGITS, tmp_path / "plain", common)
    recomputed = run_trainer(DIGITS, tmp_path / "ckpt", [*common, "strategy.activation_checkpointing=true"])
    assert len(set(final_digests(plain))) == 1 and set(final_digests(plain)) == set(final_digests(recomputed))


def test_a_peers_out_of_memory_a_step_could_not_survive_ends_the_job_on_every_rank():
    """The ranks that did not run out leave with ``StepAbandoned``; like the rank that did (``OutOfMemory``), they
    treat it as the job's end (their node-local copies go), which a failure of unknown kind is not."""
    from ddp_core.trainer.redo import StepAbandoned, ends_the_job

    assert classify(StepAbandoned("step 3 abandoned: rank 1 could not fit it")) is Kind.unknown  # rank 1's decides
    assert ends_the_job(StepAbandoned("step 3 abandoned")) and ends_the_job(OutOfMemory("no fit", "more memory"))
    assert not ends_the_job(RuntimeError("a peer's socket closed"))


def test_under_fsdp_a_rank_that_runs_out_ends_the_attempt_with_its_micro_batch_and_the_next_probes_under_half(
    tmp_path,
):
    """fsdp's steps meet in collectives, so a rank that runs out raises ``RanOut``: a memory failure whose
    ``rank_failed`` event carries the micro-batch (``failures.record``), which keeps the node-local copies (the
    allocation runs the attempt again from them), and whose attempt after it probes under half of the smallest that
    ran out in the same allocation (``memory.below``: the same job and restart count; a requeue probes afresh). At the
    smallest there is nothing to halve: ``OutOfMemory``, the run's end."""
    from ddp_core.cluster.env import DistEnv
    from ddp_core.cluster.failures import Failure, record
    from ddp_core.config import StrategyConfig, StrategyName
    from ddp_core.run.rundir import RunDir
    from ddp_core.strategies import build_strategy
    from ddp_core.trainer.memory import RanOut, below, give_up
    from ddp_core.trainer.redo import ends_the_job

    cpu, every = torch.device("cpu"), micro_batch_candidates(16)
    fsdp = build_strategy(StrategyConfig(name=StrategyName.fsdp), DistEnv(), cpu, None, None)
    err = give_up(8, every, 6, cpu, "DefaultCPUAllocator: can't allocate memory", fsdp)
    assert isinstance(err, RanOut) and err.micro_batch == 8 and classify(err) is Kind.memory
    assert str(err).startswith("a micro-batch of 8 ran out at step 6 (host: ") and not ends_the_job(err)
    last = give_up(1, every, 6, cpu, "can't allocate memory", fsdp)
    assert not isinstance(last, RanOut) and ends_the_job(last)
    assert str(last).startswith("a micro-batch of 1 does not fit at step 6")
    assert (
        last.hint == "more memory (slurm.mem_gb), strategy.activation_checkpointing=true, or a smaller "
        "data.global_batch_size"
    )  # fsdp's own fix is not offered to an fsdp run

    run = RunDir(tmp_path)
    record(run, DistEnv(job_id="57", restart_count=0, rank=1), err, 6)
    (event,) = run.events()
    assert (event["kind"], event["micro_batch"]) == ("memory", 8)
    failure = Failure.of_rank(Kind.memory, event)
    assert failure.micro_batch == 8 and failure.fields()["micro_batch"] == 8
    earlier = [
        {"event": "failure", "job_id": "57", "restart_count": 0, "micro_batch": 16},
        {"event": "failure", "job_id": "57", "restart_count": 0, "micro_batch": 8, "step": 6},
    ]
    assert below(earlier, "57", 0) == (4, earlier[-1])
    infra = {"event": "failure", "job_id": "57", "restart_count": 0, "kind": "infrastructure"}
    assert below([*earlier, infra], "57", 0) == (4, None)  # still under it, the shrink recorded already
    assert below(earlier, "57", 1) == (None, None) and below(earlier, "58", 0) == (None, None)


def test_a_pipeline_probes_then_trains_at_its_choice_as_a_run_that_wrote_it_in(tmp_path):
    """A pipeline's stages fix their micro-batches' shapes at their first step: the probe's (its headroom's 40
    samples, cut into 2) are forgotten after it (``Strategy.probed``), and the run trains at the 32 it chose, bitwise
    as the run with ``data.batch_size=32`` written in."""
    from tests.support.helpers import events, final_digests, run_trainer

    common = ["data.global_batch_size=32", "strategy.name=pipeline", "strategy.stages=2", "strategy.microbatches=2",
              "train.max_steps=4", "optim.warmup_steps=0", "train.eval_every=0", "wandb.mode=disabled"]  # fmt: skip
    auto = run_trainer(DIGITS, tmp_path / "auto", [*common, "data.batch_size=auto"], nproc=2)
    (start,) = events(tmp_path / "auto", "start")
    assert (start["micro_batch"], start["probed"]) == (32, [[32, True]]), start
    fixed = run_trainer(DIGITS, tmp_path / "fixed", [*common, "data.batch_size=32"], nproc=2)
    assert len(set(final_digests(auto))) == 1 and set(final_digests(auto)) == set(final_digests(fixed))


def test_at_the_smallest_micro_batch_auto_recomputes_activations_once_before_the_end():
    """``data.batch_size=auto``'s last resort, in a step and in the probe: activation checkpointing turned on (the
    same bits), once; then the one line, which no longer offers it as a fix."""
    from ddp_core.cluster.env import DistEnv
    from ddp_core.config import StrategyConfig
    from ddp_core.strategies import build_strategy
    from ddp_core.trainer.redo import Halve

    strategy = build_strategy(StrategyConfig(), DistEnv(), torch.device("cpu"), None, None)
    model = strategy.wrap(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2)))
    relief = Halve(Fit(share=4, micro=2), strategy, strategy.local_model(model))
    assert relief.relieve(3, torch.device("cpu"), "rank 1: can't allocate")[:2] == (
        "micro_batch_shrunk", {"was": 2, "micro_batch": 1, "grad_accum": 4}
    )  # fmt: skip
    event, fields, again = relief.relieve(4, torch.device("cpu"), "rank 1: can't allocate")
    assert (event, fields) == ("activations_recomputed", {"micro_batch": 1}) and strategy.recomputes()
    assert again.startswith("with a micro-batch of 1, the smallest: the step again")
    assert "recomputed" in model[0].forward.__name__
    with pytest.raises(OutOfMemory) as err:
        relief.relieve(5, torch.device("cpu"), "rank 1: can't allocate")
    assert str(err.value).startswith("a micro-batch of 1 does not fit at step 5 even recomputing its activations")
    assert "activation_checkpointing" not in err.value.hint
