"""``python -m ddp_core RUN_DIR|CONFIG.yaml [key=value ...]``: the trainer in this process."""

from ddp_core.exits import leave
from ddp_core.launch import main

leave(main())
