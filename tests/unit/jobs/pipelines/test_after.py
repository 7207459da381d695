"""``ddpjob submit --after`` (jobs.pipelines.after): the condition's syntax, what an ended run leaves to wait for,
and the dependency in the job's one request, as every renderer writes it."""

from __future__ import annotations

import pytest

from ddp_core.config import load_config
from ddp_core.errors import DdpJobError
from ddp_core.run.rundir import RunDir
from jobs.pipelines.after import After, Upstream, dependency, satisfied
from jobs.submission.render import Layout, render, render_template
from jobs.submission.request import SlurmRequest
from tests.support.cli_runner import run_cli
from tests.support.helpers import ROOT

DIGITS = str(ROOT / "configs" / "digits.yaml")


@pytest.mark.parametrize(
    ("text", "ref", "mode"),
    [("5301", "5301", "ok"), ("train:any", "train", "any"), ("runs/a:b/x:notok", "runs/a:b/x", "notok"),
     ("runs/a:b/x", "runs/a:b/x", "ok")],
)  # fmt: skip
def test_after_syntax(text, ref, mode):
    assert After.parse(text) == After(ref, mode)


@pytest.mark.parametrize(("text", "needle"), [("train:okk", "unknown condition 'okk'"), (":ok", "names nothing")])
def test_bad_after_is_one_line(text, needle):
    with pytest.raises(DdpJobError, match=needle):
        After.parse(text)


def test_an_ended_run_is_decided_here_and_a_running_one_waited_for():
    assert satisfied("RUNNING", "ok") is None and satisfied("REQUEUED", "any") is None
    assert Upstream("train", "7", "RUNNING").decide("ok", "--after") == "afterok:7"
    assert Upstream("train", "7", "COMPLETED").decide("ok", "--after") is None  # nothing left to wait for
    assert Upstream("train", "7", "FAILED(1)").decide("notok", "--after") is None
    assert Upstream("5301", "5301", None).decide("any", "--after") == "afterany:5301"  # a plain job: Slurm decides
    with pytest.raises(DdpJobError, match=r"run train ended FAILED\(1\), so this job could never start"):
        Upstream("train", "7", "FAILED(1)").decide("ok", "--after")
    assert dependency(["afterok:7", None, "afterany:8"]) == "afterok:7,afterany:8"
    assert dependency([None]) is None


def test_the_dependency_is_in_the_request_and_every_script(tmp_path):
    cfg = load_config(DIGITS)
    request = SlurmRequest.resolve(cfg, dependency="afterok:11,afternotok:12")
    script = render(request, Layout.run(tmp_path / "run"))
    assert "#SBATCH --dependency=afterok:11,afternotok:12" in script.splitlines()
    assert "#SBATCH --kill-on-invalid-dep=yes" in script.splitlines()
    template = render_template(request, RunDir(tmp_path / "run"))  # prepare --sbatch-script's
    assert "#SBATCH --dependency=afterok:11,afternotok:12" in template.splitlines()
    assert "--dependency" not in render(SlurmRequest.resolve(cfg), Layout.run(tmp_path / "run"))


def test_submit_dry_run_after_a_job_and_a_run(tmp_path):
    run = tmp_path / "runs" / "train-1"
    (run / "slurm").mkdir(parents=True)
    (run / "config.yaml").write_text("run: {name: train}\n")
    (run / "run.json").write_text(
        '{"jobs": [{"job_id": "4242", "via": "submitit", "submitted": "2020-01-01T00:00:00"}]}'
    )
    args = ["submit", DIGITS, "--dry-run", "--no-cluster-check", "--after", "5301:any", "--after", "train-1"]
    proc = run_cli(*args, cwd=tmp_path, env={"PATH": "/nonexistent"})  # no sacct: the run's state is unknown
    assert proc.returncode == 0, proc.stderr
    assert "#SBATCH --dependency=afterany:5301,afterok:4242" in proc.stdout.splitlines()
    bad = run_cli("submit", DIGITS, "--dry-run", "--no-cluster-check", "--after", "nosuch", cwd=tmp_path)
    assert bad.returncode == 2 and "no run under 'runs' is named 'nosuch'" in bad.stderr, bad.stderr
