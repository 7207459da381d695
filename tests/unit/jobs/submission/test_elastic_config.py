"""Elastic node counts on the login node: ``slurm.nodes`` as a count or MIN-MAX (YAML, overrides, the saved config),
the world sizes a job may run at, the request against a partition, the doctor's view, and the dry run. The bad
inputs are rows of tests/unit/test_bad_inputs.py; the rendered scripts are goldens
(tests/unit/jobs/submission/test_rendering.py)."""

from __future__ import annotations

import logging
import re

import pytest

from ddp_core.config import load_config, load_saved, to_yaml
from ddp_core.config.batch import job_world_sizes
from ddp_core.config.load import Config
from ddp_core.config.shapes import from_plain
from ddp_core.errors import DdpJobError
from jobs.doctor.findings import node_count_finding
from jobs.submission.partitions import Partition
from jobs.submission.request import SlurmRequest
from tests.support.cli_runner import field, run_cli
from tests.support.helpers import ROOT

DIGITS = ROOT / "configs" / "digits.yaml"  # 2 ranks per node, data.batch_size 32


def test_nodes_is_a_count_or_a_range_from_yaml_overrides_and_the_saved_config(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("run: {name: e}\nslurm: {nodes: 1-3}\n")  # YAML reads 1-3 as a string
    cfg = load_config(path)
    assert (cfg.slurm.nodes, cfg.slurm.node_range, cfg.slurm.elastic) == ("1-3", (1, 3), True)
    saved = tmp_path / "config.yaml"
    saved.write_text(to_yaml(cfg))
    # The saved copy every rank reads: the fast path builds it without OmegaConf, the range as the string it is.
    assert from_plain(Config, {"slurm": {"nodes": "1-3"}, "run": {"name": "e"}}).slurm.nodes == "1-3"
    assert load_saved(saved).slurm.nodes == "1-3"
    fixed = load_config(DIGITS, ["slurm.nodes=2"])
    assert (fixed.slurm.nodes, fixed.slurm.node_range, fixed.slurm.elastic) == (2, (2, 2), False)
    assert load_config(DIGITS, ["slurm.nodes='2-2'"]).slurm.node_range == (2, 2)  # a one-value range: a count


def test_world_sizes_of_a_job():
    def sizes(*overrides: str) -> list[int]:
        return job_world_sizes(load_config(DIGITS, list(overrides)))

    assert sizes() == [2]
    assert sizes("slurm.nodes=1-3") == [2, 4, 6]
    assert sizes("slurm.nodes=2-3", "slurm.gpus_per_node=4") == [8, 12]  # a rank per GPU
    # A global batch every world size divides: 32 x lcm(2, 4, 6) = 384; 128 is refused for the 3-node size.
    assert load_config(DIGITS, ["slurm.nodes=1-3", "data.global_batch_size=384"]).data.global_batch_size == 384
    with pytest.raises(DdpJobError, match=re.escape("may run on 3 node(s), world size 6")) as err:
        load_config(DIGITS, ["slurm.nodes=1-3", "data.global_batch_size=128"])
    assert "multiple of 384" in err.value.hint


def test_a_range_against_the_partition(caplog):
    part = Partition("local", nodes=2, cpus_per_node=4, gpus_per_node=0)
    request = SlurmRequest.resolve(load_config(DIGITS, ["slurm.nodes=3-4"]), part)
    with pytest.raises(
        DdpJobError, match=re.escape("'slurm.nodes' = 3-4 exceeds partition 'local' (2 nodes, and a job needs MIN")
    ):
        request.check_fits(part)
    # MAX above the partition: Slurm starts the job on what there is; a warning, not a refusal.
    with caplog.at_level(logging.WARNING, logger="ddpjob"):
        SlurmRequest.resolve(load_config(DIGITS, ["slurm.nodes=1-4"]), part).check_fits(part)
        SlurmRequest.resolve(load_config(DIGITS, ["slurm.nodes=1-2"]), part).check_fits(part)
    assert [r.getMessage() for r in caplog.records] == [
        "slurm.nodes = 1-4: partition 'local' has 2 nodes, so attempts run on at most 2 (MAX 4 is never reached); "
        "slurm.nodes=1-2 says so"
    ]
    request = SlurmRequest.resolve(load_config(DIGITS, ["slurm.nodes=1-2"]))
    assert request.sbatch_options()["nodes"] == "1-2" and request.min_nodes * request.tasks_per_node == 2


def test_the_doctor_reads_a_range_against_the_partition():
    levels = {
        nodes: node_count_finding(nodes, low, high, "local", 2).level
        for nodes, low, high in (("3-4", 3, 4), ("1-4", 1, 4), ("1-2", 1, 2), (2, 2, 2), (3, 3, 3))
    }
    assert levels == {"3-4": "problem", "1-4": "warn", "1-2": "info", 2: "ok", 3: "problem"}
    assert node_count_finding("1-4", 1, 4, "local", 2).fix == "set slurm.nodes=1-2"


def test_dry_run_shows_the_range(tmp_path):
    proc = run_cli("submit", str(DIGITS), "--dry-run", "--no-cluster-check", "slurm.nodes=1-2", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "#SBATCH --nodes=1-2\n#SBATCH --ntasks-per-node=2\n" in proc.stdout and "--ntasks=" not in proc.stdout
    assert "# slurm.nodes=1-2: each attempt runs on the nodes Slurm gives it, world size 2 or 4" in proc.stdout
    assert "  nodes: 1-2\n" in proc.stdout  # the resolved config
    with pytest.raises(AssertionError):
        field(proc.stdout, "job")  # nothing submitted


def test_a_node_is_excluded_only_while_min_nodes_stay():
    """A running elastic job's NumNodes is the count it got (2 of ``1-2``): excluding one of the partition's two
    nodes still leaves its MIN, 1."""
    import subprocess

    from ddp_core.cluster.policy import room_for
    from ddp_core.cluster.slurm import JobInfo, SlurmGateway

    def scontrol(cmd: tuple[str, ...]) -> subprocess.CompletedProcess[str]:
        assert cmd[:3] == ("scontrol", "show", "partition"), cmd
        return subprocess.CompletedProcess(cmd, 0, "PartitionName=local Nodes=n[1-2] TotalNodes=2\n", "")

    job = JobInfo("7", "RUNNING", "None", True, None, "local", "normal", None, 0, {"NumNodes": "2"})
    gateway = SlurmGateway(scontrol)
    assert room_for(gateway, job, {"n2": "health"}, needed=1)
    assert not room_for(gateway, job, {"n2": "health"}, needed=2)
