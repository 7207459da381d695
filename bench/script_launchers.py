"""Launch -> first script step, script mode's two launchers on this host, without Slurm: srun mode (one
``python -m ddp_core.script RUN`` per rank, each with the variables an srun task of a one-node step has, all started at
once, as Slurm would) against ``script.launcher=torchrun`` (one ``python -m ddp_core.script RUN``, the node's agent,
which starts the ranks). The script stamps the time after ``init_process_group`` and its first all-reduce; a launch
takes from starting its processes to the last rank's stamp. Runs alternate, so drift on a shared machine hits both.

    .venv/bin/python bench/script_launchers.py [--ranks 2] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

FIRST_STEP = """\
import time
import torch
import torch.distributed as dist
dist.init_process_group("gloo")
dist.all_reduce(torch.ones(1))
print(f"first step {time.time():.6f}", flush=True)
dist.destroy_process_group()
"""


def make_run(tmp: Path, script: Path, ranks: int, launcher: str) -> Path:
    from ddp_core.config import load_config
    from ddp_core.run.rundir import RunDir

    cfg = load_config(None, [f"script.path={script}", f"script.launcher={launcher}", f"slurm.tasks_per_node={ranks}",
                             "run.name=bench", f"run.root={tmp}", "wandb.mode=disabled"])  # fmt: skip
    rd = RunDir(Path(tempfile.mkdtemp(dir=tmp)))
    rd.initialize(cfg)
    return rd.path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def base_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SUBMITIT_", "TORCHELASTIC_"))}
    return env | {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def srun_task_env(rank: int, ranks: int, port: int) -> dict[str, str]:
    host = socket.gethostname()
    return base_env() | {"SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank), "SLURM_NTASKS": str(ranks),
                         "SLURM_TASKS_PER_NODE": str(ranks), "SLURM_NODEID": "0", "SLURM_STEP_ID": "0",
                         "SLURM_STEP_NODELIST": host, "SLURM_JOB_NODELIST": host, "MASTER_PORT": str(port)}  # fmt: skip


def launch(run: Path, ranks: int, launcher: str) -> float:
    """Seconds from starting the launcher processes to the last rank's first step."""
    cmd = [sys.executable, "-m", "ddp_core.script", str(run)]
    port = free_port()
    envs = [srun_task_env(r, ranks, port) for r in range(ranks)] if launcher == "srun" else [base_env()]
    started = time.time()
    procs = [subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for env in envs]  # fmt: skip
    outs = [p.communicate(timeout=300) for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit(f"{launcher} launch failed:\n" + "\n".join(out + err for out, err in outs))
    stamps = [float(s) for out, _ in outs for s in re.findall(r"^first step ([\d.]+)$", out, re.M)]
    assert len(stamps) == ranks, outs
    return max(stamps) - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        script = tmp / "first_step.py"
        script.write_text(FIRST_STEP)
        runs = {launcher: make_run(tmp, script, args.ranks, launcher) for launcher in ("srun", "torchrun")}
        times: dict[str, list[float]] = {"srun": [], "torchrun": []}
        launch(runs["srun"], args.ranks, "srun")  # warm the page cache: the first launch of all reads torch from disk
        for _ in range(args.repeats):
            for launcher in times:
                times[launcher].append(launch(runs[launcher], args.ranks, launcher))
    srun, torchrun = (statistics.median(times[k]) for k in ("srun", "torchrun"))
    print(f"launch -> first script step, {args.ranks} ranks on one host, median of {args.repeats}:")
    for launcher, values in times.items():
        print(f"  {launcher:9} {statistics.median(values):6.2f} s  ({' '.join(f'{v:.2f}' for v in values)})")
    print(f"  torchrun / srun: {torchrun / srun:.2f}x")


if __name__ == "__main__":
    main()
