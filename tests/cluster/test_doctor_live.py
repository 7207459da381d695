"""``ddpjob doctor`` on the live local cluster (read-only), per profile, and its fire drill (``--drill``) on a real
job. (Fabricated cluster setups: tests/unit/jobs/doctor/test_doctor.py.)"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.support.cli_runner import run_cli


def _live(partition: str, cwd: Path) -> dict[str, dict]:
    proc = run_cli("doctor", "--partition", partition, "--json", cwd=cwd, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return {f["key"]: f for f in json.loads(proc.stdout)}


@pytest.mark.cluster_profile("preempt")
@pytest.mark.slurm_interface
def test_live_low_partition_requeues_with_grace(slurm_cluster, tmp_path):
    f = _live("low", tmp_path)
    assert f["preempt_type"]["value"] == "partition_prio"
    assert f["preempt_mode"]["value"] == "REQUEUE" and f["on_preemption"]["value"] == "REQUEUE"
    assert f["grace_time"]["value"] == 30
    assert f["job_requeue"]["level"] == "ok" and f["accounting"]["level"] == "ok"
    assert f["save_fits"]["level"] == "unknown"  # no run under this empty directory
    # the release the instance runs (scripts/slurm-local status names it), and one node of the partition asked
    release = subprocess.run(["scontrol", "--version"], capture_output=True, text=True).stdout.split()[-1]
    assert f["slurm_release"]["value"] == release and f["slurm_release"]["level"] == "ok"
    assert ("release_requeue" in f) == release.startswith("24.11.")
    assert f["scontrol_on_nodes"]["value"] is True and f["sacct_on_nodes"]["value"] is True


@pytest.mark.cluster_profile("preempt")
def test_live_local_partition_is_not_preempted(slurm_cluster, tmp_path):
    f = _live("local", tmp_path)
    assert (f["preempt_mode"]["level"], f["preempt_mode"]["value"]) == ("ok", "OFF")
    assert f["on_preemption"]["value"] == "OFF"


@pytest.mark.cluster_profile("default")
@pytest.mark.slurm_interface
def test_live_default_profile_has_no_preemption(slurm_cluster, tmp_path):
    f = _live("local", tmp_path)
    assert f["preempt_type"]["value"] == "none"
    assert f["preempt_mode"]["value"] == "OFF" and f["on_preemption"]["value"] == "OFF"
    assert f["accounting"]["level"] == "ok"


@pytest.mark.cluster_profile("preempt")
@pytest.mark.slurm_interface
def test_drill_interrupts_three_ways_and_cleans_up(slurm_cluster, tmp_path):
    """The fire drill on the preempt profile: warning signal, scontrol requeue and a preemption from the high
    partition; every time saved, requeued as the same job, resumed at its step; the twin's weights at the end."""
    proc = run_cli("doctor", "--drill", "--partition", "low", "--preempt-from", "high", cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = {line.split()[1]: line.split()[0] for line in proc.stdout.splitlines() if line.split()[:1] != ["the"]
             and len(line.split()) > 1 and line.split()[0] in {"OK", "INFO", "WARN", "PROBLEM", "UNKNOWN"}}  # fmt: skip
    assert lines["drill"] == "OK" and lines["scontrol_on_nodes"] == "OK"
    timings = [line for line in proc.stdout.splitlines() if " step " in line]
    assert [t.split(" step ")[0].strip() for t in timings] == [
        "the warning signal (SIGUSR2)", "scontrol requeue (SIGTERM)", "preemption from high"
    ]  # fmt: skip
    assert list(tmp_path.iterdir()) == []  # its run directories are gone


@pytest.mark.cluster_user  # as ddpjob-alice on the site profile: what a user may read, and her own limits
@pytest.mark.slurm_interface
def test_doctor_as_a_user_on_a_site_reads_her_limits_and_the_nodes(slurm_cluster, tmp_path):
    f = _live("local", tmp_path)
    assert f["accounting"]["level"] == "ok" and f["job_requeue"]["level"] == "ok"
    assert f["max_submit_jobs"]["level"] == "warn" and f["max_submit_jobs"]["value"] == 6  # QOS site's MaxSubmitPU
    assert "QOS site MaxSubmitPU" in f["max_submit_jobs"]["message"]
    assert f["scontrol_on_nodes"]["value"] is True and f["sacct_on_nodes"]["value"] is True  # from her job on n1
    assert not [k for k, v in f.items() if v["level"] == "problem"], f
