"""A tiny torch-free training script for script-mode sweep tests, run by ``ddp_core.script`` like any user's script.

Gradient descent on ``w**2`` from ``w = 1`` at ``--lr``: the loss falls at a rate set by the swept argument, and is
logged through ``ddp_core.runtime.log`` every ``--log-every`` steps. ``--crash-once`` makes the first attempt of a
run fail halfway (a second attempt, for tests of attempts in logs and status); ``--sleep`` stretches each step.
"""

from __future__ import annotations

import argparse
import sys
import time

from ddp_core import runtime


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lr", type=float, required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--log-every", type=int, default=5)
    parser.add_argument("--sleep", type=float, default=0.0, help="seconds per step")
    parser.add_argument("--crash-once", action="store_true")
    args = parser.parse_args()
    print(f"argv {sys.argv[1:]}", flush=True)
    marker = runtime.run_dir() / "crashed-once" if runtime.in_ddpjob() else None
    w = 1.0
    for step in range(1, args.steps + 1):
        w -= args.lr * 2 * w
        time.sleep(args.sleep)
        if step % args.log_every == 0:
            runtime.log({"loss": w * w}, step=step)
        if args.crash_once and marker is not None and not marker.exists() and step == args.steps // 2:
            marker.touch()
            raise RuntimeError("crashing once on purpose")
        if runtime.stop_requested():  # no checkpoint to keep: a requeued attempt starts over
            runtime.requeue(step=step)
    print(f"final loss {w * w:.6g} after {args.steps} steps", flush=True)


if __name__ == "__main__":
    main()
