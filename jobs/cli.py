"""``ddpjob``: the login-node command line. It only assembles the parser and dispatches: each command is a
function of the package that owns it (``jobs.submission``: submit, prepare; ``jobs.runs``: resume, status, logs,
cancel, export, sync; ``jobs.sweeps``: sweep; ``jobs.report``: report; ``jobs.doctor``: doctor). Commands whose
options are many declare them beside their function (``add_parser``).

Imports stay light here (no torch): ``ddpjob --help`` must answer instantly on a login node.
User errors (``DdpJobError``) print one line and exit 2; a job that ran and failed exits 1.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Callable, NoReturn, Optional, Sequence

from ddp_core.errors import DdpJobError
from ddp_core.run import permissions
from jobs.remote import forward, ssh


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


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line like every other user error (subcommands inherit the class)."""

    def error(self, message: str) -> NoReturn:  # argparse's own signature: never returns
        self.exit(2, f"ddpjob: error: {message} (see: {self.prog} --help)\n")


def _parser() -> argparse.ArgumentParser:
    # Imported here, not above: `ddpjob --host NAME status` goes to the remote without any of them (forward.as_is).
    from jobs.doctor import checks as doctor
    from jobs.pipelines import after, launch
    from jobs.runs import export, logs, status
    from jobs.runs.lookup import RUN_HELP
    from jobs.sweeps import command as sweep

    parser = _Parser(prog="ddpjob", description="PyTorch distributed training as Slurm batch jobs (see README.md).")
    parser.add_argument("--version", action="version", version=f"ddpjob {ssh.version()}")
    parser.add_argument("--host", metavar="NAME", help="run the command on this cluster over SSH (docs/remote.md)")
    parser.add_argument("--remote-dir", metavar="DIR", help="with --host: the remote working directory")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("submit", help="validate a config, create its run directory and submit the job")
    _add_config_args(p)
    p.add_argument("--wait", action="store_true", help="follow the job and exit with its status")
    p.add_argument("--local", action="store_true", help="run here without Slurm (submitit local executor; waits)")
    p.add_argument("--dry-run", action="store_true", help="print the sbatch script and resolved config only")
    p.add_argument("--no-cluster-check", action="store_true", help="skip checking the request against sinfo")
    p.add_argument("--after", action="append", default=[], metavar="RUN|JOB[:ok|any|notok]", help=after.HELP)

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

    sweep.add_parser(sub)

    p = sub.add_parser("report", help="PNG + self-contained HTML of a run, or of a sweep's hyperparameters and outcome")
    p.add_argument("path", metavar="RUN|SWEEP", help=f"{RUN_HELP}; or a sweep folder or name")
    p.add_argument("--out", help="output directory (default: the path itself)")
    p.add_argument(
        "--metric",
        help="ranks trials (default: a search's own metric, else checkpoint.monitor, else eval/accuracy); "
        "a loss or error is minimised, anything else maximised; min:/max: says it outright",
    )
    p.add_argument("--table", choices=("csv", "json"), help="write only the trial table, trials.csv|json, for pandas")

    status.add_parser(sub)
    launch.add_parser(sub)
    logs.add_parsers(sub)
    export.add_parser(sub)
    doctor.add_parser(sub)

    p = sub.add_parser("sync", help="upload a run's offline W&B records (wraps `wandb sync`) and MLflow store")
    p.add_argument("run_dir", metavar="RUN", help=RUN_HELP)
    p.add_argument("--mlflow-uri", help="the MLflow tracking server to push an offline store to (MLFLOW_TRACKING_URI)")
    p.add_argument("--dry-run", action="store_true", help="print the wandb command and the MLflow push only")
    return parser


def _commands() -> dict[str, Callable[[argparse.Namespace], int]]:
    from jobs.doctor import checks as doctor
    from jobs.pipelines import after, launch
    from jobs.pipelines import status as pipeline_status
    from jobs.report import command as report
    from jobs.runs import export, logs, resume, status, sync
    from jobs.submission import commands as submission
    from jobs.sweeps import command as sweep

    return {
        "submit": after.cmd_submit,
        "prepare": submission.cmd_prepare,
        "resume": resume.cmd_resume,
        "sync": sync.cmd_sync,
        "report": report.cmd_report,
        **sweep.COMMANDS,
        **status.COMMANDS,
        **pipeline_status.COMMANDS,  # `status PIPELINE`: a pipeline's steps; a run or a sweep as before
        **launch.COMMANDS,
        **logs.COMMANDS,
        **export.COMMANDS,
        **doctor.COMMANDS,
    }


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = _parser()
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
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="ddpjob: %(levelname)s: %(message)s")
    argv = list(sys.argv[1:] if argv is None else argv)
    permissions.tighten(permissions.is_private())  # nothing ddpjob writes is writable by others (a run: checks)
    try:
        ssh.check_expected_version()
        direct = forward.as_is(argv)  # `--host NAME status ...`: the remote's own parser answers
        if direct is not None:
            return direct
        args = _parse(argv)
        if args.host:
            return forward.forward(args, forward.command_argv(argv))
        return _commands()[args.command](args)
    except DdpJobError as err:
        print(f"ddpjob: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("ddpjob: interrupted (submitted jobs keep running)", file=sys.stderr)
        return 130
