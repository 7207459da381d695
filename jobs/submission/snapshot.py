"""Code snapshots, login-node side: at submit, copy the user's code into the run directory (see ddp_core.run.snapshot).

What is copied: a script's directory (``script.path``), else the top-level package, or module file, of the script
module or of ``task.target``. In a git work tree, the files git would commit there (tracked, plus untracked ones it
does not ignore), and the record names the commit and saves the uncommitted changes as ``code.diff``; elsewhere,
every file but hidden files and folders (``.env``, ``.netrc``, ``.bash_history`` in a home that holds a script),
``__pycache__`` and the run root. Anywhere, a symlink whose target lies outside the copied folder is left out (a
link to ``~/.aws/credentials``): the snapshot is sent to the cluster (``--host``) and readable as the run is.
``snapshot.include_hidden`` and ``snapshot.outside_links`` take them anyway; ``submit --dry-run`` lists the files
and what was left out. The library itself (``ddp_core``, ``jobs``) and code installed in site-packages are not the
user's working tree and are not copied.

``plan`` lists and sizes the files before anything exists, so an oversized snapshot is refused in one line before
a run directory is made; ``Plan.take`` copies them into ``RUN/code`` (or a sweep's) and writes ``RUN/code.json``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import site
import subprocess
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Sequence

if TYPE_CHECKING:
    from ddp_core.config import Config
from ddp_core.errors import DdpJobError
from ddp_core.run import permissions
from ddp_core.run.rundir import CODE_DIFF, CODE_DIR, CODE_RECORD, RunDir, atomic_write_text
from ddp_core.run.snapshot import LIBRARY_PACKAGES

SKIP_DIRS = frozenset({"__pycache__"})
# Set by ``ddpjob --host`` (jobs.remote.staging) for the remote ddpjob: the record of the files a laptop sent. Code
# inside that folder is recorded as sent (the laptop's source, git commit and uncommitted changes), not as found here.
SENT_ENV = "DDPJOB_SENT"


@dataclass
class Plan:
    """The files a snapshot will hold: ``source`` is a script's folder, a package's folder, or one module file."""

    source: Path
    kind: str  # "directory" (a script's folder), "package" or "module" (a module file)
    files: list[Path]  # relative to source's directory (source itself for a directory or package)
    bytes: int
    packages: list[str] = field(default_factory=list)  # top-level names the snapshot provides (activate checks)
    git: Optional[dict[str, Any]] = None
    diff: str = ""
    sent: Optional[dict[str, Any]] = None  # what a laptop sent (``sent_from``): recorded with the snapshot
    left_out: list[Path] = field(default_factory=list)  # hidden files, links out of the folder (module docstring)

    @property
    def base(self) -> Path:
        """The folder ``files`` are relative to."""
        return self.source.parent if self.kind == "module" else self.source

    @property
    def prefix(self) -> Path:
        """Where the files go inside the snapshot: a package keeps its name, so RUN/code on sys.path imports it."""
        return Path(self.source.name) if self.kind == "package" else Path()

    def take(self, code_dir: Path) -> dict[str, Any]:
        """Copy the files to ``code_dir`` (made here); returns the record ``write_record`` saves."""
        code_dir.mkdir(parents=True, exist_ok=True)
        for rel in self.files:
            target = code_dir / self.prefix / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(self.base / rel, target)
            permissions.restrict(target)  # copy2 kept the source's mode: a group-writable file stays no such thing
        return {
            "source": str(self.source),
            "path": str(code_dir),
            "kind": self.kind,
            "packages": self.packages,
            "files": len(self.files),
            "bytes": self.bytes,
            "git": self.git,
            **({"sent": self.sent} if self.sent else {}),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
        }

    def summary(self) -> str:
        git = f"; git {str(self.git.get('commit') or 'no commit')[:12]}" if self.git else ""
        dirty = " + uncommitted changes" if self.diff else ""
        return f"{len(self.files)} files, {self.bytes / 1024:.0f} KiB of {self.source}{git}{dirty}"

    def listing(self) -> list[str]:
        """``--dry-run``'s lines: each file that would be sent, then each one left out and the key that takes it."""
        lines = [f"#   {self.prefix / rel}" for rel in self.files]
        for rel in self.left_out:
            why = (
                "a link out of the folder: snapshot.outside_links"
                if (self.base / rel).is_symlink()
                else ("hidden: snapshot.include_hidden")
            )
            lines.append(f"#   left out: {rel}{'/' if (self.base / rel).is_dir() else ''} ({why})")
        return lines


def take(p: Optional[Plan], run_dir: RunDir) -> None:
    """Copy ``p`` into ``RUN/code`` and record it (nothing for a run without a snapshot)."""
    if p is not None:
        write_record(run_dir.path, p.take(run_dir.code), p.diff)


def take_shared(p: Optional[Plan], folder: Path) -> Optional[dict[str, Any]]:
    """A sweep's one snapshot, ``SWEEP/code``, for all its trials (``write_record`` each trial's copy of the record).
    A rerun of the same sweep keeps the snapshot it took first: every trial of a sweep runs the same code."""
    record = folder / CODE_RECORD
    if record.exists():
        return dict(json.loads(record.read_text()))
    if p is None:
        return None
    write_record(folder, p.take(folder / CODE_DIR), p.diff)
    return dict(json.loads(record.read_text()))


def write_record(folder: Path, record: dict[str, Any], diff: str = "") -> None:
    """``folder/code.json`` (and ``folder/code.diff`` for uncommitted changes): a run's or a sweep's record."""
    record = dict(record)
    if diff:
        atomic_write_text(folder / CODE_DIFF, diff)
        record["git"] = {**(record.get("git") or {}), "diff": str(folder / CODE_DIFF)}  # a sweep's trials share it
    atomic_write_text(folder / CODE_RECORD, json.dumps(record, indent=2) + "\n")


def code_source(cfg: Config) -> Optional[tuple[Path, str]]:
    """(source, kind) of the code to snapshot, or None when it is the library's or installed code."""
    if cfg.script.path is not None:
        return Path(cfg.script.path).parent, "directory"
    module = cfg.script.module or cfg.task.target.partition(":")[0]
    top = module.split(".")[0]
    if top in LIBRARY_PACKAGES:
        return None
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return None  # the task or script check names the problem
    if spec is None:
        return None
    if spec.submodule_search_locations:
        source, kind = Path(next(iter(spec.submodule_search_locations))), "package"
    elif spec.has_location and spec.origin and Path(spec.origin).is_file():
        source, kind = Path(spec.origin), "module"
    else:
        return None  # built in, frozen, a namespace without a folder
    return None if _installed(source) else (source.resolve(), kind)


def _installed(path: Path) -> bool:
    roots = {sysconfig.get_paths()[k] for k in ("purelib", "platlib", "stdlib", "platstdlib")}
    roots.update([*site.getsitepackages(), site.getusersitepackages()])
    resolved = path.resolve()
    return any(resolved.is_relative_to(Path(r).resolve()) for r in roots if r)


def plan_sweep(configs: Sequence[Config]) -> Optional[Plan]:
    """The one snapshot of a sweep's trials: they must share their code's source (a script, a task package)."""
    sources = {code_source(cfg) for cfg in configs if cfg.snapshot.enabled}
    if len(sources) > 1:
        names = sorted(str(s[0]) if s else "the library" for s in sources)
        raise DdpJobError(
            f"the trials of this sweep run code from {len(sources)} places ({', '.join(names)}): one snapshot "
            "cannot hold them",
            "sweep one task or script at a time, or pass --no-snapshot",
        )
    return plan(configs[0]) if sources else None


def plan(cfg: Config) -> Optional[Plan]:
    """What ``take`` will copy, sized and checked against the config's limits; None without a snapshot."""
    if not cfg.snapshot.enabled:
        return None
    found = code_source(cfg)
    if found is None:
        return None
    source, kind = found
    folder = source.parent if kind == "module" else source
    sent = sent_from(source)
    git = _git(folder) if sent is None else None  # sent code: the remote's own repository is not its origin
    # Sent code was chosen on the laptop, by the same rules: the remote takes all of it (hidden files git tracks).
    files, left_out = _select(cfg, source, kind, git is not None, chosen=sent is not None)
    base = folder
    sizes = {rel: (base / rel).stat().st_size for rel in files if (base / rel).is_file()}  # a deleted tracked file: no
    p = Plan(source, kind, sorted(sizes), sum(sizes.values()), [source.stem] if kind != "directory" else [], git)
    p.left_out = left_out
    _check_limits(cfg, p, sizes)
    if sent is not None:
        p.git, p.diff = sent.pop("git", None), sent.pop("diff", "")
        p.sent = sent
    if git is not None:
        p.diff = _run_git(folder, "diff", "HEAD", "--binary", "--", source.name if kind == "module" else ".") or ""
    return p


def _select(cfg: Config, source: Path, kind: str, in_git: bool, chosen: bool) -> tuple[list[Path], list[Path]]:
    """(the files to copy, those left out: hidden ones outside git, links out of the folder; see the docstring)."""
    base = source.parent if kind == "module" else source
    pruned: list[Path] = []
    if kind == "module":
        files = [Path(source.name)]
    elif in_git:
        files = _git_files(source)
    else:
        skip = Path(cfg.run.root).resolve()
        files, pruned = _walk(source, skip, cfg.snapshot.include_hidden or chosen, cfg.snapshot.outside_links)
    left_out = [rel for rel in files if _left_out(base, rel, cfg, in_git or chosen)]
    return [rel for rel in files if rel not in set(left_out)], sorted([*left_out, *pruned])


def sent_from(source: Path) -> Optional[dict[str, Any]]:
    """Where code a laptop sent (``SENT_ENV``) came from: its host, folder, git state; None for any other code."""
    record = os.environ.get(SENT_ENV)
    if not record or not source.resolve().is_relative_to(Path(record).parent.resolve()):
        return None
    try:
        data = json.loads(Path(record).read_text())
    except (OSError, ValueError):
        return None
    return {"from": data.get("from"), **(data.get("code") or {})}


def _check_limits(cfg: Config, p: Plan, sizes: dict[Path, int]) -> None:
    limit = cfg.snapshot
    if p.bytes <= limit.max_mb * 1e6 and len(p.files) <= limit.max_files:
        return
    largest = sorted(sizes.items(), key=lambda kv: -kv[1])[:3]
    top = ", ".join(f"{rel} ({size / 1e6:.1f} MB)" for rel, size in largest)
    raise DdpJobError(
        f"the code snapshot of {p.source} would hold {len(p.files)} files, {p.bytes / 1e6:.1f} MB (limits: "
        f"snapshot.max_files={limit.max_files}, snapshot.max_mb={limit.max_mb:g}); largest: {top}",
        "move data and outputs out of the code's folder (or git-ignore them), raise snapshot.max_mb / "
        "snapshot.max_files, or submit with --no-snapshot (attempts then run the code as it is when they start)",
    )


def _walk(source: Path, skip: Path, hidden: bool, links: bool) -> tuple[list[Path], list[Path]]:
    """Every file under ``source`` outside git, and the folders not entered: hidden ones unless ``hidden``, links to
    folders unless ``links`` (hidden files and links to files are listed: ``_left_out`` decides, for the dry run)."""
    files: list[Path] = []
    pruned: list[Path] = []
    for folder, dirs, names in os.walk(source, followlinks=links):
        here = Path(folder)
        keep = [d for d in dirs if d not in SKIP_DIRS and d != ".git" and (here / d).resolve() != skip]
        out = [d for d in keep if (not hidden and d.startswith(".")) or (not links and (here / d).is_symlink())]
        inside = source.resolve()  # a link to a folder inside: not entered, as os.walk never did, and not listed
        pruned += [(here / d).relative_to(source) for d in out if not (here / d).resolve().is_relative_to(inside)
                   or d.startswith(".")]  # fmt: skip
        dirs[:] = [d for d in keep if d not in out]
        files += [(here / n).relative_to(source) for n in names if not n.endswith((".pyc", ".pyo"))]
    return files, pruned


def _left_out(base: Path, rel: Path, cfg: Config, in_git: bool) -> bool:
    """A file the snapshot leaves out unless asked: a link whose target lies outside ``base`` (any part of its path
    a link out), or outside git a hidden file."""
    path, inside = base / rel, base.resolve()
    if not cfg.snapshot.outside_links and not path.resolve().is_relative_to(inside):
        return True
    return not cfg.snapshot.include_hidden and not in_git and any(p.startswith(".") for p in rel.parts)


def _run_git(folder: Path, *args: str) -> Optional[str]:
    try:
        proc = subprocess.run(["git", "-C", str(folder), *args], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout if proc.returncode == 0 else None


def _git(folder: Path) -> Optional[dict[str, Any]]:
    top = _run_git(folder, "rev-parse", "--show-toplevel")
    if top is None:
        return None
    commit = (_run_git(folder, "rev-parse", "HEAD") or "").strip() or None  # None: a repository with no commit
    branch = (_run_git(folder, "rev-parse", "--abbrev-ref", "HEAD") or "").strip() or None
    return {"repo": top.strip(), "commit": commit, "branch": branch}


def _git_files(source: Path) -> list[Path]:
    out = _run_git(source, "ls-files", "-z", "--cached", "--others", "--exclude-standard", "--", ".") or ""
    return [Path(p) for p in out.split("\0") if p and not p.endswith((".pyc", ".pyo"))]
