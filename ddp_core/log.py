"""Stdlib logging for every rank: one handler on stderr, each line prefixed with the rank."""

from __future__ import annotations

import logging
import sys

from ddp_core.dist_env import DistEnv

_FORMAT = "%(asctime)s [rank {rank}/{world}] %(levelname)s %(name)s: %(message)s"


def setup_logging(env: DistEnv, level: int = logging.INFO) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(_FORMAT.format(rank=env.rank, world=env.world_size), "%H:%M:%S"))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    # Third-party chatter (wandb's setup, submitit's polling) stays out of training logs unless it matters.
    for noisy in ("wandb", "submitit", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
