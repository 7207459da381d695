"""``python -m ddp_core RUN_DIR|CONFIG.yaml [key=value ...]``: the trainer in this process."""

from ddp_core.cluster.exits import leave
from ddp_core.launch import main

# main() ends the process itself once it has trained; it returns only a config it could not use, before anything of
# torch.distributed started: the interpreter's own exit, as the ranks beside it take the same time to refuse it.
leave(main(), teardown=True)
