"""GRES GPUs through the real slurmctld/slurmd of the local cluster (placeholder device files, so torch sees no
CUDA and trains on the CPU): GPUs requested, scheduled and made visible per rank, as on a GPU cluster."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.support.cli_runner import field, run_cli
from tests.support.helpers import ROOT, digests, rank_logs, wait_gone

DIGITS = str(ROOT / "configs" / "digits.yaml")
QUICK = ["train.max_steps=30", "checkpoint.every_steps=0", "train.eval_every=0", "train.log_every=10",
         "wandb.mode=disabled", "slurm.cpus_per_task=null"]  # fmt: skip
BINDING = re.compile(r"gpu binding: CUDA_VISIBLE_DEVICES=(\S+) local_rank (\d) -> cuda:(\d) \(GPU (\d)\)")
PLACEMENT = re.compile(r"slurm on (n\d): rank (\d)/(\d) local (\d)/(\d) node (\d)/(\d) .* threads (\d+)")


def bindings(run_dir: Path, job_id: str) -> dict[int, tuple]:
    """rank → (host, local rank, CUDA_VISIBLE_DEVICES, cuda index, physical GPU, threads), from each rank's log."""
    table = {}
    for rank, text in rank_logs(run_dir, job_id).items():
        place, bind = PLACEMENT.search(text), BINDING.search(text)
        assert place and bind, text[-3000:]
        table[rank] = (place[1], int(place[4]), bind[1], int(bind[3]), bind[4], int(place[8]))
    return table


@pytest.mark.slurm_interface
def test_gpus_per_node_job_runs_a_rank_per_gpu_on_two_nodes(slurm_cluster, tmp_path):
    """slurm.gpus_per_node=2 on 2 nodes: 4 ranks, 2 per node; every rank sees its node's 2 GPUs and takes
    cuda:LOCAL_RANK; CPUs per rank default to the node's CPUs per GPU (4 / 2)."""
    proc = run_cli("submit", DIGITS, "--wait", *QUICK, "slurm.gpus_per_node=2", "slurm.nodes=2", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run_dir, job_id = Path(field(proc.stdout, "run dir")), field(proc.stdout, "job")
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["slurm"]["cpus_per_task"] == 2
    assert bindings(run_dir, job_id) == {
        0: ("n1", 0, "0,1", 0, "0", 2),
        1: ("n1", 1, "0,1", 1, "1", 2),
        2: ("n2", 0, "0,1", 0, "0", 2),
        3: ("n2", 1, "0,1", 1, "1", 2),
    }
    script = next((run_dir / "slurm").glob("*_submission.sh")).read_text()
    assert "#SBATCH --gpus-per-node=2" in script and "--cpu-bind=cores" in script
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" in script
    assert len(set(digests(rank_logs(run_dir, job_id)).values())) == 1


def test_gpu_per_task_binding_through_the_sbatch_template(slurm_cluster, tmp_path):
    """slurm.gpu_bind=task through plain sbatch (scripts/submit.sh): each rank sees only its own GPU, as
    cuda:0, and the two ranks hold different GPUs."""
    proc = subprocess.run(
        [str(ROOT / "scripts" / "submit.sh"), DIGITS, *QUICK, "slurm.gpus_per_node=2", "slurm.gpu_bind=task"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run_dir, job_id = Path(field(proc.stdout, "run dir")), field(proc.stdout, "job")
    assert wait_gone(job_id) == "COMPLETED", (run_dir / "slurm" / f"{job_id}_batch.out").read_text()
    assert "#SBATCH --gpus-per-task=1" in (run_dir / "slurm" / "job.sbatch").read_text()
    table = bindings(run_dir, job_id)
    assert {rank: row[2:5] for rank, row in table.items()} == {0: ("0", 0, "0"), 1: ("1", 0, "1")}
    assert len({row[0] for row in table.values()}) == 1  # one node, two GPUs
