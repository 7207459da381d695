"""Script mode on the login node, without Slurm: ``ddpjob submit/prepare --script`` check the script before anything
exists, record it in the run's config, and ask Slurm for exactly what the trainer would get for the same slurm.*."""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from ddp_core.config import load_config
from ddp_core.run.rundir import RunDir
from jobs.submission.request import SlurmRequest
from tests.support.cli_runner import run_cli
from tests.support.helpers import ROOT, run_script

TUTORIAL = str(ROOT / "examples" / "ddp_tutorial.py")
DIGITS = str(ROOT / "configs" / "digits.yaml")
DRY = ("--dry-run", "--no-cluster-check")  # never asks sinfo: these tests need no cluster


def _refused(proc: subprocess.CompletedProcess[str], needle: str, cwd: Path) -> None:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and needle in lines[0] and "hint:" in lines[0], proc.stderr
    assert not (cwd / "runs").exists()


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--script", "nope.py"], "config key 'script.path' = 'nope.py': "),
        (["--script", "adir.py"], "adir.py is not a regular file"),
        (
            ["--script", "/proc/self/mem"],
            "config key 'script.path': /proc/self/mem is not readable",
        ),  # EIO, even as root
        (["--script", TUTORIAL, "script.module=pkg.train"], "'script.path' and 'script.module' are both set"),
        (["script.module=no_such_pkg.train"], "config key 'script.module' = 'no_such_pkg.train' cannot be imported"),
        ([DIGITS, "--script", TUTORIAL], "task.* applies to the built-in trainer, not to script mode"),
        (["--script", TUTORIAL, "optim.lr=0.1"], "config key 'optim.lr' is set, but optim.* applies to the built-in"),
        (["--script", TUTORIAL, "strategy.name=fsdp"], "config key 'strategy.name' is set, but in script mode"),
        (["--script", TUTORIAL, "strategy.split=[1,2]"], "config key 'strategy.split' is set"),
        ([DIGITS, "--", "--steps", "3"], "config key 'script.args' is set but no script is"),
        (
            ["--script", TUTORIAL, "script.args.lr=1e-4"],
            "'script.args.lr' names no part of it (hint: script.args.lr=v1",
        ),
        ([], "no config given"),
    ],
    ids=[
        "missing",
        "directory",
        "unreadable",
        "path_and_module",
        "module",
        "task",
        "optim",
        "strategy",
        "split",
        "args_without_script",
        "sweep_key",
        "nothing",
    ],
)
def test_bad_script_fails_before_anything_exists(tmp_path, args, needle):
    (tmp_path / "adir.py").mkdir()
    for command in (["submit", *args, *DRY], ["prepare", *args, "--no-cluster-check"]):
        _refused(run_cli(*command, cwd=tmp_path), needle, tmp_path)


def test_unreadable_script_file(tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root reads a chmod 000 file; the /proc/self/mem row covers an unreadable regular file")
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    script.chmod(0)
    _refused(run_cli("submit", "--script", str(script), *DRY, cwd=tmp_path), "is not readable", tmp_path)


def test_dry_run_runs_the_script_with_the_trainers_request(tmp_path):
    slurm = ["slurm.tasks_per_node=2", "slurm.cpus_per_task=1", "slurm.time_min=30"]
    proc = run_cli("submit", "--script", TUTORIAL, *DRY, *slurm, "--", "--steps", "3", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "# each task runs ddp_core.script.run(" in proc.stdout and "python -m ddp_core.script RUN_DIR" in proc.stdout
    resolved = yaml.safe_load(proc.stdout.split("# resolved config\n", 1)[1])
    assert resolved["script"]["path"] == TUTORIAL and resolved["script"]["args"] == ["--steps", "3"]
    assert resolved["run"]["name"] == "ddp_tutorial"
    assert not (tmp_path / "runs").exists()
    # Derive once, render many: the same slurm.* keys make the same request, script or trainer.
    trainer = load_config(DIGITS, ["run.name=ddp_tutorial"])
    script = load_config(None, ["run.name=ddp_tutorial", *slurm, f"script.path={TUTORIAL}"])
    assert SlurmRequest.resolve(script).sbatch_options() == SlurmRequest.resolve(trainer).sbatch_options()
    run = RunDir(Path(re.search(r"ddp_core\.script\.run\('([^']+)'\)", proc.stdout).group(1)))

    def sbatch_lines(text: str) -> list[str]:
        return [line for line in text.splitlines() if line.startswith("#SBATCH")]

    assert sbatch_lines(proc.stdout) == sbatch_lines(run_script(trainer, run))


def test_prepare_records_the_script_and_renders_its_srun_line(tmp_path):
    (tmp_path / "train.py").write_text("print('hello')\n")
    proc = run_cli("prepare", "--script", "train.py", "slurm.time_min=5", "--sbatch-script", "--no-cluster-check",
                   "run.name=mine", "--", "--steps", "3", "--lr", "0.1", "run.name=not_an_override",
                   cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    run = RunDir(Path(proc.stdout.strip()))
    cfg = run.load_config()
    assert cfg.script.path == str(tmp_path / "train.py")  # absolute, from where ddpjob ran
    assert cfg.script.sha256 == hashlib.sha256(b"print('hello')\n").hexdigest()
    assert cfg.script.args == ["--steps", "3", "--lr", "0.1", "run.name=not_an_override"]  # after --: as they are
    assert (cfg.run.name, cfg.slurm.time_min) == ("mine", 5)
    sbatch = (run.slurm / "job.sbatch").read_text()
    assert "\nENTRY=ddp_core.script\n" in sbatch and '-u "${PYTHON_M[@]}" "$ENTRY" "$RUN_DIR"' in sbatch
    assert subprocess.run(["bash", "-n", str(run.slurm / "job.sbatch")]).returncode == 0


def test_local_run_of_the_tutorial(tmp_path):
    """submitit's LocalExecutor, one task: ddp_core.script.run trains the unchanged tutorial (about 10 s)."""
    proc = run_cli("submit", "--script", TUTORIAL, "--local", "--", "--steps", "3", cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "COMPLETED" in proc.stdout
    (run,) = (tmp_path / "runs").iterdir()
    assert [e["event"] for e in RunDir(run).events()] == ["start", "completed"]
    out = "".join(p.read_text() for p in (run / "slurm").glob("*_0_log.out"))
    assert "rank 0: final loss" in out and "after 3 steps" in out, out
