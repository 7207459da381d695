"""A run is never started twice (``jobs.submission.active``): ``resume`` and ``prepare --job-id`` refuse a run whose
job is queued or running, however it was started (recorded at submit, or a plain template's job that only logged its
start), and fail closed when squeue cannot answer. Slurm's answers come from a fabricated gateway (the cluster tests
resume real runs); the run directories and the CLI are real."""

from __future__ import annotations

import subprocess

import pytest

from ddp_core.cluster.slurm import SlurmGateway
from ddp_core.errors import DdpJobError
from ddp_core.run.rundir import RunDir
from jobs.submission import active
from tests.support.cli_runner import run_cli
from tests.support.helpers import ROOT

DIGITS = str(ROOT / "configs" / "digits.yaml")


def squeue(rc: int, out: str = "", err: str = "") -> SlurmGateway:
    return SlurmGateway(lambda cmd: subprocess.CompletedProcess(cmd, rc, out, err))


def a_run(tmp_path) -> RunDir:
    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    run.record_job("5301", "submitit")
    run.record_job("local-1", "local")
    run.log_event("start", job_id="5302", restart_count=0, step=0)  # the plain template's job: no record at submit
    return run


def test_every_slurm_job_of_a_run_counts_however_it_was_started(tmp_path):
    run = a_run(tmp_path)
    assert active.slurm_jobs(run) == ["5301", "5302"]
    with pytest.raises(DdpJobError, match="is still queued or running as job 5302"):
        active.refuse_if_active(run, squeue(0, "5302 5302\n"))
    active.refuse_if_active(run, squeue(0, ""))  # ended: nothing listed
    active.refuse_if_active(run, squeue(1, err="slurm_load_jobs error: Invalid job id specified\n"))  # purged


def test_a_squeue_that_cannot_answer_stops_the_command(tmp_path):
    run = a_run(tmp_path)
    with pytest.raises(DdpJobError) as err:
        active.refuse_if_active(run, squeue(1, err="slurm_load_jobs error: Unable to contact slurm controller\n"))
    assert "squeue cannot say whether job 5301, 5302 is still queued or running" in err.value.message
    assert "Unable to contact slurm controller" in err.value.message


def test_prepare_job_id_adopts_its_own_directory_and_refuses_anothers(tmp_path):
    first = run_cli("prepare", DIGITS, "run.name=t", "--job-id", "77", "--no-cluster-check", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    path = first.stdout.strip().splitlines()[-1]
    assert active.slurm_jobs(RunDir(tmp_path / path)) == ["77"]
    again = run_cli("prepare", DIGITS, "run.name=t", "--job-id", "77", "--no-cluster-check", cwd=tmp_path)
    assert again.returncode == 0 and again.stdout.strip().splitlines()[-1] == path  # a requeue of job 77
    other = tmp_path / "runs" / "u-78"
    other.mkdir(parents=True)  # a folder of that name, not job 78's (a reused id, made by hand)
    refused = run_cli("prepare", DIGITS, "run.name=u", "--job-id", "78", "--no-cluster-check", cwd=tmp_path)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert f"run directory {other.resolve()} exists and is not job 78's (its jobs: none recorded)" in refused.stderr
