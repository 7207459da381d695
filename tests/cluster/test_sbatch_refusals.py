"""Requests that the local cluster's sbatch refuses: ``ddpjob submit`` names the key to change, and a resume
that sbatch rejects leaves the run's config as it was. (The CLI without a cluster: tests/unit/jobs/test_cli.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from jobs import cli
from tests.support.cli_runner import run_cli
from tests.support.digits import DIGITS

# Refused before sbatch, or by it: no job runs (tests/support/cluster_guard.py).
pytestmark = pytest.mark.cluster_shared("a")


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["slurm.tasks_per_node=9"], "config key 'slurm.tasks_per_node' = 9 ranks"),
        (["slurm.cpus_per_task=3"], "needs 6 CPUs per node"),
        (["slurm.nodes=3"], "config key 'slurm.nodes' = 3 exceeds partition"),
        (["slurm.gpus_per_node=3"], "config key 'slurm.gpus_per_node' = 3 exceeds partition 'local' (2 GPUs per node)"),
        (["slurm.partition=nosuch"], "config key 'slurm.partition' = 'nosuch': no such partition"),
    ],
)
def test_impossible_request_is_refused(slurm_cluster, tmp_path, monkeypatch, capsys, args, needle):
    # In this process, against the real cluster's partitions: a torch import per case, saved.
    monkeypatch.chdir(tmp_path)
    assert cli.main(["submit", DIGITS, *args]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], err
    assert not (tmp_path / "runs").exists()


def test_a_resume_that_sbatch_rejects_leaves_the_run_config_as_it_was(slurm_cluster, tmp_path):
    prepared = run_cli("prepare", DIGITS, cwd=tmp_path)
    assert prepared.returncode == 0, prepared.stderr
    run_dir = Path(prepared.stdout.strip())
    before = (run_dir / "config.yaml").read_text()
    proc = run_cli("resume", str(run_dir), "train.max_steps=77", "slurm.additional={no-such-option: 1}", cwd=tmp_path)
    assert proc.returncode == 2 and "submission failed" in proc.stderr, proc.stderr
    assert (run_dir / "config.yaml").read_text() == before and run_dir.is_dir()
