"""The trainer without Slurm: alone and under torchrun, exact resume, W&B modes, bf16 and accumulation."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

from tests.support.digits import DIGITS, trainer
from tests.support.helpers import ROOT, events, final_digests, run_trainer

BASE = [
    "train.eval_every=0",
    "optim.warmup_steps=5",
    "train.log_every=10",
    "checkpoint.every_steps=10",
    "wandb.mode=disabled",
]


def test_single_process_run(tmp_path):
    """One process, W&B disabled (nothing written for it), and ``ddpjob export`` of its final checkpoint: one plain
    state dict (strict keys, no wrapper prefixes) with the trainer's final weights."""
    log = trainer(tmp_path / "run", *BASE, "train.max_steps=30")
    assert "single on" in log and "rank 0/1" in log
    assert (tmp_path / "run" / "checkpoints" / "step_00000030.json").exists()
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if m["split"] == "train"] == [10, 20, 30]
    assert all(m["step_ms"] > 0 for m in metrics if m["split"] == "train")
    assert metrics[-2]["split"] == "eval" and metrics[-2]["accuracy"] > 0.5
    # The final checkpoint's save time, after the final eval.
    assert metrics[-1]["split"] == "checkpoint" and metrics[-1]["step"] == 30 and metrics[-1]["save_s"] > 0
    assert not list((tmp_path / "run" / "wandb").glob("offline-run-*"))  # wandb.mode=disabled

    import torch

    from ddp_core.tasks.digits import DigitsTask
    from ddp_core.trainer.steps import weights_digest

    out = tmp_path / "model.pt"
    proc = subprocess.run(
        [sys.executable, "-m", "jobs", "export", str(tmp_path / "run"), str(out)], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    state = torch.load(out, weights_only=True)
    model = DigitsTask().build_model(**{"hidden": 128, "depth": 2, "dropout": 0.1})
    model.load_state_dict(state)  # strict: plain keys, no wrapper prefixes
    assert final_digests(log) == [weights_digest(state)]


# Model parallel: one process driving its stages. The property of continuation
# (test_continuation_property.py) covers DDP at 1 and 2 ranks, accumulation and background saves.
def test_resume_is_bitwise_exact_with_model_parallel(tmp_path):
    # Reference: 60 uninterrupted steps, checkpointing every 5. Then the same run directory with every
    # checkpoint after step 25 deleted (as if the job died there, mid-epoch) is resumed to the end.
    common = [*BASE, "data.batch_size=32", "train.grad_accum=2", "checkpoint.every_steps=5", "checkpoint.keep_last=20",
              "strategy.name=model_parallel", "task.model.dropout=0.2", "train.max_steps=60"]  # fmt: skip
    ref = final_digests(trainer(tmp_path / "run", *common))
    assert len(ref) == 1
    for path in (tmp_path / "run" / "checkpoints").glob("step_*"):
        if int(path.stem.split("_")[1]) > 25:
            path.unlink()
    log = trainer(tmp_path / "run", *common)
    resumed = re.search(r"resumed from step_00000025.pt \(step 25, epoch (\d+)\)", log)
    assert resumed and int(resumed[1]) >= 1, log  # mid-epoch, past the first epoch boundary
    assert final_digests(log) == ref


def test_interrupted_runs_are_exact_at_three_ranks(tmp_path):
    """Three ranks: a run stopped right after an epoch boundary, then again in the first step of the next attempt,
    ends with the uninterrupted run's weights. With 3+ ranks an all-reduce's summation order depends on DDP's bucket
    layout (see DDPStrategy.prime). (1 and 2 ranks: test_continuation_property.py; fsdp: test_fsdp.py; pipeline:
    test_pipeline.py; 4 ranks on 2 nodes: test_slurm_preemption.py.)"""
    nproc, strategy, data_world = 3, "ddp", 3
    # train.stop_check_ms=0: the ranks exchange their flags after every step, so a signal lands at a known step.
    common = [*BASE, "task.target=tests.support.tasks:SignalledDigitsTask", "data.batch_size=32",
              "task.model.dropout=0.2", "train.max_steps=30", "checkpoint.every_steps=1000",
              f"strategy.name={strategy}", "train.stop_check_ms=0"]  # fmt: skip
    ref = final_digests(trainer(tmp_path / "ref", *common, nproc=nproc))
    assert len(set(ref)) == 1
    per_epoch = (1438 // data_world) // 32  # digits: 1438 training samples, sharded, whole batches of 32
    primes = 1 if strategy == "ddp" else 0  # DDP's extra first batch per attempt (DDPStrategy.prime)
    run = tmp_path / "run"
    # A signal during step k is acted on after step k + 1 (StopFlag.agree): attempt 1 stops at the epoch's end.
    trainer(run, *common, nproc=nproc, env={"DDPJOB_TEST_SIGNAL_AT": f"{nproc - 1}:{per_epoch - 1 + primes}"},
            stopped=True)  # fmt: skip
    run_trainer(str(run), run, [], nproc, {"DDPJOB_TEST_SIGNAL_AT": "0:1"}, stopped=True)  # the attempt's first batch
    log = run_trainer(str(run), run, [], nproc)
    stops = [e["step"] for e in events(run, "interrupted")]
    assert stops == [per_epoch, per_epoch + 2], stops
    assert final_digests(log) == ref


def test_bf16_and_accumulation_train(tmp_path):
    log = trainer(tmp_path / "run", *BASE, "train.max_steps=20", "train.precision=bf16", "train.grad_accum=3")
    assert "finished at step 20" in log


def test_wandb_offline_records_and_online_without_key_falls_back(tmp_path):
    env = {"WANDB_API_KEY": "", "HOME": str(tmp_path)}  # no key anywhere
    log = trainer(tmp_path / "run", *BASE[:-1], "train.max_steps=10", "wandb.mode=online", env=env)
    assert "logging offline instead" in log
    run_id = json.loads((tmp_path / "run" / "run.json").read_text())["run_id"]
    records = list((tmp_path / "run" / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))
    assert len(records) == 1
    proc = subprocess.run([sys.executable, "-m", "jobs", "sync", str(tmp_path / "run"), "--dry-run"],
                          capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 0 and "offline-run-" in proc.stdout and "wandb sync" in proc.stdout


def test_a_signal_outside_slurm_stops_non_zero_and_resumes(tmp_path):
    """torchrun or a plain process: nothing requeues, so a signalled run checkpoints, records 'stopped' and exits
    4 (not 0, which would read as finished); started again on its run directory it completes. With async saves
    the signal's save is synchronous: complete before the process exits. (The same with sync saves, the default:
    tests/unit/ddp_core/trainer/test_wandb.py's and tests/unit/ddp_core/run/test_run_identity.py's stopped runs, and
    test_script_mode.py's.)"""
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "ddp_core", DIGITS, "--run-dir", str(run), *BASE, "train.max_steps=200",
           "train.log_every=1", "task.target=tests.support.tasks:SlowDigitsTask", "task.data.pause_s=0.02",
           "checkpoint.async_save=true", "checkpoint.every_steps=3"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SUBMITIT_"))}
    proc = subprocess.Popen(cmd, env=env | {"OMP_NUM_THREADS": "1"}, stderr=subprocess.PIPE, text=True)
    metrics = run / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.exists() and metrics.read_text().count('"train"') >= 5) and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGUSR2)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 4, err[-2000:]
    stopped = [json.loads(line) for line in (run / "attempts.jsonl").read_text().splitlines()]
    stopped = [e for e in stopped if e["event"] == "interrupted"]
    assert [e["kind"] for e in stopped] == ["stopped"]
    assert f"continue with: python -m ddp_core {run}" in err
    log = run_trainer(str(run), run, [])  # started on the run directory: resumes and completes
    assert f"resumed from step_{stopped[0]['step']:08d}.pt" in log and "finished at step 200" in log


def test_a_non_finite_loss_stops_the_run(tmp_path):
    cmd = [sys.executable, "-m", "ddp_core", DIGITS, "--run-dir", str(tmp_path / "run"), *BASE,
           "train.max_steps=40", "train.log_every=5", "optim.lr=1e30", "optim.warmup_steps=0"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SUBMITIT_"))}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env | {"OMP_NUM_THREADS": "1"})
    assert proc.returncode == 1
    assert re.search(r"rank 0/1 on \S+ failed: DdpJobError: the training loss became nan by step \d+", proc.stderr)
    assert "final weights" not in proc.stderr


def test_a_taken_rendezvous_port_is_a_clear_error(tmp_path):
    """Rank 0 of two, told MASTER_PORT by its launcher, which its peer connects to: a taken port is an error. (Alone,
    or under a Slurm step's meeting file, it listens on another port instead.)"""
    import socket

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SUBMITIT_"))}
        env |= {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        cmd = [sys.executable, "-m", "ddp_core", DIGITS, "--run-dir", str(tmp_path / "run"), *BASE]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env | {"OMP_NUM_THREADS": "1"})
    assert proc.returncode == 1
    assert f"cannot listen on the rendezvous port {port}: in use (hint: another process" in proc.stderr


def test_a_rank_that_starts_before_rank_0_joins_its_store_once_it_listens():
    """Under srun every rank starts at once and rank 0 often opens its store last: the other ranks wait for the
    port to listen (``_await_listener``), then join rank 0's store and sign in; no listener by the deadline is the
    one-line rendezvous error's cause."""
    import socket
    import threading

    from ddp_core.cluster.env import DistEnv
    from ddp_core.config import DistConfig
    from ddp_core.distributed import groups

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    assert groups._await_listener("127.0.0.1", port, 0.3) is not None  # nothing listens: the error, in time

    hosted: dict[str, object] = {}

    def rank_0() -> None:
        time.sleep(0.5)  # rank 1 is already waiting
        env0 = DistEnv(rank=0, world_size=2, master_port=port)
        hosted["store"] = groups._rendezvous_store(env0, DistConfig(init_timeout_s=30), None)

    host = threading.Thread(target=rank_0)
    host.start()
    env1 = DistEnv(rank=1, world_size=2, master_port=port)
    store = groups._rendezvous_store(env1, DistConfig(init_timeout_s=30), None)
    host.join(30)
    assert "store" in hosted  # rank 0 saw rank 1 sign in
    assert store.get("ddpjob/0/0/arrived/1").decode() == socket.gethostname()


def test_a_second_trainer_in_the_same_run_directory_is_refused(tmp_path):
    """Rank 0 holds an advisory lock on the run directory for its attempt; a second trainer there (a rerun while
    the first still runs, ranks left alive by a killed torchrun) stops at once, naming the holder."""
    run = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SUBMITIT_"))} | {"OMP_NUM_THREADS": "1"}
    first = subprocess.Popen(
        [sys.executable, "-m", "ddp_core", DIGITS, "--run-dir", str(run), *BASE, "train.max_steps=400",
         "train.log_every=1", "task.target=tests.support.tasks:SlowDigitsTask", "task.data.pause_s=0.02"],
        env=env, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not (run / "metrics.jsonl").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        second = subprocess.run([sys.executable, "-m", "ddp_core", str(run)], capture_output=True, text=True,
                                timeout=120, env=env)  # fmt: skip
        assert second.returncode == 1
        assert re.search(rf"is in use by a trainer \(host \S+ pid {first.pid} job -\)", second.stderr), second.stderr
        assert first.poll() is None  # the first one trains on
    finally:
        first.kill()
        first.wait()


def test_a_failure_after_training_is_logged_and_exits_nonzero(tmp_path):
    """Recording the end of an attempt can fail too (here the event log became a directory): the trainer names
    the rank, host, step and error in one log line and exits 1; it does not die silently or report success."""
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "ddp_core", DIGITS, "--run-dir", str(run), *BASE, "train.max_steps=20",
           "task.target=tests.support.tasks:UnrecordableTask", f"task.data.events_file={run / 'attempts.jsonl'}",
           "task.data.break_at=20"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SUBMITIT_"))}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env | {"OMP_NUM_THREADS": "1"})
    assert proc.returncode == 1, proc.stderr
    assert re.search(r"rank 0/1 on \S+ failed after training, at step 20: IsADirectoryError", proc.stderr), proc.stderr
    assert (run / "checkpoints" / "step_00000020.json").exists()  # the work itself was saved


def test_the_trainer_imports_only_what_its_run_uses():
    """``import ddp_core.trainer.loop`` leaves out what a ddp run on a full checkpoint never touches (a second of
    imports on
    top of torch): the other strategies' torch modules, DCP, pipelining, dynamo, W&B, OmegaConf. They load when a
    run uses them: building the fsdp strategy brings FSDP in."""
    heavy = ["omegaconf", "wandb", "torch._dynamo", "torch.distributed.checkpoint", "torch.distributed.pipelining",
             "torch.distributed.fsdp", "ddp_core.checkpoint.sharded", "ddp_core.strategies.fsdp"]  # fmt: skip
    code = (
        "import sys, torch, ddp_core.trainer.loop\n"
        f"print([m for m in {heavy!r} if m in sys.modules])\n"
        "from ddp_core.config import StrategyConfig, StrategyName\n"
        "from ddp_core.cluster.env import DistEnv\n"
        "from ddp_core.strategies import build_strategy\n"
        "build_strategy(StrategyConfig(name=StrategyName.fsdp), DistEnv(), torch.device('cpu'))\n"
        "print('torch.distributed.fsdp' in sys.modules)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["[]", "True"], proc.stdout


def test_train_deterministic_reaches_torch_and_torch_is_called_only_on_a_change(monkeypatch):
    """Left at torch's default, torch.use_deterministic_algorithms is not called: it imports all of dynamo."""
    import torch

    from ddp_core.config import load_config
    from ddp_core.trainer.steps import apply_determinism

    real, calls = torch.use_deterministic_algorithms, []
    monkeypatch.setattr(torch, "use_deterministic_algorithms", lambda mode: (calls.append(mode), real(mode)))
    cpu, on, off = torch.device("cpu"), load_config(DIGITS, ["train.deterministic=true"]), load_config(DIGITS)
    try:
        apply_determinism(off, cpu)
        assert calls == [] and not torch.are_deterministic_algorithms_enabled()
        apply_determinism(on, cpu)
        apply_determinism(on, cpu)
        assert calls == [True] and torch.are_deterministic_algorithms_enabled()
        apply_determinism(off, cpu)
        assert calls == [True, False] and not torch.are_deterministic_algorithms_enabled()
    finally:
        real(False)
