"""``ddpjob status PIPELINE`` (jobs.pipelines.status): which argument names a pipeline, its steps' table from their
runs' own records (no accounting here), and why a step will never run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ddp_core.config import Config
from ddp_core.errors import DdpJobError
from ddp_core.run.rundir import RunDir
from jobs.pipelines import record
from jobs.pipelines.status import find, why_not
from tests.support.cli_runner import run_cli

NO_SLURM = {"PATH": "/nonexistent"}  # no sacct: each run's state is its own last event


def pipeline(tmp_path: Path) -> Path:
    steps = {}
    for name, event in (("train", "completed"), ("use", "failed")):
        run = RunDir(tmp_path / "runs" / f"chain-{name}-20261128-110142-d0fc")
        cfg = Config()
        cfg.run.name = f"chain-{name}"
        run.initialize(cfg)
        run.record_job(str(len(steps) + 1), "submitit")
        run.log_event(event, job_id=str(len(steps) + 1))
        steps[name] = record.Entry(str(run.path), str(len(steps) + 1), ["train:ok"] if name == "use" else [])
    steps["last"] = record.Entry(after=["use:ok"], skipped="use ended FAILED, and this step runs after use:ok")
    folder = tmp_path / "runs" / "pipelines" / "chain"
    record.Record("chain", str(tmp_path / "chain.yaml"), steps).write(folder)
    (tmp_path / "chain.yaml").write_text(json.dumps({"steps": {"a": {"script": "x.py"}}}))
    return folder


def test_a_pipeline_by_name_file_or_folder_and_its_table(tmp_path):
    folder = pipeline(tmp_path)
    for ref in ("chain", "chain.yaml", "runs/pipelines/chain"):
        proc = run_cli("status", ref, cwd=tmp_path, env=NO_SLURM)
        assert proc.returncode == 0, proc.stderr
        lines = proc.stdout.splitlines()
        assert lines[0] == f"pipeline chain ({tmp_path / 'chain.yaml'})"
        states = {line.split()[0]: line.split()[1] for line in lines[2:5]}
        assert states == {"train": "COMPLETED", "use": "FAILED", "last": "SKIPPED"}, proc.stdout
        assert lines[-1] == "last: skipped: use ended FAILED, and this step runs after use:ok"
    assert (folder / record.FILE).is_file()
    run = run_cli("status", "runs/chain-train-20261128-110142-d0fc", cwd=tmp_path, env=NO_SLURM)
    assert run.returncode == 0 and "pipeline" not in run.stdout and "COMPLETED" in run.stdout  # a run, as before


def test_a_name_of_both_a_pipeline_and_a_run_is_one_line(tmp_path, monkeypatch):
    pipeline(tmp_path)
    monkeypatch.chdir(tmp_path)
    assert find("chain") == Path("runs/pipelines/chain") and find("nosuch") is None
    run = RunDir(tmp_path / "runs" / "chain-20261128-120000-abcd")
    run.initialize(Config())
    with pytest.raises(DdpJobError, match=r"'chain' names a pipeline .* and a run or sweep"):
        find("chain")


def test_why_a_step_never_runs():
    rec = record.Record("p", "p.yaml", {"train": record.Entry("t", "1"), "use": record.Entry("u", "2", ["train:ok"]),
                                        "note": record.Entry("n", "3", ["train:notok"])})  # fmt: skip
    states = {"train": "FAILED(1)", "use": "CANCELLED", "note": "RUNNING"}
    assert why_not("use", rec, states) == "cancelled: train ended FAILED(1), and this step runs after train:ok"
    assert why_not("note", rec, states) == ""
    assert why_not("use", rec, {"train": "RUNNING", "use": "PENDING"}) == ""
