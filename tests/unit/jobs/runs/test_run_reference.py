"""One run reference (``jobs.runs.lookup.resolve``): every command that takes a run accepts its directory, a Slurm job
id of one of its attempts (an array task's too) or its name, and an unknown or ambiguous one is one line.
``status``, ``logs``, ``report`` and ``sync`` used to refuse the job id ``ddpjob submit`` had printed, each in its
own words (``resume`` and ``export`` took one already)."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest

from ddp_core.config import load_config
from ddp_core.errors import DdpJobError
from ddp_core.run.rundir import RunDir
from jobs.runs.lookup import resolve
from tests.support import users
from tests.support.cli_runner import run_cli
from tests.support.helpers import ROOT

DIGITS = ROOT / "configs" / "digits.yaml"


def _run(path: Path, job_id: str) -> Path:
    cfg = load_config(DIGITS, ["run.name=x", "wandb.mode=disabled"])
    run = RunDir(path)
    run.initialize(cfg)
    run.record_job(job_id, "submitit")
    return path


@pytest.fixture
def runs(tmp_path: Path) -> Path:
    root = tmp_path / "runs"
    _run(root / "digits-20261127-232414-3fe5", "101")
    _run(root / "digits-20261127-232429-6c29", "102")
    _run(root / "charlm-20261127-232500-a1b2", "103")
    _run(root / "lr-sweep" / "t0001", "200_1")
    _run(root / "lr-sweep" / "t0002", "200_2")
    return root


def test_a_directory_a_job_id_an_array_task_or_a_name(runs):
    first = runs / "digits-20261127-232414-3fe5"
    assert resolve(str(first), runs) == first.resolve()
    assert resolve("102", runs) == (runs / "digits-20261127-232429-6c29").resolve()
    assert resolve("200_2", runs) == (runs / "lr-sweep" / "t0002").resolve()
    assert resolve("charlm", runs) == (runs / "charlm-20261127-232500-a1b2").resolve()
    assert resolve("digits-20261127-232414-3fe5", runs) == first.resolve()  # the directory's own name
    assert resolve("lr-sweep", runs, sweeps=True) == (runs / "lr-sweep").resolve()
    assert resolve(str(runs / "lr-sweep"), runs, sweeps=True) == (runs / "lr-sweep").resolve()


@pytest.mark.parametrize(
    ("ref", "sweeps", "message"),
    [
        ("digits", False, "'digits' names 2 runs under '{root}': {root}/digits-20261127-232414-3fe5, {root}/digits-"),
        ("999", False, "no run under '{root}' has job '999'"),
        ("nothing", False, "no run under '{root}' is named 'nothing'"),
        ("lr-sweep", False, "no run under '{root}' is named 'lr-sweep'"),  # a sweep, where one run is wanted
        ("{root}/lr-sweep", False, "'{root}/lr-sweep' is not a run directory (no config.yaml in it)"),
        ("a/b", True, "'a/b' is not a run directory or a sweep folder, a job id or a run name"),
    ],
)
def test_unknown_or_ambiguous_is_one_line(runs, ref, sweeps, message):
    with pytest.raises(DdpJobError) as err:
        resolve(ref.format(root=runs), runs, sweeps=sweeps)
    assert str(err.value).startswith(message.format(root=runs)) and "\n" not in str(err.value), err.value
    assert err.value.hint


@pytest.mark.parametrize(
    ("command", "reached"),
    [
        ("status", "digits-20261127-232414-3fe5"),  # its row
        ("logs", "no rank 0 err log for run digits-20261127-232414-3fe5"),
        ("report", "png:"),
        ("sync", "no offline W&B records in"),
    ],
)
def test_every_command_takes_the_job_id_submit_printed(runs, command, reached):
    """By the job id each command gets to the run, and shows it or says what the run lacks."""
    proc = run_cli(command, "101", cwd=runs.parent)
    assert reached in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    wrong = run_cli(command, "999", cwd=runs.parent)
    assert wrong.returncode == 2 and "ddpjob: error: no run under 'runs' has job '999'" in wrong.stderr, wrong.stderr


@pytest.mark.parametrize("command", ["status", "logs"])
def test_another_users_run_is_one_line_naming_its_owner(tmp_path, command):
    """Root's run given to alice's ddpjob, in a folder she may list (mode 0700: its owner in one line) and in one she
    may not enter (pytest's, mode 0700): not the ``PermissionError`` of the first file opened in it (a real second
    user: ``tests/support/users.py``)."""
    alice = users.ensure("alice")
    hint = "(hint: pass a run of your own, or ask its owner to share it (a group of yours and chmod -R g+rX))"
    shared = Path(tempfile.mkdtemp(dir="/var/tmp"))
    try:
        shared.chmod(0o755)
        closed = _run(tmp_path / "closed", "123")
        for run in (_run(shared / "run", "124"), closed):
            run.chmod(0o700)
            proc = users.run(alice, [users.SYSTEM_PYTHON, "-m", "jobs", command, str(run)])
            why = "reached by ddpjob-alice: a folder above it is closed to you" if run == closed else \
                "read by ddpjob-alice: it belongs to root (mode 0700)"  # fmt: skip
            assert proc.returncode == 2, proc.stdout + proc.stderr
            assert proc.stderr.splitlines() == [f"ddpjob: error: '{run}' cannot be {why} {hint}"], proc.stderr
    finally:
        shutil.rmtree(shared)
