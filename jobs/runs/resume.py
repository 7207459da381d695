"""``ddpjob resume RUN [key=value ...]``: submit an ended run again, through the same submission pipeline as
``submit``; it continues from its newest checkpoint. It refuses a change of the model (the checkpoint's shapes),
says which changes break exactness (``ddp_core.config.continuation``), keeps the nodes the run excluded, and never
starts a run that is still queued or running."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from ddp_core.errors import DdpJobError
from jobs.runs.follow import follow
from jobs.runs.lookup import resolve
from jobs.submission.submit import print_submitted

if TYPE_CHECKING:
    from ddp_core.config import Config
    from ddp_core.run.rundir import RunDir


def cmd_resume(args: argparse.Namespace) -> int:
    from ddp_core.config import load_config, to_dict
    from ddp_core.config.continuation import breaks
    from ddp_core.run.rundir import RunDir
    from jobs.submission import active, checks
    from jobs.submission.submit import submit

    run_dir = RunDir(resolve(args.run_dir, Path(args.root)))
    old = run_dir.load_config()
    cfg = load_config(run_dir.config_file, args.overrides)
    if to_dict(cfg)["task"]["model"] != to_dict(old)["task"]["model"] or cfg.task.target != old.task.target:
        raise DdpJobError(
            "resume cannot change task.target or task.model.*: the checkpoint's weights have the old model's shape",
            "start a new run with `ddpjob submit` instead",
        )
    for line in [] if cfg.script.enabled else breaks(old, cfg):  # a script's exactness is the script's own
        print(f"exactness: {line}")
    keep_off_excluded(run_dir, cfg, args.include_node)
    request = checks.check_and_resolve(cfg, local=args.local, run_root=run_dir.path.parent)
    with run_dir.submit_lock():  # from "not active" to "job recorded": concurrent resumes queue up here
        active.refuse_if_active(run_dir)  # however its jobs were started; fails closed
        sub = submit(cfg, request, run_dir, local=args.local, fresh=False)
    print_submitted(sub)
    return follow(sub) if (args.wait or args.local) else 0


def keep_off_excluded(run_dir: RunDir, cfg: Config, include: Sequence[str]) -> None:
    """A resumed run stays off the nodes it excluded after failures (``ddp_core.cluster.failures``), as its requeued
    attempts did: ``--exclude``, beside any the config sets. ``include``: hosts taken back (an ``included`` event)."""
    from ddp_core.cluster.failures import excluded_hosts

    excluded = excluded_hosts(run_dir.events())
    for host in include:
        if host not in excluded:
            shown = ", ".join(excluded) or "none"
            raise DdpJobError(f"--include-node {host}: the run has not excluded it (excluded: {shown})", "drop it")
        run_dir.log_event("included", host=host)
        excluded.pop(host)
    for host, why in excluded.items():
        print(f"excluding {host}: {why} (take it back with --include-node {host})")
    # The resumed config records the list (slurm.additional.exclude): a host taken back leaves it too.
    own = [h for h in str(cfg.slurm.additional.get("exclude", "")).split(",") if h and h not in include]
    hosts = ",".join(dict.fromkeys([*own, *excluded]))
    if hosts:
        cfg.slurm.additional["exclude"] = hosts
    else:
        cfg.slurm.additional.pop("exclude", None)
