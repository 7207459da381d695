"""Which run directory a trainer started from a YAML config (no --run-dir) lands in, outside Slurm: only a named
identity (torchrun's --rdzv-id) brings a rerun of the same command back to its run; torchrun's unnamed c10d runs
are refused rather than pooled; plain processes are new runs each time, and --run-dir resumes."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Sequence

from tests.support.helpers import ROOT, events, final_digests

DIGITS = str(ROOT / "configs" / "digits.yaml")
QUICK = ["train.eval_every=0", "optim.warmup_steps=5", "train.log_every=10", "checkpoint.every_steps=1000",
         "wandb.mode=disabled", "train.max_steps=20", "train.stop_check_ms=0"]  # fmt: skip
# Rank RANK sends itself the stop signal at its BATCH-th batch (tests/support/tasks.py): the run checkpoints and stops
# (the ranks exchange their flags after every step, train.stop_check_ms=0, so it stops well within the 20 steps).
SIGNALLED = "task.target=tests.support.tasks:SignalledDigitsTask"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SUBMITIT_", "TORCHELASTIC_"))}
    return env | {"OMP_NUM_THREADS": "1"} | extra


def torchrun(root: Path, rdzv_id: str | None, *overrides: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    """The same c10d command a user would type again, on a fresh endpoint port each time (the port a rerun gets
    is not the first run's: only the id may carry the run's identity). Returns (exit code, log)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--rdzv-backend", "c10d", "--rdzv-endpoint",
           f"127.0.0.1:{free_port()}", "--nnodes", "1", "--nproc-per-node", "2",
           *(["--rdzv-id", rdzv_id] if rdzv_id else []),
           "-m", "ddp_core", DIGITS, f"run.root={root}", *QUICK, *overrides]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=clean_env(**(env or {})))
    return proc.returncode, proc.stdout + proc.stderr


def run_dirs(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if p.is_dir()) if root.exists() else []


def test_c10d_without_rdzv_id_is_refused_not_pooled(tmp_path):
    # torchrun names every such launch "none": one shared directory would pool unrelated runs' checkpoints.
    code, log = torchrun(tmp_path / "runs", None)
    assert code == 1, log  # torchrun's code for a failed worker
    refused = "ERROR ddp_core: torchrun was started with --rdzv-backend c10d but without --rdzv-id"
    # Each rank refuses by itself (nothing rank-dependent decides it). torchrun stops the other rank as soon as one
    # exits, often before it has logged anything (under load it is still importing torch): one refusal or two.
    assert any(f"[rank {rank}/2] {refused}" in log for rank in (0, 1)), log
    assert f"add --rdzv-id NAME (the run directory is then {tmp_path / 'runs' / 'digits'}-NAME" in log
    assert run_dirs(tmp_path / "runs") == []


def test_a_rerun_with_the_same_rdzv_id_resumes_its_run_directory(tmp_path):
    root = tmp_path / "runs"
    code, log = torchrun(root, "exp1", SIGNALLED, env={"DDPJOB_TEST_SIGNAL_AT": "1:8"})
    assert code == 1, log  # a stopped attempt (4) is a failed worker to torchrun
    run = root / "digits-exp1"
    assert run_dirs(root) == [run]
    stopped = [e["step"] for e in events(run, "interrupted")]
    assert len(stopped) == 1 and 0 < stopped[0] < 20, stopped

    code, log = torchrun(root, "exp1", SIGNALLED)  # the same command, typed again
    assert code == 0, log
    assert run_dirs(root) == [run]
    assert f"resumed from step_{stopped[0]:08d}.pt (step {stopped[0]}," in log and "finished at step 20" in log
    assert [e["step"] for e in events(run, "start")] == [0, stopped[0]]
    resumed = final_digests(log)

    code, log = torchrun(root, "exp2", SIGNALLED)  # another id is another run, from step 0: here uninterrupted
    assert code == 0, log
    assert run_dirs(root) == [run, root / "digits-exp2"]
    assert "resumed from" not in log and [e["step"] for e in events(root / "digits-exp2", "start")] == [0]
    assert resumed == final_digests(log) and len(set(resumed)) == 1  # the resumed run is the uninterrupted one


def test_plain_processes_without_run_dir_are_new_runs(tmp_path):
    root = tmp_path / "runs"
    cmd = [sys.executable, "-m", "ddp_core", DIGITS, f"run.root={root}", *QUICK, "train.max_steps=10"]
    # Started together, so that most often both land in the same second: the pid still tells them apart.
    procs = [subprocess.Popen(cmd, env=clean_env(), stderr=subprocess.PIPE, text=True) for _ in range(2)]
    logs = [p.communicate(timeout=300)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], logs
    dirs = run_dirs(root)
    assert len(dirs) == 2 and all(d.name.startswith("digits-") for d in dirs), dirs
    run_ids = {json.loads((d / "run.json").read_text())["run_id"] for d in dirs}
    assert len(run_ids) == 2  # two W&B runs too
    assert all([e["step"] for e in events(d, "start")] == [0] for d in dirs)


def run_alone(overrides: Sequence[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "ddp_core", DIGITS, *overrides]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=clean_env(**env))


def test_a_rerun_with_the_same_run_dir_resumes(tmp_path):
    command = ["--run-dir", str(tmp_path / "run"), *QUICK, SIGNALLED]
    first = run_alone(command, {"DDPJOB_TEST_SIGNAL_AT": "0:8"})
    assert first.returncode == 4, first.stderr  # stopped outside Slurm
    stopped = [e["step"] for e in events(tmp_path / "run", "interrupted")]
    assert len(stopped) == 1 and 0 < stopped[0] < 20, stopped
    second = run_alone(command, {})
    assert second.returncode == 0, second.stderr
    assert f"resumed from step_{stopped[0]:08d}.pt" in second.stderr and "finished at step 20" in second.stderr
    assert [e["step"] for e in events(tmp_path / "run", "start")] == [0, stopped[0]]
    assert run_dirs(tmp_path) == [tmp_path / "run"]
