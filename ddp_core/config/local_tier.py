"""The login node's checks of the node-local checkpoint tier (``checkpoint.local_every_steps``, ``local_path``), as far
as it can tell: it cannot see the compute nodes' folders, so whether ``local_path`` exists there, is writable and has
room is checked by the ranks at start (``ddp_core.checkpoint``)."""

from __future__ import annotations

import re

from ddp_core.config.schema import CheckpointConfig
from ddp_core.errors import DdpJobError

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def refuse(key: str, value: object, why: str) -> DdpJobError:
    return DdpJobError(f"config key '{key}' = {value!r} is invalid: {why}", f"fix {key} in the config or the overrides")


def validate_local_tier(c: CheckpointConfig, script_enabled: bool) -> None:
    """Raise ``DdpJobError`` naming the key for a tier the login node can tell is wrong."""
    if c.local_every_steps <= 0:
        return
    key, path = "checkpoint.local_every_steps", c.local_path
    if script_enabled:
        raise DdpJobError(
            f"config key '{key}' is set, but the node-local tier is the built-in trainer's, not script mode's",
            "drop it (your script writes its own checkpoints to runtime.checkpoint_dir())",
        )
    if c.every_steps and c.local_every_steps >= c.every_steps:
        why = f"must be below checkpoint.every_steps ({c.every_steps}): a local copy at a durable checkpoint's step is "
        raise refuse(key, c.local_every_steps, why + "never used")
    if _CONTROL.search(path):
        raise refuse("checkpoint.local_path", path, "no control characters")
    if not path.startswith("/"):
        why = "must be an absolute path on the compute nodes, e.g. /dev/shm or /tmp (a relative one would land in each "
        raise refuse("checkpoint.local_path", path, why + "rank's working directory, on the shared filesystem)")
    if ".." in path.split("/"):
        raise refuse("checkpoint.local_path", path, "no '..' in it: name the folder itself")
