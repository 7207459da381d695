"""The login-node CLI: fast help, one-line errors before anything is created, dry runs that submit nothing. (What
the cluster's sbatch refuses: tests/cluster/test_sbatch_refusals.py.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from jobs import cli
from tests.support.cli_runner import run_cli
from tests.support.helpers import ROOT

DIGITS = str(ROOT / "configs" / "digits.yaml")


def test_help_does_not_import_torch():
    code = (
        "import sys; from jobs.cli import main\n"
        "try:\n main(['--help'])\nexcept SystemExit: pass\n"
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().endswith("False")


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["optim.lrr=1"], "unknown config key 'optim.lrr'"),
        (["optim.lr=abc"], "config key 'optim.lr'"),
        (["optim.lr"], "override 'optim.lr' is not of the form key=value"),
        (["task.model.widht=3"], "unknown config key 'task.model.widht'"),
        (["task.target=nosuch.module:Task"], "cannot import module 'nosuch.module'"),
    ],
)
def test_bad_input_fails_before_anything_exists(tmp_path, monkeypatch, capsys, args, needle):
    # In this process (`python -m jobs` is every other CLI test's): a torch import per case, saved.
    monkeypatch.chdir(tmp_path)
    assert cli.main(["submit", DIGITS, *args]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and "hint:" in lines[0], err
    assert not (tmp_path / "runs").exists()


def test_missing_required_value(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("train:\n  max_steps: 5\n")  # no run.name
    proc = run_cli("submit", str(cfg), cwd=tmp_path)
    assert proc.returncode == 2 and "config key 'run.name' is required" in proc.stderr, proc.stderr
    assert not (tmp_path / "runs").exists()


def test_missing_config_file(tmp_path):
    proc = run_cli("submit", str(tmp_path / "nope.yaml"), cwd=tmp_path)
    assert proc.returncode == 2 and "not found" in proc.stderr


def test_dry_run_prints_script_and_config_and_submits_nothing(tmp_path):
    # As its own process (`python -m jobs`): the other submits run ddpjob's main in the test's
    # (tests/support/cli_runner.py).
    proc = run_cli("submit", DIGITS, "--dry-run", "optim.lr=0.01", cwd=tmp_path, process=True)
    assert proc.returncode == 0, proc.stderr
    assert "#SBATCH --ntasks-per-node=2" in proc.stdout
    assert "srun --unbuffered" in proc.stdout and "--kill-on-bad-exit=1" in proc.stdout
    assert "lr: 0.01" in proc.stdout
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    ("yaml_text", "needle"),
    [
        ('slurm: {job_name: "x\\ntouch /tmp/p #"}', "config key 'slurm.job_name' = 'x\\ntouch /tmp/p #' is invalid"),
        ('slurm: {account: "proj\\n#SBATCH --partition=evil"}', "config key 'slurm.account'"),
        ('run: {name: "r\\ntouch /tmp/p"}', "config key 'run.name'"),
        ('slurm: {additional: {"x --partition=evil --comment": 1}}', "config key 'slurm.additional' = 'x --partition"),
        ('slurm: {additional: {comment: "x --partition=evil"}}', "config key 'slurm.additional.comment'"),
        ('slurm: {setup: ["module load a\\ntouch /tmp/p"]}', "config key 'slurm.setup[0]'"),
    ],
    ids=["job_name", "account", "run_name", "option_name", "option_value", "setup"],
)
def test_strings_that_reach_a_batch_script_cannot_inject_lines(tmp_path, yaml_text, needle):
    """A newline in an #SBATCH value starts a shell line and ends the directives sbatch reads (losing --requeue,
    --signal, --time); whitespace starts another option. Refused before anything is rendered or created."""
    config = tmp_path / "bad.yaml"
    config.write_text(f"run: {{name: ok}}\n{yaml_text}\n" if not yaml_text.startswith("run:") else yaml_text + "\n")
    for command in (["submit", str(config), "--dry-run"], ["prepare", str(config), "--sbatch-script"]):
        proc = run_cli(*command, "--no-cluster-check" if command[0] == "prepare" else "--local", cwd=tmp_path)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and needle in lines[0], proc.stderr
        assert not (tmp_path / "runs").exists() and not Path("/tmp/p").exists()


def test_prepare_job_id_cannot_leave_the_run_root(tmp_path):
    proc = run_cli("prepare", DIGITS, "--job-id", "../../../victim", "--no-cluster-check", cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "ddpjob: error: --job-id '../../../victim' is not a Slurm job id (hint: pass $SLURM_JOB_ID (digits))"
    )
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["submit", "--bogus"], "unrecognized arguments: --bogus (see: ddpjob submit --help)"),
        (["bogus"], "invalid choice: 'bogus'"),
        (["status", "--metric"], "argument --metric: expected one argument (see: ddpjob status --help)"),
        (["sweep", "-x"], "unrecognized arguments: -x (see: ddpjob sweep --help)"),
        (["status", "--", "x"], "arguments after -- are a script's"),
    ],
)
def test_usage_errors_are_one_line(argv, needle, capsys):
    """argparse's own errors read like every other user error: one line, exit 2, and where to look."""
    with pytest.raises(SystemExit) as exited:
        cli.main(argv)
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.count("\n") == 1 and err.startswith("ddpjob: error: "), err
    assert needle in err, err
