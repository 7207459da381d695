"""The run directory: one folder per run holding config, identity, checkpoints, metrics, logs and W&B files.

Layout::

    <run>/config.yaml     resolved config (what the compute node trains with)
    <run>/run.json        identity: run id (= W&B id), created time, submitted job ids (login node writes)
    <run>/attempts.jsonl  what each attempt did: start, interrupted, requeued, completed, pruned (rank 0 appends)
    <run>/checkpoints/    step_X.pt (full) or step_X.dcp/ (sharded) + step_X.json (manifest, written last)
    <run>/metrics.jsonl   one JSON object per logged step (rank 0)
    <run>/slurm/          submitit's and sbatch's job files and per-task logs
    <run>/wandb/          W&B run files (offline runs are synced from here)
    <run>/tensorboard/, <run>/mlflow/, <run>/metrics.csv   the other trackers' records (log.trackers; ddp_core.trackers)
    <run>/hangs/<job>_<attempt>/  a hung attempt: rank<R>.txt (every thread's stack), rank<R>.json, summary.txt
    <run>/code/           the user's code as submitted (a sweep's trials share <sweep>/code/ instead)
    <run>/code.json       the snapshot's record: source, path, files, bytes, git commit; code.diff: uncommitted changes

The one module that knows this layout: the trainer, status, logs, report and doctor all read it from here. Stdlib
only at import (omegaconf is imported when a config is read or written), so login-node readers stay light.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import secrets
import string
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Callable, Iterator

from ddp_core.errors import DdpJobError
from ddp_core.locations import is_url
from ddp_core.run import diskfull, locking, permissions
from ddp_core.run import private as private_files

if TYPE_CHECKING:
    from ddp_core.config import Config

CONFIG_FILE = "config.yaml"
META_FILE = "run.json"
ATTEMPTS_FILE = "attempts.jsonl"
METRICS_FILE = "metrics.jsonl"
CODE_DIR = "code"  # the snapshot of the user's code taken at submit (ddp_core.run.snapshot, jobs.submission.snapshot)
CODE_RECORD = "code.json"  # where it came from, where it lies (a sweep's trials share the sweep's), git commit
CODE_DIFF = "code.diff"  # uncommitted changes against that commit, when the code is in a git repository
# Advisory locks (flock): the kernel drops them when their process exits, however it exits.
TRAINER_LOCK = ".trainer.lock"  # rank 0 of the attempt training in this directory; holds who it is
DEAD_ASK_S = 5.0  # how often a waiting trainer asks whether the lock's holder is dead (its node taken out meanwhile)
SUBMIT_LOCK = ".submit.lock"  # a CLI command between "is the run active?" and "job recorded"
META_LOCK = ".meta.lock"  # run.json's read-modify-write
NO_SCRIPT = b"\nscript:\n  path: null\n  module: null\n"  # config.yaml's script section of a trainer run (to_yaml)


def new_run_id(length: int = 8) -> str:
    alphabet = string.ascii_lowercase + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(length))


def atomic_write_text(path: Path, text: str, private: bool = False) -> None:
    """Write-then-rename so readers never see half a file; durable once it returns (file and entry fsynced). On an
    error (a full disk) the old file is untouched, no temp file left. ``private``: 0600 (``private.opener``)."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "w", opener=private_files.opener if private else None) as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def fsync_dir(directory: Path) -> None:
    """Make the directory's entries (a rename, a new file) durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


log = logging.getLogger(__name__)
_JSON_TYPES = {list: "a list", str: "a string", int: "a number", float: "a number", bool: "a boolean"}


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The JSON objects of an append-only ``.jsonl`` file in order; [] if it does not exist yet. A line that is not
    an object (the torn last line of a killed writer, damage) is skipped; an unreadable file is a warning, so one
    damaged run never stops ``status`` over a sweep."""
    try:
        text = path.read_bytes().decode(errors="replace")
    except FileNotFoundError:
        return []
    except OSError as err:
        log.warning("skipping %s: %s", path, err.strerror or err)
        return []
    out = []
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            out.append(record)
    return out


_META_HINT = "restore it from a backup, or delete it (the run id, and so the W&B run, then changes)"


@dataclass(frozen=True)
class RunDir:
    path: Path
    # This process made the directory (``create_run_dir``): a failed submission removes it, and only then.
    created: bool = field(default=False, compare=False)

    @property
    def config_file(self) -> Path:
        return self.path / CONFIG_FILE

    @property
    def meta_file(self) -> Path:
        return self.path / META_FILE

    @property
    def attempts_file(self) -> Path:
        return self.path / ATTEMPTS_FILE

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    def checkpoint_location(self, base: str | None) -> Path | str:
        """Where this run's durable checkpoints go: ``RUN/checkpoints`` without ``checkpoint.dir`` (``base``), else
        the run's own folder under it, a path or a URL: the run directory's name (unique: a timestamp and random
        digits), a sweep's trial's under its sweep's, so runs and trials sharing one ``checkpoint.dir`` never mix."""
        if base is None:
            return self.checkpoints
        name = self.name if _DIR_SUFFIX.search(self.name) else f"{self.path.parent.name}/{self.name}"
        if is_url(base):
            return f"{base.rstrip('/')}/{name}"
        return Path(base.removeprefix("file://")) / name

    def recorded_checkpoints(self) -> Path | str:
        """Where the run's checkpoints are, as ``initialize`` recorded it (run.json), for the login node's readers
        (``status``, ``export``): no config to parse. An unreadable run.json is reported by whoever reads it for
        more: here it means RUN/checkpoints."""
        try:
            where = self.read_meta().get("checkpoints")
        except DdpJobError:
            where = None
        return (Path(where) if where.startswith("/") else where) if isinstance(where, str) else self.checkpoints

    @property
    def metrics_file(self) -> Path:
        return self.path / METRICS_FILE

    @property
    def slurm(self) -> Path:
        return self.path / "slurm"

    @property
    def wandb(self) -> Path:
        return self.path / "wandb"

    @property
    def hangs(self) -> Path:
        return self.path / "hangs"

    @property
    def code(self) -> Path:
        return self.path / CODE_DIR

    @property
    def code_record(self) -> Path:
        return self.path / CODE_RECORD

    @property
    def name(self) -> str:
        return self.path.name

    def exists(self) -> bool:
        return self.config_file.is_file()

    def load_config(self) -> Config:
        if not self.exists():
            raise DdpJobError(f"'{self.path}' is not a run directory (no {CONFIG_FILE})", "pass a run directory")
        from ddp_core.config import load_saved  # only for readers of the config, not of the records

        return load_saved(self.config_file)

    def read_meta(self) -> dict[str, Any]:
        try:
            meta = json.loads(self.meta_file.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as err:
            raise DdpJobError(f"{self.meta_file} is unreadable ({err})", _META_HINT) from None
        if not isinstance(meta, dict):
            what = _JSON_TYPES.get(type(meta), "null")
            raise DdpJobError(f"{self.meta_file} holds {what}, not an object", _META_HINT)
        return meta

    def jobs(self) -> list[dict[str, Any]]:
        """The jobs submitted for this run (run.json), oldest first; an entry without a job id is skipped."""
        jobs = self.read_meta().get("jobs")
        return [j for j in jobs if isinstance(j, dict) and j.get("job_id")] if isinstance(jobs, list) else []

    def update_meta(self, **fields: Any) -> dict[str, Any]:
        return self._edit_meta(lambda meta: meta | fields)

    def record_job(self, job_id: str, how: str, **extra: Any) -> None:
        job = {"job_id": job_id, "submitted": time.strftime("%Y-%m-%dT%H:%M:%S"), "via": how, **extra}
        self._edit_meta(lambda meta: meta | {"jobs": [*self.jobs(), job]})

    def _edit_meta(self, edit: Callable[[dict[str, Any]], dict[str, Any]]) -> dict[str, Any]:
        """run.json's read-modify-write, locked: concurrent commands must not drop each other's fields."""
        with _locked(self.path / META_LOCK):
            meta = edit(self.read_meta())
            atomic_write_text(self.meta_file, json.dumps(meta, indent=2, sort_keys=True) + "\n")
        return meta

    def submit_lock(self) -> contextlib.AbstractContextManager[None]:
        """Held by a command from its check that the run is not active until its new job is recorded: a second
        command waits, then sees the first one's job."""
        return _locked(self.path / SUBMIT_LOCK)

    def hold_trainer_lock(
        self, holder: dict[str, Any], wait_s: float = 0.0, dead: Callable[[dict[str, str]], bool] | None = None
    ) -> IO[str]:
        """Rank 0, for a whole attempt: refuse to train where another trainer is training. Keep the returned file
        open (closing it releases the lock). ``wait_s``: how long to wait for a holder that is ending (the previous
        attempt of the same job, still exiting when its requeued successor starts). ``dead``: whether the recorded
        holder (``host``, ``pid``, ``job``) is dead though its lock is not released (a lock on a shared filesystem
        outlives a dead node until the server's lease ends): the lock file is then replaced by a fresh one."""
        self.path.mkdir(parents=True, exist_ok=True)
        f = open(self.path / TRAINER_LOCK, "a+")
        deadline, asked = time.monotonic() + wait_s, -DEAD_ASK_S
        while True:
            try:
                locking.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                ending = time.monotonic() >= deadline
                ask = dead is not None and (time.monotonic() - asked >= DEAD_ASK_S or ending)
                if not (ask or ending):
                    time.sleep(0.2)
                    continue
                f.seek(0)  # the holder's line, read only when it is needed (a shared filesystem's round trip)
                who = f.read().strip() or "another process"
                if ask and dead is not None:
                    asked, words = time.monotonic(), who.split()
                    if dead(dict(zip(words[::2], words[1::2], strict=False))):
                        f.close()
                        log.warning("breaking the trainer lock of %s: its holder is dead (%s)", self.path, who)
                        os.unlink(self.path / TRAINER_LOCK)  # the dead holder keeps its lock, on a file no one opens
                        return self.hold_trainer_lock(holder)
                if ending:
                    f.close()
                    raise DdpJobError(
                        f"run directory {self.path} is in use by a trainer ({who})",
                        "two trainers in one directory would interleave checkpoints and metrics: wait for it to "
                        "end or stop it (ddpjob cancel, or kill that process)",
                    ) from None
                time.sleep(0.2)
        f.seek(0)
        f.truncate()
        f.write(" ".join(f"{k} {v}" for k, v in holder.items()) + "\n")
        f.flush()
        return f

    def log_event(self, event: str, **fields: Any) -> None:
        """Append one attempt event (rank 0 only). Append-only, so the login node never races with it. On a full or
        failing filesystem (``diskfull``) the line is lost with a warning."""
        now = time.time()  # "t": to the millisecond, for timings (doctor --drill); "time" for people
        record = {
            "event": event,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(now)),
            "t": round(now, 3),
            **fields,
        }
        diskfull.tolerant(f"event {event!r}", self.attempts_file, lambda: self._append_event(json.dumps(record)))

    def _append_event(self, line: str) -> None:
        with open(self.attempts_file, "a") as f:
            f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())

    def events(self) -> list[dict[str, Any]]:
        """The attempt events rank 0 logged, oldest first (records without an event name skipped)."""
        return [e for e in read_jsonl(self.attempts_file) if isinstance(e.get("event"), str)]

    def metrics(self) -> list[dict[str, Any]]:
        """The records of ``metrics.jsonl`` in file order (each has an int ``step`` and a str ``split``)."""
        return [
            r
            for r in read_jsonl(self.metrics_file)
            if isinstance(r.get("step"), int) and isinstance(r.get("split"), str)
        ]

    def script_command(self) -> list[str] | None:
        """A script-mode run's command line, ``[PATH, *args]`` or ``["-m", MODULE, *args]``, from config.yaml read as
        plain YAML without validating it (cheap: ``status`` reads it for every trial of a sweep). None for a trainer
        run, or a config.yaml that does not say."""
        import yaml  # as omegaconf for load_config: only for readers of the config

        loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml: ~8x faster than the pure-Python loader
        try:
            text = self.config_file.read_bytes()
            if NO_SCRIPT in text:  # a trainer run as to_yaml writes it: no need to parse (status of 1,000 trials)
                return None
            data = yaml.load(text, Loader=loader)
        except (OSError, ValueError, RecursionError, yaml.YAMLError):
            return None
        script = data.get("script") if isinstance(data, dict) else None
        if not isinstance(script, dict):
            return None
        path, module, args = script.get("path"), script.get("module"), script.get("args")
        head = [path] if isinstance(path, str) else ["-m", module] if isinstance(module, str) else None
        if head is None:
            return None
        return [*head, *(str(a) for a in args)] if isinstance(args, list) else head

    def initialize(self, cfg: Config) -> None:
        """Create the layout, save the config, fix the run's identity (idempotent); ``run.permissions``' policy."""
        permissions.tighten(permissions.is_private(cfg.run.private))
        for sub in (self.path, self.checkpoints, self.slurm, self.wandb):
            sub.mkdir(parents=True, exist_ok=True)
        from ddp_core.config import to_yaml

        atomic_write_text(self.config_file, to_yaml(cfg))
        meta = self.read_meta()
        where = self.checkpoint_location(cfg.checkpoint.dir)
        if meta.get("checkpoints", str(self.checkpoints)) != str(where):
            meta = self.update_meta(checkpoints=str(where))
        if "run_id" not in meta:
            # The W&B id is fixed here, before step 0, so every attempt of this run logs into one W&B run.
            self.update_meta(
                run_id=meta.get("run_id") or new_run_id(),
                name=cfg.run.name,
                created=time.strftime("%Y-%m-%dT%H:%M:%S"),
            )


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        locking.flock(f, fcntl.LOCK_EX)
        yield


# What new_run_dir appends to run.name: -<timestamp>-<4 hex digits>.
_DIR_SUFFIX = re.compile(r"-\d{8}-\d{6}-[0-9a-f]{4}$")


def stamp() -> str:  # a new run directory's time (the tests force two into one second)
    return time.strftime("%Y%m%d-%H%M%S")


def suffix() -> str:  # its random part, 4 hex digits (the tests force a collision through it)
    return secrets.token_hex(2)


CREATE_TRIES = 20  # names create_run_dir tries: a collision is a run of the same second with the same 16 bits


def new_run_dir(cfg: Config, base: Path | None = None) -> RunDir:
    """A fresh ``<root>/<name>-<timestamp>-<suffix>`` name, not created (``submit --dry-run``); ``create_run_dir``
    makes one."""
    root = Path(cfg.run.root) if base is None else base
    return RunDir((root / f"{cfg.run.name}-{stamp()}-{suffix()}").resolve())


def create_run_dir(cfg: Config, base: Path | None = None) -> RunDir:
    """A new run directory, created here and by nobody else: ``mkdir`` without ``exist_ok``, another random suffix
    on a collision. Two submissions in the same second never share one (the second would take over the first's run
    id, W&B run and checkpoints, and its withdrawal would delete the first run). The result is ``created``: a failed
    submission may remove it, as it removes nothing it did not make."""
    for _ in range(CREATE_TRIES):
        run_dir = new_run_dir(cfg, base)
        run_dir.path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):  # taken (a run of the same second): another suffix
            run_dir.path.mkdir()
            return RunDir(run_dir.path, created=True)
    where, hint = run_dir.path.parent, "check what else creates directories there, or set run.root to another folder"
    raise DdpJobError(f"no new run directory under {where}: {CREATE_TRIES} names tried, all taken", hint)


def run_name_of(dir_name: str) -> str | None:
    """The ``run.name`` a directory of ``new_run_dir``'s was named after; None for another directory (a trial)."""
    return _DIR_SUFFIX.sub("", dir_name) if _DIR_SUFFIX.search(dir_name) else None
