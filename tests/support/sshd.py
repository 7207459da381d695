"""A real OpenSSH login node for the ``ddpjob --host`` tests, and a "laptop" that reaches it.

``SshServer.start`` runs Debian's ``sshd -D -e`` on a free loopback port with a host key and one authorised user key,
both made by ``ssh-keygen`` for the test (root logs in by key only; ``StrictModes no`` because the keys live in a
pytest tmp folder). sshd's log (``-E``) holds one ``Accepted publickey`` line per SSH connection: ``connections()``
counts them.

``Laptop`` is the machine the user types on: its own HOME with ``~/.ssh/config`` naming the server ``cluster``, a
``hosts.yaml`` for ddpjob, a short state folder for the connection's socket, and a PATH holding only what a laptop
has (python, ssh, rsync, the shell's tools), no Slurm command. ``run`` is ``ddpjob ARGS`` there, as a process.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from ddp_core.cluster.rendezvous import free_port
from tests.support.helpers import ROOT

SSHD = "/usr/sbin/sshd"
LAPTOP_TOOLS = ("ssh", "rsync", "sh", "bash", "env", "git", "cat", "ls", "mkdir", "rm", "hostname", "uname")


def require() -> None:
    """Skip the test without OpenSSH's server (``scripts/slurm-local up`` installs it); fail instead where the suite
    requires everything (``DDPJOB_REQUIRE_SLURM=1``, as ``scripts/test`` sets)."""
    import pytest

    if Path(SSHD).exists() and shutil.which("ssh-keygen") and shutil.which("rsync"):
        return
    if os.environ.get("DDPJOB_REQUIRE_SLURM") == "1":
        pytest.fail("sshd, ssh-keygen or rsync is missing (scripts/slurm-local up installs openssh-server)")
    pytest.skip("no sshd (openssh-server): scripts/slurm-local up installs it")


def keygen(path: Path) -> Path:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)], check=True)
    return path


@dataclass
class SshServer:
    folder: Path
    port: int
    proc: Optional[subprocess.Popen[bytes]] = None

    @property
    def log(self) -> Path:
        return self.folder / "sshd.log"

    @property
    def host_key_pub(self) -> str:
        return (self.folder / "host_key.pub").read_text().strip()

    def authorize(self, public_key: Path) -> None:
        with open(self.folder / "authorized_keys", "a") as f:
            f.write(public_key.read_text())

    def start(self) -> SshServer:
        if os.geteuid() == 0:  # root's sshd separates privileges there; a user's serves only her own logins
            Path("/run/sshd").mkdir(exist_ok=True)
        keygen(self.folder / "host_key")
        (self.folder / "authorized_keys").touch()
        config = self.folder / "sshd_config"
        config.write_text(
            f"ListenAddress 127.0.0.1\nHostKey {self.folder / 'host_key'}\nPidFile {self.folder / 'sshd.pid'}\n"
            f"AuthorizedKeysFile {self.folder / 'authorized_keys'}\nPermitRootLogin prohibit-password\n"
            "PasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\n"
            "LogLevel VERBOSE\nMaxStartups 50\nMaxSessions 50\n"
        )
        cmd = [SSHD, "-D", "-e", "-f", str(config), "-p", str(self.port), "-E", str(self.log)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while "Server listening" not in (self.log.read_text() if self.log.exists() else ""):
            assert self.proc.poll() is None, f"sshd exited: {self.log.read_text() if self.log.exists() else ''}"
            assert time.monotonic() < deadline, "sshd did not start listening within 10 s"
            time.sleep(0.05)
        return self

    def connections(self) -> int:
        """SSH connections logged in so far (one per TCP connection, however many sessions it carries)."""
        return self.log.read_text().count("Accepted publickey")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)


@dataclass
class Laptop:
    home: Path
    server: SshServer
    env: dict[str, str] = field(default_factory=dict)

    @property
    def key(self) -> Path:
        return self.home / ".ssh" / "id_ed25519"

    @property
    def state(self) -> Path:
        return Path(self.env["DDPJOB_STATE_DIR"])

    @classmethod
    def make(cls, home: Path, server: SshServer, authorized: bool = True) -> Laptop:
        ssh_dir = home / ".ssh"
        ssh_dir.mkdir(parents=True)
        laptop = cls(home, server)
        keygen(laptop.key)
        if authorized:
            server.authorize(laptop.key.with_suffix(".pub"))
        (ssh_dir / "known_hosts").write_text(f"[127.0.0.1]:{server.port} {server.host_key_pub}\n")
        user = pwd.getpwuid(os.getuid()).pw_name  # root, or the user pass's ddpjob-alice (her own sshd's only login)
        (ssh_dir / "config").write_text(
            f"Host cluster\n  HostName 127.0.0.1\n  Port {server.port}\n  User {user}\n  IdentityFile {laptop.key}\n"
            f"  IdentitiesOnly yes\n  UserKnownHostsFile {ssh_dir / 'known_hosts'}\n  StrictHostKeyChecking yes\n"
        )
        bin_dir = home / "bin"  # the laptop's PATH: no sbatch, squeue, ...
        bin_dir.mkdir()
        for tool in LAPTOP_TOOLS:
            if (found := shutil.which(tool)) is not None:
                (bin_dir / tool).symlink_to(found)
        (bin_dir / "python").symlink_to(sys.executable)
        # A socket path must fit in 108 bytes: the connection's lives in a short folder, not under pytest's tmp.
        state = tempfile.mkdtemp(prefix="ddpjob-ssh-", dir="/tmp")
        laptop.env = {
            "HOME": str(home),
            "PATH": str(bin_dir),
            "PYTHONPATH": project_path(),
            "DDPJOB_HOSTS": str(home / "hosts.yaml"),
            "DDPJOB_STATE_DIR": state,
            "OMP_NUM_THREADS": "1",
        }
        return laptop

    def host_file(self, text: str) -> None:
        Path(self.env["DDPJOB_HOSTS"]).write_text(text)

    def cluster_entry(self, name: str = "cluster", **keys: object) -> str:
        """A hosts.yaml entry whose remote ddpjob is this checkout's, as the tests' login node runs it."""
        setup = f"export PYTHONPATH={project_path()}" + (
            f" SLURM_CONF={os.environ['SLURM_CONF']}" if "SLURM_CONF" in os.environ else ""
        )
        entry: dict[str, object] = {
            "host": "cluster",
            "remote_dir": str(ROOT),
            "ddpjob": f"{sys.executable} -m jobs",
            "setup": setup,
        }
        entry.update(keys)
        return f"{name}:\n" + "".join(f"  {k}: {v!r}\n" for k, v in entry.items())

    def run(
        self, args: Sequence[str], cwd: Optional[Path] = None, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "jobs", *args],
            cwd=cwd or self.home, env=self.env, capture_output=True, text=True, timeout=timeout,
            stdin=subprocess.DEVNULL,
        )  # fmt: skip

    def close(self) -> None:
        """Stop the connection's master (if any) and remove its folder."""
        for sock in self.state.glob("*"):
            subprocess.run(["ssh", "-O", "exit", "-o", f"ControlPath={sock}", "x"], capture_output=True, timeout=10)
        shutil.rmtree(self.state, ignore_errors=True)


def project_path() -> str:
    """The ``PYTHONPATH`` the laptop's and the login node's ddpjob run with: the checkout, or a user's own (the user
    pass's: the checkout and the venv's site-packages, tests/support/users.py python_env)."""
    return os.environ.get("PYTHONPATH", str(ROOT))


def start_server(folder: Path) -> SshServer:
    folder.mkdir(parents=True, exist_ok=True)
    return SshServer(folder, free_port()).start()
