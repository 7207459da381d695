"""Script mode's ranks started by hand on this host, as srun tasks of a one-node step: ``python -m ddp_core.script
RUN`` once per rank with the variables such a task has, and the run directories and environments they start from."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

from ddp_core.config import load_config
from ddp_core.run.rundir import RunDir
from tests.support.helpers import ROOT

HOST = socket.gethostname()


# What a launcher around the test run may have set; each rank here gets only what the test gives it.
_LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")


def make_run(
    tmp_path: Path,
    path: Optional[Path] = None,
    module: Optional[str] = None,
    args: Sequence[str] = (),
    name: str = "run",
    overrides: Sequence[str] = (),
) -> Path:
    """A run directory as `ddpjob prepare --script` leaves it: a config whose script section names what to run."""
    cfg = load_config(None, ["run.name=script", f"run.root={tmp_path}", "wandb.mode=disabled", *overrides])
    cfg.script.path, cfg.script.module, cfg.script.args = (str(path) if path else None), module, list(args)
    rd = RunDir(tmp_path / name)
    rd.initialize(cfg)
    return rd.path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env(**extra: str) -> dict[str, str]:
    prefixes = ("SLURM_", "SUBMITIT_", "TORCHELASTIC_", "DDPJOB_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(prefixes) and k not in _LAUNCHER_VARS}
    return env | {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)} | extra


def srun_task_env(rank: int, world: int, port: int, job_id: Optional[str]) -> dict[str, str]:
    """What an srun task of a one-node step has (the subset dist_env reads), this host being the node."""
    env = clean_env(
        SLURM_PROCID=str(rank),
        SLURM_LOCALID=str(rank),
        SLURM_NTASKS=str(world),
        SLURM_TASKS_PER_NODE=str(world),
        SLURM_NODEID="0",
        SLURM_STEP_ID="0",
        SLURM_STEP_NODELIST=HOST,
        SLURM_JOB_NODELIST=HOST,
        MASTER_PORT=str(port),
    )
    return env | ({"SLURM_JOB_ID": job_id} if job_id else {})


class Ranks:
    """``python -m ddp_core.script RUN`` (or ``command``) once per rank, each with its own log files."""

    def __init__(
        self,
        run: Path,
        world: int,
        logs: Path,
        job_id: Optional[str] = None,
        extra: Optional[dict[str, str]] = None,
        command: Optional[Sequence[str]] = None,
    ) -> None:
        self.port = port = free_port()
        logs.mkdir(parents=True, exist_ok=True)
        self.out = [logs / f"rank{r}.out" for r in range(world)]
        self.err = [logs / f"rank{r}.err" for r in range(world)]
        self.procs = []
        for r in range(world):
            with open(self.out[r], "w") as out, open(self.err[r], "w") as err:
                self.procs.append(subprocess.Popen(
                    list(command or [sys.executable, "-m", "ddp_core.script", str(run)]),
                    stdout=out, stderr=err, env=srun_task_env(r, world, port, job_id) | (extra or {}), cwd=ROOT,
                ))  # fmt: skip

    def wait(self, timeout: float = 120) -> list[int]:
        deadline = time.monotonic() + timeout
        try:
            return [p.wait(max(1.0, deadline - time.monotonic())) for p in self.procs]
        finally:
            for p in self.procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()

    def text(self, rank: int) -> str:
        return self.out[rank].read_text() + self.err[rank].read_text()

    def all_text(self) -> str:
        return "\n".join(f"--- rank {r}\n{self.text(r)}" for r in range(len(self.procs)))
