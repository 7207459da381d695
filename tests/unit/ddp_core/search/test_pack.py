"""A packed sweep's parts without a cluster: the queue (real processes claiming at once under the real ask-lock), the
slots' job steps and environment, how a trial's step left it, and the login node's sizing of the pack and its one-line
refusals. (On the local cluster: tests/cluster/test_packed_sweeps.py.)"""

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path

import pytest

from ddp_core.cluster.env import PACKED_VAR, DistEnv
from ddp_core.errors import DdpJobError
from ddp_core.run.rundir import RunDir
from ddp_core.search import pack, queue
from ddp_core.search.slots import SlotSize, slots_here
from ddp_core.search.sources import QueueSource
from jobs.submission.partitions import Partition
from jobs.submission.request import SlurmRequest
from jobs.sweeps.pack import plan_pack

TRIALS = [f"/sweep/t{i:03d}" for i in range(40)]


def claim_all(sweep: str, job: str, out: str) -> None:
    taken = []
    while (trial := queue.claim(Path(sweep), job)) is not None:
        taken.append(trial)
        queue.finish(Path(sweep), trial, "completed")
    Path(out).write_text(json.dumps(taken))


def test_allocations_claiming_at_once_run_every_trial_once(tmp_path):
    queue.add_trials(tmp_path, TRIALS, {"per_node": 1})
    outs = [tmp_path / f"taken-{i}.json" for i in range(4)]
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=claim_all, args=(str(tmp_path), f"90{i}", str(o))) for i, o in enumerate(outs)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    taken = [t for o in outs for t in json.loads(o.read_text())]
    assert sorted(taken) == TRIALS  # none twice, none skipped
    assert all(c["state"] == "completed" for c in queue.read_claims(tmp_path).values())


def test_a_requeued_allocation_takes_its_own_trials_back_first_and_a_rerun_frees_the_gone_ones(tmp_path):
    queue.add_trials(tmp_path, TRIALS[:5], {"per_node": 2})
    first = queue.claim(tmp_path, "901")
    second = queue.claim(tmp_path, "901", held={first})  # the pool's own: the trials its slots run now
    other = queue.claim(tmp_path, "902")
    assert (first, second, other) == tuple(TRIALS[:3])
    # The requeued 901 (same job id): its two running trials first, each to one slot (held: the slots' own).
    assert queue.claim(tmp_path, "901") == first
    assert queue.claim(tmp_path, "901", held={first}) == second
    assert queue.claim(tmp_path, "901", held={first, second}) == TRIALS[3]
    queue.finish(tmp_path, other, "failed")
    # A rerun: 901 is gone, 902 is alive; the failed trial runs again.
    freed = queue.release(tmp_path, lambda job: job == "902", again={other})
    assert sorted(freed) == sorted([first, second, TRIALS[3], other])
    queue.add_trials(tmp_path, [TRIALS[1], TRIALS[5]], {"per_node": 2})  # known trials are not queued twice
    assert queue.read_pack(tmp_path)["trials"] == TRIALS[:6]
    held: list[str] = []
    while (trial := queue.claim(tmp_path, "903", held)) is not None:
        held.append(trial)
    assert held == TRIALS[:6]


def test_each_slot_runs_its_steps_on_its_own_node_share_and_port():
    environ = {"SLURM_JOB_NODELIST": "n[1-2]", "SLURM_JOB_ID": "3001", "SLURM_MEM_PER_NODE": "8000"}
    slots = slots_here(SlotSize(tasks=2, cpus=1), 2, environ)
    assert [(s.index, s.node, s.size.mem_mb) for s in slots] == [(0, "n1", 4000), (1, "n1", 4000), (2, "n2", 4000),
                                                                 (3, "n2", 4000)]  # fmt: skip
    line = slots[2].srun(["srun", "--kill-on-bad-exit=1", "--cpus-per-task=1"])
    assert line == ["srun", "--nodes=1", "--nodelist=n2", "--ntasks=2", "--exact", "--mem=4000M",
                    "--kill-on-bad-exit=1", "--cpus-per-task=1"]  # fmt: skip
    ports = [int(s.environment()["MASTER_PORT"]) for s in slots for _ in range(3)]
    assert len(set(ports)) == len(ports)  # every step of the allocation: a port of its own
    assert slots[0].environment()[PACKED_VAR] == "0"
    gpu = slots_here(SlotSize(tasks=1, cpus=4, gpus=1, mem_mb=1000), 4, {"SLURM_JOB_NODELIST": "g1"})[3]
    assert gpu.srun(["srun"]) == ["srun", "--nodes=1", "--nodelist=g1", "--ntasks=1", "--exact", "--gres=gpu:1",
                                  "--mem=1000M"]  # fmt: skip
    step = {**environ, "SLURM_STEP_ID": "4", "SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_NODEID": "0"}
    assert DistEnv.from_env({**step, **slots[1].environment()}).packed and not DistEnv.from_env(step).packed


def test_how_a_trials_step_left_it(tmp_path):
    run = RunDir(tmp_path / "t")
    run.path.mkdir()
    for events, want in [
        ([{"event": "completed"}], "completed"),
        ([{"event": "completed"}, {"event": "rank_failed"}], "completed"),
        ([{"event": "interrupted"}, {"event": "requeue_deferred", "kind": "preemption"}], "deferred"),
        ([{"event": "hang"}, {"event": "requeue_deferred", "kind": "hang"}], "hang"),
        ([{"event": "budget_exhausted"}], "failed"),
        ([], "failed"),
    ]:
        (run.path / "attempts.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
        assert pack.outcome(run) == want, events


def request(tasks: int = 2, cpus: int = 1, gpus: int = 0, nodes: int = 1) -> SlurmRequest:
    return SlurmRequest(
        job_name="s", min_nodes=nodes, max_nodes=nodes, ranks_per_node=tasks, tasks_per_node=tasks,
        cpus_per_task=cpus, ranks_per_task=1, cpus_per_rank=cpus, time_min=30, gpus_per_node=gpus, signal="USR2@90",
    )  # fmt: skip


def test_the_pack_is_sized_by_whole_nodes_and_refused_in_one_line_when_a_trial_cannot_fit():
    node = Partition("p", nodes=4, cpus_per_node=16, gpus_per_node=4)
    packing = plan_pack(request(tasks=2, cpus=2), 4.0, node, trials=200, parallelism=32)
    assert (packing.per_node, packing.allocations) == (4, 8)  # 16 CPUs / 4 per trial; 32 at once
    assert packing.request.tasks_per_node == 8 and packing.request.where["mem"] == "16G"
    assert packing.request.additional["exclusive"] is True
    assert plan_pack(request(), None, node, trials=3, parallelism=32).allocations == 1  # 8 slots hold all 3
    assert plan_pack(request(), None, node, trials=200, parallelism=32, allocations=2).allocations == 2
    gpus = plan_pack(request(tasks=1, cpus=2, gpus=1), None, node, trials=50, parallelism=32)
    assert (gpus.per_node, gpus.request.gpus) == (4, {"gpus_per_node": 4})  # one GPU a slot: 4 a node
    with pytest.raises(DdpJobError, match=r"needs 32 CPUs of one node.*nodes of 16 CPUs"):
        plan_pack(request(tasks=4, cpus=8), None, node, trials=2, parallelism=2)
    with pytest.raises(DdpJobError, match=r"'slurm\.nodes' = 2: a packed trial runs on one node"):
        plan_pack(request(nodes=2), None, node, trials=2, parallelism=2)
    with pytest.raises(DdpJobError, match="--pack -1 is invalid"):
        plan_pack(request(), None, node, trials=2, parallelism=2, allocations=-1)


def test_a_slot_starts_no_trial_that_would_not_end_before_the_allocation(tmp_path):
    pack_spec = {"slot": {"tasks": 1, "cpus": 1}, "per_node": 2, "step": {"srun": ["srun"], "command": []}}
    environ = {"SLURM_JOB_NODELIST": "n1", "SLURM_JOB_ID": "77", "SLURM_JOB_END_TIME": "10000"}
    pool = pack.Pool(pack_spec, QueueSource(tmp_path, "77"), environ)
    assert pool.fits(9990)  # nothing completed here yet: nothing to measure a trial by
    pool.lengths = [100.0, 300.0, 120.0]  # median 120 s, and the margin
    assert pool.fits(10000 - 120 - pack.MARGIN_S - 1) and not pool.fits(10000 - 120 - pack.MARGIN_S + 1)
    queue.add_trials(tmp_path, TRIALS[:2], pack_spec)
    assert pool.take(pool.slots[0]) is None and pool.out_of_time  # late: left for the requeued allocation
    assert pool.source.pending("77")
    unlimited = pack.Pool(pack_spec, QueueSource(tmp_path, "78"), {**environ, "SLURM_JOB_END_TIME": "0"})
    unlimited.lengths = [1e9]
    assert unlimited.fits(5e9) and unlimited.end == float("inf")  # no time limit: every trial fits
