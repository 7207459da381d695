"""A job whose ranks run inside an apptainer image (docs/containers.md): 2 ranks on 2 nodes, stopped by the warning
signal at a chosen step, requeued and resumed, with bitwise the weights of an uninterrupted run outside any image.

The image (``scripts/container-image``: Debian 12, torch and ddpjob's dependencies, no Slurm commands) has no
scontrol, so rank 0 cannot requeue the job itself: it records ``requeue_deferred`` and exits ``REQUEUE_DEFERRED``, and
the batch script's watcher, outside the image, requeues it (``requeued_by_batch``); in an adaptive search the worker,
outside the image too, makes its trial's requeue. Slurm 26.05 only: its root filesystem is the one with apptainer
(``scripts/slurm-rootfs``).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import optuna
import pytest

from ddp_core.search.study import open_study
from tests.support.cli_runner import field, run_cli
from tests.support.helpers import (
    ROOT,
    cached_reference,
    digests,
    events,
    final_digests,
    rank_logs,
    run_trainer,
    wait_for,
    wait_gone,
)

pytestmark = [pytest.mark.cluster_release("26.05"), pytest.mark.cluster_shared("b")]
DIGITS = str(ROOT / "configs" / "digits.yaml")
CONFIG = [
    "task.target=tests.support.tasks:ContainedDigitsTask", "train.max_steps=24", "train.log_every=4",
    "train.eval_every=0", "checkpoint.every_steps=8", "data.batch_size=16", "task.model.dropout=0.2",
    "wandb.mode=disabled",
    "train.stop_check_ms=0",  # the ranks agree on the flag after every step: the stop is STOP_AT or the next
]  # fmt: skip
STOP_AT = 10  # rank 0 signals itself at its 10th batch of the first attempt (tests.support.tasks.SignalsItself)


@pytest.fixture(scope="module")
def image() -> str:
    """The test image, built (about 6 minutes) and cached on first use."""
    proc = subprocess.run([str(ROOT / "scripts" / "container-image"), "path"], capture_output=True, text=True,
                          timeout=1800)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, pytestconfig) -> str:
    """The uninterrupted run, 2 ranks under torchrun on this machine, outside any image."""

    def run() -> str:
        where = tmp_path_factory.mktemp("where")
        overrides = [*CONFIG, f"task.data.where_dir={where}"]
        d = final_digests(run_trainer(DIGITS, tmp_path_factory.mktemp("ref") / "run", overrides, nproc=2))
        assert len(d) == 2 and len(set(d)) == 1
        return d[0]

    return cached_reference(pytestconfig, "container", [DIGITS, *CONFIG, "nproc=2"], run)


def test_a_job_inside_the_image_is_requeued_by_its_batch_script_and_resumes_exactly(
    slurm_cluster, image, reference, tmp_path
):
    where = tmp_path / "where"
    where.mkdir()
    proc = run_cli(
        "submit", DIGITS, *CONFIG, f"task.data.where_dir={where}", "slurm.partition=local", "slurm.nodes=2",
        "slurm.tasks_per_node=1", f"slurm.container.image={image}", cwd=tmp_path,
        env={"DDPJOB_TEST_SIGNAL_AT": f"0:{STOP_AT}@0"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    job_id, run_dir = field(proc.stdout, "job"), Path(field(proc.stdout, "run dir"))
    assert wait_gone(job_id, 300) == "COMPLETED", [p.read_text()[-3000:] for p in (run_dir / "slurm").glob("*")]

    # Every rank of both attempts ran inside the image, where there is no scontrol.
    seen = {p.name: json.loads(p.read_text()) for p in where.iterdir()}
    assert sorted(seen) == ["rank0-attempt0.json", "rank0-attempt1.json", "rank1-attempt0.json", "rank1-attempt1.json"]
    name = Path(image).stem
    assert all(w == {"container": image, "image": name, "scontrol": None} for w in seen.values()), seen

    # Stopped once, the requeue decided by rank 0 and made by the batch script, resumed at the step it stopped after.
    # As outside an image: a warning signal well before the time limit (told from SLURM_JOB_END_TIME) is a preemption.
    (stop,) = [e["step"] for e in events(run_dir, "interrupted") if e["kind"] == "preemption"]
    assert STOP_AT - 1 <= stop <= STOP_AT + 1
    assert [e["step"] for e in events(run_dir, "start")] == [0, stop]
    assert [(e["kind"], e["step"]) for e in events(run_dir, "requeued")] == [("preemption", stop)]
    (deferred,) = events(run_dir, "requeue_deferred")
    assert deferred["step"] == stop and "scontrol" in deferred["error"], deferred
    assert [e["step"] for e in events(run_dir, "requeued_by_batch")] == [stop]
    assert not events(run_dir, "requeue_failed") and not events(run_dir, "failure")
    assert set(digests(rank_logs(run_dir, job_id)).values()) == {reference}
    status = run_cli("status", str(run_dir), cwd=tmp_path)
    assert status.returncode == 0 and "COMPLETED" in status.stdout, status.stdout + status.stderr


def test_a_search_trial_inside_the_image_is_requeued_by_its_worker_and_resumes_exactly(slurm_cluster, image, tmp_path):
    where = tmp_path / "where"
    where.mkdir()
    proc = run_cli(
        "sweep", DIGITS, "--search", "random", "--name", "inside", "--trials", "1", "--parallel", "1",
        "optim.lr=choice(0.002,0.003)", *CONFIG, f"task.data.where_dir={where}", "slurm.partition=local",
        "slurm.tasks_per_node=1", f"slurm.container.image={image}", cwd=tmp_path,
        env={"DDPJOB_TEST_SIGNAL_AT": f"0:{STOP_AT}@0"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    sweep, array = Path(field(proc.stdout, "dir")), field(proc.stdout, "arrays")
    trial = sweep / "t0000"

    def complete() -> bool:
        return all(t.state.is_finished() for t in open_study(sweep)[1].get_trials()) and trial.exists()

    wait_for(complete, 300, "the search's one trial", poll=1)
    (only,) = open_study(sweep)[1].get_trials()
    logs = [p.read_text()[-3000:] for p in (sweep / "slurm").glob("*.err")]
    assert only.state == optuna.trial.TrialState.COMPLETE, (only.user_attrs, logs)
    assert only.user_attrs["worker"] == "1:0" and only.user_attrs["run_dir"] == str(trial)  # its requeued worker

    # The trial's step ran inside the image both times; its rank 0 decided the requeue there, the worker made it.
    seen = {p.name: json.loads(p.read_text()) for p in where.iterdir()}
    assert sorted(seen) == ["rank0-attempt0.json", "rank0-attempt1.json"], seen
    assert all(w["container"] == image and w["scontrol"] is None for w in seen.values()), seen
    (stop,) = [e["step"] for e in events(trial, "interrupted")]
    assert [e["step"] for e in events(trial, "requeue_deferred")] == [stop]
    assert [e["step"] for e in events(trial, "requeued_by_batch")] == [stop]
    assert [e["step"] for e in events(trial, "start")] == [0, stop]
    assert not events(trial, "requeue_failed") and not events(trial, "failure")
    job = events(trial, "start")[0]["job_id"]
    overrides = ["trial.storage=null", "trial.number=-1", f"task.data.where_dir={tmp_path}"]
    reference = final_digests(run_trainer(str(trial / "config.yaml"), tmp_path / "reference", overrides))
    assert digests(rank_logs(trial, job)) == {0: reference[-1]}
    assert wait_gone(array, 120) == "COMPLETED"
