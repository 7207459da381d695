"""Checkpoints in object storage on the real cluster: a 2-rank job saves to an S3 server on loopback (moto's server
mode, ``tests/support/s3.py``) in the background, is preempted at a chosen step (the warning signal, sent by rank 0
to itself: ``tests.support.tasks.SignalsItself``), requeued, resumes from S3 and ends with bitwise the weights of an
uninterrupted run. The run directory stays on the shared filesystem; the credentials, which reach the job through
the environment, appear nowhere in it (config.yaml, the sbatch script, the logs); ``status`` shows the checkpoints'
URL and ``export`` reads them from there."""

from __future__ import annotations

from pathlib import Path

import pytest
import s3fs
import torch

from tests.support import s3 as s3_support
from tests.support.cli_runner import field, run_cli
from tests.support.helpers import (
    ROOT,
    digests,
    events,
    rank_logs,
    two_rank_reference,
    wait_gone,
)

pytestmark = [pytest.mark.cluster_shared("b")]  # one 2-CPU job
s3_server, s3 = s3_support.s3_server, s3_support.s3  # the fixtures
DIGITS = str(ROOT / "configs" / "digits.yaml")
CONFIG = [
    "task.target=tests.support.tasks:SignalledDigitsTask", "train.max_steps=24", "train.log_every=4",
    "train.eval_every=0", "checkpoint.every_steps=8", "data.batch_size=16", "task.model.dropout=0.2",
    "wandb.mode=disabled",
    "train.stop_check_ms=0",  # the ranks agree on the flag after every step: the stop is STOP_AT or the next
]  # fmt: skip
STOP_AT = 10  # rank 0 signals itself at its 10th batch of the first attempt


@pytest.fixture(scope="module")
def reference(tmp_path_factory, pytestconfig) -> str:
    """The uninterrupted run, 2 ranks under torchrun, checkpoints in its run directory."""
    return two_rank_reference(pytestconfig, tmp_path_factory, "object-storage", DIGITS, CONFIG)


def test_a_job_checkpointing_to_s3_is_preempted_and_resumes_from_there_exactly(slurm_cluster, s3, reference, tmp_path):
    base = s3.url("ckpt")
    proc = run_cli(
        "submit", DIGITS, *CONFIG, f"checkpoint.dir={base}", "checkpoint.async_save=true", "slurm.partition=local",
        cwd=tmp_path, env={"DDPJOB_TEST_SIGNAL_AT": f"0:{STOP_AT}@0"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    job_id, run_dir = field(proc.stdout, "job"), Path(field(proc.stdout, "run dir"))
    assert wait_gone(job_id, 300) == "COMPLETED", [p.read_text()[-3000:] for p in (run_dir / "slurm").glob("*")]

    # Stopped once by the signal, requeued, resumed at the step it saved (to S3) when stopped.
    (stop,) = [e["step"] for e in events(run_dir, "interrupted")]
    assert STOP_AT - 1 <= stop <= STOP_AT + 1
    assert [e["step"] for e in events(run_dir, "start")] == [0, stop]
    assert not events(run_dir, "failure")
    assert set(digests(rank_logs(run_dir, job_id)).values()) == {reference}
    logs = "\n".join(rank_logs(run_dir, job_id).values())
    assert f"resumed from step_{stop:08d}.pt" in logs

    # The checkpoints are in the bucket, under the run's own folder; none in the run directory.
    url = f"{base}/{run_dir.name}"
    fs = s3fs.S3FileSystem()
    names = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(url.removeprefix("s3://"), refresh=True))
    assert names[-2:] == ["step_00000024.json", "step_00000024.pt"] and f"step_{stop:08d}.pt" in names, names
    assert not list((run_dir / "checkpoints").iterdir())

    # The credentials reached the job through its environment, and were written nowhere.
    for path in run_dir.rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            assert s3_support.SECRET_KEY.encode() not in data and s3_support.ACCESS_KEY.encode() not in data, path

    # status shows where the checkpoints are; export reads them from there.
    status = run_cli("status", str(run_dir), cwd=tmp_path)
    assert status.returncode == 0 and url in status.stdout, status.stdout + status.stderr
    out = tmp_path / "model.pt"
    export = run_cli("export", str(run_dir), str(out), cwd=tmp_path)
    assert export.returncode == 0 and f"{url}/step_00000024.pt" in export.stdout, export.stdout + export.stderr
    assert torch.load(out, weights_only=True)  # a state dict of the model's weights
    # The report reads the run directory (metrics, events), never the checkpoints: it works the same.
    report = run_cli("report", str(run_dir), cwd=tmp_path)
    assert report.returncode == 0, report.stdout + report.stderr
    assert Path(field(report.stdout, "html")).stat().st_size > 0 and Path(field(report.stdout, "png")).exists()
