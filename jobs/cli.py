"""``ddpjob``: the login-node command line (submit, prepare, resume, sync, report; sweep, status, logs, cancel,
export and doctor are declared in their own modules).

Imports stay light here (no torch): ``ddpjob --help`` must answer instantly on a login node.
User errors (``DdpJobError``) print one line and exit 2; a job that ran and failed exits 1.
"""

from __future__ import annotations

import argparse
import logging
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn, Optional, Sequence

from ddp_core.errors import DdpJobError
from jobs import doctor as doctor_cmd
from jobs import export as export_cmd
from jobs import logs as logs_cmds
from jobs import snapshot, sweep_cmd
from jobs import status as status_cmds
from jobs.lookup import RUN_HELP, resolve

if TYPE_CHECKING:
    from ddp_core.config import Config
    from ddp_core.run.rundir import RunDir

log = logging.getLogger("ddpjob")


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", nargs="?", help="YAML config, e.g. configs/digits.yaml (optional with --script)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. optim.lr=3e-4")
    p.add_argument(
        "--script",
        metavar="TRAIN.py",
        help="script mode: run this torchrun-style script instead of the trainer; its arguments go after --",
    )
    p.add_argument(
        "--no-snapshot",
        action="store_true",
        help="do not copy the code into the run directory (snapshot.enabled=false): attempts run the code as it is",
    )


def _load(args: argparse.Namespace) -> Config:
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


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line like every other user error (subcommands inherit the class)."""

    def error(self, message: str) -> NoReturn:  # argparse's own signature: never returns
        self.exit(2, f"ddpjob: error: {message} (see: {self.prog} --help)\n")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="ddpjob", description="PyTorch distributed training as Slurm batch jobs (see README.md).")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("submit", help="validate a config, create its run directory and submit the job")
    _add_config_args(p)
    p.add_argument("--wait", action="store_true", help="follow the job and exit with its status")
    p.add_argument("--local", action="store_true", help="run here without Slurm (submitit local executor; waits)")
    p.add_argument("--dry-run", action="store_true", help="print the sbatch script and resolved config only")
    p.add_argument("--no-cluster-check", action="store_true", help="skip checking the request against sinfo")

    p = sub.add_parser("prepare", help="validate a config and create its run directory; print its path")
    _add_config_args(p)
    p.add_argument("--sbatch-script", action="store_true", help="also render RUN_DIR/slurm/job.sbatch")
    p.add_argument("--no-cluster-check", action="store_true", help="skip checking the request against sinfo")
    p.add_argument(
        "--job-id", help="name the run directory <run.name>-<JOB_ID> and reuse it if it exists (requeued sbatch jobs)"
    )

    p = sub.add_parser("resume", help="submit an ended run again; it continues from its newest checkpoint")
    p.add_argument("run_dir", metavar="RUN", help=RUN_HELP)
    p.add_argument("--root", default="runs", help="where to look for a run named by a job id or a name (default: runs)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="changes, e.g. train.max_steps=2000")
    p.add_argument("--wait", action="store_true", help="follow the job and exit with its status")
    p.add_argument("--local", action="store_true", help="run here without Slurm (waits)")
    p.add_argument("--include-node", action="append", default=[], metavar="HOST",
                   help="take back a node the run excluded after failures (repeatable)")  # fmt: skip

    sweep_cmd.add_parser(sub)

    p = sub.add_parser("report", help="PNG + self-contained HTML of a run, or of a sweep's hyperparameters and outcome")
    p.add_argument("path", metavar="RUN|SWEEP", help=f"{RUN_HELP}; or a sweep folder or name")
    p.add_argument("--out", help="output directory (default: the path itself)")
    p.add_argument(
        "--metric",
        help="ranks trials (default: a search's own metric, else checkpoint.monitor, else eval/accuracy); "
        "a loss or error is minimised, anything else maximised; min:/max: says it outright",
    )
    p.add_argument("--table", choices=("csv", "json"), help="write only the trial table, trials.csv|json, for pandas")

    status_cmds.add_parser(sub)
    logs_cmds.add_parsers(sub)
    export_cmd.add_parser(sub)
    doctor_cmd.add_parser(sub)

    p = sub.add_parser("sync", help="upload a run's offline W&B records (wraps `wandb sync`)")
    p.add_argument("run_dir", metavar="RUN", help=RUN_HELP)
    p.add_argument("--dry-run", action="store_true", help="print the wandb command only")
    return parser


def _print_submitted(sub: object) -> None:
    from jobs.submit import Submitted

    assert isinstance(sub, Submitted)
    print(f"job:     {sub.job_id}")
    print(f"run dir: {sub.run_dir.path}")
    print(f"log:     {sub.log_path}")
    sys.stdout.flush()


def _follow(sub: object) -> int:
    from jobs.submit import Submitted, wait

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
    from jobs.request import SlurmRequest
    from jobs.submit import render_submitit_script, submit, validate_for_submit

    cfg = _load(args)
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
    _print_submitted(sub)
    return _follow(sub) if (args.wait or args.local) else 0


def cmd_prepare(args: argparse.Namespace) -> int:
    from ddp_core.run.rundir import RunDir, new_run_dir
    from jobs.submit import validate_for_submit

    cfg = _load(args)
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
        from jobs.sbatch_template import render

        (run_dir.slurm / "job.sbatch").write_text(render(cfg, run_dir))
    print(run_dir.path)
    return 0


def cmd_resume(args: argparse.Namespace) -> int:
    from ddp_core.config import load_config, to_dict
    from ddp_core.config.continuation import breaks
    from ddp_core.run.rundir import RunDir
    from jobs.submit import submit, validate_for_submit
    from jobs.sweep import active_jobs

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
    validate_for_submit(cfg, local=args.local)
    with run_dir.submit_lock():  # from "not active" to "job recorded": concurrent resumes queue up here
        recorded = [str(j["job_id"]) for j in run_dir.jobs() if j.get("via") != "local"]
        queued = active_jobs(recorded)  # no squeue here (--local without Slurm): the gateway lists nothing
        active = [j for j in recorded if j in queued]
        if active:
            raise DdpJobError(
                f"run {run_dir.name} is still queued or running as job {active[0]}", "wait for it or scancel it first"
            )
        sub = submit(cfg, run_dir, local=args.local, fresh=False)
    _print_submitted(sub)
    return _follow(sub) if (args.wait or args.local) else 0


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


def cmd_sync(args: argparse.Namespace) -> int:
    from ddp_core.run.rundir import RunDir

    run_dir = RunDir(resolve(args.run_dir))
    offline = sorted(str(p) for p in run_dir.wandb.glob("offline-run-*"))
    if not offline:
        raise DdpJobError(f"no offline W&B records in {run_dir.wandb}", "was the run started with wandb.mode=disabled?")
    command = [sys.executable, "-m", "wandb", "sync", "--include-offline", *offline]
    print(shlex.join(command))
    if args.dry_run:
        return 0
    return subprocess.call(command)


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


_COMMANDS = {
    "submit": cmd_submit,
    "prepare": cmd_prepare,
    "resume": cmd_resume,
    "sync": cmd_sync,
    "report": cmd_report,
}


_COMMANDS |= sweep_cmd.COMMANDS | status_cmds.COMMANDS | logs_cmds.COMMANDS | export_cmd.COMMANDS | doctor_cmd.COMMANDS


def main(argv: Optional[Sequence[str]] = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="ddpjob: %(levelname)s: %(message)s")
    parser = _parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    script_args = None
    if "--" in argv:  # everything after the first `--` is the script's own, passed as it is
        script_args, argv = argv[argv.index("--") + 1 :], argv[: argv.index("--")]
    # Overrides may come after options (`submit cfg.yaml --wait optim.lr=1e-3`): collect the leftovers.
    args, extra = parser.parse_known_args(argv)
    if script_args is not None and not hasattr(args, "script"):
        parser.error(f"arguments after -- are a script's: only submit, prepare and sweep take them, not {args.command}")
    args.script_args = script_args
    if extra and (not hasattr(args, "overrides") or any(e.startswith("-") for e in extra)):
        parser.prog = f"ddpjob {args.command}"  # the help that lists this command's options
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    try:
        return _COMMANDS[args.command](args)
    except DdpJobError as err:
        print(f"ddpjob: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("ddpjob: interrupted (submitted jobs keep running)", file=sys.stderr)
        return 130
