"""``python -m jobs.report``: the report without the rest of ``ddpjob``'s command line."""

import sys

from jobs.report import main

sys.exit(main())
