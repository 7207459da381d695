"""What a remote submission sends, and where: a staging folder of the remote that only this submission uses,
``REMOTE_DIR/.ddpjob/incoming/<laptop>-<random>/``, so two laptops (or two submits of one) never mix their files.

``Stage.add_file`` sends a file (a config, a sweep file and its base) and ``Stage.add_code`` the code snapshot's
files (``jobs.submission.snapshot.plan``: exactly the files the run would copy on the login node), each at its path
relative to the laptop's working directory under ``tree/`` (outside it: ``tree/_abs/<absolute path>``), so relative
references between them still hold. ``sent.json`` records where they came from (the laptop, its folder, its git
commit and uncommitted changes): the remote snapshot (``DDPJOB_SENT``) records it with the run. ``push`` copies the
whole folder in one rsync over the connection; a transfer that fails removes what arrived and raises, before
anything is submitted.

The folder gathered here is a private temporary folder of this user's (``ddp_core.run.private``: 0700, checked, its
folders 0700 and ``sent.json`` 0600): no other user of the laptop reads or swaps what is about to be run. The copies
of the user's files keep their own modes (``rsync -a`` carries them to the remote, where the run's snapshot copies
them): inside the folder no one else can reach them.
"""

from __future__ import annotations

import json
import shlex
import shutil
import socket
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from ddp_core.errors import DdpJobError
from ddp_core.run import private
from jobs.remote.ssh import Gateway

if TYPE_CHECKING:
    from jobs.submission.snapshot import Plan

INCOMING = ".ddpjob/incoming"


class Stage:
    """One submission's files, gathered here in a temporary folder, then pushed to the remote's staging folder."""

    def __init__(self, gateway: Gateway, cwd: Optional[Path] = None) -> None:
        self.gateway = gateway
        self.cwd = (cwd or Path.cwd()).resolve()
        laptop = socket.gethostname().split(".")[0] or "laptop"
        self.name = f"{laptop}-{uuid.uuid4().hex[:12]}"
        self.remote = f"{gateway.host.remote_dir.rstrip('/')}/{INCOMING}/{self.name}"
        self.local = private.temp_folder("stage")
        self.sent: dict[str, Any] = {"from": socket.gethostname(), "cwd": str(self.cwd), "files": []}

    def relative(self, path: Path) -> Path:
        path = path.absolute()
        return path.relative_to(self.cwd) if path.is_relative_to(self.cwd) else Path("_abs") / path.relative_to("/")

    def remote_path(self, path: Path | str) -> str:
        """Where a local file or folder of this submission is on the remote."""
        return f"{self.remote}/tree/{self.relative(Path(path)).as_posix()}".rstrip("/.")

    def add_file(self, path: Path | str) -> str:
        """Send one local file; returns its remote path."""
        target = self.local / "tree" / self.relative(Path(path))
        private.makedirs(target.parent)
        shutil.copy2(path, target)
        self.sent["files"].append(str(Path(path).absolute()))
        return self.remote_path(path)

    def add_code(self, code: Plan) -> str:
        """Send a code snapshot's files where the run's import finds them; returns the remote folder to import from
        (for a package or a module: its parent folder, for PYTHONPATH), or the script's folder."""
        for rel in code.files:
            target = self.local / "tree" / self.relative(code.base) / rel
            private.makedirs(target.parent)
            shutil.copy2(code.base / rel, target)
        self.sent["code"] = {"source": str(code.source), "kind": code.kind, "files": len(code.files), "git": code.git}
        if code.diff:
            self.sent["code"]["diff"] = code.diff
        return self.remote_path(code.source.parent if code.kind != "directory" else code.source)

    def env(self) -> dict[str, str]:
        """The remote ddpjob's environment for this submission: where its snapshot finds the record of what was sent."""
        from jobs.submission.snapshot import SENT_ENV

        return {SENT_ENV: f"{self.remote}/sent.json"}

    def push(self) -> None:
        """One rsync of the whole staging folder; on failure, what arrived is removed and the error raised."""
        with open(self.local / "sent.json", "w", opener=private.opener) as f:
            f.write(json.dumps(self.sent, indent=2) + "\n")
        parent = self.remote.rsplit("/", 1)[0]
        try:
            proc = self.gateway.rsync(
                f"{self.local}/", f":{self.remote}/", extra=["--rsync-path", f"mkdir -p {shlex.quote(parent)} && rsync"]
            )
        finally:
            shutil.rmtree(self.local, ignore_errors=True)
        if proc.returncode != 0:
            self.gateway.runner(self.gateway.ssh(), f"rm -rf {shlex.quote(self.remote)}")
            last = (proc.stderr.strip().splitlines() or [f"rsync exited {proc.returncode}"])[-1]
            raise DdpJobError(
                f"sending the config and code to {self.gateway.host.name}:{self.remote} failed (nothing submitted): "
                f"{last}",
                "check the space and permissions of the remote directory (remote_dir), then submit again",
            )

    def discard(self) -> None:
        shutil.rmtree(self.local, ignore_errors=True)
