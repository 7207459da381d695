"""The cluster guard follows the instance the tests talk to (scripts/slurm-local env), and refuses an environment
whose client commands would reach another cluster than the one whose lock it takes."""

from __future__ import annotations

from pathlib import Path

from tests.support import cluster_guard


def test_the_guard_locks_the_cluster_the_commands_reach():
    second = {"DDPJOB_SLURM_HOME": "/var/tmp/ddpjob-slurm-r", "SLURM_CONF": "/var/tmp/ddpjob-slurm-r/etc/slurm.conf"}
    assert cluster_guard.cluster_home(second) == Path("/var/tmp/ddpjob-slurm-r")
    assert cluster_guard.instance_mismatch(second) is None
    conf_only = {"SLURM_CONF": "/var/tmp/ddpjob-slurm-r/etc/slurm.conf"}
    assert cluster_guard.cluster_home(conf_only) == Path("/var/tmp/ddpjob-slurm-r")
    for default in ({}, {"SLURM_CONF": "/etc/slurm/slurm.conf"}, {"DDPJOB_SLURM_HOME": "/var/tmp/ddpjob-slurm"}):
        assert cluster_guard.cluster_home(default) == cluster_guard.DEFAULT_HOME
        assert cluster_guard.instance_mismatch(default) is None


def test_a_home_without_its_slurm_conf_is_refused():
    # the commands would read /etc/slurm (the default cluster) while the guard locks the second one
    assert "without SLURM_CONF" in (cluster_guard.instance_mismatch({"DDPJOB_SLURM_HOME": "/var/tmp/x"}) or "")
    crossed = {"DDPJOB_SLURM_HOME": "/var/tmp/x", "SLURM_CONF": "/var/tmp/ddpjob-slurm/etc/slurm.conf"}
    assert "is not the slurm.conf of" in (cluster_guard.instance_mismatch(crossed) or "")
