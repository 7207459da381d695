"""Crash-safe checkpoint files: atomic write, a manifest written last, checksum verified on load, keep-last-k.

A checkpoint is ``step_XXXXXXXX.pt`` plus ``step_XXXXXXXX.json``. The manifest (step, size, sha256) is
written only after the data file is durable, so a kill at any moment leaves either a complete pair or
something ``find_latest`` skips. Only rank 0 calls ``save``; the trainer puts a barrier after it.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import re
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Optional

import torch

from ddp_core.rundir import atomic_write_text

log = logging.getLogger(__name__)

_NAME = re.compile(r"^step_(\d{8})\.json$")


@dataclass(frozen=True)
class CheckpointInfo:
    step: int
    path: Path
    sha256: str
    size: int


class _HashingWriter(io.RawIOBase):
    """A write-only file object that hashes what passes through to the real file."""

    def __init__(self, f: BinaryIO) -> None:
        self.f, self.sha256, self.size = f, hashlib.sha256(), 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data)
        self.sha256.update(view)
        self.size += view.nbytes
        return self.f.write(view)

    def flush(self) -> None:
        self.f.flush()


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(directory: Path, step: int, state: dict[str, Any], keep_last: int, writer_rank: int = 0) -> CheckpointInfo:
    """Atomically write ``state`` for ``step``, then its manifest, then prune to the newest ``keep_last``."""
    directory.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    final = directory / f"step_{step:08d}.pt"
    tmp = directory / f".step_{step:08d}.pt.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        writer = _HashingWriter(f)
        torch.save(state, writer)  # streamed: no second in-memory copy of a multi-GB state
        f.flush()
        os.fsync(f.fileno())
    digest, size = writer.sha256.hexdigest(), writer.size
    os.replace(tmp, final)
    _fsync_dir(directory)
    manifest = {
        "step": step,
        "file": final.name,
        "sha256": digest,
        "size": size,
        "time": time.time(),
        "writer": {"rank": writer_rank, "host": socket.gethostname(), "pid": os.getpid()},
    }
    atomic_write_text(directory / f"step_{step:08d}.json", json.dumps(manifest, indent=1) + "\n")
    _fsync_dir(directory)
    info = CheckpointInfo(step=step, path=final, sha256=digest, size=size)
    log.info("checkpoint step %d saved (%.1f MB, %.2f s): %s", step, size / 1e6, time.perf_counter() - started, final)
    prune(directory, keep_last)
    return info


def _manifests(directory: Path) -> list[tuple[int, Path]]:
    if not directory.is_dir():
        return []
    found = [(int(m[1]), p) for p in directory.iterdir() if (m := _NAME.match(p.name))]
    return sorted(found, reverse=True)


def prune(directory: Path, keep_last: int) -> None:
    for _, manifest in _manifests(directory)[keep_last:]:
        # Manifest first: a kill between the two unlinks leaves an orphan data file, never a manifest
        # pointing at nothing.
        manifest.unlink(missing_ok=True)
        manifest.with_suffix(".pt").unlink(missing_ok=True)
    for stale in directory.glob(".step_*.tmp*"):
        stale.unlink(missing_ok=True)


def verify(manifest: Path) -> Optional[CheckpointInfo]:
    """The checkpoint named by ``manifest`` if its data file is complete and its checksum matches."""
    try:
        meta = json.loads(manifest.read_text())
        path = manifest.with_name(meta["file"])
        size = path.stat().st_size
    except (OSError, ValueError, KeyError) as err:
        log.warning("skipping checkpoint %s: unreadable manifest or missing data (%s)", manifest.name, err)
        return None
    if size != meta["size"]:
        log.warning("skipping checkpoint %s: size %d != %d in its manifest (truncated?)", path.name, size, meta["size"])
        return None
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):  # 16 MiB at a time: a multi-GB checkpoint is never in memory twice
            sha.update(chunk)
    digest = sha.hexdigest()
    if digest != meta["sha256"]:
        log.warning("skipping checkpoint %s: sha256 mismatch (corrupt)", path.name)
        return None
    return CheckpointInfo(step=int(meta["step"]), path=path, sha256=digest, size=size)


def find_latest(directory: Path) -> Optional[CheckpointInfo]:
    """Newest complete, verified checkpoint; incomplete or corrupt newer ones are skipped with a warning."""
    for _, manifest in _manifests(directory):
        info = verify(manifest)
        if info is not None:
            return info
    return None


def load(info: CheckpointInfo) -> dict[str, Any]:
    # weights_only=True: a checkpoint file can never run code on load.
    return torch.load(info.path, map_location="cpu", weights_only=True)
