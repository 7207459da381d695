"""Compute-node entry points: ``run`` (what submitit calls on every task) and ``main`` (``python -m ddp_core``).

Both build the ``DistEnv`` once, set up rank-prefixed logging, train, and leave through a clean exit path:
a failing rank logs its rank and error and exits non-zero at once (srun --kill-on-bad-exit ends the
others); a successful run meets at a barrier and destroys the process group before exiting.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

from ddp_core import distributed
from ddp_core.config import Config, load_config
from ddp_core.dist_env import DistEnv
from ddp_core.errors import DdpJobError
from ddp_core.log import setup_logging
from ddp_core.rundir import RunDir

log = logging.getLogger("ddp_core")


def _train(cfg: Config, run_dir: RunDir, env: DistEnv) -> dict[str, float]:
    from ddp_core.train import train  # torch is imported here, after logging is up

    try:
        return train(cfg, run_dir, env)
    except BaseException as err:
        log.error("rank %d/%d failed: %s: %s", env.rank, env.world_size, type(err).__name__, err, exc_info=True)
        raise


def run(run_dir: str) -> dict[str, float]:
    """Train the run in ``run_dir`` (created on the login node). Called by submitit on every task."""
    env = DistEnv.from_env()
    setup_logging(env)
    rd = RunDir(Path(run_dir))
    result = _train(rd.load_config(), rd, env)
    distributed.teardown()
    return result


def _run_dir_for(cfg: Config, env: DistEnv, explicit: Optional[str]) -> RunDir:
    if explicit:
        return RunDir(Path(explicit).resolve())
    # Every rank must derive the same directory without talking: key it on the launcher's job identity.
    key = os.environ.get("SLURM_JOB_ID") or os.environ.get("TORCHELASTIC_RUN_ID") or time.strftime("%Y%m%d-%H%M%S")
    return RunDir((Path(cfg.run.root) / f"{cfg.run.name}-{key}").resolve())


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ddp_core",
        description="Run the ddpjob trainer in this process (under srun, torchrun, or alone).",
    )
    parser.add_argument("target", help="a run directory, or a YAML config (a run directory is then created)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides (only with a YAML config)")
    parser.add_argument("--run-dir", help="where to create the run directory for a YAML config")
    args = parser.parse_intermixed_args(argv)

    env = DistEnv.from_env()
    setup_logging(env)
    try:
        target = Path(args.target)
        if target.is_dir():
            if args.overrides:
                raise DdpJobError(
                    "overrides apply to a YAML config, not a run directory", "use `ddpjob resume RUN k=v`"
                )
            run_dir = RunDir(target.resolve())
            cfg = run_dir.load_config()
        else:
            cfg = load_config(target, args.overrides)
            run_dir = _run_dir_for(cfg, env, args.run_dir)
            if env.is_main:
                run_dir.initialize(cfg)
    except DdpJobError as err:
        log.error("%s", err)
        return 2
    try:
        _train(cfg, run_dir, env)
        distributed.teardown()
    except BaseException:
        logging.shutdown()
        os._exit(1)  # skip interpreter teardown: a half-open gloo group can abort (rc 134) or hang there
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
