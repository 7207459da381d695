"""The host file: what ``--host NAME`` stands for. ``~/.config/ddpjob/hosts.yaml`` (or ``$DDPJOB_HOSTS``) maps a
name to its SSH destination, the remote working directory, the remote ddpjob and a setup line::

    mycluster:
      host: login.example.edu       # an SSH destination or a Host of ~/.ssh/config (default: the name itself)
      remote_dir: /home/me/project  # where the commands run, and runs/ lives (default: this project's own path)
      ddpjob: .venv/bin/ddpjob      # a path (relative to remote_dir) or a command, e.g. "python -m jobs"
      setup: module load python/3.11 && source ~/env/bin/activate   # a shell line run first (default: none)
      connect_timeout: 10           # seconds before an unreachable host is given up (default 10)

A name without an entry is a host of the SSH config, with the defaults. ``--remote-dir`` wins over both. The setup
line reaches the remote on ssh's stdin, never its command line (``jobs.remote.ssh``), and may not write a secret out
(``export HF_TOKEN=...``: ``ddp_core.config.secrets``).
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from ddp_core.config.secrets import refuse_secret_assignments
from ddp_core.errors import DdpJobError

HOSTS_ENV = "DDPJOB_HOSTS"
DEFAULT_DDPJOB = ".venv/bin/ddpjob"
KEYS = ("host", "remote_dir", "ddpjob", "setup", "connect_timeout")


def host_file() -> Path:
    return Path(os.environ.get(HOSTS_ENV) or Path.home() / ".config" / "ddpjob" / "hosts.yaml")


def project_dir(cwd: Optional[Path] = None) -> Path:
    """This project's own path: the git work tree around the working directory, else the working directory."""
    here = (cwd or Path.cwd()).resolve()
    try:
        top = subprocess.run(["git", "-C", str(here), "rev-parse", "--show-toplevel"], capture_output=True, text=True)
    except OSError:
        return here
    return Path(top.stdout.strip()) if top.returncode == 0 and top.stdout.strip() else here


@dataclass(frozen=True)
class Host:
    """One remote cluster as the commands reach it."""

    name: str  # what the user typed after --host
    destination: str  # what ssh connects to
    remote_dir: str
    ddpjob: str
    setup: str = ""
    connect_timeout: float = 10.0


def lookup(name: str, remote_dir: Optional[str] = None) -> Host:
    """``name``'s entry in the host file, or the SSH config's host of that name with the defaults."""
    path = host_file()
    entries = read(path) if path.is_file() else {}
    entry = entries.get(name) or {}
    if not isinstance(entry, dict):
        raise DdpJobError(f"{path}: entry {name!r} is not a mapping", "give it keys: " + ", ".join(KEYS))
    unknown = sorted(set(entry) - set(KEYS))
    if unknown:
        raise DdpJobError(f"{path}: entry {name!r} has unknown key(s) {', '.join(unknown)}", "keys: " + ", ".join(KEYS))
    setup = str(entry.get("setup") or "")
    refuse_secret_assignments(f"{path}: {name}.setup", setup)  # the one guard for secrets (ddp_core.config.secrets)
    return Host(
        name=name,
        destination=str(entry.get("host") or name),
        remote_dir=str(remote_dir or entry.get("remote_dir") or project_dir()),
        ddpjob=str(entry.get("ddpjob") or DEFAULT_DDPJOB),
        setup=setup,
        connect_timeout=_seconds(path, name, entry.get("connect_timeout", 10)),
    )


def read(path: Path) -> dict[str, Any]:
    """The host file's mapping (PyYAML, not the config's reader: ``--host NAME status`` loads nothing of the config)."""
    import yaml

    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as err:
        why = str(err).replace("\n", " ")
        raise DdpJobError(
            f"host file {path} cannot be read: {why}", "a YAML mapping of names (docs/remote.md)"
        ) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise DdpJobError(f"host file {path} is not a mapping of names", "e.g. mycluster: {host: login.example.edu}")
    return data


def _seconds(path: Path, name: str, value: Any) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
        return float(value)
    raise DdpJobError(f"{path}: {name}.connect_timeout = {value!r} is not a number of seconds", "e.g. 10")
