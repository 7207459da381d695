"""jobs: the login-node side of ddpjob — validate configs, submit and follow Slurm jobs. Never imports torch
at module import (``ddpjob --help`` must be instant on a login node)."""
