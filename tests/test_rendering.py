"""Golden files pin the two sbatch scripts a config turns into: submitit's and the template's."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ddp_core.config import load_config
from ddp_core.rundir import RunDir
from jobs.sbatch_template import render
from jobs.submit import render_submitit_script
from tests.conftest import ROOT

GOLDEN = Path(__file__).parent / "golden"
RUN = RunDir(Path("/runs/digits-golden"))
OVERRIDES = ["slurm.partition=gpu", "slurm.account=proj42", "slurm.setup=[module load cuda]",
             "slurm.additional={constraint: a100}"]  # fmt: skip


def check_golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if os.environ.get("DDPJOB_UPDATE_GOLDEN") == "1":
        path.write_text(text)
    assert text == path.read_text(), f"{name} changed; review and rerun with DDPJOB_UPDATE_GOLDEN=1"


@pytest.mark.parametrize("overrides", [[], OVERRIDES], ids=["default", "custom"])
def test_submitit_script(overrides):
    cfg = load_config(ROOT / "configs" / "digits.yaml", overrides)
    suffix = "custom" if overrides else "default"
    check_golden(f"submitit-{suffix}.sbatch", render_submitit_script(cfg, RUN, python="/usr/bin/python3"))


@pytest.mark.parametrize("overrides", [[], OVERRIDES], ids=["default", "custom"])
def test_template_script(overrides):
    cfg = load_config(ROOT / "configs" / "digits.yaml", overrides)
    suffix = "custom" if overrides else "default"
    check_golden(f"template-{suffix}.sbatch", render(cfg, RUN, python="/usr/bin/python3"))


def test_template_by_hand_is_valid_bash():
    import subprocess

    proc = subprocess.run(["bash", "-n", str(ROOT / "slurm_templates" / "ddp.sbatch")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_gpu_request_is_one_task_per_gpu():
    cfg = load_config(ROOT / "configs" / "digits.yaml", ["slurm.gpus_per_node=4", "slurm.nodes=2"])
    script = render_submitit_script(cfg, RUN, python="python")
    assert "#SBATCH --ntasks-per-node=4" in script and "#SBATCH --gpus-per-node=4" in script
    assert "#SBATCH --nodes=2" in script
