"""``python -m jobs``: same as the ``ddpjob`` command."""

import sys

from jobs.cli import main

sys.exit(main())
