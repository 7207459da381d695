"""Each command, forwarded: ``ddpjob --host NAME COMMAND ...`` runs ``ddpjob COMMAND ...`` on the remote, in its
working directory, with its output on this terminal and its exit status as this one's.

What differs by command (``HANDLERS``; any other command goes as it is):

- ``submit`` and ``sweep``: the config is loaded and validated here (and the task imported when this machine has
  torch); the config files and the code snapshot are sent (``jobs.remote.staging``) and the command's paths point at
  what was sent. Nothing is submitted unless all of it arrived.
- ``logs -f``: a connection lost while following is opened again, and the remote skips the lines already shown.
- ``report``: the remote writes the report in a folder of its own, which is brought back here (``--out``, default
  ``reports/NAME``).
- ``pipeline``: the file and each step's config and code, checked here and sent; the copy of the file names them.

``send_files`` is the generic piece for a command that names local files (a pipeline file and the configs it names):
they are sent keeping their relative paths, and the arguments that name them rewritten.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import logging
import os
import shlex
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Mapping, Optional, Sequence

from ddp_core.errors import DdpJobError
from ddp_core.run import private
from jobs.remote import hosts
from jobs.remote.ssh import SSH_FAILED, Gateway
from jobs.remote.staging import Stage

if TYPE_CHECKING:  # the submission's modules load the config's: imported where a submission is forwarded
    from ddp_core.config import Config
    from jobs.submission.snapshot import Plan

log = logging.getLogger(__name__)
RECONNECTS = 5  # a `logs -f` whose connection drops tries this often, a few seconds apart, before it gives up
RECONNECT_WAIT_S = 2.0


def forward(args: argparse.Namespace, argv: Sequence[str], gateway: Optional[Gateway] = None) -> int:
    """Run the parsed command ``args`` (``argv``: its arguments from the command name on) on ``args.host``."""
    gw = gateway or Gateway(hosts.lookup(args.host, args.remote_dir))
    gw.connect()
    if args.command not in HANDLERS:
        return run_remote(gw, argv)
    return HANDLERS[args.command](gw, args, list(argv))


def split_globals(argv: Sequence[str]) -> tuple[dict[str, str], list[str]]:
    """``--host``/``--remote-dir`` (before the command) and the command's own arguments, from the command name on
    (with the script's arguments after ``--`` as given)."""
    found: dict[str, str] = {}
    for i, arg in enumerate(argv):
        name, eq, value = arg.partition("=")
        if name in ("--host", "--remote-dir"):
            if not eq and i + 1 < len(argv):
                value = argv[i + 1]
            found[name] = value
        elif i == 0 or argv[i - 1] not in ("--host", "--remote-dir"):
            return found, list(argv[i:])
    return found, []


def command_argv(argv: Sequence[str]) -> list[str]:
    return split_globals(argv)[1]


def as_is(argv: Sequence[str]) -> Optional[int]:
    """``--host NAME COMMAND ...`` for a command that sends and fetches nothing (``status``, ``cancel``, ``resume``,
    ``doctor``, ...): sent as typed, the remote's parser and command answer, and this process imports nothing of
    ddpjob's commands (what keeps a remote ``status`` close to a local one). None for everything else."""
    found, rest = split_globals(argv)
    if "--host" not in found or not rest or rest[0].startswith("-") or rest[0] in HANDLERS:
        return None
    gw = Gateway(hosts.lookup(found["--host"], found.get("--remote-dir")))
    gw.connect()
    return run_remote(gw, rest)


def run_remote(gw: Gateway, argv: Sequence[str], env: Mapping[str, str] = {}, pythonpath: str = "") -> int:
    """``ddpjob ARGV`` on the remote, its output straight to this terminal; its exit status."""
    proc = gw.stream(gw.command(argv, env, pythonpath))
    return lost_if_failed(gw, argv, proc.wait())


def lost_if_failed(gw: Gateway, argv: Sequence[str], code: int) -> int:
    if code == SSH_FAILED:  # ddpjob never exits 255: ssh lost the connection
        raise DdpJobError(
            f"the connection to {gw.host.name} was lost during `ddpjob {argv[0]}`",
            f"run `ddpjob --host {gw.host.name} status` to see what happened, then run the command again",
        )
    return code


def rewrite(argv: Sequence[str], swap: Mapping[str, str]) -> list[str]:
    """``argv`` with each argument (or ``--option=value``'s value) that names a sent file pointing at its copy;
    the script's own arguments after ``--`` are left as they are."""
    out, tail = [], False
    for arg in argv:
        opt, eq, value = arg.partition("=")
        if tail or not swap:
            out.append(arg)
        elif arg in swap:
            out.append(swap[arg])
        elif eq and opt.startswith("--") and value in swap:
            out.append(f"{opt}={swap[value]}")
        else:
            out.append(arg)
        tail = tail or arg == "--"
    return out


def send_files(
    gw: Gateway, argv: Sequence[str], files: Sequence[Path | str], stage: Optional[Stage] = None
) -> list[str]:
    """Send ``files`` (keeping their paths relative to each other) and return ``argv`` naming the copies; pushed
    unless a ``stage`` the caller adds more to (and pushes) is given."""
    own = stage is None
    stage = stage or Stage(gw)
    swap = {str(f): stage.add_file(f) for f in files}
    if own:
        stage.push()
    return rewrite(argv, swap)


def check_here(cfg: Config) -> None:
    """What can be checked on this machine before sending: the script exists (its path made absolute), and the
    task's import and model where torch is installed here (else the remote checks them, before it submits)."""
    if cfg.script.enabled:
        from ddp_core.script.prepare import resolve_for_submit

        resolve_for_submit(cfg.script)
    elif importlib.util.find_spec("torch") is not None:
        from ddp_core.strategies.check import check_model
        from ddp_core.tasks.base import check_task

        check_task(cfg.task)
        check_model(cfg)


def send_code(gw: Gateway, stage: Stage, argv: list[str], cfg: Config, code: Optional[Plan]) -> str:
    """Add the code snapshot to ``stage``; a script's path in ``argv`` points at its copy (``--script``). Returns
    the remote folder a task's package is imported from ("" for none)."""
    if code is None:
        return ""
    root = stage.add_code(code)
    if cfg.script.path is None:
        return root if code.kind != "directory" else ""
    cut = argv.index("--") if "--" in argv else len(argv)
    own, tail = argv[:cut], argv[cut:]
    if "--script" in own:
        del own[own.index("--script") : own.index("--script") + 2]
    own = [a for a in own if not a.startswith("--script=")]
    # --script wins over a script.path of the config file or an override
    argv[:] = [own[0], "--script", stage.remote_path(Path(cfg.script.path)), *own[1:], *tail]
    return ""


def submit(gw: Gateway, args: argparse.Namespace, argv: list[str]) -> int:
    from jobs.submission import snapshot
    from jobs.submission.commands import load_from_args

    cfg = load_from_args(args)
    check_here(cfg)
    return send_and_run(gw, args, argv, cfg, snapshot.plan(cfg), [args.config])


def sweep(gw: Gateway, args: argparse.Namespace, argv: list[str]) -> int:
    from jobs.submission import snapshot
    from jobs.sweeps.command import is_search, load_from_args

    files: list[Optional[str]] = [args.config]
    if is_search(args):  # an adaptive search's config is checked by the remote; its code is the remote's for now
        log.warning("an adaptive search over --host runs the remote's code: only its config files are sent")
        return send_and_run(gw, args, argv, None, None, [*files, base_of(args.config)])
    spec = load_from_args(args)
    files.append(str(spec.base_config) if spec.base_config else None)
    check_here(copy.deepcopy(spec.configs[0]))  # a copy: the check makes its script's path absolute
    return send_and_run(gw, args, argv, spec.configs[0], snapshot.plan_sweep(spec.configs), files)


def base_of(sweep_file: Optional[str]) -> Optional[str]:
    """The base config a sweep file names (``base:``, relative to the file), if any: it is sent with the file."""
    if sweep_file is None or not Path(sweep_file).is_file():
        return None
    from ddp_core.config.input import read_yaml_mapping

    base = read_yaml_mapping(Path(sweep_file)).get("base")
    return os.path.normpath(Path(sweep_file).parent / str(base)) if base else None


def send_and_run(
    gw: Gateway,
    args: argparse.Namespace,
    argv: list[str],
    cfg: Optional[Config],
    code: Optional[Plan],
    files: Sequence[Optional[str]],
) -> int:
    """Send the config files and the code, then run the command on what was sent."""
    stage = Stage(gw)
    try:
        pythonpath = send_code(gw, stage, argv, cfg, code) if cfg is not None else ""
        argv = send_files(gw, argv, [f for f in dict.fromkeys(files) if f and Path(f).is_file()], stage)
    except BaseException:
        stage.discard()
        raise
    stage.push()  # raises, with nothing submitted, unless everything arrived
    return run_remote(gw, argv, stage.env(), pythonpath)


def pipeline(gw: Gateway, args: argparse.Namespace, argv: list[str]) -> int:
    """A pipeline file: read and checked here (its steps, their order, each step's config and references, as
    ``submit``'s are), sent with each step's config and code snapshot (a script step's folder, a config step's task
    package), and run on the copies: the copy of the file names the configs and scripts that were sent."""
    import yaml

    from ddp_core.config.input import read_yaml_mapping
    from jobs.pipelines import launch, spec
    from jobs.submission import snapshot

    pipe = spec.load(Path(args.file))
    data, roots = read_yaml_mapping(pipe.file), []
    data["name"] = pipe.name  # the copy's record is the pipeline's, whatever the file's name
    stage = Stage(gw)
    try:
        with private.temporary("pipeline") as folder:
            steps = [launch.load_step(pipe, step, False, folder, checked=False) for step in pipe.steps]
        for prepared in steps:
            check_here(copy.deepcopy(prepared.cfg))
            body, code = data["steps"][prepared.step.name], snapshot.plan(prepared.cfg)
            root = stage.add_code(code) if code is not None else ""
            if prepared.step.script:
                body["script"] = stage.remote_path(prepared.step.script)
            elif root and code is not None and code.kind != "directory":
                roots.append(root)
            if prepared.step.config:
                body["config"] = stage.add_file(prepared.step.config)
        sent = stage.local / "tree" / stage.relative(pipe.file)
        private.makedirs(sent.parent)
        with open(sent, "w", opener=private.opener) as f:
            f.write(yaml.safe_dump(data, sort_keys=False))
        argv = rewrite(argv, {args.file: stage.remote_path(pipe.file)})
    except BaseException:
        stage.discard()
        raise
    stage.push()
    return run_remote(gw, argv, stage.env(), ":".join(dict.fromkeys(roots)))


def follow_logs(gw: Gateway, args: argparse.Namespace, argv: list[str]) -> int:
    """``logs -f``: the remote's lines as they come; a lost connection is opened again and the remote asked to skip
    the lines already shown (``logs --skip-lines``), so none is shown twice."""
    if not args.follow:
        return run_remote(gw, argv)
    try:
        return follow_again(gw, argv)
    except KeyboardInterrupt:  # the normal way out of -f, as on the login node
        return 0


def follow_again(gw: Gateway, argv: list[str]) -> int:
    shown, tries = 0, 0
    while True:
        remote = [*argv, "--skip-lines", str(shown)] if shown else argv
        proc = gw.stream(gw.command(remote), stdout=subprocess.PIPE)
        assert proc.stdout is not None
        partial = ""
        for line in proc.stdout:
            if not line.endswith("\n"):
                partial = line  # shown only if the stream ends here: a lost connection sends it again whole
                break
            sys.stdout.write(line)
            sys.stdout.flush()
            shown, tries = shown + 1, 0
        code = proc.wait()
        if code != SSH_FAILED or tries >= RECONNECTS:
            sys.stdout.write(partial)
            return lost_if_failed(gw, argv, code)
        tries += 1
        print(f"ddpjob: connection to {gw.host.name} lost; following again after line {shown}", file=sys.stderr)
        time.sleep(RECONNECT_WAIT_S * (tries - 1))
        try:
            gw.connect()
        except DdpJobError as err:
            if tries >= RECONNECTS:
                raise
            log.debug("reconnect %d failed: %s", tries, err)


def report(gw: Gateway, args: argparse.Namespace, argv: list[str]) -> int:
    """The report written on the remote into a folder of its own, brought back to ``--out`` here."""
    local = Path(args.out or Path("reports") / Path(args.path).name)
    remote = f"{gw.host.remote_dir.rstrip('/')}/.ddpjob/reports/{uuid.uuid4().hex[:12]}"
    argv = [a for a in argv if not a.startswith("--out=")]
    if "--out" in argv:
        del argv[argv.index("--out") : argv.index("--out") + 2]
    proc = gw.stream(gw.command([*argv, "--out", remote]), stdout=subprocess.PIPE)
    out, _ = proc.communicate()
    code = lost_if_failed(gw, argv, proc.returncode)
    if code == 0:
        local.mkdir(parents=True, exist_ok=True)
        got = fetch_report(gw, remote, local)
        if got.returncode != 0:
            why = (got.stderr.strip().splitlines() or [f"rsync exited {got.returncode}"])[-1]
            raise DdpJobError(f"could not bring the report back from {gw.host.name}:{remote}: {why}", "run it again")
        out = out.replace(remote, str(local))
    gw.runner(gw.ssh(), f"rm -rf {shlex.quote(remote)}")
    sys.stdout.write(out)
    return code


def fetch_report(gw: Gateway, remote: str, local: Path) -> subprocess.CompletedProcess[str]:
    """The report's own files from the remote's folder, and nothing else a compromised remote could leave there:
    regular files of those names only (no symlink, device or folder: ``-rt``, not ``-a``), never a path outside
    ``local``, written with this user's umask."""
    from jobs.report import FILES

    only = [*(f"--include=/{name}" for name in FILES), "--exclude=*"]
    return gw.rsync(f":{remote}/", f"{local}/", extra=only, flags=("-rt", "--no-links", "--no-devices"))


HANDLERS: dict[str, Callable[[Gateway, argparse.Namespace, list[str]], int]] = {
    "submit": submit,
    "sweep": sweep,
    "logs": follow_logs,
    "report": report,
    "pipeline": pipeline,
}
