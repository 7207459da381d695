"""``ddpjob submit`` and ``ddpjob prepare``: a config from the command line (``load_from_args``) through the
submission pipeline (``jobs.submission.pipeline``), and how a submitted job is shown and followed (``--wait``), which
``ddpjob resume`` shares."""

from __future__ import annotations

import argparse
import re
import shutil
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from ddp_core.errors import DdpJobError
from jobs.submission import snapshot

if TYPE_CHECKING:
    from ddp_core.config import Config


def load_from_args(args: argparse.Namespace) -> Config:
    """The config of ``submit``/``prepare``: CONFIG + overrides, plus ``--script`` and the script's arguments after
    ``--``. In script mode CONFIG is optional (run.name then defaults to the script's name)."""
    from ddp_core.config import load_config, validate

    config, overrides = args.config, list(args.overrides)
    given = overrides if config is None else [config, *overrides]
    module = next((o.partition("=")[2] for o in given if o.startswith("script.module=")), None)
    scripted = args.script is not None or module is not None
    if scripted and config is not None and "=" in config and not Path(config).exists():
        overrides.insert(0, config)  # `submit --script t.py k=v`: argparse took the first override for CONFIG
        config = None
    if config is None:
        if not scripted:
            raise DdpJobError("no config given", "ddpjob submit CONFIG.yaml [key=value ...], or --script train.py")
        name = Path(args.script).stem if args.script is not None else str(module).rpartition(".")[2]
        overrides.insert(0, f"run.name={name}")  # the user's own run.name=..., later in the list, wins
    if args.no_snapshot:
        overrides.append("snapshot.enabled=false")
    if args.script is not None:
        # Keys that need a script (script.launcher, script.arg_style) are checked as the config loads: a stand-in
        # path until the real one is set below, as it is (an override's value would be read as YAML).
        overrides.insert(0, "script.path=--script")
    cfg = load_config(config, overrides)
    if args.script is not None or args.script_args is not None:
        # Set on the loaded config, not as overrides: a path or an argument is taken as it is, never read as YAML.
        if args.script is not None:
            cfg.script.path = args.script
        if args.script_args is not None:
            cfg.script.args = list(args.script_args)
        validate(cfg)
    return cfg


def print_submitted(sub: object) -> None:
    from jobs.submission.submit import Submitted

    assert isinstance(sub, Submitted)
    print(f"job:     {sub.job_id}")
    print(f"run dir: {sub.run_dir.path}")
    print(f"log:     {sub.log_path}")
    sys.stdout.flush()


def follow(sub: object) -> int:
    from jobs.submission.submit import Submitted, wait

    assert isinstance(sub, Submitted)
    started = time.monotonic()
    ok, result, state = wait(sub)
    print(f"job {sub.job_id} {'COMPLETED' if ok else 'FAILED'} after {time.monotonic() - started:.1f} s")
    if not ok:
        print(f"error: {state}")
        print(f"logs:  {sub.run_dir.slurm}")
        return 1
    from ddp_core.checkpoint import store as checkpoint

    if result:
        print("final eval: " + " ".join(f"{k} {v:.4f}" for k, v in sorted(result.items())))
    latest = checkpoint.find_latest(sub.run_dir.checkpoints)
    print(f"checkpoint: {latest.path if latest else 'none'}")
    offline = sorted(sub.run_dir.wandb.glob("offline-run-*"))
    if offline:
        print(f"W&B (offline): {offline[-1]}  (upload: ddpjob sync {sub.run_dir.path})")
    return 0


def cmd_submit(args: argparse.Namespace) -> int:
    from ddp_core.config import to_yaml
    from ddp_core.run.rundir import new_run_dir
    from jobs.submission.request import SlurmRequest
    from jobs.submission.submit import render_submitit_script, submit, validate_for_submit

    cfg = load_from_args(args)
    # A dry run checks the request against the cluster where there is one, and still renders where not.
    no_sinfo = args.dry_run and shutil.which("sinfo") is None
    validate_for_submit(cfg, local=args.local, cluster_check=not (args.no_cluster_check or no_sinfo))
    run_dir = new_run_dir(cfg)
    if args.dry_run:
        code = snapshot.plan(cfg)  # an oversized snapshot is refused before anything is printed
        print("# sbatch script (nothing submitted)")
        request = SlurmRequest.resolve(cfg)
        entry = request.entry_module
        print(f"# each task runs {entry}.run({str(run_dir.path)!r}), as python -m {entry} RUN_DIR would")
        if request.elastic:
            from ddp_core.config.batch import job_world_sizes

            sizes = " or ".join(str(n) for n in job_world_sizes(cfg))
            print(f"# slurm.nodes={request.nodes}: each attempt runs on the nodes Slurm gives it, world size {sizes}")
        if cfg.script.launcher == "torchrun":
            ranks = request.ranks_per_task
            print(f"# script.launcher=torchrun: one task per node, a torchrun agent that starts {ranks} ranks")
        if (container := cfg.slurm.container).enabled:
            where = f"# slurm.container: each task runs inside {container.image} ({container.runtime})"
            print(f"{where}; the batch script and its watcher run outside it")
        print(render_submitit_script(cfg, run_dir))
        print(f"# code snapshot: {code.summary() if code else 'none'}")
        print("# resolved config")
        print(to_yaml(cfg), end="")
        return 0
    sub = submit(cfg, run_dir, local=args.local)
    print_submitted(sub)
    return follow(sub) if (args.wait or args.local) else 0


def cmd_prepare(args: argparse.Namespace) -> int:
    from ddp_core.run.rundir import RunDir, new_run_dir
    from jobs.submission.submit import validate_for_submit

    cfg = load_from_args(args)
    if args.job_id and not re.fullmatch(r"\d+(_\d+)?", args.job_id):
        # The id names a directory under run.root: anything but a Slurm job id could point outside it.
        raise DdpJobError(f"--job-id {args.job_id!r} is not a Slurm job id", "pass $SLURM_JOB_ID (digits)")
    if args.job_id:
        # A requeued batch script runs `prepare` again: the same job must find the same run directory.
        run_dir = RunDir((Path(cfg.run.root) / f"{cfg.run.name}-{args.job_id}").resolve())
        if run_dir.exists():
            print(run_dir.path)
            return 0
    else:
        run_dir = new_run_dir(cfg)
    validate_for_submit(cfg, local=False, cluster_check=not args.no_cluster_check)
    code = snapshot.plan(cfg)
    run_dir.initialize(cfg)
    try:
        snapshot.take(code, run_dir)
    except OSError as err:
        shutil.rmtree(run_dir.path, ignore_errors=True)
        raise DdpJobError(f"could not copy the code snapshot: {err}", "check the space left under run.root") from err
    if args.sbatch_script:
        from jobs.submission.template import render

        (run_dir.slurm / "job.sbatch").write_text(render(cfg, run_dir))
    print(run_dir.path)
    return 0
