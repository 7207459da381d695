"""``ddpjob report RUN|SWEEP``: the page and image of a run or a sweep, or its trial table."""

from __future__ import annotations

import argparse
from pathlib import Path

from jobs.runs.lookup import resolve


def cmd_report(args: argparse.Namespace) -> int:
    from jobs.report import write_report, write_table

    out = Path(args.out) if args.out else None
    path = resolve(args.path, sweeps=True)
    if args.table:
        print(f"table: {write_table(path, args.table, out, metric=args.metric)}")
        return 0
    png, html = write_report(path, out, metric=args.metric)
    print(f"png:  {png}")
    print(f"html: {html}")
    return 0
