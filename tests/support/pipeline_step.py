"""A pipeline step's script (tests/cluster/test_pipeline.py): what it was handed as it started, written to
``RUN/seen.json`` (the earlier step's run directory and best checkpoint, both resolved on the node, and whether that
run had completed by then), then a user error while ``--gate`` names a file that does not exist: the test opens the
gate from outside before the pipeline's rerun."""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--earlier", required=True, help="the earlier step's run directory")
    parser.add_argument("--checkpoint", default="", help="the earlier step's best checkpoint")
    parser.add_argument("--gate", default="", help="fail unless this file exists")
    args = parser.parse_args()
    attempts = Path(args.earlier) / "attempts.jsonl"
    events = [json.loads(line)["event"] for line in attempts.read_text().splitlines() if line.strip()]
    seen = {
        "earlier": args.earlier,
        "checkpoint": args.checkpoint,
        "checkpoint_exists": Path(args.checkpoint).exists() if args.checkpoint else None,
        "earlier_events": events,
        "t": time.time(),
    }
    (Path(os.environ["DDPJOB_RUN_DIR"]) / "seen.json").write_text(json.dumps(seen) + "\n")
    if args.gate and not Path(args.gate).exists():
        raise ValueError(f"the gate {args.gate} is closed")  # a user error: the job fails at once, not requeued


if __name__ == "__main__":
    main()
