"""``ddpjob sync``'s upload of a run's offline W&B records through the real ``wandb sync``, with the wandb this venv
has (what a fresh install gets, or the constraints file's) and with the oldest release pyproject.toml admits. There
is no W&B server here, so each runs up to the point where it needs the network: its arguments are accepted, and what
fails is the connection to a closed loopback port (``WANDB_BASE_URL``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

import pytest

from ddp_core.cluster.rendezvous import free_port
from jobs.runs.sync import wandb_sync_command
from tests.support.dependency_venvs import floor, python_with
from tests.support.digits import trainer

REFUSED_ARGUMENTS = ("No such option", "have been removed", "Usage:")
CONNECTION_FAILED = ("connection refused", "ConnectionError", "Network error")


@pytest.fixture(scope="module")
def offline_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    home = tmp_path_factory.mktemp("home")
    run = home / "run"
    overrides = ["train.eval_every=0", "optim.warmup_steps=5", "train.max_steps=10", "train.log_every=10",
                 "checkpoint.every_steps=10", "wandb.mode=offline"]  # fmt: skip
    trainer(run, *overrides, env={"WANDB_API_KEY": "", "HOME": str(home)})
    run_id = json.loads((run / "run.json").read_text())["run_id"]
    assert list((run / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))
    return run


def until_connection_fails(argv: Sequence[str], home: Path, timeout_s: float = 90.0) -> str:
    """Run ``argv`` against a W&B server that is not there; return its output once it says the connection failed
    (old releases then retry for minutes: the process is stopped there), or once it exits."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env |= {"HOME": str(home), "WANDB_API_KEY": "x" * 40, "WANDB_BASE_URL": f"http://127.0.0.1:{free_port()}",
            "WANDB_X_GRAPHQL_RETRY_MAX": "1", "WANDB_X_GRAPHQL_RETRY_WAIT_MAX_SECONDS": "1"}  # fmt: skip
    proc = subprocess.Popen(argv, cwd=home, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + timeout_s
    try:
        for line in proc.stdout:
            lines.append(line)
            if any(word in line for word in CONNECTION_FAILED) or time.monotonic() > deadline:
                break
    finally:
        proc.kill()
        proc.wait()
    return "".join(lines)


def test_ddpjob_sync_runs_the_installed_wandb_up_to_the_network(offline_run: Path) -> None:
    out = until_connection_fails([sys.executable, "-m", "jobs", "sync", str(offline_run)], offline_run.parent)
    assert not any(word in out for word in REFUSED_ARGUMENTS), out
    assert any(word in out for word in CONNECTION_FAILED), out
    assert "wandb sync" in out.splitlines()[0] and "offline-run-" in out.splitlines()[0], out


def test_the_sync_command_is_accepted_by_the_oldest_supported_wandb(offline_run: Path) -> None:
    python = python_with("wandb", floor("wandb"))
    records = sorted(str(p) for p in (offline_run / "wandb").glob("offline-run-*"))
    out = until_connection_fails(wandb_sync_command(records, python=python), offline_run.parent)
    assert not any(word in out for word in REFUSED_ARGUMENTS), out
    assert any(word in out for word in CONNECTION_FAILED), out
