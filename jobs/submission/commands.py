"""``ddpjob submit`` and ``ddpjob prepare``: a config from the command line (``load_from_args``) through the
submission pipeline (check and resolve: ``jobs.submission.checks``; render: ``jobs.submission.render``; submit:
``jobs.submission.submit``). ``--dry-run`` prints what the same steps would queue; ``prepare --sbatch-script``
renders the plain template from the same request."""

from __future__ import annotations

import argparse
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional

from ddp_core.errors import DdpJobError
from jobs.submission import active, checks, snapshot

if TYPE_CHECKING:
    from ddp_core.config import Config
    from ddp_core.run.rundir import RunDir
    from jobs.submission.request import SlurmRequest
    from jobs.submission.submit import Submitted


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


def cmd_submit(
    args: argparse.Namespace, dependency: Optional[str] = None, follow: Optional[Callable[[Submitted], int]] = None
) -> int:
    """``dependency``: sbatch's --dependency (``--after``, resolved by ``jobs.pipelines.after``); ``follow``: what
    ``--wait`` (and ``--local``) does with the queued job (``jobs.runs.follow``, a layer above this one)."""
    from ddp_core.run.rundir import create_run_dir, new_run_dir
    from jobs.submission.submit import print_submitted, submit

    cfg = load_from_args(args)
    # A dry run checks the request against the cluster where there is one, and still renders where not.
    no_sinfo = args.dry_run and shutil.which("sinfo") is None
    cluster = not (args.no_cluster_check or no_sinfo)
    run_root = Path(cfg.run.root).resolve()
    request = checks.check_and_resolve(cfg, local=args.local, cluster=cluster, run_root=run_root, dependency=dependency)
    if args.dry_run:
        print_dry_run(cfg, request, new_run_dir(cfg))  # a name only: nothing is created
        return 0
    sub = submit(cfg, request, create_run_dir(cfg), local=args.local)  # created once the checks passed
    print_submitted(sub)
    return follow(sub) if follow is not None and (args.wait or args.local) else 0


def print_dry_run(cfg: Config, request: SlurmRequest, run_dir: RunDir) -> None:
    """``submit --dry-run``: the batch script ``submit`` would queue (the same renderer), the code snapshot, and the
    resolved config; nothing is created."""
    from ddp_core.config import to_yaml
    from jobs.submission.render import Layout, render

    code = snapshot.plan(cfg)  # an oversized snapshot is refused before anything is printed
    print("# sbatch script (nothing submitted)")
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
    print(render(request, Layout.run(run_dir.path)))
    print(f"# code snapshot: {code.summary() if code else 'none'}")
    for line in code.listing() if code else []:  # what would be sent: to the run directory, and with --host
        print(line)
    print("# resolved config")
    print(to_yaml(cfg), end="")


def cmd_prepare(args: argparse.Namespace) -> int:
    from ddp_core.run.rundir import RunDir, create_run_dir

    cfg = load_from_args(args)
    if args.job_id and not re.fullmatch(r"\d+(_\d+)?", args.job_id):
        # The id names a directory under run.root: anything but a Slurm job id could point outside it.
        raise DdpJobError(f"--job-id {args.job_id!r} is not a Slurm job id", "pass $SLURM_JOB_ID (digits)")
    # A requeued batch script runs `prepare` again: the same job must find the same run directory.
    own = RunDir((Path(cfg.run.root) / f"{cfg.run.name}-{args.job_id}").resolve()) if args.job_id else None
    if own is not None and own.path.exists():  # a reused id, or a folder made by hand: not its own
        if args.job_id not in active.slurm_jobs(own) or not own.exists():
            raise DdpJobError(
                f"run directory {own.path} exists and is not job {args.job_id}'s (its jobs: "
                f"{', '.join(active.slurm_jobs(own)) or 'none recorded'})",
                "give the job another run.name, or move that directory away",
            )
        active.refuse_if_active(own, this_job=args.job_id)  # another job still training there
        print(own.path)
        return 0
    request = checks.check_and_resolve(cfg, cluster=not args.no_cluster_check, run_root=Path(cfg.run.root).resolve())
    code = snapshot.plan(cfg)
    run_dir = own or create_run_dir(cfg)
    run_dir.initialize(cfg)
    if args.job_id:
        run_dir.record_job(args.job_id, "template")  # its requeue finds the directory its own
    try:
        snapshot.take(code, run_dir)
    except OSError as err:
        if run_dir.created or args.job_id:  # made here, or this job's own (named for it)
            shutil.rmtree(run_dir.path, ignore_errors=True)
        raise DdpJobError(f"could not copy the code snapshot: {err}", "check the space left under run.root") from err
    if args.sbatch_script:
        from jobs.submission.render import render_template

        (run_dir.slurm / "job.sbatch").write_text(render_template(request, run_dir))
    print(run_dir.path)
    return 0
