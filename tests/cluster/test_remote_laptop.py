"""``ddpjob --host`` from a laptop: a real sshd on loopback as the cluster's login node (tests/support/sshd.py), a
laptop without Slurm commands on its PATH. It submits a job (its config and code sent over the connection), follows
its logs through a connection killed from outside (every line once), cancels it, resumes it to the end and brings
its report back; every command but the one after the kill reuses the first login. (The SSH failures, the version
check and what a submission sends: tests/unit/jobs/remote/test_ssh.py.)"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading

import pytest

from tests.support import sshd
from tests.support.cli_runner import field
from tests.support.helpers import ROOT, events, metric_steps, wait_for, wait_gone

# one 2-rank job at a time on one node; as ddpjob-alice on the site profile (the user pass): her sshd, her logins
pytestmark = [pytest.mark.cluster_shared("b"), pytest.mark.cluster_user]


@pytest.fixture
def laptop(slurm_cluster, tmp_path):
    sshd.require()
    server = sshd.start_server(tmp_path / "sshd")
    lap = sshd.Laptop.make(tmp_path / "home", server)
    (tmp_path / "remote").mkdir()
    lap.host_file(lap.cluster_entry(remote_dir=str(tmp_path / "remote")))
    yield lap
    lap.close()
    server.stop()


def kill_master(laptop: sshd.Laptop) -> None:
    """SIGKILL the laptop's master connection, as a dropped network would end it."""
    (sock,) = [p for p in laptop.state.iterdir() if p.is_socket()]
    check = subprocess.run(["ssh", "-O", "check", "-o", f"ControlPath={sock}", "x"], capture_output=True, text=True)
    os.kill(int(re.search(r"pid=(\d+)", check.stderr)[1]), signal.SIGKILL)  # type: ignore[index]


def test_submit_follow_cancel_resume_and_report_from_a_laptop(laptop, tmp_path):
    project = laptop.home / "project"
    project.mkdir()
    (project / "digits.yaml").write_text((ROOT / "configs" / "digits.yaml").read_text())
    host = ["--host", "cluster"]
    sub = laptop.run([*host, "submit", "digits.yaml", "task.target=tests.support.tasks:SlowDigitsTask",
                      "task.data.pause_s=0.05", "train.max_steps=100000", "train.log_every=5", "train.eval_every=0",
                      "checkpoint.every_steps=10", "wandb.mode=disabled"], cwd=project, timeout=120)  # fmt: skip
    assert sub.returncode == 0, sub.stdout + sub.stderr
    run_dir, job_id = field(sub.stdout, "run dir"), field(sub.stdout, "job")
    assert run_dir.startswith(str(tmp_path / "remote" / "runs"))
    # The task's package went with the job: the run's snapshot is what the laptop sent, and says where from.
    record = (tmp_path / "remote" / "runs").glob("*/code.json")
    assert '"source": "' + str(ROOT / "tests") in next(record).read_text()

    follower = subprocess.Popen([sys.executable, "-m", "jobs", *host, "logs", run_dir, "-f"], env=laptop.env,
                                cwd=project, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(follower.stdout), daemon=True)  # type: ignore[arg-type]
    reader.start()
    wait_for(lambda: sum("step" in line for line in lines) >= 2, 120, "the followed log's progress lines")
    remote_run = tmp_path / "remote" / "runs" / os.path.basename(run_dir)
    # A step in its metrics too, before the cancel below: the log's lines can come first (CI: none yet at the cancel).
    wait_for(lambda: metric_steps(remote_run), 120, "a training step in the run's metrics")
    kill_master(laptop)
    shown = len(lines)
    wait_for(lambda: len(lines) > shown + 2, 60, "the log followed again after the lost connection")
    cancel = laptop.run([*host, "cancel", run_dir])
    assert cancel.returncode == 0 and f"cancelled {job_id}" in cancel.stdout, cancel.stdout + cancel.stderr
    assert follower.wait(120) == 0 and wait_gone(job_id).startswith("CANCELLED")
    reader.join(10)
    assert "connection to cluster lost; following again after line" in follower.stderr.read()  # type: ignore[union-attr]
    whole = laptop.run([*host, "logs", run_dir])
    assert "".join(lines) == whole.stdout  # every line once, none lost, none twice

    last = max(metric_steps(remote_run))
    resumed = laptop.run([*host, "resume", run_dir, f"train.max_steps={last + 40}", "--wait"], timeout=180)
    assert resumed.returncode == 0 and "COMPLETED" in resumed.stdout, resumed.stdout + resumed.stderr
    assert events(remote_run, "resume") or "job:" in resumed.stdout
    status = laptop.run([*host, "status", run_dir])
    assert status.returncode == 0 and "COMPLETED" in status.stdout, status.stdout + status.stderr

    report = laptop.run([*host, "report", run_dir, "--out", "report"], cwd=project, timeout=120)
    assert report.returncode == 0, report.stdout + report.stderr
    assert f"html: {project / 'report' / 'report.html'}" in report.stdout or "html: report/report.html" in report.stdout
    assert (project / "report" / "report.html").stat().st_size > 0 and (project / "report" / "report.png").is_file()
    assert laptop.server.connections() == 2  # the first login, and the one after the kill: every other reused them
