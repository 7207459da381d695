"""The one SSH gateway: every call to the remote goes through the system ``ssh`` (and ``rsync -e`` with the same
options), so the user's SSH config, keys and agent apply, and one persistent connection serves every command.

The connection: ``ControlMaster=auto`` with ``ControlPersist``, its socket in a state folder of ddpjob's
(``$DDPJOB_STATE_DIR``, default ``~/.ssh/ddpjob``; private to this user, ``ddp_core.run.private``: whoever could
enter it could use the logged-in connection): the first command logs in (a two-factor login is typed once, in a
terminal) and leaves a master running; later commands reuse it without a new login. Outside a terminal
``BatchMode=yes``: nothing prompts, a login that would need a prompt fails at once. ``ConnectTimeout`` bounds an
unreachable host. ``connect`` logs in when no master runs and checks the remote ddpjob's version; an SSH failure is
one line naming the host and the fix (``explain``).

``Gateway.runner`` is the one injectable runner for captured calls (like ``ddp_core.cluster.slurm``'s).
"""

from __future__ import annotations

import functools
import hashlib
import os
import posixpath
import pwd
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Optional, Sequence

from ddp_core.errors import DdpJobError
from ddp_core.run import private
from jobs.remote.hosts import Host

Runner = Callable[[Sequence[str], Optional[str]], subprocess.CompletedProcess[str]]
SSH_FAILED = 255  # ssh's own exit status for a connection that failed or was lost
PERSIST = "10m"  # how long an idle master connection stays up
STATE_ENV = "DDPJOB_STATE_DIR"
EXPECT_ENV, NAME_ENV = "DDPJOB_EXPECT_VERSION", "DDPJOB_HOST_NAME"  # for the remote's check_expected_version
WRAPPER_ERRORS = ("is not a directory", "no ddpjob at ")  # the remote wrapper's own lines (``Gateway.command``)
# What ssh asks the remote's login shell to run: the command line itself comes on stdin, so neither the laptop's
# ssh nor the remote shell has it on its command line, where ps shows it (the host file's setup: line, the overrides).
FROM_STDIN = 'eval "$(cat)"'


def run_captured(cmd: Sequence[str], script: Optional[str] = None) -> subprocess.CompletedProcess[str]:
    """``cmd``, captured; ``script`` on its stdin (None: none)."""
    stdin = subprocess.DEVNULL if script is None else None
    return subprocess.run(list(cmd), capture_output=True, text=True, stdin=stdin, input=script)


def version() -> str:
    """This ddpjob's version (the installed distribution's), as ``ddpjob --version`` prints it."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("ddpjob")
    except PackageNotFoundError:
        return "unknown"


def explain(host: Host, stderr: str) -> DdpJobError:
    """ssh's failure (exit status 255) as one line naming the host and the fix."""
    text = stderr.strip()
    last = text.splitlines()[-1] if text else "ssh failed without a message"
    where = f"{host.name} ({host.destination})" if host.destination != host.name else host.name
    setup = "ddpjob --host reads ~/.ssh/config and the host file (docs/remote.md)"
    if "Could not resolve hostname" in text:
        return DdpJobError(
            f"unknown host {where}: {last}",
            f"add 'Host {host.name}' to ~/.ssh/config or an entry to the host file; {setup}",
        )
    if "Host key verification failed" in text or "REMOTE HOST IDENTIFICATION HAS CHANGED" in text:
        return DdpJobError(
            f"{where} refused: its host key is not known or has changed",
            f"log in once with `ssh {host.destination}` and check its host key",
        )
    if "Permission denied" in text or "Too many authentication failures" in text:
        return DdpJobError(
            f"{where} refused the login: {last}",
            f"check the key: `ssh {host.destination} true` must log in (ssh-add, IdentityFile in ~/.ssh/config); "
            "a login with a password or two-factor: run the ddpjob command once in a terminal, later ones reuse it",
        )
    if any(s in text for s in ("Connection refused", "timed out", "No route to host", "Network is unreachable")):
        return DdpJobError(
            f"{where} is unreachable: {last}",
            f"check the host name and port (`ssh -v {host.destination}`), the VPN and the network",
        )
    return DdpJobError(f"ssh to {where} failed: {last}", f"try `ssh -v {host.destination} true`")


@functools.lru_cache(maxsize=1)
def local_rsync_version() -> tuple[int, ...]:
    """This machine's rsync release (``rsync --version``'s first line), (0,) when it does not say."""
    try:
        first = subprocess.run(["rsync", "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return (0,)
    found = re.search(r"version\s+(\d+)\.(\d+)\.(\d+)", first)
    return tuple(int(part) for part in found.groups()) if found else (0,)


@dataclass
class Gateway:
    """SSH to one host: captured calls (``run``), calls whose output goes straight to this terminal (``stream``),
    and rsync both ways, all over one persistent connection."""

    host: Host
    runner: Runner = run_captured
    interactive: bool = field(default_factory=lambda: sys.stdin.isatty())
    rsync_version: tuple[int, ...] = field(default_factory=lambda: local_rsync_version())

    def state_dir(self) -> Path:
        """The control sockets' and stamps' folder: made 0700 if missing, refused unless it is this user's alone."""
        raw = os.environ.get(STATE_ENV)
        folder = Path(raw) if raw else Path.home() / ".ssh" / "ddpjob"
        folder.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        hint = f"if it is yours, chmod 700 it; else set {STATE_ENV} to a folder of your own"
        return private.folder(folder, "ddpjob's SSH state folder", hint)

    def options(self) -> list[str]:
        """The options of every ssh call: the persistent connection, no prompts outside a terminal, bounded time."""
        opts = []
        user_config = Path.home() / ".ssh" / "config"
        if user_config.is_file() and Path.home() != account_home():
            opts += ["-F", str(user_config)]  # ssh reads the passwd home's config; $HOME names another (a sandbox)
        opts += [
            "-o", "ControlMaster=auto",
            "-o", f"ControlPath={self.state_dir() / 'ddpjob-%C'}",
            "-o", f"ControlPersist={PERSIST}",
            "-o", f"ConnectTimeout={self.host.connect_timeout:g}",
            "-o", "ServerAliveInterval=15",
            "-o", "ServerAliveCountMax=3",
        ]  # fmt: skip
        if not self.interactive:
            opts += ["-o", "BatchMode=yes"]
        return opts

    def ssh(self) -> list[str]:
        """The ssh command of a call whose remote command line comes on its stdin (``FROM_STDIN``)."""
        return ["ssh", *self.options(), self.host.destination, FROM_STDIN]

    def master(self) -> Optional[str]:
        """The running master connection's pid, or None when none runs (the next call logs in)."""
        proc = self.runner(["ssh", *self.options(), "-O", "check", self.host.destination], None)
        found = re.search(r"pid=(\d+)", proc.stderr + proc.stdout)
        return found[1] if proc.returncode == 0 and found else None

    def checked_stamp(self) -> Path:
        """Where the pid of the master connection over which this host entry's ddpjob was checked is kept."""
        h = self.host
        key = hashlib.sha256(f"{h.destination}\0{h.remote_dir}\0{h.ddpjob}\0{h.setup}".encode()).hexdigest()[:16]
        return self.state_dir() / f"ddpjob-checked-{key}"

    def run(self, remote_command: str) -> subprocess.CompletedProcess[str]:
        """A captured call; an SSH failure raises one line."""
        proc = self.runner(self.ssh(), remote_command)
        if proc.returncode == SSH_FAILED:
            raise explain(self.host, proc.stderr)
        return proc

    def stream(self, remote_command: str, stdout: Optional[int] = None) -> subprocess.Popen[str]:
        """A call whose stderr (and stdout, unless ``stdout=PIPE``) go to this terminal as the remote writes them."""
        proc = subprocess.Popen(self.ssh(), stdin=subprocess.PIPE, stdout=stdout, text=True)
        assert proc.stdin is not None
        try:
            proc.stdin.write(remote_command)
            proc.stdin.close()  # the remote reads to the end of it: the command's own stdin is then empty
        except BrokenPipeError:
            pass  # ssh failed before reading it: its exit status says why
        proc.stdin = None  # closed: communicate() and wait() have nothing left to send
        return proc

    def rsync(
        self, source: str, target: str, extra: Sequence[str] = (), flags: Sequence[str] = ("-a",)
    ) -> subprocess.CompletedProcess[str]:
        """``rsync -a`` (or ``flags``) over this host's connection; ``HOST:`` in ``source``/``target`` is written
        ``:PATH``. The remote path reaches the remote rsync as it is, never split or expanded by the remote shell:
        ``--protect-args`` from rsync 3.0 (the default from 3.2.4, asked for anyway: ``RSYNC_OLD_ARGS`` turns it
        off), quoted for that shell on older ones (macOS ships 2.6.9, which has no such option)."""
        remote, old = shlex.join(["ssh", *self.options()]), self.rsync_version < (3, 0)

        def spell(path: str) -> str:
            if not path.startswith(":"):
                return path
            return f"{self.host.destination}:{shlex.quote(path[1:]) if old else path[1:]}"

        protect = [] if old else ["--protect-args"]
        return self.runner(["rsync", *flags, *protect, "-e", remote, *extra, spell(source), spell(target)], None)

    def command(self, argv: Sequence[str], env: Mapping[str, str] = {}, pythonpath: str = "") -> str:
        """The remote shell line that runs ``ddpjob ARGV`` in the remote directory, after the host's setup line;
        a missing directory or ddpjob is the remote's one-line error (exit 2), as the login node would give."""
        host, quote = self.host, shlex.quote
        where = f"{host.name}:{host.remote_dir}"
        no_dir = (
            f"ddpjob: error: {where} is not a directory "
            "(hint: clone the project there, or set remote_dir in the host file / --remote-dir)"
        )
        ddpjob = host.ddpjob if " " in host.ddpjob else quote(host.ddpjob)  # a command ("python -m jobs") as it is
        first = host.ddpjob.split()[0]
        missing = (
            f"ddpjob: error: no ddpjob at {host.name}:{posixpath.join(host.remote_dir, first)} "
            f"(hint: install it there: python -m venv .venv && .venv/bin/pip install -e . in {host.remote_dir}, "
            "or set ddpjob: in the host file)"
        )
        envs = " ".join(f"{k}={quote(v)}" for k, v in {EXPECT_ENV: version(), NAME_ENV: host.name, **env}.items())
        if pythonpath:  # sent code first on the path, before what the setup line put there
            envs += f' PYTHONPATH={quote(pythonpath)}"${{PYTHONPATH:+:$PYTHONPATH}}"'
        lines = [
            *([host.setup] if host.setup else []),
            f"cd {quote(host.remote_dir)} 2>/dev/null || {{ echo {quote(no_dir)} >&2; exit 2; }}",
            f"command -v {quote(first)} >/dev/null 2>&1 || {{ echo {quote(missing)} >&2; exit 2; }}",
            f"exec env {envs} {ddpjob} {shlex.join(argv)}",
        ]
        return "\n".join(lines)

    def connect(self) -> None:
        """Log in unless a master connection runs, and check the remote directory and ddpjob's version once per
        master connection (and host entry); later commands reuse both."""
        stamp = self.checked_stamp()
        pid = self.master()
        if pid is not None and stamp.is_file() and stamp.read_text() == pid:
            return  # checked over this connection; each remote ddpjob checks DDPJOB_EXPECT_VERSION too
        proc = self.run(self.command(["--version"]))
        ours = version()
        err = remote_error(proc.stderr) if proc.returncode != 0 else None
        if err is not None and (err.message.endswith(WRAPPER_ERRORS[0]) or err.message.startswith(WRAPPER_ERRORS[1])):
            raise err  # no directory, no ddpjob: the wrapper's own line (a ddpjob without --version: a mismatch)
        theirs = proc.stdout.strip().removeprefix("ddpjob ") if proc.returncode == 0 else "unknown (no --version)"
        if theirs != ours:
            raise mismatch(self.host.name, f"{self.host.remote_dir}, {self.host.ddpjob}", theirs, ours)
        if (pid := self.master()) is not None:
            with open(stamp, "w", opener=private.opener) as f:
                f.write(pid)


def account_home() -> Optional[Path]:
    """The account's home as ssh finds it (the password database), whatever $HOME says."""
    try:
        return Path(pwd.getpwuid(os.getuid()).pw_dir)
    except KeyError:  # no entry (some containers): ssh then has no config of its own to read
        return None


def mismatch(name: str, where: str, theirs: str, ours: str) -> DdpJobError:
    return DdpJobError(
        f"{name} runs ddpjob {theirs} ({where}), this laptop ddpjob {ours}",
        f"install the same ddpjob on both: {ours} on {name} (pip install ddpjob=={ours}, or the same checkout), "
        f"or {theirs} here",
    )


def check_expected_version() -> None:
    """On the remote: a ddpjob called by ``ddpjob --host`` of another version refuses in one line (the laptop's
    version and the host's name come in the environment)."""
    expected = os.environ.pop(EXPECT_ENV, None)  # popped: the jobs this process submits do not inherit it
    name = os.environ.pop(NAME_ENV, "the remote")
    if expected and expected != version():
        raise mismatch(name, f"{os.getcwd()}, {sys.argv[0]}", version(), expected)


def remote_error(stderr: str) -> Optional[DdpJobError]:
    """The remote's one-line error (``ddpjob: error: MESSAGE (hint: HINT)``) as the same error here."""
    lines = [line for line in stderr.strip().splitlines() if line.startswith("ddpjob: error: ")]
    if not lines:
        return None
    message, _, hint = lines[-1].removeprefix("ddpjob: error: ").partition(" (hint: ")
    return DdpJobError(message, hint.removesuffix(")"))
