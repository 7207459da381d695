"""Every way in checks a config as ``ddpjob submit`` does (``jobs.submission.checks``: the code, the place, the
request against the partition): a config that ``submit`` refuses on the login node is refused by a sweep and by an
adaptive search with the same line, before anything is written or submitted. Sweeps used to skip the strategy's cut
of the model and the image."""

from __future__ import annotations

import pytest

from tests.support.cli_runner import run_cli
from tests.support.helpers import ROOT

CHARLM = str(ROOT / "configs" / "charlm.yaml")
PIPELINE = ["strategy.name=pipeline", "strategy.stages=8", "slurm.tasks_per_node=8"]  # the char LM has 4 layers
WAYS = {
    "submit": ["submit", CHARLM, *PIPELINE],
    "grid sweep": ["sweep", CHARLM, *PIPELINE, "optim.lr=0.1,0.01"],
    "adaptive search": ["sweep", CHARLM, "--search", "tpe", *PIPELINE, "optim.lr=uniform(0.001,0.01)"],
}
REFUSED = "ddpjob: error: config key 'strategy.stages' = 8 exceeds the model's 4 top-level layers"


@pytest.mark.parametrize("way", list(WAYS))
def test_a_config_submit_refuses_is_refused_alike_by_every_way_in(way, tmp_path):
    proc = run_cli(*WAYS[way], "--dry-run", "--no-cluster-check", cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(REFUSED), proc.stderr
    assert not proc.stdout and not (tmp_path / "runs").exists()  # no trial listed, no array script, no directory
