"""A sweep of a script on the local cluster: one job array, every trial with its own arguments, then status and
report. (Sweeps of a script with sbatch faked: tests/unit/jobs/sweeps/test_script_sweep.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from ddp_core.run.rundir import RunDir
from tests.support.cli_runner import field, run_cli
from tests.support.helpers import events, wait_for, wait_out_of_queue
from tests.support.report_pages import figures as report_figures
from tests.support.script_sweeps import QUIET, TRAIN, trials_of


@pytest.mark.slurm_interface
@pytest.mark.cluster_user
def test_script_sweep_runs_as_one_array(slurm_cluster, tmp_path):
    """Four trials of a small script, one array job: every trial completes with its own arguments; status lists the
    four, report draws four curves."""
    proc = run_cli("sweep", "--script", TRAIN, "script.args.lr=0.05,0.1,0.2,0.3", QUIET, "slurm.time_min=5",
                   "--name", "script-lr", "--", "--steps", "40", "--log-every", "5", "--sleep", "0.05",
                   cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    arrays = field(proc.stdout, "arrays").split()
    assert len(arrays) == 1, proc.stdout  # four trials, one sbatch
    sweep_dir = Path(field(proc.stdout, "dir"))
    trials = trials_of(sweep_dir)
    assert len(trials) == 4

    def completed(trial: Path) -> bool:
        found = events(trial)
        return bool(found) and found[-1]["event"] == "completed"

    wait_for(lambda: all(completed(t) for t in trials), 300, "all four trials to complete", poll=1)
    seen = set()
    for trial in trials:
        run = RunDir(trial)
        assert run.jobs()[0]["job_id"].startswith(f"{arrays[0]}_")
        assert events(trial, "completed")[-1]["step"] == 40
        seen.add(run.load_config().script.args[-1])
        assert [r["step"] for r in run.metrics()] == list(range(5, 41, 5))
    assert seen == {f"--lr={lr}" for lr in ("0.05", "0.1", "0.2", "0.3")}
    wait_out_of_queue(arrays[0], 60)
    shown = run_cli("status", str(sweep_dir), "--metric", "min:train/loss", cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    rows = [line for line in shown.stdout.splitlines() if f"{arrays[0]}_" in line]
    assert len(rows) == 4 and all("COMPLETED" in r and "script_sweep_train.py" in r for r in rows), shown.stdout
    report = run_cli("report", str(sweep_dir), "--metric", "min:train/loss", cwd=tmp_path)
    assert report.returncode == 0, report.stderr
    html = Path(field(report.stdout, "html")).read_text()
    curves = report_figures(html)["curve-train/loss"]["data"]  # a curve per trial, named by its swept argument
    assert sorted(t["name"].lstrip("★ ") for t in curves) == [f"lr={lr}" for lr in ("0.05", "0.1", "0.2", "0.3")]
    assert Path(field(report.stdout, "png")).stat().st_size > 10_000
