"""Crash-safe checkpoints: data first, a manifest written last, checksums verified on load, keep-last-k.

Two kinds share the manifest ``step_XXXXXXXX.json`` (``kind`` field) and everything built on it (find the
newest verified one, prune):

- ``full``: one file ``step_XXXXXXXX.pt`` written by rank 0 (``save`` here): atomic write, manifest with its
  size and sha256. The trainer puts a barrier after it.
- ``sharded``: a folder ``step_XXXXXXXX.dcp/`` every rank wrote its shard into (``ddp_core.sharded_checkpoint``);
  the manifest lists each file's size and sha256.

The manifest is written only after the data is durable, so a kill at any moment leaves either a complete
checkpoint or something ``find_latest`` skips.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import re
import shutil
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Optional

import torch
import torch.distributed as dist

from ddp_core.rundir import atomic_write_text, fsync_dir

log = logging.getLogger(__name__)

_NAME = re.compile(r"^step_(\d{8})\.json$")


FULL, SHARDED = "full", "sharded"


@dataclass(frozen=True)
class CheckpointInfo:
    step: int
    path: Path  # the .pt file (full) or the .dcp folder (sharded)
    sha256: str  # of the file (full); of the manifest's per-file digests (sharded)
    size: int  # bytes, all files together
    kind: str = FULL


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
    fsync_dir(directory)
    manifest = {
        "step": step,
        "kind": FULL,
        "file": final.name,
        "sha256": digest,
        "size": size,
        "time": time.time(),
        "writer": {"rank": writer_rank, "host": socket.gethostname(), "pid": os.getpid()},
    }
    atomic_write_text(directory / f"step_{step:08d}.json", json.dumps(manifest, indent=1) + "\n")
    fsync_dir(directory)
    info = CheckpointInfo(step=step, path=final, sha256=digest, size=size)
    log.info("checkpoint step %d saved (%.1f MB, %.2f s): %s", step, size / 1e6, time.perf_counter() - started, final)
    prune(directory, keep_last)
    return info


def _manifests(directory: Path) -> list[tuple[int, Path]]:
    if not directory.is_dir():
        return []
    found = [(int(m[1]), p) for p in directory.iterdir() if (m := _NAME.match(p.name))]
    return sorted(found, reverse=True)


def remove_data(path: Path) -> None:
    """Delete a checkpoint's data: a file, or a sharded checkpoint's folder."""
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def prune(directory: Path, keep_last: int) -> None:
    for _, manifest in _manifests(directory)[keep_last:]:
        # Manifest first: a kill between the unlinks leaves orphan data, never a manifest pointing at nothing.
        manifest.unlink(missing_ok=True)
        remove_data(manifest.with_suffix(".pt"))
        remove_data(manifest.with_suffix(".dcp"))
    for stale in directory.glob(".step_*.tmp*"):
        remove_data(stale)


def sha256_file(path: Path) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):  # 16 MiB at a time: a multi-GB checkpoint is never in memory twice
            sha.update(chunk)
    return sha.hexdigest()


def files_digest(files: dict[str, dict[str, Any]]) -> str:
    """One digest for a sharded checkpoint: sha256 over its files' names and digests, in name order."""
    return hashlib.sha256("".join(f"{name}:{files[name]['sha256']}\n" for name in sorted(files)).encode()).hexdigest()


def _verify_sharded(manifest: Path, meta: dict[str, Any]) -> Optional[CheckpointInfo]:
    folder = manifest.with_name(meta["file"])
    files: dict[str, dict[str, Any]] = meta["files"]
    for name, expected in sorted(files.items()):
        path = folder / name
        try:
            size = path.stat().st_size
        except OSError:
            log.warning("skipping checkpoint %s: shard file %s is missing", folder.name, name)
            return None
        if size != expected["size"]:
            log.warning("skipping checkpoint %s: %s has %d bytes, not %d (truncated?)", folder.name, name, size,
                        expected["size"])  # fmt: skip
            return None
        if sha256_file(path) != expected["sha256"]:
            log.warning("skipping checkpoint %s: sha256 mismatch in %s (corrupt)", folder.name, name)
            return None
    size = sum(f["size"] for f in files.values())
    return CheckpointInfo(step=_step_of(manifest), path=folder, sha256=files_digest(files), size=size, kind=SHARDED)


def _step_of(manifest: Path) -> int:
    return int(_NAME.match(manifest.name)[1])  # type: ignore[index]  # _manifests lists only matching names


def _read_manifest(manifest: Path) -> dict[str, Any]:
    """A manifest's fields, checked: it names its own step's data file and nothing else (no '..', no path)."""
    meta = json.loads(manifest.read_text())
    if not isinstance(meta, dict):
        raise ValueError(f"holds a {type(meta).__name__}, not an object")
    kind = meta.get("kind", FULL)
    expected = manifest.with_suffix(".dcp" if kind == SHARDED else ".pt").name
    if meta.get("file") != expected:
        raise ValueError(f"names the file {meta.get('file')!r}, not {expected!r}")
    if kind == SHARDED:
        files = meta.get("files")
        if not isinstance(files, dict) or any(not isinstance(f, dict) or "/" in n or n in ("", ".", "..")
                                              for n, f in files.items()):  # fmt: skip
            raise ValueError("its file list is not a mapping of plain file names")
    elif not isinstance(meta.get("size"), int) or not isinstance(meta.get("sha256"), str):
        raise ValueError("size or sha256 missing")
    return meta


def verify(manifest: Path) -> Optional[CheckpointInfo]:
    """The checkpoint named by ``manifest`` if its data is complete and its checksums match; None (with a
    warning) for anything else, a malformed or hostile manifest included."""
    try:
        meta = _read_manifest(manifest)
        if meta.get("kind", FULL) == SHARDED:
            return _verify_sharded(manifest, meta)
        path = manifest.with_name(meta["file"])
        size = path.stat().st_size
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        log.warning("skipping checkpoint %s: unreadable manifest or missing data (%s)", manifest.name, err)
        return None
    if size != meta["size"]:
        log.warning("skipping checkpoint %s: size %d != %d in its manifest (truncated?)", path.name, size, meta["size"])
        return None
    digest = sha256_file(path)
    if digest != meta["sha256"]:
        log.warning("skipping checkpoint %s: sha256 mismatch (corrupt)", path.name)
        return None
    return CheckpointInfo(step=_step_of(manifest), path=path, sha256=digest, size=size)


def find_latest(directory: Path) -> Optional[CheckpointInfo]:
    """Newest complete, verified checkpoint; incomplete or corrupt newer ones are skipped with a warning."""
    for _, manifest in _manifests(directory):
        info = verify(manifest)
        if info is not None:
            return info
    return None


def find(directory: Path, step: int) -> Optional[CheckpointInfo]:
    """The checkpoint of ``step`` if it exists and verifies."""
    manifest = directory / f"step_{step:08d}.json"
    return verify(manifest) if manifest.is_file() else None


def find_latest_agreed(directory: Path) -> Optional[CheckpointInfo]:
    """``find_latest`` on rank 0, told to every rank: each file is hashed once, not once per rank, and all
    ranks resume from the same checkpoint even if a newer one appeared meanwhile."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return find_latest(directory)
    box = [find_latest(directory) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def load(info: CheckpointInfo) -> dict[str, Any]:
    # weights_only=True: a checkpoint file can never run code on load.
    return torch.load(info.path, map_location="cpu", weights_only=True)
