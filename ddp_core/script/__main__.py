"""``python -m ddp_core.script RUN``: a run directory's script as this process's rank (a template's task)."""

from ddp_core.cluster.exits import leave
from ddp_core.script.mode import main

leave(main(), exit_handlers=True)  # the script's exit handlers (W&B's finish, its own), then no teardown
