"""``data.batch_size: auto`` on the local cluster, under a real memory limit (``ulimit -v`` in ``slurm.setup``: the
CPU allocator itself fails, as a GPU's does at its capacity), never an exception raised in its place
(``ddp_core.trainer.memory``).

The limit is set from what a run at a fixed micro-batch of 4 took (its ranks' peak address space, which the trainer
logs) plus 128 MiB: a micro-batch of 4 fits with the probe's headroom (5 samples: 48 MiB more), 8 and 16 do not
(10 samples: 288 MiB more). The task (``WideDigitsTask``) holds about 48 MiB a sample during its backward, twice that
for the samples of step 6 that rank 1 holds, a longer batch than the probe saw. glibc's malloc is fixed in both runs
(``MALLOC``): its adaptive mmap threshold otherwise moves allocations of up to 32 MiB onto a heap that keeps its
address space, and each thread that meets a locked arena reserves one of its own, 64 MiB of address space, as a
machine's load decides (measured: rank 0 of a Slurm job 56 MiB over the same run outside Slurm, one CI run's probe
then refused 4). With one arena the two runs' ranks agree within 10 MiB.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.support.cli_runner import field, run_cli
from tests.support.helpers import ROOT, digests, events, final_digests, rank_logs, run_trainer, wait_gone
from tests.support.memcg import memory_cgroup

pytestmark = [pytest.mark.cluster_shared("a")]  # 2 ranks of one CPU on one node
DIGITS = str(ROOT / "configs" / "digits.yaml")
GLOBAL, HEAVY_STEP = 32, 6
# Rank 1's samples of step 6 (unshuffled, sample i of the stream goes to rank i % 2: trainer.data).
HEAVY = list(range(HEAVY_STEP * GLOBAL + 1, (HEAVY_STEP + 1) * GLOBAL, 2))
WIDE = [
    "task.target=tests.support.memory_tasks:WideDigitsTask", "task.data.width=400000", f"task.data.heavy={HEAVY}",
    f"data.global_batch_size={GLOBAL}", "data.shuffle=false", "optim.schedule=constant", "optim.warmup_steps=0",
    "train.eval_every=0", "train.max_steps=12", "wandb.mode=disabled", "slurm.nodes=1", "slurm.tasks_per_node=2",
]  # fmt: skip
MARGIN_MIB = 128
ADDRESS_SPACE = re.compile(r"peak host memory of this rank: resident \d+ MiB, address space (\d+) MiB")


MALLOC = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_ARENA_MAX": "1"}


def limited(kib: int) -> str:
    exports = ", ".join(f"'export {k}={v}'" for k, v in MALLOC.items())
    return f"slurm.setup=['ulimit -v {kib}', {exports}]"


def submitted(cwd: Path, *args: str) -> tuple[str, Path]:
    """``ddpjob submit DIGITS WIDE ARGS``: the job and its run directory."""
    proc = run_cli("submit", DIGITS, *WIDE, *args, cwd=cwd)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return field(proc.stdout, "job"), Path(field(proc.stdout, "run dir"))


def failed_event(job_id: str, run_dir: Path) -> dict:
    """The job, once gone, FAILED; its run's one ``failed`` event."""
    assert wait_gone(job_id, 240) == "FAILED", rank_logs(run_dir, job_id)
    (failed,) = events(run_dir, "failed")
    return failed


def test_auto_fits_the_micro_batch_under_a_memory_limit_and_survives_a_larger_batch(slurm_cluster, tmp_path):
    """The probe takes 4 (16 and 8 do not fit); at step 6 rank 1 runs out with its longer samples, rank 0 does not:
    both do the step again with 2 x 8, and the run completes, bitwise equal to the run at a fixed micro-batch of 4 to
    step 6 continued at 2: the probe and the failed step left nothing behind. Then a task whose micro-batch of one
    needs more than the limit: the job fails at once, as out of memory, with the one line that says what to change."""
    ref = tmp_path / "reference"
    before = run_trainer(DIGITS, ref, [*WIDE, "data.batch_size=4", "train.max_steps=6"], nproc=2, env=MALLOC)
    peak_mib = max(int(n) for n in ADDRESS_SPACE.findall(before))
    (reference,) = set(final_digests(run_trainer(DIGITS, ref, [*WIDE, "data.batch_size=2"], nproc=2)))

    limit = limited((peak_mib + MARGIN_MIB) * 1024)
    job_id, run_dir = submitted(tmp_path, "data.batch_size=auto", limit)
    assert wait_gone(job_id, 240) == "COMPLETED", rank_logs(run_dir, job_id)
    (start,) = events(run_dir, "start")
    assert (start["micro_batch"], start["grad_accum"]) == (4, 4), start
    assert dict(map(tuple, start["probed"])) == {16: False, 8: False, 4: True}, start
    (shrunk,) = events(run_dir, "micro_batch_shrunk")
    assert (shrunk["step"], shrunk["was"], shrunk["micro_batch"], shrunk["grad_accum"], shrunk["ranks"]) == (
        HEAVY_STEP,
        4,
        2,
        8,
        [1],
    ), shrunk
    assert "can't allocate memory" in shrunk["error"], shrunk
    assert not events(run_dir, "failure") and not events(run_dir, "rank_failed")
    assert set(digests(rank_logs(run_dir, job_id)).values()) == {reference}
    status = run_cli("status", str(run_dir), cwd=tmp_path)
    assert f"micro-batch in {run_dir.name}: 4 x 4 a replica (data.batch_size=auto" in status.stdout, status.stdout
    assert f"halved to 2 at step {HEAVY_STEP}, out of memory on rank 1:" in status.stdout, status.stdout

    # Below a micro-batch of one: ten times the columns (about 480 MiB a sample in the backward) under the same limit,
    # whose 128 MiB over the reference's peak a probe step of 2 samples passes by some 700 MiB, and which the start-up
    # (the reference's, its activations aside) stays under by as much. Refused by the probe, even with activations
    # recomputed (its last resort; this task's spread is outside the model): a memory failure, not retried. (A limit
    # under the reference's peak, by a guess of its activations, left the start-up too little.)
    job_id, run_dir = submitted(tmp_path, "data.batch_size=auto", "task.data.width=4000000", limit)
    failed = failed_event(job_id, run_dir)
    assert [(e["event"], e.get("kind")) for e in events(run_dir) if e["event"] != "rank_failed"] == [
        ("failure", "memory"), ("failed", None)
    ]  # fmt: skip
    assert re.match(
        r"out of host memory on n\d \(rank \d\) before its first step: OutOfMemory: a micro-batch of 1 does not fit "
        r"before its first step even recomputing its activations \(host: address space at peak [\d.]+ GiB of "
        r"ulimit -v [\d.]+ GiB\) \(hint: more memory \(slurm.mem_gb\), a smaller data.global_batch_size, or fsdp\)",
        failed["reason"],
    ), failed  # the probe's last resort, activation checkpointing, tried already: not in the hint
    status = run_cli("status", str(run_dir), cwd=tmp_path)
    assert re.search(r"^\s+\d+\s+OUT_OF_MEMORY\s", status.stdout, re.M), status.stdout

    # A fixed micro-batch of 8 under the first limit: the allocator's failure, said with the memory used and there.
    job_id, run_dir = submitted(tmp_path, "data.batch_size=8", limit)
    failed = failed_event(job_id, run_dir)
    assert re.match(
        r"out of host memory on n\d \(rank \d\) at step 0: OutOfMemory: ran out at step 0 \(host: address space at "
        r"peak [\d.]+ GiB of ulimit -v [\d.]+ GiB\): DefaultCPUAllocator: can't allocate memory",
        failed["reason"],
    ), failed
    assert not events(run_dir, "requeued") and not events(run_dir, "restarted")


def test_a_script_that_runs_out_of_host_memory_is_reported_as_out_of_memory_and_not_retried(slurm_cluster, tmp_path):
    """Script mode: a user's script whose rank 1 asks the CPU allocator for more than ``ulimit -v`` leaves (its
    RuntimeError is the memory kind, host): the job fails once, no restart in the allocation, no requeue, and status
    says OUT_OF_MEMORY with the rank, the host and the fix."""
    script = tmp_path / "grows.py"
    script.write_text(
        "import torch\n"
        "import torch.distributed as dist\n"
        "dist.init_process_group('gloo')\n"
        "if dist.get_rank() == 1:\n"
        "    torch.empty(8 << 30, dtype=torch.uint8)  # 8 GiB, past the limit\n"
        "dist.barrier()\n"
    )
    args = ["slurm.tasks_per_node=2", "slurm.max_restarts=2", "slurm.max_failures=2", limited(4 << 20)]  # 4 GiB
    proc = run_cli("submit", "--script", str(script), *args, "--wait", cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    run_dir = Path(field(proc.stdout, "run dir"))
    assert [(e["event"], e.get("kind")) for e in events(run_dir) if e["event"] != "rank_failed"] == [
        ("start", None), ("failure", "memory"), ("failed", None)
    ]  # fmt: skip
    (failed,) = events(run_dir, "failed")
    said = r"out of host memory on n\d \(rank 1\) before its first step: RuntimeError: .*DefaultCPUAllocator: can't"
    assert re.match(said + " allocate memory", failed["reason"]), failed
    status = run_cli("status", str(run_dir), cwd=tmp_path)
    assert re.search(r"^\s+\d+\s+OUT_OF_MEMORY\s", status.stdout, re.M), status.stdout
    noted = r"out of host memory in \S+ before its first step on n\d \(rank 1\): RuntimeError: .*can't allocate"
    assert re.search(noted + r" memory.* \(not retried: give it slurm.mem_gb=N\)", status.stdout), status.stdout


@pytest.mark.parametrize("launcher", ["srun", "torchrun"])
def test_a_rank_the_kernels_oom_killer_ends_is_out_of_memory_by_the_kernel_log_and_not_retried(
    slurm_cluster, tmp_path, launcher
):
    """Nothing of Slurm's limits memory on this cluster: rank 1 of a user's script joins a memory cgroup of 256 MiB
    that the test made (as a node's own limit, or its whole RAM, would be) and takes more; the kernel's OOM killer
    SIGKILLs it, and srun (or the torchrun agent, for its worker) says only that it was killed. The watcher reads the
    kill in the kernel's log: out of memory, host, with the resident memory at the kill; the job fails once, no
    restart and no requeue, though both budgets have room."""
    with memory_cgroup(256 << 20) as procs:
        script = tmp_path / "takes_all.py"
        script.write_text(
            "import os\n"
            "import torch\n"
            "import torch.distributed as dist\n"
            "dist.init_process_group('gloo')\n"
            "if dist.get_rank() == 1:\n"
            f"    open({str(procs)!r}, 'w').write(str(os.getpid()))\n"
            "    held = [torch.ones(16 << 20, dtype=torch.uint8) for _ in range(64)]  # 1 GiB, touched\n"
            "dist.barrier()\n"
        )
        args = ["slurm.tasks_per_node=2", "slurm.max_restarts=2", "slurm.max_failures=2", f"script.launcher={launcher}"]
        proc = run_cli("submit", "--script", str(script), *args, "--wait", cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    run_dir = Path(field(proc.stdout, "run dir"))
    assert [(e["event"], e.get("kind")) for e in events(run_dir) if e["event"] != "rank_failed"] == [
        ("start", None), ("failure", "memory"), ("failed", None)
    ]  # fmt: skip
    (failed,) = events(run_dir, "failed")
    said = (
        r"out of host memory on n\d \(rank 1\) before its first step: killed by the kernel's OOM killer: resident "
        r"(\d+) MiB at the kill, a memory cgroup's limit of 256 MiB \(kernel log: Memory cgroup out of memory: Killed "
        r"process \d+ \(python"
    )
    assert (found := re.match(said, failed["reason"])) and int(found[1]) >= 256, failed  # with what it held before
    status = run_cli("status", str(run_dir), cwd=tmp_path).stdout
    assert "killed by the kernel's OOM killer" in status and "(not retried: give it slurm.mem_gb=N)" in status, status


# train.invariant: 4 shards of 4 samples a step, 2 a rank, through 6 Spread units that each keep about 24 MiB a shard
# for the backward (48 for rank 1's samples of step 3), which activation checkpointing recomputes one unit at a time.
# Measured (2 ranks, one arena): the heavy step peaks about 190 MiB over the plain steps without it, 45 under with it.
INV_STEP = 3
INVARIANT = [
    "task.target=tests.support.memory_tasks:WideDigitsTask", "task.data.width=150000", "task.data.blocks=6",
    f"task.data.heavy={list(range(INV_STEP * 16 + 8, (INV_STEP + 1) * 16))}", "train.invariant=true",
    "data.global_batch_size=16", "data.batch_size=4", "data.shuffle=false", "optim.schedule=constant",
    "optim.warmup_steps=0", "train.eval_every=0", "train.max_steps=6", "wandb.mode=disabled", "slurm.nodes=1",
    "slurm.tasks_per_node=2",
]  # fmt: skip
INV_MARGIN_MIB = 72


def test_invariant_survives_an_out_of_memory_by_recomputing_activations_with_the_same_bits(slurm_cluster, tmp_path):
    """Under ``train.invariant`` the micro-batch is the summation tree's leaf, never cut: rank 1's longer samples of
    step 3 run it out of memory under the limit (the plain steps' peak + 72 MiB), both ranks do the step again with
    activation checkpointing on, and the run completes bitwise equal to the same run without a limit (no
    checkpointing, resumed from step 3 on: a resume keeps the bits); so does the run with ``data.batch_size=auto``,
    whose probe chooses 4 under the limit. With activations recomputed from the start
    and samples eight times as long, there is nothing left to give: the job fails at step 3, out of memory, in one
    line."""
    ref = tmp_path / "reference"
    before = run_trainer(DIGITS, ref, [*INVARIANT, f"train.max_steps={INV_STEP}"], nproc=2, env=MALLOC)
    peak_mib = max(int(n) for n in ADDRESS_SPACE.findall(before))
    (reference,) = set(final_digests(run_trainer(DIGITS, ref, INVARIANT, nproc=2, env=MALLOC)))

    limit = limited((peak_mib + INV_MARGIN_MIB) * 1024)
    proc = run_cli("submit", DIGITS, *INVARIANT, limit, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    job_id, run_dir = field(proc.stdout, "job"), Path(field(proc.stdout, "run dir"))
    assert wait_gone(job_id, 240) == "COMPLETED", rank_logs(run_dir, job_id)
    (again,) = events(run_dir, "activations_recomputed")
    assert (again["step"], again["ranks"]) == (INV_STEP, [1]) and "can't allocate memory" in again["error"], again
    assert not events(run_dir, "failure") and not events(run_dir, "rank_failed")
    assert set(digests(rank_logs(run_dir, job_id)).values()) == {reference}
    status = run_cli("status", str(run_dir), cwd=tmp_path)
    assert f"activations recomputed from step {INV_STEP} in {run_dir.name}, out of memory on rank 1:" in status.stdout

    # data.batch_size=auto under the same limit: the shards of 16 a step that 2 ranks divide are 8, 4, 2 and 1; 8 does
    # not fit with the probe's headroom (10 samples), 4 does (5), and the run is the one at a fixed 4, step 3 included.
    proc = run_cli("submit", DIGITS, *INVARIANT, "data.batch_size=auto", limit, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    job_id, run_dir = field(proc.stdout, "job"), Path(field(proc.stdout, "run dir"))
    assert wait_gone(job_id, 240) == "COMPLETED", rank_logs(run_dir, job_id)
    (start,) = events(run_dir, "start")
    assert (start["micro_batch"], start["shards"], start["kept"], start["probed"][0]) == (4, 4, False, [8, False])
    (again,) = events(run_dir, "activations_recomputed")
    assert (again["step"], again["ranks"]) == (INV_STEP, [1]), again
    assert set(digests(rank_logs(run_dir, job_id)).values()) == {reference}
    status = run_cli("status", str(run_dir), cwd=tmp_path).stdout
    assert "micro-batch in " in status and " s at step 0, train.invariant's 4 shards); activations recomputed" in status

    spent = [*INVARIANT, "task.data.heavy_factor=8", "strategy.activation_checkpointing=true", limit]
    proc = run_cli("submit", DIGITS, *spent, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    failed = failed_event(field(proc.stdout, "job"), Path(field(proc.stdout, "run dir")))
    assert re.match(
        rf"out of host memory on n\d \(rank 1\) at step {INV_STEP}: OutOfMemory: a train.invariant shard of 4 does "
        rf"not fit at step {INV_STEP} even recomputing its activations \(host: address space at peak [\d.]+ GiB of "
        r"ulimit -v [\d.]+ GiB\): DefaultCPUAllocator: can't allocate memory: you tried to allocate \d+ bytes "
        r"\(hint: more memory \(slurm.mem_gb\), or a smaller data.batch_size",
        failed["reason"],
    ), failed


# fsdp gathers each unit's parameters inside the forward: a rank that runs out leaves its peer in a collective, so
# no step can be done again in place. The same limit as the first test (4 fits, 8 and 16 do not, rank 1's samples of
# step 6 need twice): each out-of-memory ends the attempt, and the allocation runs it again at half, from step 4's
# checkpoint for the one at step 6.
FSDP = [*WIDE, "strategy.name=fsdp", "checkpoint.every_steps=4"]


def test_fsdp_runs_the_attempt_again_at_half_the_micro_batch_that_ran_out(slurm_cluster, tmp_path):
    """Under fsdp the probe tries one micro-batch, the largest under what ran out before: 16 and 8 run out (two
    attempts, restarted in the allocation), 4 fits; at step 6 rank 1 runs out again, and the attempt after it goes on
    from step 4 at 2. The run completes, no restart budget or failure budget spent, bitwise equal to the run at a fixed
    micro-batch of 4 to step 4 continued at 2; status says what was halved, and when."""
    ref = tmp_path / "reference"
    before = run_trainer(DIGITS, ref, [*FSDP, "data.batch_size=4", "train.max_steps=4"], nproc=2, env=MALLOC)
    peak_mib = max(int(n) for n in ADDRESS_SPACE.findall(before))
    (reference,) = set(final_digests(run_trainer(DIGITS, ref, [*FSDP, "data.batch_size=2"], nproc=2, env=MALLOC)))

    proc = run_cli("submit", DIGITS, *FSDP, "data.batch_size=auto", "slurm.max_restarts=0", "slurm.max_failures=0",
                   limited((peak_mib + MARGIN_MIB) * 1024), cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    job_id, run_dir = field(proc.stdout, "job"), Path(field(proc.stdout, "run dir"))
    assert wait_gone(job_id, 300) == "COMPLETED", rank_logs(run_dir, job_id)
    shrunk = [(e["was"], e["micro_batch"], e["grad_accum"]) for e in events(run_dir, "micro_batch_shrunk")]
    assert shrunk == [(16, 8, 2), (8, 4, 4), (4, 2, 8)], events(run_dir)
    failures = events(run_dir, "failure")
    assert [(e["kind"], e["micro_batch"], e["step"]) for e in failures] == [
        ("memory", 16, None), ("memory", 8, None), ("memory", 4, HEAVY_STEP)
    ], failures  # fmt: skip
    assert all("can't allocate memory" in e["error"] for e in failures), failures
    assert [e["kind"] for e in events(run_dir, "restarted")] == ["memory"] * 3
    starts = [(e["step"], e["micro_batch"], e["probed"]) for e in events(run_dir, "start")]
    assert starts == [(0, 4, [[4, True]]), (4, 2, [[2, True]])], starts
    assert not events(run_dir, "failed") and not events(run_dir, "requeued")
    assert set(digests(rank_logs(run_dir, job_id)).values()) == {reference}
    status = run_cli("status", str(run_dir), cwd=tmp_path)
    assert f"micro-batch in {run_dir.name}: 2 x 8 a replica" in status.stdout, status.stdout
    assert f"halved to 2 at step {HEAVY_STEP}, out of memory on rank 1:" in status.stdout, status.stdout
