"""Sweeps of a script: the small training script they sweep (tests/support/script_sweep_train.py), and their trials."""

from __future__ import annotations

from pathlib import Path

from tests.support.helpers import ROOT

TRAIN = str(ROOT / "tests" / "support" / "script_sweep_train.py")
QUIET = "wandb.mode=disabled"  # runtime.log then imports no wandb: these runs take a second each


def trials_of(sweep_dir: Path) -> list[Path]:
    return sorted(p.parent for p in sweep_dir.glob("*/config.yaml"))
