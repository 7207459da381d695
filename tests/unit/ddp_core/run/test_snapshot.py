"""Code snapshots without Slurm: ``ddpjob prepare`` copies the user's code into the run directory, and every later
attempt (``python -m ddp_core RUN``, ``python -m ddp_core.script RUN``) imports the copy, not the edited working tree.
What is copied (git's files, or a plain folder's), the record, the diff, the size limits and ``--no-snapshot``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ddp_core.run.rundir import RunDir
from tests.support.cli_runner import run_cli
from tests.support.helpers import ROOT

DIGITS = str(ROOT / "configs" / "digits.yaml")
QUICK = [
    "train.max_steps=2",
    "optim.warmup_steps=0",
    "train.log_every=1",
    "train.eval_every=0",
    "wandb.mode=disabled",
    "data.batch_size=8",
]

TASK = """
import logging
from ddp_core.tasks.digits import DigitsTask
from {pkg}.settings import MARK


class MarkedTask(DigitsTask):
    def build_model(self, **kwargs):
        logging.getLogger("ddp_core").warning("snapshot mark: %s", MARK)
        return super().build_model(**kwargs)
"""

SCRIPT = """
from helper import MARK
print("snapshot mark:", MARK)
"""


def _package(root: Path, name: str = "snaptask") -> Path:
    pkg = root / name
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "settings.py").write_text('MARK = "as submitted"\n')
    (pkg / "task.py").write_text(TASK.format(pkg=name))
    return pkg


def _env(*paths: Path) -> dict[str, str]:
    return {"PYTHONPATH": os.pathsep.join([*map(str, paths), str(ROOT)]), "OMP_NUM_THREADS": "1"}


def _prepare(cwd: Path, *args: str, env: dict[str, str] | None = None) -> RunDir:
    proc = run_cli("prepare", *args, "--no-cluster-check", cwd=cwd, env=env)
    assert proc.returncode == 0, proc.stderr
    return RunDir(Path(proc.stdout.strip().splitlines()[-1]))


def _attempt(run: RunDir, module: str, env: dict[str, str]) -> str:
    """One attempt on the run directory, as srun would start it (alone here); its output."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SUBMITIT_"))}
    proc = subprocess.run([sys.executable, "-m", module, str(run.path)], capture_output=True, text=True, timeout=120,
                          env=clean | env, cwd=run.path)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout + proc.stderr


def _git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True,
                   env={**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@x", "GIT_COMMITTER_NAME": "t",
                        "GIT_COMMITTER_EMAIL": "t@x"})  # fmt: skip


def test_task_package_edited_after_submit_is_not_what_the_next_attempt_runs(tmp_path):
    src = tmp_path / "src"
    pkg = _package(src)
    env = _env(src)
    target = "task.target=snaptask.task:MarkedTask"
    run = _prepare(tmp_path, DIGITS, target, *QUICK, env=env)
    record = json.loads(run.code_record.read_text())
    assert record["kind"] == "package" and record["source"] == str(pkg) and record["packages"] == ["snaptask"]
    assert (run.code / "snaptask" / "settings.py").read_text() == 'MARK = "as submitted"\n'
    assert record["git"] is None and not (run.path / "code.diff").exists()

    (pkg / "settings.py").write_text('MARK = "edited later"\n')  # the user goes on working
    assert "snapshot mark: as submitted" in _attempt(run, "ddp_core", env)

    # The control: without a snapshot the same edit is what an attempt runs.
    plain = _prepare(tmp_path, DIGITS, target, *QUICK, "--no-snapshot", env=env)
    assert not plain.code_record.exists() and not plain.code.exists()
    (pkg / "settings.py").write_text('MARK = "edited again"\n')
    assert "snapshot mark: edited again" in _attempt(plain, "ddp_core", env)

    status = run_cli("status", str(run.path), cwd=tmp_path)
    assert "code: 3 files" in status.stdout and str(pkg) in status.stdout, status.stdout
    assert "code: none" in run_cli("status", str(plain.path), cwd=tmp_path).stdout


def test_script_siblings_come_from_the_snapshot(tmp_path):
    folder = tmp_path / "proj"
    folder.mkdir()
    (folder / "train.py").write_text(SCRIPT)
    (folder / "helper.py").write_text('MARK = "as submitted"\n')
    run = _prepare(tmp_path, "--script", str(folder / "train.py"))
    (folder / "helper.py").write_text('MARK = "edited later"\n')
    out = _attempt(run, "ddp_core.script", {"OMP_NUM_THREADS": "1"})
    assert "snapshot mark: as submitted" in out
    assert str(run.code / "train.py") in out  # the copy ran, not the original


def test_git_repository_snapshot_holds_what_git_would_commit_and_records_the_diff(tmp_path):
    repo = tmp_path / "repo"
    pkg = _package(repo)
    (repo / ".gitignore").write_text("data/\n")
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    _git(repo, "commit", "-qm", "first")
    (pkg / "settings.py").write_text('MARK = "uncommitted"\n')  # tracked, changed
    (pkg / "extra.py").write_text("X = 1\n")  # untracked, not ignored: copied
    (pkg / "data").mkdir()
    (pkg / "data" / "big.bin").write_bytes(b"0" * 1000)  # ignored: not copied
    run = _prepare(tmp_path, DIGITS, "task.target=snaptask.task:MarkedTask", *QUICK, env=_env(repo))
    record = json.loads(run.code_record.read_text())
    head = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    assert record["git"]["commit"] == head.strip() and record["git"]["diff"] == str(run.path / "code.diff")
    assert sorted(p.name for p in (run.code / "snaptask").rglob("*") if p.is_file()) == [
        "__init__.py", "extra.py", "settings.py", "task.py"]  # fmt: skip
    diff = (run.path / "code.diff").read_text()
    assert '-MARK = "as submitted"' in diff and '+MARK = "uncommitted"' in diff
    assert (run.code / "snaptask" / "settings.py").read_text() == 'MARK = "uncommitted"\n'


def test_plain_folder_snapshot_skips_hidden_caches_and_the_run_root(tmp_path):
    folder = tmp_path / "proj"
    folder.mkdir()
    (folder / "train.py").write_text("print('hi')\n")
    for skipped in (".venv/lib.py", "__pycache__/train.cpython-311.pyc", "runs/old/config.yaml"):
        (folder / skipped).parent.mkdir(parents=True, exist_ok=True)
        (folder / skipped).write_text("x")
    (folder / "conf").mkdir()
    (folder / "conf" / "model.yaml").write_text("a: 1\n")
    run = _prepare(folder, "--script", "train.py")  # run.root = proj/runs: inside the script's folder
    files = sorted(str(p.relative_to(run.code)) for p in run.code.rglob("*") if p.is_file())
    assert files == ["conf/model.yaml", "train.py"]


@pytest.mark.parametrize("limit", ["snapshot.max_mb=0.001", "snapshot.max_files=1"])
def test_oversized_snapshot_is_refused_in_one_line_before_anything_exists(tmp_path, limit):
    folder = tmp_path / "proj"
    folder.mkdir()
    (folder / "train.py").write_text("print('hi')\n")
    (folder / "weights.bin").write_bytes(b"0" * 5000)
    for command in (["prepare", "--no-cluster-check"], ["submit", "--dry-run", "--no-cluster-check"]):
        proc = run_cli(*command, "--script", str(folder / "train.py"), limit, cwd=tmp_path)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1, proc.stderr
        assert f"the code snapshot of {folder} would hold 2 files" in lines[0] and "weights.bin (0.0 MB)" in lines[0]
        assert "--no-snapshot" in lines[0]
        assert not (tmp_path / "runs").exists()


def test_library_tasks_take_no_snapshot(tmp_path):
    run = _prepare(tmp_path, DIGITS, *QUICK)  # ddp_core.tasks.digits: the installed library's own code
    assert not run.code_record.exists()
    proc = run_cli("submit", DIGITS, "--dry-run", "--no-cluster-check", cwd=tmp_path)
    assert "# code snapshot: none" in proc.stdout


def _home_like(tmp_path: Path) -> Path:
    """A folder outside git like the home that holds ``~/train.py``: hidden files, and links in and out of it."""
    home, outside = tmp_path / "home", tmp_path / "elsewhere"
    (home / "lib").mkdir(parents=True)
    outside.mkdir()
    (outside / "credentials").write_text("[default]\naws_secret_access_key = x\n")
    (outside / "shared").mkdir()
    (outside / "shared" / "data.py").write_text("x = 1\n")
    (home / "train.py").write_text("print('hi')\n")
    (home / "lib" / "util.py").write_text("y = 2\n")
    for hidden in (".bash_history", ".env", ".netrc", "lib/.secret.py", ".config/tool.yaml"):
        (home / hidden).parent.mkdir(parents=True, exist_ok=True)
        (home / hidden).write_text("secret\n")
    (home / "aws_credentials").symlink_to(outside / "credentials")
    (home / "shared").symlink_to(outside / "shared")
    (home / "util_link.py").symlink_to(home / "lib" / "util.py")  # inside the folder: copied
    return home


def test_a_snapshot_outside_git_leaves_out_hidden_files_and_links_out_of_the_folder(tmp_path):
    home = _home_like(tmp_path)
    run = _prepare(home, "--script", "train.py", "run.root=" + str(tmp_path / "runs"))
    files = sorted(str(p.relative_to(run.code)) for p in run.code.rglob("*") if p.is_file())
    assert files == ["lib/util.py", "train.py", "util_link.py"]
    dry = run_cli("submit", "--dry-run", "--no-cluster-check", "--script", "train.py", "run.root=" + str(tmp_path),
                  cwd=home)  # fmt: skip
    assert dry.returncode == 0, dry.stderr
    listed = [line for line in dry.stdout.splitlines() if line.startswith("#   ")]
    assert listed == [
        "#   lib/util.py", "#   train.py", "#   util_link.py",
        "#   left out: .bash_history (hidden: snapshot.include_hidden)",
        "#   left out: .config/ (hidden: snapshot.include_hidden)",
        "#   left out: .env (hidden: snapshot.include_hidden)",
        "#   left out: .netrc (hidden: snapshot.include_hidden)",
        "#   left out: aws_credentials (a link out of the folder: snapshot.outside_links)",
        "#   left out: lib/.secret.py (hidden: snapshot.include_hidden)",
        "#   left out: shared/ (a link out of the folder: snapshot.outside_links)",
    ], dry.stdout  # fmt: skip


def test_asked_for_the_snapshot_takes_hidden_files_and_links_out(tmp_path):
    home = _home_like(tmp_path)
    run = _prepare(home, "--script", "train.py", "run.root=" + str(tmp_path / "runs"), "snapshot.include_hidden=true",
                   "snapshot.outside_links=true")  # fmt: skip
    files = sorted(str(p.relative_to(run.code)) for p in run.code.rglob("*") if p.is_file())
    assert files == [".bash_history", ".config/tool.yaml", ".env", ".netrc", "aws_credentials", "lib/.secret.py",
                     "lib/util.py", "shared/data.py", "train.py", "util_link.py"]  # fmt: skip


def test_in_git_a_tracked_link_out_of_the_tree_is_left_out(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    (tmp_path / "netrc").write_text("machine x password y\n")
    (repo / "train.py").write_text("print('hi')\n")
    (repo / ".gitignore").write_text("runs/\n")
    (repo / "netrc_link").symlink_to(tmp_path / "netrc")
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "x")
    run = _prepare(repo, "--script", "train.py")
    files = sorted(str(p.relative_to(run.code)) for p in run.code.rglob("*") if p.is_file())
    assert files == [".gitignore", "train.py"]  # git's own hidden files are the user's choice: tracked
