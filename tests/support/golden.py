"""The golden files of the rendered sbatch scripts (tests/support/golden/): ``DDPJOB_UPDATE_GOLDEN=1`` rewrites them."""

from __future__ import annotations

import os
from pathlib import Path

from ddp_core.run.rundir import RunDir

GOLDEN = Path(__file__).parent / "golden"
RUN = RunDir(Path("/runs/digits-golden"))


def check_golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if os.environ.get("DDPJOB_UPDATE_GOLDEN") == "1":
        path.write_text(text)
    assert text == path.read_text(), f"{name} changed; review and rerun with DDPJOB_UPDATE_GOLDEN=1"
