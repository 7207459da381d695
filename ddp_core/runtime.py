"""``ddp_core.runtime``: the helper a user's own training script imports in script mode (its public name).

Everything is ``ddp_core.script.runtime``; importing this installs the warning-signal handlers, as that does.
"""

from ddp_core.script.runtime import (
    checkpoint_dir,
    finish,
    in_ddpjob,
    log,
    requeue,
    restart_count,
    run_dir,
    stop_requested,
)

__all__ = [
    "checkpoint_dir",
    "finish",
    "in_ddpjob",
    "log",
    "requeue",
    "restart_count",
    "run_dir",
    "stop_requested",
]
