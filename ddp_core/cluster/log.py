"""Stdlib logging for every rank: one handler on stderr, each line prefixed with the rank."""

from __future__ import annotations

import logging
import socket
import sys
from typing import Optional

from ddp_core.cluster.env import DistEnv

_FORMAT = "%(asctime)s [{label}] %(levelname)s %(name)s: %(message)s"


def setup_logging(env: DistEnv, level: int = logging.INFO, label: Optional[str] = None) -> None:
    """``label``: what the prefix names instead of ``rank R/W`` (a process that is no rank, e.g. a torchrun agent)."""
    handler = logging.StreamHandler(sys.stderr)
    prefix = label or f"rank {env.rank}/{env.world_size}"
    handler.setFormatter(logging.Formatter(_FORMAT.format(label=prefix), "%H:%M:%S"))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    # Third-party chatter (wandb's setup, submitit's polling) stays out of training logs unless it matters.
    for noisy in ("wandb", "submitit", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def log_failure(log: logging.Logger, env: DistEnv, err: BaseException, hint: str = "") -> None:
    """The line a failing rank leaves, naming its rank, host and error (``hint``: what to try next), with the
    traceback: the trainer's and script mode's alike."""
    log.error(
        "rank %d/%d on %s failed: %s: %s%s",
        env.rank,
        env.world_size,
        socket.gethostname(),
        type(err).__name__,
        err,
        hint,
        exc_info=True,
    )
