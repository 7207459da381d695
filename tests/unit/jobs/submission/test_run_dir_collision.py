"""One run per directory: two submissions in the same second whose random suffixes collide get two directories
(``create_run_dir``'s exclusive ``mkdir``, another suffix on a collision), and the one sbatch refuses removes its
own directory only, never the first run's. Only the clock and the random source are forced; the filesystem and
the submission pipeline are real, sbatch is the gateway's runner answering as Slurm does."""

import json
import subprocess
from pathlib import Path

from ddp_core.cluster import slurm
from ddp_core.run import rundir
from tests.support.cli_runner import run_cli
from tests.support.helpers import ROOT


class Sbatch:
    """sbatch that accepts the first submission and refuses the others (squeue: nothing queued)."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, cmd):
        if cmd[0] == "sbatch":
            self.calls += 1
            if self.calls == 1:
                return subprocess.CompletedProcess(list(cmd), 0, "Submitted batch job 4242\n", "")
            return subprocess.CompletedProcess(list(cmd), 1, "", "sbatch: error: Batch job submission failed\n")
        return subprocess.CompletedProcess(list(cmd), 0, "", "")


def test_two_submissions_in_one_second_with_one_suffix_get_two_directories(tmp_path, monkeypatch):
    suffixes = iter(["beef", "beef", "cafe"])  # the second submission's first name collides with the first's
    monkeypatch.setattr(rundir, "stamp", lambda: "20270101-000000")
    monkeypatch.setattr(rundir, "suffix", lambda: next(suffixes))
    monkeypatch.setattr(slurm.GATEWAY, "runner", Sbatch())
    args = ["submit", "configs/digits.yaml", "--no-cluster-check", f"run.root={tmp_path}", "snapshot.enabled=false"]
    first = run_cli(*args, cwd=ROOT)
    assert first.returncode == 0, first.stderr
    taken = tmp_path / "digits-20270101-000000-beef"
    run_id = json.loads((taken / "run.json").read_text())["run_id"]
    second = run_cli(*args, cwd=ROOT)
    assert second.returncode == 2 and "submission failed: sbatch: error: Batch job submission failed" in second.stderr
    # The refused one had its own directory (the next suffix), and removed it; the first run is untouched.
    assert sorted(p.name for p in tmp_path.iterdir()) == [taken.name]
    meta = json.loads((taken / "run.json").read_text())
    assert meta["run_id"] == run_id and [j["job_id"] for j in meta["jobs"]] == ["4242"]
    assert (taken / "config.yaml").is_file()


def test_create_run_dir_never_reuses_a_directory(tmp_path, monkeypatch):
    from ddp_core.config import load_config

    monkeypatch.setattr(rundir, "stamp", lambda: "20270101-000000")
    monkeypatch.setattr(rundir, "suffix", lambda: "beef")
    cfg = load_config(ROOT / "configs/digits.yaml", [f"run.root={tmp_path}"])
    made = rundir.create_run_dir(cfg)
    assert made.created and made.path.is_dir() and made == rundir.RunDir(made.path)
    try:
        rundir.create_run_dir(cfg)
    except Exception as err:
        assert "names tried, all taken" in str(err)
    else:
        raise AssertionError("a taken name was reused")
    assert [p.name for p in Path(tmp_path).iterdir()] == [made.path.name]
