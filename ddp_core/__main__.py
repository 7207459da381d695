"""``python -m ddp_core RUN_DIR|CONFIG.yaml [key=value ...]``: the trainer in this process."""

import sys

from ddp_core.launch import main

sys.exit(main())
