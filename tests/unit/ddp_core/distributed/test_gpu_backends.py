"""GPU-node correctness, checked on a CPU machine: the backend table the CUDA branch builds, the collective guard
(a real 2-rank trainer whose process groups refuse what a GPU node would not serve), and the stop flag's
one-step-late agreement."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ddp_core.cluster.env import DistEnv
from ddp_core.config import DistConfig, load_config
from ddp_core.distributed import groups
from ddp_core.errors import DdpJobError
from tests.support.helpers import ROOT, final_digests, run_trainer

DIGITS = str(ROOT / "configs" / "digits.yaml")
CHARLM = str(ROOT / "configs" / "charlm.yaml")
QUICK = ["wandb.mode=disabled", "train.eval_every=0", "checkpoint.every_steps=10", "optim.warmup_steps=0"]
CPU_ONLY = {"CUDA_VISIBLE_DEVICES": ""}  # a rehearsal's ranks, also on a machine with GPUs
GUARD_COUNTS = re.compile(r"collective guard: (.*)$", re.M)


def test_cuda_branch_builds_gloo_and_nccl(monkeypatch):
    """On a CUDA node: one group with gloo for CPU tensors and NCCL for CUDA ones, bound to cuda:LOCAL_RANK, the
    rendezvous bounded by dist.init_timeout_s and collectives by dist.timeout_s."""
    calls: dict = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.setdefault("set_device", device))

    class Store:
        def __init__(self, host, port, world, is_master, timeout, wait_for_workers=True):
            calls["tcp_store"] = (host, port, world, is_master, timeout, wait_for_workers)

        def set(self, key, value):
            calls["signed_in"] = (key, value)  # the rendezvous sign-in rank 0 waits for

    monkeypatch.setattr(dist, "TCPStore", Store)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: calls.update(backend=backend, **kw))

    def listening(*args):  # a rank other than 0 first waits for the store's port: the fake store listens at once
        calls["awaited"] = args

    monkeypatch.setattr(groups, "_await_listener", listening)
    env = DistEnv(rank=3, local_rank=1, world_size=4, local_world_size=2, master_addr="n1", master_port=23456,
                  source="slurm")  # fmt: skip
    device = groups.setup(env, DistConfig(timeout_s=90, init_timeout_s=900))
    assert calls["awaited"] == ("n1", 23456, 900)
    assert device == torch.device("cuda", 1) and calls["set_device"] == device
    assert calls["backend"] == groups.GPU_BACKEND == "cpu:gloo,cuda:nccl"
    assert calls["device_id"] == device and calls["rank"] == 3 and calls["world_size"] == 4
    assert calls["timeout"] == timedelta(seconds=90)
    assert isinstance(calls["store"], Store)
    assert calls["tcp_store"] == ("n1", 23456, 4, False, timedelta(seconds=900), False)
    assert calls["signed_in"][0] == "ddpjob/0/0/arrived/3"  # attempt 0, job step 0
    assert groups.backend_spec(cuda=False) == "gloo"


def test_rank_to_gpu_mapping():
    # Every task sees the node's GPUs (--gpus-per-node): local rank r drives GPU r.
    assert [groups.device_index(DistEnv(local_rank=r, local_world_size=4), 4) for r in range(4)] == [0, 1, 2, 3]
    # Each task sees only its own (--gpus-per-task=1): always the first visible one.
    assert [groups.device_index(DistEnv(local_rank=r, local_world_size=4), 1) for r in range(4)] == [0, 0, 0, 0]
    with pytest.raises(DdpJobError, match="4 ranks on node 0 but only 2 GPUs are visible"):
        groups.device_index(DistEnv(local_rank=3, local_world_size=4), 2)
    with pytest.raises(DdpJobError, match="no visible GPU"):
        groups.device_index(DistEnv(), 0)


def test_guard_spec_validation():
    for good in ("gpu", "nccl", "cpu:gloo,cuda:nccl"):
        assert load_config(DIGITS, ["run.name=x", f"dist.guard='{good}'"]).dist.guard == good
    with pytest.raises(DdpJobError, match=re.escape("config key 'dist.guard' = 'cuda:mpi'")):
        load_config(DIGITS, ["dist.guard='cuda:mpi'"])


def _counts(log: str) -> dict[str, int]:
    """rank 0's guard counts: 'all_reduce cpu->gloo' -> n."""
    line = GUARD_COUNTS.findall(log)[-1]
    return {m[1]: int(m[2]) for m in re.finditer(r"(\w+ \w+->\w+) x(\d+)", line)}


@pytest.mark.parametrize(
    ("config", "overrides"),
    [
        (DIGITS, ["strategy.name=ddp"]),
        (CHARLM, ["strategy.name=fsdp", "strategy.mixed_precision=bf16", "train.precision=bf16"]),
        (CHARLM, ["strategy.name=pipeline", "strategy.stages=2", "optim.grad_clip=1.0"]),
    ],
    ids=["ddp", "fsdp", "pipeline"],
)
def test_trainer_under_gpu_guard(tmp_path, config, overrides):
    """The real 2-rank trainer with its process groups built from the GPU node's table (nccl rehearsed by gloo,
    device types kept): every collective it issues, from Python or C++, is one the GPU node serves. A rehearsal on
    the CPU: a machine's GPUs are hidden from its ranks (two ranks on one GPU would be NCCL's, not the guard's)."""
    small = ["task.data.max_chars=60000", "data.batch_size=8", "task.model.d_model=32"] if config == CHARLM else []
    log = run_trainer(
        config, tmp_path / "run", [*QUICK, *small, *overrides, "train.max_steps=20", "dist.guard=gpu",
                                   "train.stop_check_ms=0"], nproc=2, env=CPU_ONLY,
    )  # fmt: skip
    assert "rehearsed here as cpu:gloo,cuda:gloo" in log and "backend cpu:gloo,cuda:gloo" in log
    assert len(set(final_digests(log))) == 1
    counts = _counts(log)
    # The stop flag (train.stop_check_ms=0): one all-reduce per step, host-side (gloo on a GPU node). Object
    # collectives likewise.
    assert counts["all_reduce cpu->gloo"] >= 20
    assert counts["gather_object cpu->gloo"] >= 2  # every rank's RNG to rank 0, per checkpoint
    assert not [k for k in counts if "->nccl" in k and k.split()[1].startswith("cpu")]


def test_guard_catches_a_cpu_collective_on_nccl(tmp_path):
    """What the trainer did before it had a CPU backend: NCCL alone. The guard refuses its first CPU-tensor
    collective (the stop flag) on the CPU machine, naming the collective, the backends and the line."""
    cmd = [sys.executable, "-m", "ddp_core", DIGITS, "--run-dir", str(tmp_path / "run"), *QUICK,
           "strategy.name=dp", "train.max_steps=5", "dist.guard=nccl"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SUBMITIT_"))}
    env |= {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29731"}
    env |= CPU_ONLY  # the CPU machine's refusal: on a GPU the stop flag's CPU tensor would meet the real NCCL
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode != 0
    assert re.search(
        r"rank 0/1 on \S+ failed: CollectiveRefused: rank 0 on \S+: all_reduce on a cpu tensor, but on a GPU node "
        r"this group's backends are 'cuda:nccl', which serve no cpu tensors \(called from \S+preemption.py:\d+ "
        r"\(agree\)\)",
        proc.stderr,
    ), proc.stderr[-3000:]


def _stop_flag_rank(rank: int, port: int, results: dict) -> None:
    from ddp_core.cluster.preemption import StopFlag

    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    flag = StopFlag("USR2")
    seen = []
    for step in range(4):
        if rank == 1 and step == 1:
            os.kill(os.getpid(), signal.SIGUSR2)  # only rank 1 is signalled, after its step 1
        seen.append(flag.agree())
    flag.settle()
    results[rank] = seen
    dist.barrier()
    dist.destroy_process_group()


def test_stop_flag_agrees_one_step_later_on_every_rank():
    """Rank 1 alone gets the signal before its second agree(); the exchange started there is read at the next
    call, so both ranks see it at the same step (the third), never one rank earlier than the other."""
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_stop_flag_rank, args=(29000 + os.getpid() % 1000, results), nprocs=2)
        assert results[0] == results[1] == [0, 0, int(signal.SIGUSR2), int(signal.SIGUSR2)]


def _paced_flag_rank(rank: int, port: int, results: dict) -> None:
    from ddp_core.cluster.preemption import StopFlag

    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    exchanges = 0
    all_reduce = dist.all_reduce

    def counted(*args, **kwargs):
        nonlocal exchanges
        exchanges += 1
        return all_reduce(*args, **kwargs)

    dist.all_reduce = counted
    flag = StopFlag("USR2", interval_s=0.1)
    seen = []
    for step in range(1, 101):
        time.sleep(0.005 if rank == 0 else 0.007)  # the ranks' own paces: the slower one sets the interval
        if rank == 1 and step == 20:
            os.kill(os.getpid(), signal.SIGUSR2)
        seen.append(flag.agree())
    flag.settle()
    results[rank] = (seen, exchanges)
    dist.barrier()
    dist.destroy_process_group()


def test_stop_flag_paced_by_time_exchanges_every_few_steps_and_stops_together():
    """With a target interval the ranks exchange their flags every k steps (k from their paces, the same on both),
    and still both see rank 1's signal at the same step, within about two intervals of it."""
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_paced_flag_rank, args=(29000 + os.getpid() % 1000, results), nprocs=2)
        (seen0, exchanges0), (seen1, exchanges1) = results[0], results[1]
    assert seen0 == seen1 and exchanges0 == exchanges1
    stop = next(i for i, signum in enumerate(seen0, start=1) if signum)
    assert seen0[stop - 1] == signal.SIGUSR2
    # k <= 0.1 s / 5 ms = 20 steps: read at the exchange after the one that follows step 20.
    assert 20 < stop <= 20 + 2 * 20 + 1, seen0
    assert exchanges0 <= 50  # every step would be 100; at most every other one under a heavy load


def test_loss_stays_on_the_device(tmp_path):
    """The hot loop never reads a loss back: forward_backward hands the trainer a detached tensor."""
    from ddp_core.strategies import build_strategy
    from ddp_core.tasks.digits import DigitsTask

    cfg = load_config(DIGITS, ["run.name=x"])
    strategy = build_strategy(cfg.strategy, DistEnv(), torch.device("cpu"))
    task = DigitsTask()
    model = strategy.wrap(task.build_model(**cfg.task.model))
    x, y = torch.randn(4, 64), torch.tensor([0, 1, 2, 3])
    loss = strategy.forward_backward(task, model, (x, y), grad_accum=2, sync=True)
    assert isinstance(loss, torch.Tensor) and not loss.requires_grad and loss.device.type == "cpu"


def test_gpu_binding_line_reads_slurm_visibility(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    line = groups.describe_binding(DistEnv(local_rank=1, local_world_size=2), cuda=False)
    assert line == "CUDA_VISIBLE_DEVICES=2,3 local_rank 1 -> cuda:1 (GPU 3) (no CUDA in this process: training on cpu)"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    line = groups.describe_binding(DistEnv(local_rank=1, local_world_size=2), cuda=False)
    assert line.startswith("CUDA_VISIBLE_DEVICES=3 local_rank 1 -> cuda:0 (GPU 3)")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert groups.describe_binding(DistEnv(), cuda=False) == "CUDA_VISIBLE_DEVICES=unset local_rank 0 -> cpu"


def test_dataloader_workers_persist_across_epochs():
    from ddp_core.trainer.data import ResumableShardSampler, train_loader

    cfg = load_config(DIGITS, ["run.name=x", "data.num_workers=1", "data.batch_size=8"])
    sampler = ResumableShardSampler(64, 0, 1, True, 0)
    loader = train_loader(torch.utils.data.TensorDataset(torch.arange(64)), sampler, cfg.data, 0, pin_memory=False)
    assert loader.persistent_workers
    first = [b[0].tolist() for b in loader]
    sampler.set_epoch(1, start=8)
    second = [b[0].tolist() for b in loader]  # the same loader, the sampler's new epoch and start
    assert sorted(i for b in first for i in b) == list(range(64)) and sum(len(b) for b in second) == 56
