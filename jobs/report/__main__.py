"""``python -m jobs.report ARGS`` is ``ddpjob report ARGS``: one parser, one way to name the run and the metric, one
error prefix."""

import sys

from jobs.cli import main

sys.exit(main(["report", *sys.argv[1:]]))
